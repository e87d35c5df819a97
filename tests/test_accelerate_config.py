"""--accelerate-config: accelerate's launch YAML read with accelerate's own classes predicts what the equivalent
flags predict; what accelerate does that llmsim does not model is refused with one line."""
from __future__ import annotations

import json

import pytest

from llmsim.app.cli import main

TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "2"]


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _peaks(capsys, *args) -> list[int]:
    assert main(["predict", *TINY, *args, "--format", "json"]) == 0
    return [r["peak_allocated_bytes"] for r in json.loads(capsys.readouterr().out)["ranks"]]


def test_deepspeed_launch_is_the_json_accelerate_builds(tmp_path, capsys):
    """Inline deepspeed_config keys (DeepSpeedPlugin's JSON, bf16 written in by set_mixed_precision) and a
    deepspeed_config_file with "auto" values both predict what the written-out JSON predicts."""
    inline = _write(tmp_path, "inline.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
                    "deepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 1.0\n  gradient_accumulation_steps: 1\n"
                    "  offload_optimizer_device: none\n  offload_param_device: none\n  zero3_init_flag: false\n")
    written = _write(tmp_path, "ds.json", json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                                                      "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    expected = _peaks(capsys, "--ds-config", written, "--world-size", "2")
    assert _peaks(capsys, "--accelerate-config", inline) == expected
    auto = _write(tmp_path, "auto.json", json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                                     "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
                                                     "bf16": {"enabled": "auto"}}))
    from_file = _write(tmp_path, "file.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
                       f"deepspeed_config:\n  deepspeed_config_file: {auto}\n  deepspeed_multinode_launcher: standard\n")
    assert _peaks(capsys, "--accelerate-config", from_file) == expected


def test_offloaded_optimizer_is_deepspeeds_cpu_adam_as_accelerate_swaps_it_in(tmp_path, capsys):
    """With the optimizer offloaded accelerate hands DeepSpeed `map_pytorch_optim_to_deepspeed(optimizer)`, a
    DeepSpeedCPUAdam: the launch predicts what a JSON with an Adam "optimizer" section predicts (DeepSpeed's CPU
    Adam again), not what the client AdamW kept by "zero_force_ds_cpu_optimizer": false predicts."""
    launch = _write(tmp_path, "offload.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
                    "deepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 1.0\n  gradient_accumulation_steps: 1\n"
                    "  offload_optimizer_device: cpu\n")
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    section = _write(tmp_path, "adam.json", json.dumps({**base, "optimizer": {"type": "AdamW"}}))
    client = _write(tmp_path, "client.json", json.dumps({**base, "zero_force_ds_cpu_optimizer": False}))

    def host(*args) -> list[int]:
        assert main(["predict", *TINY, *args, "--format", "json"]) == 0
        out = json.loads(capsys.readouterr().out)
        return [(r["peak_allocated_bytes"], r["peak_host_bytes"]) for r in out["ranks"]], out["optimizer"]

    swapped, words = host("--accelerate-config", launch)
    assert swapped == host("--ds-config", section, "--world-size", "2")[0]
    assert swapped != host("--ds-config", client, "--world-size", "2")[0]
    assert words.startswith("DeepSpeed's CPU Adam (accelerate's map_pytorch_optim_to_deepspeed, in place of adamw")


def test_parameters_to_nvme_is_the_json_accelerate_builds(tmp_path, capsys):
    """`offload_param_device: nvme` with its `offload_param_nvme_path` (ZeRO-Infinity's parameter swapper, with
    DeepSpeed's pool defaults: 5 buffers of 1e8 elements) predicts what the JSON accelerate writes predicts. On a
    model this small the host peak is zero.Init's, the pool twice (its torch.empty and the page-locked tensor that
    replaces it, as measured: experiments/measure_offload.py run 94); the device is parameter offload's."""
    def launch(device: str) -> str:
        return _write(tmp_path, f"{device}.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                      "num_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n  gradient_accumulation_steps: 1\n"
                      f"  offload_optimizer_device: cpu\n  offload_param_device: {device}\n"
                      "  offload_param_nvme_path: /local_nvme\n  zero3_init_flag: true\n")

    def host(*args) -> list[tuple[int, int]]:
        assert main(["predict", *TINY, *args, "--format", "json"]) == 0
        out = json.loads(capsys.readouterr().out)
        return [(r["peak_allocated_bytes"], r["peak_host_bytes"]) for r in out["ranks"]]

    written = _write(tmp_path, "nvme.json", json.dumps({
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}))
    swapped = host("--accelerate-config", launch("nvme"))
    assert swapped == host("--ds-config", written, "--world-size", "2")
    pool = 5 * 100_000_256 * 2  # 1e8 elements rounded up to the 512-element (1 KiB) I/O alignment, bf16
    assert [h for _, h in swapped] == [2 * pool] * 2
    assert [d for d, _ in swapped] == [d for d, _ in host("--accelerate-config", launch("cpu"))]


