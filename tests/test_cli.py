"""The CLI contract: JSON keys of DESIGN.md "Interfaces"; bad input is one line and exit status 2."""
import json
import subprocess
import sys

import pytest

from llmsim.app.cli import main

TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256"]


def test_predict_json_contract(capsys):
    assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "2", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_allocated_bytes"] == max(r["peak_allocated_bytes"] for r in out["ranks"])
    rank = out["ranks"][0]
    for key in ("rank", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "peak_phase",
                "peak_layer", "breakdown_bytes"):
        assert key in rank
    assert sum(rank["breakdown_bytes"].values()) == rank["peak_allocated_bytes"]
    assert out["peak_host_bytes"] == rank["peak_host_bytes"] == 0  # nothing offloaded without --ckpt-offload


@pytest.mark.parametrize("command, exits, collects", [
    (["predict", *TINY, "--seq-len", "16", "--micro-batch", "2"], True, False),  # the `llmsim` command: ends after
    (["predict", *TINY, "--seq-len", "16", "--micro-batch", "2"], False, True),  # a test's or a script's main
    (["gpus"], True, True),  # a command other than predict (size, sweep: many predictions) collects between them
])
def test_the_llmsim_command_keeps_the_collector_off_for_a_predict(command, exits, collects, capsys):
    import gc

    assert gc.isenabled()
    try:
        assert main(command, exits=exits) == 0
        assert gc.isenabled() is collects
    finally:
        gc.enable()


def test_list_and_dict_overrides_predict(capsys):
    """`--set` takes any JSON value: a list (layer types) or a dict (rope scaling) too, not only scalars."""
    for value in ('rope_scaling={"rope_type": "linear", "factor": 2.0}', 'layer_types=["full_attention", "full_attention"]'):
        assert main(["predict", *TINY, "--set", value, "--seq-len", "16", "--micro-batch", "2", "--format",
                     "json", "--no-suggest"]) == 0, value
        assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] > 0


def test_predict_json_reports_host_bytes_apart(capsys):
    assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "2", "--grad-ckpt", "--ckpt-offload",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rank = out["ranks"][0]
    assert out["ckpt_offload"] is True
    assert rank["peak_host_bytes"] == 2 * 2 * 16 * 64 * 4  # two layers' fp32 inputs (2 x 16 x 64)
    assert sum(rank["breakdown_bytes"].values()) == rank["peak_allocated_bytes"]


BAD = [
    (["predict", "--model", "no-such-model", "--seq-len", "8", "--micro-batch", "1"], "unknown model"),
    (["predict", *TINY, "--seq-len", "0", "--micro-batch", "1"], "seq-len"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "-2"], "micro-batch"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--precision", "fp8"], "valid choices"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--attn", "flash"], "valid choices"),
    (["predict", "--model", "bloom-560m", "--seq-len", "8", "--micro-batch", "1", "--attn", "sdpa"],
     "does not support attention"),
    (["predict", "--model", "gpt2", "--seq-len", "4096", "--micro-batch", "1"], "max positions"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--ckpt-every", "2"], "--grad-ckpt"),
    (["predict", "--model", "gpt2", "--seq-len", "8"], "required"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--jobs", "0"], "jobs(0) must be >= 1"),
    (["predict", *TINY, "--set", "model_type=resnet", "--seq-len", "8", "--micro-batch", "1"], "model_type"),
    (["predict", *TINY, "--set", "hidden_size=70", "--seq-len", "8", "--micro-batch", "1"], "hidden size (70)"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--lora-rank", "4", "--lora-targets", "w_x"],
     "not found"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--lora-rank", "-3"], "lora-rank"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--lora-rank", "4", "--tp", "2",
      "--world-size", "2"], "LoRA with tp/pp is not modelled yet"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--build-dtype", "bf16"], "needs precision bf16"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--optimizer", "lion"], "valid choices"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--ckpt-offload"], "needs activation checkpointing"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--grad-ckpt", "--ckpt-offload", "--strategy", "ddp",
      "--pp", "2", "--world-size", "4"], "ckpt-offload with strategy ddp and tp/pp is not modelled yet"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--optimizer", "paged-adamw8bit", "--gpu", "l4"],
     "optimizer paged-adamw8bit on a GPU is not modelled"),
    (["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--optimizer", "hf-adafactor", "--tp", "2"],
     "optimizer hf-adafactor with tp(2) is not modelled yet"),
]


