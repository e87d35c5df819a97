"""A DeepSpeed config JSON exactly as the user passes it to `deepspeed.initialize`.

"auto" values are resolved the way transformers' DeepSpeed integration resolves them
(transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process and
trainer_config_finalize): batch sizes from the training arguments, `reduce_bucket_size` = hidden_size²,
`stage3_prefetch_bucket_size` = int(0.9 · hidden_size²), `stage3_param_persistence_threshold` =
10 · hidden_size. The zero_optimization section is validated by DeepSpeed's own pydantic model, so a key
DeepSpeed would reject is rejected here with DeepSpeed's words.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmsim.enums import Precision
from llmsim.errors import InputError, one_line

AUTO = "auto"
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # predicting needs no accelerator; skips DeepSpeed's probe
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
HF_DEFAULT_MAX_GRAD_NORM = 1.0  # transformers.TrainingArguments.max_grad_norm
DEEPSPEED_ADAM_TYPES = ("adam", "adamw")  # deepspeed/runtime/config.py ADAM_OPTIMIZER, ADAMW_OPTIMIZER
# DeepSpeedSetup.optimizer_kind, as the report names what steps
DEEPSPEED_OPTIMIZER_NAMES = {"client": "the client optimizer", "torch": "torch.optim.AdamW (torch_adam)",
                             "fused": "DeepSpeed's FusedAdam", "cpu_adam": "DeepSpeed's CPU Adam"}


@dataclass(frozen=True)
class DeepSpeedSetup:
    """The resolved config (canonical JSON, hashable) and what the training loop takes from it."""

    config_json: str
    world_size: int
    # who calls deepspeed.initialize: the user's script ("deepspeed") or accelerate's `Accelerator.prepare` (the HF
    # Trainer, `accelerate launch`), which replaces a torch optimizer by DeepSpeed's CPU Adam under optimizer offload
    launcher: str = "deepspeed"

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @property
    def micro_batch(self) -> int:
        return int(self.config["train_micro_batch_size_per_gpu"])

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step: `engine.step()` steps at every n-th call (engine.py,
        `is_gradient_accumulation_boundary`); the script calls forward, `engine.backward` and `engine.step` each
        micro-step, and `engine.backward` divides the loss by n."""
        return int(self.config.get("gradient_accumulation_steps", 1))  # rows measured before it was resolved: 1

    @property
    def precision(self) -> Precision:
        return Precision.BF16 if self.config.get("bf16", {}).get("enabled") else Precision.FP32

    @property
    def optimizer_kind(self) -> str:
        """Which optimizer steps: "client" (no "optimizer" section: the client torch.optim.AdamW), "torch"
        (`torch_adam: true`: torch.optim.Adam/AdamW), "fused" (DeepSpeed's FusedAdam, what
        engine.get_optimizer_configuration builds without offload) or "cpu_adam" (DeepSpeedCPUAdam: what it builds
        with the optimizer offloaded, and what accelerate puts in place of a client optimizer then, see
        `replaces_client_optimizer`)."""
        optimizer = self.config.get("optimizer")
        if optimizer is None:
            return "cpu_adam" if self.replaces_client_optimizer else "client"
        if optimizer.get("params", {}).get("torch_adam"):
            return "torch"
        return "cpu_adam" if self.offloads_optimizer else "fused"

    @property
    def replaces_client_optimizer(self) -> bool:
        """accelerate's `_prepare_deepspeed` (the HF Trainer's path): with the optimizer offloaded and
        "zero_force_ds_cpu_optimizer" unset or true, a client torch optimizer is handed to DeepSpeed as
        `map_pytorch_optim_to_deepspeed(optimizer)`, a DeepSpeedCPUAdam over its param groups with its lr and
        weight decay (accelerate/utils/deepspeed.py; torch's Adagrad would be DeepSpeedCPUAdagrad)."""
        return (self.launcher == "accelerate" and self.config.get("optimizer") is None and self.offloads_optimizer
                and bool(self.config.get("zero_force_ds_cpu_optimizer", True)))

    @property
    def offloads_optimizer(self) -> bool:
        """ZeRO-Offload: `zero_optimization.offload_optimizer.device` is "cpu" (the master weights, their gradient
        and the optimizer's states and step on the host), or under ZeRO-1/2 "nvme", which DeepSpeed runs as "cpu"
        (stage_1_and_2.py: `cpu_offload = True` for any device but none; no swapper, nothing written to the path).
        Under ZeRO-3 "nvme" is CPU offload too, with the optimizer swapper on top (`swaps_optimizer`)."""
        offload = self.config.get("zero_optimization", {}).get("offload_optimizer") or {}
        return offload.get("device", "none") in ("cpu", "nvme")

    @property
    def swaps_optimizer(self) -> bool:
        """ZeRO-Infinity's optimizer swapper (stage3.py `swap_optimizer`): ZeRO-3 with `offload_optimizer.device`
        "nvme". Each sub-group whose fp32 partition reaches the swap threshold keeps its master and states in
        files under nvme_path and comes into pinned host buffers for its step (strategies/zero3.py)."""
        zero = self.config.get("zero_optimization", {})
        offload = zero.get("offload_optimizer") or {}
        return int(zero.get("stage", 0)) == 3 and offload.get("device", "none") == "nvme"

    def aio(self) -> dict:
        """DeepSpeed's parsed "aio" section, its defaults where absent (swap_tensor/aio_config.py)."""
        from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

        return get_aio_config(self.config)

    @property
    def offloads_params(self) -> bool:
        """ZeRO-3's parameter offload: `zero_optimization.offload_param.device` is "cpu" (every parameter's
        partition on the host, brought to the device for each all-gather) or "nvme" (`swaps_params`)."""
        offload = self.config.get("zero_optimization", {}).get("offload_param") or {}
        return offload.get("device", "none") in ("cpu", "nvme")

    @property
    def swaps_params(self) -> bool:
        """ZeRO-Infinity's parameter swapper (`offload_param.device` "nvme"): zero.Init writes each partition of
        at least the swap threshold to a file through a pinned pool; `initialize` reads the trainable ones back
        into its flat host buffer for good, up to `max_in_cpu` elements (stage3.py `_move_to_flat_buffer`), so
        after it they are parameter offload's (strategies/zero3.py)."""
        offload = self.config.get("zero_optimization", {}).get("offload_param") or {}
        return offload.get("device", "none") == "nvme"

    @property
    def autotp_size(self) -> int:
        return autotp_size(self.config)

    def zero(self):
        """DeepSpeed's own parsed zero_optimization section, with DeepSpeed's defaults."""
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        return DeepSpeedZeroConfig(**self.config.get("zero_optimization", {}))