def test_multi_gpu_launch_is_ddp_under_autocast(tmp_path, capsys):
    config = _write(tmp_path, "ddp.yaml", "distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 4\n"
                    "num_machines: 1\ngpu_ids: all\n")
    assert _peaks(capsys, "--accelerate-config", config) == \
        _peaks(capsys, "--strategy", "ddp", "--world-size", "4", "--precision", "bf16-autocast")
    assert _peaks(capsys, "--accelerate-config", config, "--world-size", "4") == \
        _peaks(capsys, "--strategy", "ddp", "--world-size", "4", "--precision", "bf16-autocast")


@pytest.mark.parametrize("text,extra,needle", [
    ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n", [],
     "distributed_type FSDP is modelled with the HF Trainer (--training-args"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precison: bf16\n", [], "unknown keys (['mixed_precison'])"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp8\n", [], "mixed_precision 'fp8'"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\n", ["--world-size", "4"], "--world-size 4 contradicts"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: bf16\n", ["--precision", "bf16"],
     "--precision bf16 contradicts"),
    ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n"
     "  offload_optimizer_device: cpu\n", ["--optimizer", "sgd"], "replaced by DeepSpeed's CPU Adam"),
    ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stag: 2\n", [],
     "deepspeed_config: unknown keys ['zero_stag']"),
    ("distributed_type: XLA\nnum_processes: 2\n", [], "distributed_type XLA is not modelled"),
    ("distributed_type: MULTI_GPU\nmixed_precision: bf16\n", [], "num_processes(-1) is not a process count"),
])
def test_what_accelerate_does_and_llmsim_does_not_model_is_one_line(tmp_path, capsys, text, extra, needle):
    config = _write(tmp_path, "bad.yaml", text)
    assert main(["predict", *TINY, "--accelerate-config", config, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


FSDP_YAML = ("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: {mixed}\nfsdp_config:\n"
             "  fsdp_version: {version}\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
             "  fsdp_reshard_after_forward: {reshard}\n  fsdp_offload_params: {offload}\n"
             "  fsdp_cpu_ram_efficient_loading: {ram}\n")
TRAINER = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
           "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
           "--set", "vocab_size=256", "--seq-len", "16", "--dtype", "float32"]


def _trainer_peaks(capsys, *args) -> list[tuple[int, int]]:
    assert main(["predict", *TRAINER, *args, "--format", "json"]) == 0
    return [(r["peak_allocated_bytes"], r["peak_host_bytes"]) for r in json.loads(capsys.readouterr().out)["ranks"]]


@pytest.mark.parametrize("mixed,reshard,offload,ram", [("bf16", "true", "false", "false"),
                                                       ("'no'", "false", "true", "false"),
                                                       ("bf16", "true", "false", "true")])
def test_an_fsdp_launch_gives_the_trainer_the_plugin_its_variables_build(tmp_path, capsys, mixed, reshard, offload,
                                                                         ram):
    """`accelerate launch --config_file` with FSDP under the Trainer predicts what the TrainingArguments' fsdp,
    fsdp_config and bf16 that build the same plugin predict (measured through accelerate's launcher itself:
    trainer_fsdp_cpu.csv, the rows with accelerate_config)."""
    launch = _write(tmp_path, "fsdp.yaml", FSDP_YAML.format(mixed=mixed, version=2, reshard=reshard,
                                                            offload=offload, ram=ram))
    args = _write(tmp_path, "args.yaml", "per_device_train_batch_size: 2\n")
    same = {"per_device_train_batch_size": 2, "fsdp": True, "bf16": mixed == "bf16",
            "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": reshard == "true",
                            "cpu_offload": offload == "true", "cpu_ram_efficient_loading": ram == "true"}}
    direct = _write(tmp_path, "direct.json", json.dumps(same))
    launched = _trainer_peaks(capsys, "--training-args", args, "--accelerate-config", launch)
    assert launched == _trainer_peaks(capsys, "--training-args", direct, "--world-size", "2")
    assert len(launched) == 2 and (launched[0][1] > 0) == (offload == "true")


