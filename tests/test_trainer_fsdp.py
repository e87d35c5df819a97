"""The HF Trainer's FSDP (TrainingArguments fsdp / fsdp_config): transformers' plugin arguments read with its own
class, accelerate's FSDP2 path run by the trace on a fake process group, and real Trainer.train() runs under
torchrun (llmsim/model/trainer_recipe.py) against it."""
import json
from dataclasses import replace

import pandas as pd
import pytest

from llmsim.app.cli import main

from llmsim.errors import InputError
from llmsim.inputs.hf import trainer_setup
from llmsim.inputs.spec import load_model_spec
from llmsim.measure.runs import MEASUREMENTS_DIR, measure_trainer
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Strategy, trainer_layout

FSDP_CSV = MEASUREMENTS_DIR / "trainer_fsdp_cpu.csv"
LLAMA_TINY = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_hidden_layers": 3,
              "num_key_value_heads": 2, "vocab_size": 800}


def _layout(fields, world_size=2, strategy=None, peft=None, dtype="float32", model="llama-2-7b",
            overrides=LLAMA_TINY, quantization=None):
    spec = load_model_spec(model, overrides)
    setup = trainer_setup(spec, 48, {"per_device_train_batch_size": 2, **fields}, peft, dtype, quantization)
    return spec, *trainer_layout(spec, setup, world_size, strategy)


def test_the_trainers_fsdp_is_read_as_transformers_hands_it_to_accelerate():
    _, _, layout = _layout({"fsdp": True, "bf16": True})
    assert layout.strategy is Strategy.FSDP and layout.world_size == 2
    assert (layout.fsdp.wrap, layout.fsdp.init, layout.fsdp.reshard_after_forward) == ("accelerate", "full", True)
    assert (layout.fsdp.param_dtype, layout.fsdp.reduce_dtype) == ("bfloat16", "bfloat16")  # set_mixed_precision
    _, _, legacy = _layout({"fsdp": "shard_grad_op auto_wrap"})  # transformers' legacy words, its translation
    assert not legacy.fsdp.reshard_after_forward and legacy.fsdp.param_dtype is None
    assert not legacy.fsdp.offload
    for fields in ({"fsdp": True, "fsdp_config": {"cpu_offload": True}}, {"fsdp": "full_shard offload auto_wrap"}):
        assert _layout(fields)[2].fsdp.offload  # accelerate's CPUOffloadPolicy()
    assert not legacy.fsdp.cpu_ram_efficient_loading  # the Trainer's default, unlike accelerate launch's
    assert _layout({"fsdp": True, "fsdp_config": {"cpu_ram_efficient_loading": True}})[2].fsdp.cpu_ram_efficient_loading
    checkpointed = _layout({"fsdp": True, "fsdp_config": {"activation_checkpointing": True}})[2].fsdp
    assert checkpointed.activation_checkpointing and not legacy.fsdp.activation_checkpointing


