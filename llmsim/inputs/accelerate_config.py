"""accelerate's config file (`accelerate launch --config_file FILE`, the YAML `accelerate config` writes), read with
accelerate's own classes: which layout the launch runs, on how many processes, in which mixed precision.

- `load_config_from_file` (accelerate.commands.config.config_args) parses it, so its keys, defaults and refusals are
  accelerate's (an unknown key is its own error);
- `distributed_type: NO` is one process, `MULTI_GPU` torch DDP over `num_processes` (every machine's), with
  `mixed_precision` as accelerate applies it to a plain model: autocast (bf16-autocast; fp16-autocast with its
  GradScaler);
- `DEEPSPEED` builds the DeepSpeed JSON as accelerate does: `DeepSpeedPlugin` from the file's `deepspeed_config`
  (its `deepspeed_config_file`, or the inline `zero_stage`, offload devices, accumulation and clipping), then
  `set_mixed_precision`, which writes `bf16`/`fp16` into it; its "auto" values are resolved as for `--ds-config`.
  With the optimizer offloaded accelerate replaces a torch optimizer by DeepSpeed's CPU Adam
  (`map_pytorch_optim_to_deepspeed`) unless the JSON sets `"zero_force_ds_cpu_optimizer": false`
  (`DeepSpeedSetup.replaces_client_optimizer`, the setup made with `launcher="accelerate"`);
- `FSDP` with the HF Trainer (`--training-args`): `accelerate launch` hands the file's `fsdp_config` and
  `mixed_precision` to the script as `FSDP_*`/`ACCELERATE_*` environment variables (accelerate's own
  `prepare_multi_gpu_env`, run here on the file), from which the Trainer's `Accelerator` builds its
  `FullyShardedDataParallelPlugin`; `trainer_fsdp_launch` builds that plugin the same way and gives the Trainer the
  TrainingArguments `fsdp`/`fsdp_config`/`bf16` that build the same plugin (transformers' path, modelled:
  llmsim/inputs/hf.py `trainer_fsdp`). Measured through `accelerate launch --config_file FILE` itself
  (experiments/measure_trainer.py).
  Without the Trainer (a script's own loop under accelerate's FSDP) it is refused; `--strategy fsdp` models
  `fully_shard` on each decoder layer, then the root.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmsim.enums import Precision
from llmsim.errors import InputError, one_line

# deepspeed_config keys that choose how `accelerate launch` starts the processes, not what they hold
LAUNCHER_KEYS = frozenset({"deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
                           "deepspeed_inclusion_filter"})
# the other deepspeed_config keys, as DeepSpeedPlugin's fields
PLUGIN_FIELDS = {"deepspeed_config_file": "hf_ds_config", "zero_stage": "zero_stage",
                 "gradient_accumulation_steps": "gradient_accumulation_steps",
                 "gradient_clipping": "gradient_clipping", "offload_optimizer_device": "offload_optimizer_device",
                 "offload_param_device": "offload_param_device",
                 "offload_optimizer_nvme_path": "offload_optimizer_nvme_path",
                 "offload_param_nvme_path": "offload_param_nvme_path", "zero3_init_flag": "zero3_init_flag",
                 "zero3_save_16bit_model": "zero3_save_16bit_model"}
MODELLED = "modelled: NO, MULTI_GPU, DEEPSPEED"
AUTOCAST = {"no": Precision.FP32, "bf16": Precision.BF16_AUTOCAST, "fp16": Precision.FP16_AUTOCAST}


@dataclass(frozen=True)
class AccelerateLaunch:
    """What the config file launches: the strategy ("single", "ddp" or "deepspeed"), the processes, the precision
    of a plain model (None under DeepSpeed, whose JSON carries it) and the DeepSpeed JSON."""

    strategy: str
    world_size: int
    precision: Precision | None
    ds_config: dict[str, Any] | None


def read_accelerate_config(path: str | Path) -> AccelerateLaunch:
    config = _read(path)
    kind = getattr(config.distributed_type, "value", config.distributed_type)
    mixed = str(getattr(config.mixed_precision, "value", config.mixed_precision) or "no")
    if mixed not in AUTOCAST:
        raise InputError(f"accelerate config mixed_precision {mixed!r} is not modelled; modelled: no, bf16, fp16")
    world = config.num_processes
    if not isinstance(world, int) or world < 1:  # accelerate's default, -1: `accelerate launch` counts the GPUs
        raise InputError(f"accelerate config num_processes({world}) is not a process count (unset, accelerate "
                         "launch uses every GPU it finds, which llmsim cannot know): set num_processes")
    if kind == "NO":
        if world != 1:
            raise InputError(f"accelerate config distributed_type NO runs one process, not num_processes({world})")
        return AccelerateLaunch("single", 1, AUTOCAST[mixed], None)
    if kind == "MULTI_GPU":
        return AccelerateLaunch("ddp", world, AUTOCAST[mixed], None)
    if kind == "DEEPSPEED":
        return AccelerateLaunch("deepspeed", world, None, _deepspeed_json(config.deepspeed_config or {}, mixed))
    if kind == "FSDP":
        raise InputError("accelerate config distributed_type FSDP is modelled with the HF Trainer (--training-args: "
                         "the Trainer's Accelerator builds its FSDP plugin from what the launcher passes); a script's "
                         "own loop under accelerate's FSDP is not modelled yet; --strategy fsdp models fully_shard "
                         f"per layer, then the root; {MODELLED}")
    raise InputError(f"accelerate config distributed_type {kind} is not modelled; {MODELLED}")


def _deepspeed_json(fields: dict[str, Any], mixed: str) -> dict[str, Any]:
    """The JSON `Accelerator` hands `deepspeed.initialize`: DeepSpeedPlugin's, with the mixed precision set."""
    from accelerate.utils import DeepSpeedPlugin

    unknown = sorted(set(fields) - set(PLUGIN_FIELDS) - LAUNCHER_KEYS)
    if unknown:
        raise InputError(f"accelerate config deepspeed_config: unknown keys {unknown}; valid: "
                         f"{', '.join(sorted(set(PLUGIN_FIELDS) | LAUNCHER_KEYS))}")
    kwargs = {PLUGIN_FIELDS[key]: value for key, value in fields.items() if key in PLUGIN_FIELDS}
    if "hf_ds_config" in kwargs and not Path(kwargs["hf_ds_config"]).is_file():
        raise InputError(f"accelerate config deepspeed_config_file {kwargs['hf_ds_config']!r} does not exist")
    try:
        plugin = DeepSpeedPlugin(**kwargs)
        plugin.set_mixed_precision(mixed)
    except Exception as exc:  # the plugin's own validation (a stage, a device, a mismatch with the file)
        raise InputError(f"accelerate config deepspeed_config: {one_line(exc)}") from None
    config = json.loads(json.dumps(plugin.deepspeed_config))
    return config


