"""Tensor parallelism as users run it: from_pretrained(distributed_config=DistributedConfig(tp_size=N)) and a plain
AdamW loop (llmsim/model/from_pretrained_recipe.py), measured fresh against `llmsim predict --tp N`."""
import json
import subprocess
import sys

import pytest

from llmsim.app.cli import main
from llmsim.enums import Precision
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.measure.runs import measure_from_pretrained
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout

HARNESS_MAY_IMPORT = {"llmsim", "llmsim.model", "llmsim.model.from_pretrained_recipe", "llmsim.model.gloo",
                      "llmsim.model.tracker",
                      "llmsim.enums"}
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 600}
MESH_TENSOR_BYTES = 16  # DeviceMesh's rank tensors, which from_pretrained makes in the run: host memory on a GPU


def test_the_recipe_imports_nothing_of_the_predictor():
    code = ("import sys; import llmsim.model.from_pretrained_recipe; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'llmsim'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = set(eval(done.stdout.strip().splitlines()[-1]))
    assert imported <= HARNESS_MAY_IMPORT, imported - HARNESS_MAY_IMPORT


@pytest.mark.parametrize("dtype,extra", [("float32", {}), ("bfloat16", {}),
                                         ("float32", {"intermediate_size": 125, "tie_word_embeddings": True})],
                         ids=["fp32", "bf16", "uneven-mlp-tied"])
def test_a_fresh_tp_run_is_the_prediction(dtype, extra):
    """The loaded shards count as the copies a GPU holds (the CPU keeps them in the safetensors mapping), and
    every other byte of both ranks is the prediction's, the rotary tables that transformers keeps in fp32 included;
    an MLP width TP 2 does not divide (63 and 62 columns: a trace per rank) and a head tied to the embedding too."""
    spec = load_model_spec("mistral-7b", {**SMALL, **extra})
    setup = TrainSetup(2, 48, load_dtype=dtype, **({"precision": Precision.BF16, "build_bf16": True}
                                                    if dtype == "bfloat16" else {}))
    layout = Layout(world_size=2, tp=2)
    rows = measure_from_pretrained(spec, setup, layout)
    predicted = predict(spec, setup, layout).ranks
    assert [r["peak_allocated_bytes"] - p.peak_allocated_bytes for r, p in zip(rows, predicted)] == \
        [MESH_TENSOR_BYTES] * 2


def test_what_the_recipe_does_not_run_is_refused_in_one_line(capsys):
    base = ["measure", "--model", "mistral-7b", *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")],
            "--seq-len", "32", "--micro-batch", "1", "--recipe", "from-pretrained", "--dry-run"]
    for flags, message in ((["--dtype", "float32"], "tp >= 2"),
                           (["--tp", "2", "--dtype", "float32", "--lora-rank", "8"], "LoRA"),
                           (["--tp", "2"], "--dtype float32 or bfloat16"),
                           (["--tp", "2", "--dtype", "bfloat16", "--precision", "bf16-autocast"], "train as bf16"),
                           (["--tp", "3", "--dtype", "float32"], "tp(3) must divide num_attention_heads(4)")):
        assert main([*base, *flags]) == 2, flags
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error, (flags, error)


def test_uneven_shards_with_pp_are_refused_in_one_line(capsys):
    argv = ["predict", "--model", "mistral-7b", *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")],
            "--set", "intermediate_size=125", "--seq-len", "32", "--micro-batch", "1", "--tp", "2", "--pp", "2"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "unevenly" in error, error


def test_a_fresh_fsdp_run_as_transformers_applies_it_is_the_prediction():
    """from_pretrained(distributed_config=DistributedConfig(fsdp_size=2, fsdp_mixed_precision=True)): the model's
    own FSDP plan (a head tied to the embedding wrapped with it), against --strategy fsdp --fsdp-wrap transformers."""
    from llmsim.inputs.spec import FsdpSetup
    from llmsim.sim.strategies import Strategy

    spec = load_model_spec("qwen2.5-0.5b", {**SMALL, "tie_word_embeddings": True})
    setup = TrainSetup(2, 40, load_dtype="float32")
    layout = Layout(Strategy.FSDP, 2, fsdp=FsdpSetup(param_dtype="bfloat16", reduce_dtype="float32",
                                                     wrap="transformers"))
    rows = measure_from_pretrained(spec, setup, layout)
    predicted = predict(spec, setup, layout).ranks
    assert all(0 <= r["peak_allocated_bytes"] - p.peak_allocated_bytes <= MESH_TENSOR_BYTES
               for r, p in zip(rows, predicted)), ([r["peak_allocated_bytes"] for r in rows], predicted)


def test_transformers_fsdp_plan_options_are_checked_in_one_line(capsys):
    base = ["predict", "--model", "mistral-7b", *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")],
            "--seq-len", "32", "--micro-batch", "1"]
    for flags, message in ((["--fsdp-wrap", "transformers"], "--fsdp-wrap needs --strategy fsdp"),
                           (["--strategy", "fsdp", "--world-size", "2", "--fsdp-wrap", "modules"], "fsdp-wrap(modules)"),
                           (["--strategy", "fsdp", "--world-size", "2", "--fsdp-wrap", "transformers",
                             "--fsdp-no-reshard"], "decides the resharding itself"),
                           (["--strategy", "fsdp", "--world-size", "2", "--fsdp-wrap", "transformers",
                             "--fsdp-param-dtype", "fp16"], "fsdp_mixed_precision")):
        assert main([*base, *flags]) == 2, flags
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error, (flags, error)


def test_a_fresh_fsdp_x_tp_run_is_the_prediction(capsys):
    """DistributedConfig(tp_size=2, fsdp_size=2) on 4 ranks: transformers' TP plan, then its FSDP plan over the
    data-parallel ranks of a 2-D mesh; uneven shards, and the per-layer wrap with TP and CPU offload, are refused in
    one line (the per-layer wrap with TP is modelled: tests/test_parallel.py)."""
    from llmsim.inputs.spec import FsdpSetup
    from llmsim.sim.strategies import Strategy

    spec = load_model_spec("llama-2-7b", {**SMALL, "num_key_value_heads": 4})
    setup = TrainSetup(2, 32, load_dtype="float32")
    layout = Layout(Strategy.FSDP, 4, fsdp=FsdpSetup(wrap="transformers"), tp=2)
    rows = measure_from_pretrained(spec, setup, layout)
    predicted = predict(spec, setup, layout).ranks
    assert all(0 <= r["peak_allocated_bytes"] - p.peak_allocated_bytes <= MESH_TENSOR_BYTES
               for r, p in zip(rows, predicted)), ([r["peak_allocated_bytes"] for r in rows], predicted)
    capsys.readouterr()  # the checkpoint's save_pretrained progress
    base = ["predict", "--model", "llama-2-7b", *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")],
            "--set", "num_key_value_heads=4", "--seq-len", "32", "--micro-batch", "1", "--strategy", "fsdp",
            "--world-size", "4", "--tp", "2"]
    for flags, message in ((["--fsdp-offload"], "--fsdp-offload or fsdp-init host with --pp or --tp is not modelled"),
                           (["--fsdp-wrap", "transformers", "--set", "intermediate_size=126"],
                            "do not divide evenly over the 4 ranks")):
        assert main([*base, *flags]) == 2, flags
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error, (flags, error)