@pytest.mark.parametrize("fields, world_size, strategy, says", [
    ({"fsdp": True, "fsdp_config": {"version": 1}}, 2, None, "fsdp_version=1 is not modelled yet"),
    ({"fsdp": True, "fsdp_config": {"activation_checkpointing": True}, "gradient_checkpointing": True}, 2, None,
     "can't both be set to True"),
    ({"fsdp": True, "fsdp_config": {"auto_wrap_policy": "SIZE_BASED_WRAP"}}, 2, None, "auto_wrap_policy"),
    ({"fsdp": True, "fp16": True}, 2, None, "FSDP and fp16=True is not modelled yet"),
    ({"fsdp": True}, 1, None, "give --world-size N (2 or more)"),
    ({"fsdp": True}, 2, Strategy.DDP, "--strategy ddp contradicts the TrainingArguments' fsdp"),
    ({"fsdp": "full_shard nope"}, 2, None, "Unknown `fsdp` option: nope"),
    ({"fsdp": True, "fsdp_config": {"xla": True}}, 2, None, "xla=True (torch_xla's FSDP, on TPUs) is not modelled"),
])
def test_what_the_trainers_fsdp_does_not_model_is_one_line(fields, world_size, strategy, says):
    with pytest.raises(InputError) as raised:
        _layout(fields, world_size, strategy)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_fsdp_cli_errors_are_one_line(tmp_path, capsys):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "fsdp": True}))
    sets = [arg for key, value in LLAMA_TINY.items() for arg in ("--set", f"{key}={value}")]
    base = ["predict", "--model", "llama-2-7b", "--seq-len", "48", "--dtype", "float32", *sets]
    quantization = tmp_path / "bnb.json"
    quantization.write_text(json.dumps({"load_in_4bit": True}))
    peft = tmp_path / "lora.json"
    peft.write_text(json.dumps({"r": 4, "target_modules": "all-linear"}))
    for extra, says in (
            (["--training-args", str(args), "--world-size", "2", "--quantization-config", str(quantization),
              "--peft-config", str(peft)], "a quantized base with the Trainer's FSDP is not modelled yet"),
            (["--training-args", str(args), "--world-size", "2", "--fsdp-no-reshard"],
             "--fsdp-no-reshard with --training-args: the Trainer's files decide it (reshard_after_forward"),
            (["--training-args", str(args), "--world-size", "2", "--fsdp-init", "meta"],
             "fsdp-init(meta) is not where the Trainer's FSDP finds the model; choose full"),
            (["--training-args", str(args), "--world-size", "2", "--fsdp-init", "full", "--gpu", "h100-80gb"],
             "--fsdp-init full with --gpu: on a GPU the Trainer leaves the model where from_pretrained loaded it"),
            (["--micro-batch", "2", "--strategy", "fsdp", "--world-size", "2", "--fsdp-wrap", "accelerate"],
             "fsdp-wrap(accelerate) is the HF Trainer's FSDP")):
        capsys.readouterr()
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_the_report_names_fsdp2_as_accelerate_runs_it(tmp_path, capsys):
    args = tmp_path / "args.yaml"
    args.write_text("per_device_train_batch_size: 2\nbf16: true\nfsdp: true\n")
    sets = [arg for key, value in LLAMA_TINY.items() for arg in ("--set", f"{key}={value}")]
    assert main(["predict", "--model", "llama-2-7b", "--seq-len", "48", "--dtype", "float32", *sets,
                 "--training-args", str(args), "--world-size", "2"]) == 0
    out = capsys.readouterr()
    assert ("fsdp x 2 (FSDP2, accelerate's wrap, reshard_after_forward True, MixedPrecisionPolicy(param bfloat16, "
            "reduce bfloat16))") in out.out
    assert "Warning" not in out.err and "warn" not in out.err  # accelerate's thread notice and deprecations stay out


FRESH = [  # a family and shape the committed rows do not hold, checkpointing and accumulation together
    ("mistral-7b", {**LLAMA_TINY, "num_hidden_layers": 4},
     {"fsdp": True, "bf16": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2}, "float32"),
]


@pytest.mark.parametrize("model, overrides, fields, dtype", FRESH, ids=["mistral-ckpt-accum"])
def test_a_fresh_trainer_fsdp_run_matches_its_prediction(model, overrides, fields, dtype):
    spec, setup, layout = _layout(fields, dtype=dtype, model=model, overrides=overrides)
    measured = [row["peak_allocated_bytes"] for row in measure_trainer(spec, setup, dtype, layout)]
    predicted = [rank.peak_allocated_bytes for rank in predict(spec, setup, layout).ranks]
    for p, m in zip(predicted, measured, strict=True):
        assert abs(p - m) / m <= PEAK_ALLOCATED_TOLERANCE[2], (predicted, measured)


def test_a_fresh_host_loaded_trainer_fsdp_run_matches_its_prediction():
    """The Trainer's FSDP measured as on a GPU (init "host"): a shape whose whole model on the device would be its
    peak, LoRA on a bf16 load; device and host peaks of each rank against the prediction."""
    deep = {**LLAMA_TINY, "hidden_size": 128, "intermediate_size": 1024, "num_hidden_layers": 8,
            "num_key_value_heads": 4, "vocab_size": 1000}
    spec = load_model_spec("qwen2.5-0.5b", {**deep, "max_window_layers": 8})
    setup = trainer_setup(spec, 8, {"per_device_train_batch_size": 1, "fsdp": True, "bf16": True},
                          {"r": 4, "target_modules": "all-linear"}, "bfloat16", None)
    setup, layout = trainer_layout(spec, setup, 2, None)
    layout = replace(layout, fsdp=replace(layout.fsdp, init="host"))
    measured = measure_trainer(spec, setup, "bfloat16", layout)
    predicted = predict(spec, setup, layout).ranks
    for p, m in zip(predicted, measured, strict=True):
        assert m["fsdp_init"] == "host" and m["peak_host_bytes"] > 0
        for ours, theirs in ((p.peak_allocated_bytes, m["peak_allocated_bytes"]),
                             (p.peak_host_bytes, m["peak_host_bytes"])):
            assert abs(ours - theirs) / theirs <= PEAK_ALLOCATED_TOLERANCE[2], (predicted, measured)