def autotp_size(config: dict) -> int:
    """DeepSpeed's AutoTP training: the JSON's `tensor_parallel.autotp_size`, the ranks the engine shards the model's
    linear layers over (0 and 1: none); the deepspeed-autotp recipe (llmsim/model/ds_script.py)."""
    return int((config.get("tensor_parallel") or {}).get("autotp_size") or 0)


def load_ds_config(path: str | Path, world_size: int, hidden_size: int, micro_batch: int | None,
                   precision: Precision | None, grad_accum: int | None = None,
                   pipeline: bool = False) -> DeepSpeedSetup:
    """Read, resolve and validate; `micro_batch`/`precision`/`grad_accum` are the CLI's, None when not given.
    `world_size`: the data-parallel ranks the batch is split over (under DeepSpeed's pipeline engine, `pipeline`,
    the world size over pp)."""
    if world_size < 1:
        raise InputError(f"world-size({world_size}) must be >= 1")
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read DeepSpeed config {str(path)!r}: {one_line(exc)}") from None
    if not isinstance(config, dict):
        raise InputError(f"DeepSpeed config {str(path)!r} is not a JSON object")
    return ds_setup(config, world_size, hidden_size, micro_batch, precision, grad_accum, pipeline=pipeline)


def ds_setup(config: dict[str, Any], world_size: int, hidden_size: int, micro_batch: int | None,
             precision: Precision | None, grad_accum: int | None = None,
             launcher: str = "deepspeed", pipeline: bool = False) -> DeepSpeedSetup:
    """A DeepSpeed config given as a dict (as `deepspeed.initialize(config=...)` takes one): resolved, validated.
    `launcher`: "deepspeed" (the script calls deepspeed.initialize) or "accelerate" (the Trainer, accelerate launch)."""
    config = json.loads(json.dumps(config))  # a copy: resolving fills in "auto" values
    _resolve_batch(config, world_size, micro_batch, grad_accum, pipeline)
    _resolve_precision(config, precision)
    _resolve_hidden_size_autos(config, hidden_size)
    _validate(config, launcher)
    return DeepSpeedSetup(json.dumps(config, sort_keys=True), world_size, launcher)