# accelerate's FullyShardedDataParallelPlugin fields whose run is modelled for the Trainer, with the YAML key naming
# each (llmsim/inputs/hf.py FSDP_PLUGIN_MODELLED: the same limits)
FSDP_YAML_KEYS = {"fsdp_version": "fsdp_version", "auto_wrap_policy": "fsdp_auto_wrap_policy",
                  "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
                  "activation_checkpointing": "fsdp_activation_checkpointing"}


def launch_environment(path: str | Path) -> dict[str, str]:
    """The FSDP_* and ACCELERATE_* variables `accelerate launch --config_file path` starts every process with
    (accelerate's `_validate_launch_command` and `prepare_multi_gpu_env` on the file; not the rendezvous ones)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    try:
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
            ["--config_file", str(path), "train.py"]))
        env = prepare_multi_gpu_env(args)
    except (ValueError, SystemExit) as exc:  # accelerate's own refusals of the file
        raise InputError(f"accelerate config {str(path)!r}: {one_line(exc)}") from None
    return {key: value for key, value in env.items() if key.startswith(("FSDP_", "ACCELERATE_"))}


def trainer_fsdp_launch(path: str | Path, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """`accelerate launch --config_file path` (distributed_type FSDP) running the HF Trainer on TrainingArguments
    `fields`: the world size and the TrainingArguments fields that give the Trainer the plugin the launcher's
    environment gives it (FSDP2, its resharding and CPU offload; the file's `mixed_precision` bf16 as `bf16=True`,
    which sets the same mixed precision). One line for what is not modelled."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.environment import patch_environment
    from torch.distributed.fsdp import CPUOffloadPolicy

    from llmsim.inputs.hf import FSDP_PLUGIN_MODELLED

    launch = _read(path)
    kind = getattr(launch.distributed_type, "value", launch.distributed_type)
    if kind != "FSDP":
        raise InputError(f"--accelerate-config with --training-args: distributed_type {kind} under the Trainer is "
                         "not modelled yet (the Trainer takes it from the launcher's environment); modelled: FSDP "
                         "(or give the Trainer's deepspeed= / --ds-config, or torchrun with --world-size)")
    for key in ("fsdp", "deepspeed"):
        if fields.get(key):
            raise InputError(f"the TrainingArguments' {key} with --accelerate-config {path} (distributed_type FSDP): "
                             "the launch sets FSDP; give one")
    mixed = str(getattr(launch.mixed_precision, "value", launch.mixed_precision) or "no")
    if mixed not in ("no", "bf16"):
        raise InputError(f"accelerate config mixed_precision {mixed!r} with FSDP under the Trainer is not modelled "
                         "yet; modelled: no, bf16")
    world = launch.num_processes
    if not isinstance(world, int) or world < 2:
        raise InputError(f"accelerate config num_processes({world}): FSDP shards over 2 or more processes; set "
                         "num_processes")
    env = launch_environment(path)
    if env.get("FSDP_VERSION") != "2":  # FSDP1's plugin does not even build on a CPU (sync_module_states)
        raise InputError(f"accelerate config fsdp_config fsdp_version: {env.get('FSDP_VERSION')} is not modelled "
                         "yet; modelled: 2 (FSDP2, fully_shard)")
    try:
        with patch_environment(**env):
            plugin = FullyShardedDataParallelPlugin()
    except (ValueError, RuntimeError) as exc:  # the plugin's own refusals of the variables
        raise InputError(f"accelerate config fsdp_config: {one_line(exc)}") from None
    wrap = getattr(plugin.auto_wrap_policy, "__name__", plugin.auto_wrap_policy)
    found = {"fsdp_version": plugin.fsdp_version,
             "auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if wrap == "transformer_auto_wrap_policy" else wrap,
             "cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading,
             "activation_checkpointing": plugin.activation_checkpointing}
    for name, value in found.items():
        if value not in FSDP_PLUGIN_MODELLED[name]:
            raise InputError(f"accelerate config fsdp_config {FSDP_YAML_KEYS[name]}: {value!r} is not "
                             f"modelled yet; modelled: {FSDP_PLUGIN_MODELLED[name][0]!r} (FSDP2, "
                             "TRANSFORMER_BASED_WRAP, the Trainer's gradient_checkpointing)")
    fsdp_config = {"fsdp_version": 2, "reshard_after_forward": bool(plugin.reshard_after_forward),
                   "cpu_offload": isinstance(plugin.cpu_offload, CPUOffloadPolicy),
                   # accelerate launch's default where the file leaves it out (true)
                   "cpu_ram_efficient_loading": bool(plugin.cpu_ram_efficient_loading),
                   "activation_checkpointing": bool(plugin.activation_checkpointing)}
    if plugin.transformer_cls_names_to_wrap:  # the file's fsdp_transformer_layer_cls_to_wrap, as the Trainer takes it
        fsdp_config["transformer_layer_cls_to_wrap"] = list(plugin.transformer_cls_names_to_wrap)
    added = {"fsdp": True, "fsdp_config": fsdp_config}
    if mixed == "bf16":
        if fields.get("fp16"):
            raise InputError(f"TrainingArguments fp16=True contradicts --accelerate-config {path} (mixed_precision: "
                             "bf16)")
        added["bf16"] = True
    return world, {**fields, **added}


def _read(path: str | Path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    if not Path(path).is_file():
        raise InputError(f"accelerate config {str(path)!r} does not exist")
    try:
        config = load_config_from_file(str(path))
    except Exception as exc:  # accelerate's ValueError for unknown keys, yaml's and json's parse errors
        raise InputError(f"accelerate config {str(path)!r}: {one_line(exc)}") from None
    if not isinstance(config, ClusterConfig):
        raise InputError(f"accelerate config {str(path)!r} is a {type(config).__name__}; modelled: a local or "
                         "cluster launch (ClusterConfig)")
    if config.use_cpu:
        raise InputError("accelerate config use_cpu: true launches on the CPU; llmsim predicts accelerator memory "
                         "(drop use_cpu)")
    return config