def test_a_fresh_accelerate_launch_matches_its_prediction(tmp_path):
    """The Trainer started by `accelerate launch --config_file` (distributed_type FSDP, the plugin from the launcher's
    variables, CPU offload, mixed precision no, fsdp_cpu_ram_efficient_loading left out: the launch's default,
    true): a held-out Mistral shape, device and host peaks of each rank against the prediction from the file
    (llmsim/inputs/accelerate_config.py `trainer_fsdp_launch`)."""
    from llmsim.inputs.accelerate_config import trainer_fsdp_launch

    launch = tmp_path / "fsdp.yaml"
    launch.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: 'no'\nfsdp_config:\n"
                      "  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                      "  fsdp_offload_params: true\n  fsdp_reshard_after_forward: false\n")
    user = {"per_device_train_batch_size": 2, "gradient_checkpointing": True}
    spec = load_model_spec("mistral-7b", {**LLAMA_TINY, "num_hidden_layers": 3})
    world, fields = trainer_fsdp_launch(launch, user)
    setup, layout = trainer_layout(spec, trainer_setup(spec, 16, fields, None, "float32", None), world, None)
    assert layout.fsdp.cpu_ram_efficient_loading and layout.fsdp.offload
    measured = measure_trainer(spec, setup, "float32", layout, accelerate_config=str(launch), user_fields=user)
    predicted = predict(spec, setup, layout).ranks
    for p, m in zip(predicted, measured, strict=True):
        assert json.loads(m["accelerate_config"])["distributed_type"] == "FSDP" and m["peak_host_bytes"] > 0
        for ours, theirs in ((p.peak_allocated_bytes, m["peak_allocated_bytes"]),
                             (p.peak_host_bytes, m["peak_host_bytes"])):
            assert abs(ours - theirs) / theirs <= PEAK_ALLOCATED_TOLERANCE[2], (predicted, measured)


def test_committed_fsdp_rows_cover_the_trainers_fsdp():
    rows = pd.read_csv(FSDP_CSV)
    assert len(rows) >= 60 and (rows["strategy"] == "fsdp").all() and rows["gloo_settle"].all()
    assert set(rows["rank"]) == {0, 1, 2} and (rows["recipe"] == "hf-trainer").all()  # 3 ranks: uneven shards
    assert (rows.groupby("world_size")["rank"].count() > 0).all() and set(rows["world_size"]) == {2, 3}
    fields = rows["training_args"].map(json.loads)
    assert {load_model_spec(m).config_dict["model_type"] for m in rows["model"]} >= {"llama", "qwen2", "gpt2",
                                                                                       "gpt_neox"}
    assert fields.map(lambda f: f.get("fsdp") == "shard_grad_op auto_wrap").any()  # the legacy words
    for field, value in (("bf16", True), ("gradient_checkpointing", True), ("gradient_accumulation_steps", 2),
                         ("optim", "adamw_torch")):
        assert fields.map(lambda f: f.get(field) == value).any(), field
    assert fields.map(lambda f: f.get("fsdp_config", {}).get("reshard_after_forward") is False).any()
    assert set(rows["load_dtype"]) == {"float32", "bfloat16"} and rows["peft_config"].notna().any()
    # launched by `accelerate launch --config_file` (the TrainingArguments without fsdp: the file's variables)
    launches = rows["accelerate_config"].map(lambda c: json.loads(c) if isinstance(c, str) and c else None)
    launched = launches.notna()
    assert launched.sum() >= 24 and not fields[launched].map(lambda f: "fsdp" in f).any()
    assert {c["mixed_precision"] for c in launches[launched]} == {"no", "bf16"}
    offload = fields.map(lambda f: f.get("fsdp_config", {}).get("cpu_offload") is True
                         or "offload" in str(f.get("fsdp"))) | \
        launches.map(lambda c: bool(c and c["fsdp_config"].get("fsdp_offload_params")))
    assert offload.sum() >= 10 and (rows.loc[offload, "peak_host_bytes"] > 0).all()
    assert (offload & launched).sum() >= 6
    loaded_on_the_host = rows["fsdp_init"].fillna("") == "host"  # measured as on a GPU: the model loads there
    assert (rows.loc[~offload & ~loaded_on_the_host, "peak_host_bytes"] == 0).all()
    # fsdp_cpu_ram_efficient_loading (accelerate launch's default where the file leaves it out): rank 0 apart
    ram = launches.map(lambda c: bool(c) and c["fsdp_config"].get("fsdp_cpu_ram_efficient_loading", True))
    assert ram.sum() >= 40 and launches[ram].map(lambda c: "fsdp_cpu_ram_efficient_loading" not in
                                                  c["fsdp_config"]).any()
    assert (ram & offload).sum() >= 6 and (ram & loaded_on_the_host).sum() >= 10
    run = ["model", "overrides", "seq_len", "training_args", "peft_config", "load_dtype", "accelerate_config",
           "fsdp_init"]
    one_run = rows.loc[ram, run].map(str).agg("|".join, axis=1)
    apart = rows[ram].groupby(one_run)[["peak_allocated_bytes", "peak_host_bytes"]].nunique().max(axis=1)
    assert (apart > 1).sum() >= 3  # ranks whose device or host peaks differ: the build (CPU) or rank 0's host
    # FSDP's own activation checkpointing (accelerate's checkpoint_wrapper), from a launch YAML or the TrainingArguments
    checkpointed = launches.map(lambda c: bool(c) and c["fsdp_config"].get("fsdp_activation_checkpointing") is True) | \
        fields.map(lambda f: f.get("fsdp_config", {}).get("activation_checkpointing") is True)
    assert checkpointed.sum() >= 40 and (checkpointed & ~launched).sum() >= 6
    assert (checkpointed & offload).any() and (checkpointed & loaded_on_the_host).any() and (checkpointed & ram).any()


