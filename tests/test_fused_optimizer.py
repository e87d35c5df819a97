"""torch.optim's fused kernels (`fused=True`, --fused): what the step allocates, how the choice reaches the trace,
and the one-line refusals. The measured rows are data/measurements/tier1_fused_adamw_cpu.csv and
tier2_fused_adamw_cpu.csv (experiments/measure_tier1.py --fused, measure_tier2.py --fused)."""
import json

import pandas as pd
import pytest

from llmsim.app.cli import main
from llmsim.enums import Category, Optimizer, Phase
from llmsim.inputs.gpus import load_gpu, on_gpu
from llmsim.inputs.spec import TrainSetup, load_model_spec, resolve_attention
from llmsim.model.trace import run_fake
from llmsim.measure.validate import row_inputs

TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256"]
TINY_OVERRIDES = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "vocab_size": 256}


def _optimizer_bytes(setup: TrainSetup) -> tuple[int, int]:
    """(temporary bytes the optimizer steps allocate, optimizer-state bytes allocated) in the tiny Llama's
    fake trace."""
    spec = load_model_spec("llama-2-7b", TINY_OVERRIDES)
    timeline, _ = run_fake(spec, resolve_attention(spec, setup), None)
    step = timeline[timeline["phase"] == Phase.OPTIMIZER.value]
    temporaries = int(step.loc[(step["category"] == Category.TEMPORARY.value) & (step["delta_bytes"] > 0),
                               "delta_bytes"].sum())
    states = int(timeline.loc[(timeline["category"] == Category.OPTIMIZER_STATE.value) & (timeline["delta_bytes"] > 0),
                              "delta_bytes"].sum())
    return temporaries, states


def test_fused_adamw_allocates_its_states_and_no_temporaries():
    """Per parameter: `step` (0-dim fp32), `exp_avg` and `exp_avg_sq` (fp32 like the parameter); the for-loop
    path makes `sqrt` and `denom` per parameter, the fused kernel nothing."""
    spec = load_model_spec("llama-2-7b", TINY_OVERRIDES)
    from transformers import AutoModelForCausalLM
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.hf_config())
    params = list(model.parameters())
    numel, count = sum(p.numel() for p in params), len(params)
    temporaries, states = _optimizer_bytes(TrainSetup(2, 16, fused=True))
    assert (temporaries, states) == (0, count * 4 + 2 * numel * 4)
    loop_temporaries, loop_states = _optimizer_bytes(TrainSetup(2, 16))
    assert loop_states == states and loop_temporaries > 0


def test_fused_on_a_gpu_replaces_foreach():
    gpu = load_gpu("h100-80gb")
    assert on_gpu(TrainSetup(1, 8), gpu).foreach is True
    fused = on_gpu(TrainSetup(1, 8, fused=True), gpu)
    assert fused.fused is True and fused.foreach is False


def test_fused_column_maps_back_to_the_setup():
    row = {"model": "llama-2-7b", "overrides": json.dumps(TINY_OVERRIDES), "micro_batch": 2, "seq_len": 16,
           "precision": "fp32", "attention": "sdpa", "grad_ckpt": False, "ckpt_every": 1, "steps": 3,
           "optimizer": "adam", "strategy": "single", "world_size": 1}
    assert row_inputs(pd.Series({**row, "fused": True}))[1].fused is True
    assert row_inputs(pd.Series(row))[1].fused is False  # rows measured before the column: the default
    assert row_inputs(pd.Series({**row, "fused": float("nan")}))[1].optimizer is Optimizer.ADAM


BAD = [
    (["--foreach", "--fused"], "fused and foreach cannot both be on"),
    (["--fused", "--optimizer", "adafactor"], "optimizer adafactor has no fused path"),
    (["--fused", "--optimizer", "adamw8bit"], "optimizer adamw8bit has no fused path"),
    (["--fused", "--tp", "2"], "fused optimizer with tp(2) / pp(1) is not modelled yet"),
    (["--fused", "--pp", "2", "--world-size", "2"], "fused optimizer with tp(1) / pp(2) is not modelled yet"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_fused_choice_is_one_line_and_status_2(extra, needle, capsys):
    assert main(["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("optimizer,needle", [
    ({"type": "AdamW", "params": {"lr": 1e-4}}, "--fused sets the client torch.optim.AdamW"),
    ({"type": "AdamW", "params": {"torch_adam": True, "fused": True, "foreach": True}},
     "set both fused and foreach"),
])
def test_fused_with_a_deepspeed_optimizer_section(optimizer, needle, tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                                "optimizer": optimizer}))
    extra = ["--fused"] if "--fused" in needle else []
    assert main(["predict", *TINY, "--seq-len", "8", "--ds-config", str(path), "--world-size", "2", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