@pytest.mark.parametrize("version,ram,fields,needle", [
    (1, "false", "", "fsdp_config fsdp_version: 1 is not modelled yet; modelled: 2"),
    (2, "false", "fsdp: true\n", "the TrainingArguments' fsdp with --accelerate-config"),
    (2, "false", "fp16: true\n", "fp16=True contradicts --accelerate-config"),
])
def test_what_an_fsdp_launch_does_and_llmsim_does_not_model_is_one_line(tmp_path, capsys, version, ram, fields,
                                                                          needle):
    launch = _write(tmp_path, "fsdp.yaml", FSDP_YAML.format(mixed="bf16", version=version, reshard="true",
                                                            offload="false", ram=ram))
    args = _write(tmp_path, "args.yaml", "per_device_train_batch_size: 2\n" + fields)
    assert main(["predict", *TRAINER, "--training-args", args, "--accelerate-config", launch]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_an_fsdp_launch_loads_ram_efficiently_unless_the_file_says_otherwise(tmp_path):
    """accelerate launch's default for `fsdp_cpu_ram_efficient_loading` where the file leaves it out is true (its
    launcher sets FSDP_CPU_RAM_EFFICIENT_LOADING=true): the Trainer gets the plugin's value, and rank 0 (the main
    process, whose state dict the others' shards are loaded from) is traced apart from the other ranks."""
    from llmsim.inputs.accelerate_config import trainer_fsdp_launch
    from llmsim.inputs.hf import trainer_setup
    from llmsim.inputs.spec import load_model_spec
    from llmsim.sim.strategies import traced_setup, trainer_layout
    from llmsim.sim.strategies.fsdp import rank_classes

    text = FSDP_YAML.format(mixed="bf16", version=2, reshard="true", offload="false", ram="false")
    left_out = _write(tmp_path, "default.yaml", "\n".join(line for line in text.splitlines()
                                                          if "cpu_ram_efficient_loading" not in line) + "\n")
    spec = load_model_spec("llama-2-7b", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                          "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256})
    for path, ram in ((left_out, True), (_write(tmp_path, "off.yaml", text), False)):
        world, fields = trainer_fsdp_launch(path, {"per_device_train_batch_size": 2})
        assert world == 2 and fields["fsdp_config"]["cpu_ram_efficient_loading"] is ram
        setup, layout = trainer_layout(spec, trainer_setup(spec, 16, fields, None, "float32", None), world, None)
        assert layout.fsdp.cpu_ram_efficient_loading is ram
        assert rank_classes(spec, traced_setup(setup, layout), 4) == ([[0], [1, 2, 3]] if ram else [[0, 1, 2, 3]])


def test_a_ram_efficient_launch_prints_no_library_advice(tmp_path):
    """Rank 1's trace runs a Trainer that sets transformers' verbosity for a replica ("warning"): it is restored
    after the trace, so no library advice (here the FSDP checkpointing one) reaches the user's stderr."""
    launch = _write(tmp_path, "fsdp.yaml", FSDP_YAML.format(mixed="bf16", version=2, reshard="true", offload="false",
                                                            ram="true"))
    args = _write(tmp_path, "args.yaml", "per_device_train_batch_size: 2\ngradient_checkpointing: true\n")
    from transformers.utils import logging as hf_logging

    assert main(["predict", *TRAINER, "--training-args", args, "--accelerate-config", launch]) == 0
    assert hf_logging.get_verbosity() == hf_logging.ERROR  # as the CLI set it (llmsim/model/quiet.py)