def test_on_a_gpu_the_trainers_fsdp_loads_on_the_host(tmp_path, capsys):
    """--gpu: each rank loads the whole model on the host and accelerate upcasts it there (init "host"); the device
    holds one unit at a time until it is sharded. The table shows the host peak and a node's. LoRA on a deep, narrow
    model with short sequences: the whole model on the device would be its peak."""
    args = tmp_path / "args.yaml"
    args.write_text("per_device_train_batch_size: 1\nbf16: true\nfsdp: true\n")
    deep = {**LLAMA_TINY, "hidden_size": 128, "intermediate_size": 1024, "num_hidden_layers": 8,
            "num_key_value_heads": 4, "vocab_size": 1000}
    sets = [arg for key, value in deep.items() for arg in ("--set", f"{key}={value}")]
    lora = tmp_path / "adapter_config.json"
    lora.write_text(json.dumps({"r": 8, "target_modules": "all-linear"}))
    base = ["predict", "--model", "llama-2-7b", "--seq-len", "8", "--dtype", "bfloat16", *sets, "--training-args",
            str(args), "--peft-config", str(lora), "--world-size", "2", "--format", "json"]
    peaks = {}
    for extra in ([], ["--fsdp-init", "host"], ["--gpu", "h100-80gb"]):
        assert main(base + extra) == 0
        rank = json.loads(capsys.readouterr().out)["ranks"][0]
        peaks[" ".join(extra)] = rank["peak_allocated_bytes"], rank["peak_host_bytes"], rank["peak_phase"]
    whole, host, gpu = peaks[""], peaks["--fsdp-init host"], peaks["--gpu h100-80gb"]
    # the CPU run holds the whole loaded model on its one memory while it shards it: its peak is the build's
    assert whole[2] == "build" and whole[1] == 0
    # loaded on the host: the bf16 model there (8 layers of 128 x 1024 MLPs and attention, 1000-token vocabulary)
    assert host[2] == "forward" and host[0] < whole[0] and host[1] > 8_000_000
    assert gpu[1] == host[1] and gpu[2] != "build"  # a GPU run loads as the host-loaded CPU run does
    assert main(base[:-2] + ["--gpu", "h100-80gb"]) == 0
    assert "host memory per node (2 rank(s) per node" in capsys.readouterr().out


def test_committed_host_loaded_rows_cover_the_trainers_fsdp_on_a_gpu():
    rows = pd.read_csv(FSDP_CSV)
    host = rows[rows["fsdp_init"].fillna("") == "host"]
    assert len(host) >= 34 and (host["peak_host_bytes"] > 0).all() and set(host["world_size"]) == {2}
    fields = host["training_args"].map(json.loads)
    assert fields.map(lambda f: f.get("fsdp_config", {}).get("cpu_offload") is True).any()
    assert set(host["load_dtype"]) == {"float32", "bfloat16"} and host["peft_config"].notna().any()
    assert {load_model_spec(m).config_dict["model_type"] for m in host["model"]} >= {"llama", "qwen2"}