def _resolve_batch(config: dict, world_size: int, micro_batch: int | None, grad_accum: int | None,
                   pipeline: bool = False) -> None:
    """train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size. `--grad-accum`
    is the JSON's gradient_accumulation_steps: "auto" takes it (1 when not given), as transformers resolves "auto"
    from TrainingArguments.gradient_accumulation_steps; a number must equal it. With no gradient_accumulation_steps
    DeepSpeed derives it from train_batch_size and the micro-batch (config.py, `_set_batch_related_parameters`),
    else takes 1."""
    if grad_accum is not None and grad_accum < 1:
        raise InputError(f"grad-accum must be a positive integer, got {grad_accum!r}")
    accumulation = config.get("gradient_accumulation_steps")
    mb = config.get("train_micro_batch_size_per_gpu")
    total = config.get("train_batch_size")
    if accumulation is None and isinstance(total, int) and isinstance(mb, int) and grad_accum is None:
        accumulation = total // (mb * world_size)  # DeepSpeed's derivation
    if accumulation is None or accumulation == AUTO:
        accumulation = grad_accum or 1
    if not isinstance(accumulation, int) or isinstance(accumulation, bool) or accumulation < 1:
        raise InputError(f"the DeepSpeed config's gradient_accumulation_steps({accumulation!r}) must be a positive "
                         "integer or \"auto\"")
    if grad_accum is not None and grad_accum != accumulation:
        raise InputError(f"--grad-accum({grad_accum}) contradicts the DeepSpeed config's "
                         f"gradient_accumulation_steps({accumulation})")
    config["gradient_accumulation_steps"] = accumulation
    if mb == AUTO or mb is None:
        if isinstance(total, int):
            mb = total // (accumulation * world_size)
        elif micro_batch is not None:
            mb = micro_batch
        else:
            raise InputError("the DeepSpeed config sets no train_micro_batch_size_per_gpu (or it is \"auto\"); "
                             "give --micro-batch")
        config["train_micro_batch_size_per_gpu"] = mb
    if micro_batch is not None and micro_batch != mb:
        raise InputError(f"--micro-batch({micro_batch}) contradicts the DeepSpeed config's "
                         f"train_micro_batch_size_per_gpu({mb})")
    total = config.get("train_batch_size", AUTO)
    expected = mb * accumulation * world_size
    if total == AUTO:
        config["train_batch_size"] = expected
    elif total != expected:
        raise InputError(f"train_batch_size({total}) != train_micro_batch_size_per_gpu({mb}) x "
                         f"gradient_accumulation_steps({accumulation}) x data-parallel ranks({world_size}) = "
                         f"{expected}" + (" (world-size / pp under a pipeline)" if pipeline else ""))
    if config.get("gradient_clipping") == AUTO:
        config["gradient_clipping"] = HF_DEFAULT_MAX_GRAD_NORM