@pytest.mark.parametrize("config,optimizer,needle", [
    ('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}', "adamw8bit",
     "DeepSpeed refuses optimizer adamw8bit under ZeRO: 'You are using an untested ZeRO Optimizer"),
    ('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}', "sgd",
     "DeepSpeed ZeRO stage 0 with optimizer sgd is not modelled yet"),
    ('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": true, '
     '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}', "hf-adafactor",
     "optimizer hf-adafactor is a client optimizer, which the DeepSpeed config's \"optimizer\" section replaces"),
])
def test_deepspeed_with_another_client_optimizer_is_refused(config, optimizer, needle, tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(config)
    argv = ["predict", *TINY, "--seq-len", "8", "--optimizer", optimizer, "--ds-config", str(path),
            "--world-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_one_line_and_status_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert needle in err


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"model_type": "llama", "hidden_size": "big"}'])
def test_unreadable_or_invalid_config_file(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "llmsim.app.cli", "predict", "--model", str(path), "--seq-len", "8",
                           "--micro-batch", "1"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len([l for l in proc.stderr.splitlines() if l.startswith("error:")]) == 1


QUANT_BAD = [
    (["--quant", "nf4"], "needs LoRA adapters"),
    (["--quant", "int4", "--lora-rank", "8"], "unknown quantization 'int4'; valid choices: nf4, fp4, int8"),
    (["--quant", "int8", "--lora-rank", "8", "--double-quant"], "it needs a 4-bit quant (nf4, fp4), not int8"),
    (["--quant", "int8", "--lora-rank", "8", "--gpu", "h100-80gb"], "quant int8 on a GPU is not modelled"),
    (["--quant", "int8", "--lora-rank", "8", "--int8-threshold", "-1"], "int8-threshold must be a number >= 0"),
    (["--quant", "int8", "--lora-rank", "8", "--int8-threshold", "nan"], "int8-threshold must be a number >= 0"),
    (["--quant", "nf4", "--lora-rank", "8", "--int8-threshold", "0"], "int8-threshold(0.0) is LLM.int8's outlier"),
    (["--quant", "int8", "--lora-rank", "8", "--precision", "bf16"], "quant int8 with precision bf16 is not modelled"),
    (["--quant", "nf4", "--lora-rank", "8", "--precision", "bf16"], "quant nf4 with precision bf16 is not modelled"),
    (["--quant", "fp4", "--lora-rank", "8", "--strategy", "ddp", "--world-size", "2"], "LoRA with strategy ddp"),
]


@pytest.mark.parametrize("extra,needle", QUANT_BAD, ids=[b[1] for b in QUANT_BAD])
def test_bad_quantization_is_one_line_and_status_2(extra, needle, capsys):
    argv = ["predict", "--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
            "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
            "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


PEFT_BAD = [
    (["--lora-rank", "4", "--lora-modules-to-save", "lm_hed"],
     "lora-modules-to-save: no module 'lm_hed' in LlamaForCausalLM; valid names end a module's FQN, e.g. lm_head"),
    (["--lora-modules-to-save", "lm_head"], "lora-modules-to-save is a LoraConfig field (modules_to_save): it needs "
     "a LoRA rank"),
    (["--trainable-tokens", "0,256"], "trainable-tokens [256] outside the vocabulary (vocab_size 256"),
    (["--lora-rank", "4", "--trainable-tokens", "300"], "trainable-tokens [300] outside the vocabulary"),
    (["--trainable-tokens=-1,2"], "trainable-tokens must be vocabulary indices >= 0, got [-1]"),
    (["--trainable-tokens", "a,b"], "trainable-tokens(a,b) must be vocabulary indices separated by commas"),
    (["--trainable-tokens", "1,1"], "trainable-tokens lists an index twice"),
    (["--lora-rank", "4", "--lora-modules-to-save", "embed_tokens", "--trainable-tokens", "3"],
     "model.embed_tokens holds the input embedding's weight"),
    (["--trainable-tokens", "1", "--strategy", "ddp", "--pp", "2", "--world-size", "4"],
     "trainable-tokens with strategy ddp and tp/pp is not modelled yet; modelled: single and ddp, and DeepSpeed "
     "ZeRO-0/1/2 (tp = pp = 1)"),
    (["--lora-rank", "4", "--lora-modules-to-save", "lm_head", "--strategy", "ddp", "--pp", "2", "--world-size", "4"],
     "LoRA with tp/pp is not modelled yet"),
    (["--trainable-tokens", "1", "--tp", "2"], "trainable-tokens with strategy single and tp/pp is not modelled yet"),
    (["--lora-rank", "4", "--quant", "nf4", "--trainable-tokens", "1"], "with quant nf4 are not modelled yet"),
]


@pytest.mark.parametrize("extra,needle", PEFT_BAD, ids=[b[1][:40] for b in PEFT_BAD])
def test_bad_peft_extras_are_one_line_and_status_2(extra, needle, capsys):
    assert main(["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_lm_head_tied_to_the_embedding_is_not_trained_both_ways(capsys):
    """qwen2.5 ties its LM head to the embedding: trainable tokens wrap the head too, so it cannot also be copied."""
    argv = ["predict", "--model", "qwen2.5-0.5b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
            "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
            "--set", "vocab_size=256", "--seq-len", "8", "--micro-batch", "1", "--lora-rank", "4",
            "--lora-modules-to-save", "lm_head", "--trainable-tokens", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lm_head holds the input embedding's weight" in err, err


LOSS_BAD = [
    (["--loss", "chunked-nll", "--loss-chunk", "0"], "loss-chunk must be a positive integer, got 0"),
    (["--loss", "chunked-nll", "--loss-chunk", "-256"], "loss-chunk must be a positive integer, got -256"),
    (["--loss-chunk", "256"], "loss-chunk(256) needs --loss chunked-nll"),
    (["--loss", "fused-linear-ce", "--loss-chunk", "256"], "loss fused-linear-ce has no chunk to set"),
    (["--loss", "softmax"], "unknown loss 'softmax'; valid choices: hf, chunked-nll, fused-linear-ce"),
    (["--loss", "fused-linear-ce", "--strategy", "ddp", "--pp", "2", "--world-size", "4"],
     "loss fused-linear-ce with strategy ddp and tp/pp is not modelled yet"),
    (["--loss", "chunked-nll", "--gpu", "h100-80gb"], "loss chunked-nll on a GPU (--gpu) is not modelled yet"),
]


def test_fused_optimizer_under_a_pipeline_is_refused_by_checked(capsys):
    """`checked` (what `predict` checks before any trace, and what `--suggest` asks of each change it lists) refuses
    `--fused` with PP as it does with TP; before 55565ff only each stage's own setup refused it, after `checked` had
    let it through. The command says so in one line, exit status 2."""
    from llmsim.errors import InputError
    from llmsim.inputs.spec import TrainSetup, load_model_spec
    from llmsim.inputs.zoo import shrink
    from llmsim.sim.pipeline import checked
    from llmsim.sim.strategies import Layout, Strategy

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 256, 4))
    with pytest.raises(InputError, match=r"fused optimizer with tp\(1\) / pp\(2\) is not modelled yet"):
        checked(spec, TrainSetup(1, 16, fused=True), Layout(Strategy.DDP, 4, pp=2))
    assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "1", "--fused", "--strategy", "ddp",
                 "--pp", "2", "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fused optimizer with tp(1) / pp(2) is not modelled yet" in err, err


@pytest.mark.parametrize("extra,needle", LOSS_BAD, ids=[b[1] for b in LOSS_BAD])
def test_bad_loss_is_one_line_and_status_2(extra, needle, capsys):
    assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_fused_linear_ce_refused_for_a_model_liger_does_not_patch(capsys):
    argv = ["predict", "--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2",
            "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "1", "--loss", "fused-linear-ce"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no fused linear cross-entropy for model_type 'gpt2'" in err, err


@pytest.mark.parametrize("stage,extra,needle", [
    (3, ["--lora-rank", "4", "--trainable-tokens", "1,2"],
     "trainable-tokens with DeepSpeed ZeRO-3 is not modelled: peft gathers the module's partitions"),
    (3, ["--lora-rank", "4", "--lora-modules-to-save", "lm_head"], "lora-modules-to-save with DeepSpeed ZeRO-3 is "
     "not modelled: peft gathers the module's partitions to deep-copy it"),
    (3, ["--loss", "fused-linear-ce"], "loss fused-linear-ce with DeepSpeed ZeRO-3 is not modelled: both losses read "
     "lm_head.weight outside the lm_head module"),
    (3, ["--loss", "chunked-nll"], "loss chunked-nll with DeepSpeed ZeRO-3 is not modelled: both losses"),
    (2, ["--grad-accum", "2", "--grad-ckpt", "--ckpt-offload"],
     "grad-accum(2) with ckpt-offload under DeepSpeed is not modelled yet"),
    (1, ["--grad-accum", "2", "--loss", "chunked-nll"], "grad-accum(2) with loss chunked-nll under DeepSpeed"),
])
def test_levers_with_deepspeed_are_refused(stage, extra, needle, tmp_path, capsys):
    """peft's extras are modelled for one process and DDP (tier2_levers_ddp_cpu.csv); checkpoint offload and the loss
    levers also under ZeRO-0/1/2 (tier2_levers_zero_cpu.csv), not ZeRO-3; gradient accumulation under ZeRO-0/1/2/3
    (tier2_ga_zero_cpu.csv) is refused only with a DeepSpeed "optimizer" section (test_distributed.py)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}))
    assert main(["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--ds-config", str(path),
                 "--world-size", "2", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_lora_with_accumulation_under_deepspeed_is_predicted(tmp_path, capsys):
    """LoRA with gradient accumulation under ZeRO-0/1/2/3 (measured: tier2_ga_zero_cpu.csv)."""
    for stage in (0, 1, 2, 3):
        path = tmp_path / f"ds{stage}.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                    "zero_optimization": {"stage": stage}}))
        assert main(["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--ds-config", str(path),
                     "--world-size", "2", "--lora-rank", "4", "--format", "json"]) == 0, stage
        out = json.loads(capsys.readouterr().out)
        assert all(r["peak_allocated_bytes"] > 0 for r in out["ranks"])


def test_levers_with_a_deepspeed_optimizer_section_are_predicted(tmp_path, capsys):
    """The loss levers, offload and peft's extras under ZeRO-0/1/2 with a DeepSpeed "optimizer" section
    (tier2_zero_extras_cpu.csv): DeepSpeed's step is the only part the optimizer changes."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                                "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}))
    assert main(["predict", *TINY, "--seq-len", "8", "--micro-batch", "1", "--ds-config", str(path),
                 "--world-size", "2", "--loss", "chunked-nll", "--grad-ckpt", "--ckpt-offload", "--lora-rank", "4",
                 "--lora-modules-to-save", "lm_head", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["peak_host_bytes"] for r in out["ranks"]] == [2 * 1 * 8 * 64 * 4] * 2  # two layers' fp32 inputs


def test_ckpt_offload_under_zero3_is_predicted(tmp_path, capsys):
    """Checkpoint offload under ZeRO-3 (tier2_zero_extras_cpu.csv): the host holds what one process offloads."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}))
    assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "2", "--ds-config", str(path),
                 "--world-size", "2", "--grad-ckpt", "--ckpt-offload", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["peak_host_bytes"] for r in out["ranks"]] == [2 * 2 * 16 * 64 * 4] * 2


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_levers_under_zero_are_predicted(stage, tmp_path, capsys):
    """Checkpoint offload and the Liger loss under ZeRO-0/1/2: the host holds what one process offloads."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}))
    assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "2", "--ds-config", str(path),
                 "--world-size", "2", "--grad-ckpt", "--ckpt-offload", "--loss", "fused-linear-ce",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ranks"]) == 2
    assert [r["peak_host_bytes"] for r in out["ranks"]] == [2 * 2 * 16 * 64 * 4] * 2  # two layers' fp32 inputs


def test_levers_under_ddp_are_predicted(capsys):
    """Gradient accumulation, offload, a loss lever and trainable tokens together under DDP: every rank alike."""
    assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "2", "--strategy", "ddp", "--world-size", "2",
                 "--grad-accum", "2", "--grad-ckpt", "--ckpt-offload", "--loss", "fused-linear-ce",
                 "--trainable-tokens", "1,2", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ranks"]) == 2 and out["ranks"][0]["peak_allocated_bytes"] == out["ranks"][1]["peak_allocated_bytes"]
    assert out["peak_host_bytes"] == 2 * 2 * 16 * 64 * 4  # two layers' fp32 inputs (2 x 16 x 64), as one process


def test_measure_appends_to_an_untracked_file_where_it_runs(tmp_path, monkeypatch, capsys):
    """`llmsim measure` without --out writes ./llmsim-measurements.csv where the user runs it (ignored by git
    here), never the committed rows in data/measurements/."""
    import pandas as pd

    from llmsim.measure.runs import MEASUREMENTS_DIR

    committed = {path.name: path.stat().st_mtime_ns for path in MEASUREMENTS_DIR.glob("*.csv")}
    monkeypatch.chdir(tmp_path)
    assert main(["measure", *TINY, "--seq-len", "16", "--micro-batch", "1"]) == 0
    assert main(["measure", *TINY, "--seq-len", "16", "--micro-batch", "2"]) == 0
    rows = pd.read_csv(tmp_path / "llmsim-measurements.csv")
    assert rows["micro_batch"].tolist() == [1, 2]
    assert {path.name: path.stat().st_mtime_ns for path in MEASUREMENTS_DIR.glob("*.csv")} == committed


def test_help_and_argument_errors_do_not_import_torch():
    """`llmsim --help` and an option argparse refuses answer before torch (seconds to import) is loaded."""
    code = ("import sys; from llmsim.app.cli import main\n"
            "for argv in (['--help'], ['predict', '--help'], ['predict', '--model', 'gpt2', '--seq-len', 'x']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False False"
    assert "argument --seq-len: invalid int value: 'x'" in done.stderr


def test_a_lora_prediction_prints_no_library_noise():
    """transformers', peft's and bitsandbytes' advice for training scripts (bitsandbytes' CPU backend warns on
    import about an optional kernel package) stays out of llmsim's output: stderr is empty."""
    done = subprocess.run([sys.executable, "-m", "llmsim.app.cli", "predict", *TINY, "--seq-len", "16",
                           "--micro-batch", "1", "--lora-rank", "4"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""


def test_dtype_for_the_canonical_loop_is_the_load_and_levers_keep_it(capsys):
    """--dtype without --training-args: the weights as from_pretrained(dtype=...) loads them, nothing cast after; a
    precision contradicting the load is one line; a lever's bf16 loads in bf16 rather than casting an fp32 load."""
    from llmsim.enums import Precision
    from llmsim.inputs.spec import TrainSetup, as_loaded

    base = ["predict", "--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2",
            "--set", "vocab_size=500", "--seq-len", "16", "--micro-batch", "1"]
    assert main([*base, "--dtype", "bfloat16", "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["precision"] == "bf16" and result["load_dtype"] == "bfloat16"
    for flags, message in ((["--dtype", "float32", "--precision", "bf16"], "train as fp32, bf16-autocast"),
                           (["--dtype", "bfloat16", "--build-dtype", "bf16", "--precision", "bf16"], "give one"),
                           (["--dtype", "int4"], "unknown dtype 'int4'")):
        assert main([*base, *flags]) == 2, flags
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error, (flags, error)
    loaded = as_loaded(TrainSetup(1, 8, load_dtype="float32"), precision=Precision.BF16, build_bf16=True)
    assert (loaded.load_dtype, loaded.precision, loaded.build_bf16) == ("bfloat16", Precision.BF16, True)


def test_output_cut_short_by_its_reader_is_no_traceback():
    """`llmsim models | head -1`: the pipe closes after the first line; llmsim stops quietly."""
    import subprocess

    done = subprocess.run(f"{sys.executable} -m llmsim.app.cli models | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.startswith("name") and done.stderr == ""
