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
- `FSDP` is refused: `accelerate launch` hands the file's `fsdp_config` to the script as `FSDP_*` environment
  variables, from which `AcceleratorState` builds the plugin; llmsim does not read them yet. The same run given as
  the TrainingArguments' `fsdp` and `fsdp_config` is modelled (accelerate's `fsdp2_prepare_model`, llmsim/inputs/hf.py
  `trainer_fsdp`), as is `--strategy fsdp` (`fully_shard` on each decoder layer, then the root).
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
    kind = getattr(config.distributed_type, "value", config.distributed_type)
    mixed = str(getattr(config.mixed_precision, "value", config.mixed_precision) or "no")
    if config.use_cpu:
        raise InputError("accelerate config use_cpu: true launches on the CPU; llmsim predicts accelerator memory "
                         "(drop use_cpu)")
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
        raise InputError("accelerate config distributed_type FSDP is not modelled yet: the launcher hands its "
                         "fsdp_config to the script as FSDP_* variables, which llmsim does not read; the same FSDP2 "
                         "run given as the TrainingArguments' fsdp and fsdp_config (--training-args) is modelled, and "
                         f"--strategy fsdp for fully_shard per layer, then the root; {MODELLED}")
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