def _resolve_precision(config: dict, precision: Precision | None) -> None:
    for key in ("fp16", "bf16"):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") == AUTO:
            section["enabled"] = precision is Precision.BF16 if key == "bf16" else False
    if config.get("fp16", {}).get("enabled"):
        raise InputError("fp16 is not available on device cpu (DeepSpeed refuses it on CPU); use bf16 or fp32")
    ds_precision = Precision.BF16 if config.get("bf16", {}).get("enabled") else Precision.FP32
    if precision is not None and precision is not ds_precision:
        raise InputError(f"--precision {precision.value} contradicts the DeepSpeed config, which trains in "
                         f"{ds_precision.value} (bf16.enabled)")


def _resolve_hidden_size_autos(config: dict, hidden_size: int) -> None:
    zero = config.get("zero_optimization", {})
    autos = {"reduce_bucket_size": hidden_size * hidden_size,
             "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
             "stage3_param_persistence_threshold": 10 * hidden_size}
    for key, value in autos.items():
        if zero.get(key) == AUTO:
            zero[key] = value


def _validate_swapper(config: dict, offload: dict) -> None:
    """ZeRO-3's optimizer swapper as modelled: PartitionedOptimizerSwapper, AIO through libaio."""
    for key in ("pipeline_read", "pipeline_write"):
        if offload.get(key):
            raise InputError(f"DeepSpeed config zero_optimization.offload_optimizer.{key} (the pipelined swapper, "
                             "which swaps the next sub-group in while one steps) is not modelled yet; modelled: "
                             "false (DeepSpeed's default)")
    _validate_aio(config)


def _validate_aio(config: dict) -> None:
    """The "aio" section as modelled for either swapper: through libaio into host buffers."""
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

    try:
        aio = get_aio_config(config)
    except AssertionError as exc:  # use_gds off CUDA
        raise InputError(f"DeepSpeed config aio: {one_line(exc)}") from None
    if aio["use_gds"]:
        raise InputError("DeepSpeed config aio.use_gds (GPUDirect Storage: the swapper's buffers on the device) "
                         "is not modelled yet; modelled: false (DeepSpeed's default)")
    for key in ("block_size", "intra_op_parallelism"):
        if not isinstance(aio[key], int) or isinstance(aio[key], bool) or aio[key] < 1:
            raise InputError(f"DeepSpeed config aio.{key}({aio[key]!r}) must be a positive integer")


# DeepSpeed's modules whose upper-case constants name the config's keys (its own vocabulary, read rather than copied)
_KEY_MODULES = ("deepspeed.runtime.constants", "deepspeed.runtime.zero.constants", "deepspeed.runtime.zero.config",
                "deepspeed.runtime.activation_checkpointing.config", "deepspeed.profiling.constants",
                "deepspeed.comm.constants", "deepspeed.compression.constants",
                "deepspeed.runtime.data_pipeline.constants", "deepspeed.autotuning.constants",
                "deepspeed.elasticity.constants", "deepspeed.nebula.constants",
                "deepspeed.runtime.swap_tensor.constants", "deepspeed.monitor.config", "deepspeed.runtime.config")
# top-level sections DeepSpeed's config classes read by a literal name rather than a constant
_SECTIONS = ("pipeline", "tensorboard", "wandb", "csv_monitor", "comet", "compile", "tensor_parallel", "amp",
             "elasticity", "nebula", "sparse_attention", "hybrid_engine", "timers", "sequence_parallel_size")


@functools.cache
def _deepspeed_keys() -> frozenset[str]:
    import importlib

    keys = set(_SECTIONS)
    for name in _KEY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module another release moved: its keys are still checked by closeness to the rest
            continue
        keys |= {value for constant, value in vars(module).items() if isinstance(value, str) and constant.isupper()
                 and not constant.endswith("_DEFAULT") and value.islower() and value.replace("_", "").isalnum()}
    return frozenset(keys)


def _check_keys(config: dict) -> None:
    """A top-level key DeepSpeed does not read is ignored by it without a word: one that is a near miss of a key it
    reads ("zero_optimizatoin") is refused, naming that key; others (a newer release's) pass."""
    import difflib

    known = _deepspeed_keys()
    for key in config:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
            if close:
                raise InputError(f"DeepSpeed config key {key!r} is not one DeepSpeed reads (did you mean "
                                 f"{close[0]!r}?); DeepSpeed would ignore it")


@dataclass(frozen=True)
class _Feature:
    """A setting DeepSpeed acts on that changes what a rank holds, read off DeepSpeed's own parsed config
    (`DeepSpeedConfig`), and whether `config` turns it on; llmsim models DeepSpeed with it off."""
    key: str  # as the JSON spells it
    what: str  # what DeepSpeed then does
    value: Any  # (DeepSpeedConfig, the JSON) -> the value DeepSpeed acts on
    on: Any  # (value, DeepSpeedConfig) -> whether it is turned on
    modelled: str  # the values that are modelled


def _model_dtype(parsed) -> "torch.dtype":
    """The engine's model dtype (engine.py `get_data_types`): bf16 where enabled (fp16 is refused), else fp32."""
    import torch

    return torch.bfloat16 if parsed.bfloat16_config.enabled else torch.float32


def _as_dtype(name) -> "torch.dtype | None":
    """A dtype as DeepSpeed's DtypeEnum reads the JSON's ("fp32", "bf16", "torch.float32", ...), None for None."""
    from deepspeed.runtime.config import DtypeEnum

    return None if name is None else DtypeEnum(name).value


_FEATURES = (
    # AutoTP's own settings, modelled at DeepSpeed's defaults (the deepspeed-autotp recipe, llmsim/model/ds_script.py)
    *(_Feature(f"tensor_parallel.{key}", f"AutoTP's {what}", lambda p, c, k=key: getattr(p.tensor_parallel_config, k),
               lambda v, p, d=default: p.tensor_parallel_config.autotp_size > 1 and v != d, shown)
      for key, what, default, shown in (
          ("tp_overlap_comm", "all-reduce overlapped with compute", False, "false"),
          ("vocab_parallel_lm_head", "choice of a vocabulary-parallel LM head", None, "unset (DeepSpeed's default)"),
          ("vocab_parallel_ce_backend", "cross-entropy backend", "torch", "\"torch\""),
          ("partition_config", "custom partition of the layers", None, "unset (the model's TP plan or AutoTP's "
                                                                        "parser)"),
          ("injection_policy_tuple", "injection policy", None, "unset"),
          ("preset_model", "preset partition", None, "unset"),
          ("keep_module_on_host", "layers kept on the host", False, "false"),
          ("replace_with_kernel_inject", "inference kernels", False, "false"))),
    _Feature("expert_parallel.enabled", "AutoEP: the engine shards a mixture of experts over expert-parallel ranks",
             lambda p, c: p.expert_parallel_config.enabled, lambda v, p: v, "disabled"),
    _Feature("sequence_parallel_size", "Ulysses sequence parallelism", lambda p, c: c.get("sequence_parallel_size", 1),
             lambda v, p: v != 1, "1"),
    _Feature("zero_optimization.zero_hpz_partition_size", "ZeRO++ hpZ: a secondary partition of the parameters "
             "within a node", lambda p, c: p.zero_config.zero_hpz_partition_size, lambda v, p: v > 1, "1"),
    *(_Feature(f"zero_optimization.{key}", "ZeRO++ quantized communication", lambda p, c, k=key: getattr(
        p.zero_config, k), lambda v, p: v, "false") for key in ("zero_quantized_weights",
                                                                  "zero_quantized_nontrainable_weights",
                                                                  "zero_quantized_gradients")),
    _Feature("zero_optimization.zenflow", "ZenFlow: the optimizer step split between device and host",
             lambda p, c: p.zero_config.zenflow is not None, lambda v, p: v, "no zenflow section"),
    _Feature("zero_optimization.offload_optimizer.super_offload", "SuperOffload",
             lambda p, c: bool(p.zero_config.offload_optimizer and p.zero_config.offload_optimizer.super_offload),
             lambda v, p: v, "false"),
    _Feature("zero_optimization.memory_efficient_linear", "ZeRO-3 with torch's linear in place of DeepSpeed's "
             "LinearFunctionForZeroStage3", lambda p, c: p.zero_config.memory_efficient_linear,
             lambda v, p: not v and p.zero_optimization_stage == 3, "true (DeepSpeed's default)"),
    _Feature("zero_optimization.use_all_reduce_for_fetch_params", "ZeRO-3 fetching parameters by all-reduce",
             lambda p, c: p.zero_config.use_all_reduce_for_fetch_params,
             lambda v, p: v and p.zero_optimization_stage == 3, "false (DeepSpeed's default)"),
    _Feature("zero_optimization.module_granularity_threshold", "ZeRO-3 fetching small modules' parameters as one "
             "leaf", lambda p, c: p.zero_config.module_granularity_threshold,
             lambda v, p: v > 0 and p.zero_optimization_stage == 3, "0 (DeepSpeed's default)"),
    _Feature("zero_optimization.legacy_stage1", "the legacy ZeRO-1 optimizer", lambda p, c: p.zero_config.legacy_stage1,
             lambda v, p: v, "false"),
    _Feature("disable_allgather", "ZeRO-1/2 without the parameters' all-gather", lambda p, c: p.disable_allgather,
             lambda v, p: v, "false"),
    # ZeRO's tuning keys that take another code path in DeepSpeed 0.19.8 (other buffers and temporaries than the
    # plans walk): the plans model the defaults
    _Feature("zero_optimization.reduce_scatter", "gradients all-reduced whole instead of reduce-scattered "
             "(stage_1_and_2.py average_tensor; stage3.py's contiguous path)",
             lambda p, c: p.zero_config.reduce_scatter, lambda v, p: not v and p.zero_optimization_stage > 0,
             "true (DeepSpeed's default)"),
    _Feature("zero_optimization.use_multi_rank_bucket_allreduce", "a reduce per destination rank instead of the "
             "bucket's all-reduce (allreduce_no_retain)", lambda p, c: p.zero_config.use_multi_rank_bucket_allreduce,
             lambda v, p: not v and p.zero_optimization_stage in (1, 2), "true (DeepSpeed's default)"),
    _Feature("zero_optimization.compute_grad_norm", "the step without the gradients' norm",
             lambda p, c: p.zero_config.compute_grad_norm, lambda v, p: not v and p.zero_optimization_stage in (1, 2),
             "true (DeepSpeed's default)"),
    _Feature("zero_optimization.stage3_allgather_sequential", "ZeRO-3 gathering parameters one by one (and a "
             "prefetch bucket of 1)", lambda p, c: p.zero_config.allgather_sequential,
             lambda v, p: v and p.zero_optimization_stage == 3, "false (DeepSpeed's default)"),
    _Feature("zero_optimization.enable_sanity_checks", "ZeRO-3's cross-rank checks of each gradient bucket",
             lambda p, c: p.zero_config.enable_sanity_checks, lambda v, p: v and p.zero_optimization_stage == 3,
             "false (DeepSpeed's default)"),
    _Feature("zero_optimization.override_module_apply", "zero.Init's Module.apply without gathering the "
             "parameters", lambda p, c: p.zero_config.override_module_apply,
             lambda v, p: not v and p.zero_optimization_stage == 3, "true (DeepSpeed's default)"),
    _Feature("bf16.bf16_master_weights_and_grads", "bf16 master weights and gradients", lambda p, c:
             p.bfloat16_config.bf16_master_weights_and_grads, lambda v, p: v, "false"),
    _Feature("bf16.bf16_optimizer_states", "bf16 optimizer states", lambda p, c:
             p.bfloat16_config.bf16_optimizer_states, lambda v, p: v, "false"),
    _Feature("bf16.immediate_grad_update", "gradients added to the fp32 ones as each is ready", lambda p, c:
             p.bfloat16_config.immediate_grad_update, lambda v, p: v, "false"),
    _Feature("data_types.grad_accum_dtype", "gradients accumulated in a dtype other than the model's",
             lambda p, c: p.grad_accum_dtype, lambda v, p: v is not None and _as_dtype(v) != _model_dtype(p),
             "the model's dtype (unset)"),
    _Feature("communication_data_type", "gradients reduced in a dtype other than the model's",
             lambda p, c: p.communication_data_type, lambda v, p: v is not None and v != _model_dtype(p),
             "the model's dtype (unset)"),
    _Feature("data_types.buffer_dtype", "the model's buffers cast to another dtype", lambda p, c: p.buffer_dtype,
             lambda v, p: v is not None, "unset"),
    _Feature("data_types.keep_in_fp32_modules", "buffers kept in fp32 by name", lambda p, c: p.keep_in_fp32_modules,
             lambda v, p: v != "auto", "\"auto\" (DeepSpeed's default: the model's own lists)"),
    _Feature("torch_autocast.enabled", "DeepSpeed's torch autocast (fp32 parameters, lower-precision compute)",
             lambda p, c: p.torch_autocast_enabled, lambda v, p: v, "disabled"),
    _Feature("compile.deepcompile", "DeepCompile", lambda p, c: p.compile_config.deepcompile, lambda v, p: v, "false"),
    _Feature("data_efficiency.enabled", "data efficiency (curriculum learning, random-LTD: other sequence lengths)",
             lambda p, c: p.data_efficiency_enabled, lambda v, p: v, "disabled"),
    _Feature("hybrid_engine.enabled", "the hybrid engine (inference kernels and caches for RLHF)",
             lambda p, c: p.hybrid_engine.enabled, lambda v, p: v, "disabled"),
    _Feature("weight_quantization", "weight quantization", lambda p, c: p.weight_quantization_config is not None,
             lambda v, p: v, "no weight_quantization section"),
    _Feature("sparse_attention", "DeepSpeed's sparse attention", lambda p, c: "sparse_attention" in c,
             lambda v, p: v, "no sparse_attention section"),
)


def _at(config: dict, key: str, default: Any) -> Any:
    """The JSON's value at the dotted `key` (a whole section where the key names one), else `default`."""
    for part in key.split("."):
        if not isinstance(config, dict) or part not in config:
            return default
        config = config[part]
    return config


def _check_features(config: dict) -> None:
    """Refuse a setting DeepSpeed acts on that llmsim does not model (`_FEATURES`), naming the key and what is
    modelled, rather than predicting the run without it; DeepSpeed's own parse refuses what DeepSpeed would (a
    removed key, an impossible mix), in its words."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed_input = {key: value for key, value in config.items() if key != "train_batch_size"}  # no world size here
    try:
        parsed = DeepSpeedConfig(parsed_input)
    except Exception as exc:  # ValueError, AssertionError, pydantic's: DeepSpeed's words
        raise InputError(f"DeepSpeed config: {one_line(exc)}") from None
    for feature in _FEATURES:
        value = feature.value(parsed, config)
        if feature.on(value, parsed):
            shown = json.dumps(_at(config, feature.key, value))
            raise InputError(f"DeepSpeed config {feature.key}({shown}) ({feature.what}) is not modelled yet; "
                             f"modelled: {feature.modelled}")


def _validate(config: dict, launcher: str = "deepspeed") -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    _check_keys(config)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise InputError("DeepSpeed config: zero_optimization must be an object")
    try:
        DeepSpeedZeroConfig(**zero)
    except Exception as exc:  # pydantic.ValidationError: the message names the key and the valid inputs
        raise InputError(f"DeepSpeed config zero_optimization: {one_line(exc)}") from None
    optimizer = config.get("optimizer")
    if optimizer is not None:
        kind = optimizer.get("type") if isinstance(optimizer, dict) else None
        if not isinstance(kind, str) or kind.lower() not in DEEPSPEED_ADAM_TYPES:
            raise InputError(f"DeepSpeed config optimizer type {kind!r} is not modelled; modelled: Adam, AdamW "
                             "(or no \"optimizer\" section: a client torch.optim.AdamW)")
    stage = int(zero.get("stage", 0))
    optimizer_offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    device = optimizer_offload.get("device", "none")
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) if isinstance(zero.get(key), dict) else {}
        if section.get("device") == "nvme" and not section.get("nvme_path"):
            raise InputError(f"DeepSpeed config zero_optimization.{key}: device \"nvme\" needs \"nvme_path\" "
                             "(the NVMe mount DeepSpeed swaps to; it fails at initialize without one)")
    if device == "nvme" and stage == 3:
        _validate_swapper(config, optimizer_offload)
    if device == "nvme":  # DeepSpeed's CPU offload (DeepSpeedSetup.offloads_optimizer), ZeRO-3 with its swapper
        device = "cpu"
    if device not in ("none", "cpu"):
        raise InputError(f"DeepSpeed config zero_optimization.offload_optimizer.device {device!r} is not valid; "
                         "valid: \"cpu\", \"none\", \"nvme\"")
    if device == "cpu" and stage not in (1, 2, 3):
        raise InputError(f"DeepSpeed config zero_optimization.offload_optimizer with stage {stage} is not modelled "
                         "yet; modelled: stages 1, 2 and 3")
    if device == "cpu" and float(optimizer_offload.get("ratio", 1.0)) < 1.0:
        raise InputError(f"DeepSpeed config zero_optimization.offload_optimizer.ratio "
                         f"{optimizer_offload['ratio']} (partial offload: part of the step on the device) is not "
                         "modelled yet; modelled: 1.0 (the whole optimizer on the host)")
    if device == "cpu" and optimizer is None and launcher == "deepspeed" and \
            config.get("zero_force_ds_cpu_optimizer", True):
        raise InputError("DeepSpeed config: offload_optimizer with a client optimizer needs "
                         "\"zero_force_ds_cpu_optimizer\": false (DeepSpeed refuses it otherwise), or an "
                         "\"optimizer\" section (DeepSpeed's CPU Adam)")
    if stage in (1, 2) and zero.get("parameter_alignment"):
        raise InputError("DeepSpeed config zero_optimization.parameter_alignment (ZeRO-1/2 padding every parameter "
                         "to 16 bytes in the flat buffer) is not modelled yet; modelled: false (DeepSpeed's default)")
    param_offload = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else {}
    param_device = param_offload.get("device", "none")
    if param_device == "nvme" and device != "cpu":
        raise InputError("DeepSpeed config zero_optimization.offload_param.device \"nvme\" without offload_optimizer "
                         "is not modelled yet; modelled: the parameter swapper with offload_optimizer \"cpu\" or "
                         "\"nvme\", and offload_param \"cpu\" alone")
    if param_device == "nvme":  # parameter offload, with the parameter swapper (DeepSpeedSetup.swaps_params)
        if stage == 3:
            _validate_aio(config)
        param_device = "cpu"
    if param_device not in ("none", "cpu"):
        raise InputError(f"DeepSpeed config zero_optimization.offload_param.device {param_device!r} is not valid; "
                         "valid: \"cpu\", \"none\", \"nvme\"")
    if param_device == "cpu" and stage != 3:
        raise InputError(f"DeepSpeed config zero_optimization.offload_param is ZeRO-3's (stage {stage} has no "
                         "parameter partitions to offload); modelled: stage 3")
    _check_features(config)
