"""Issue 5's question: how much does each memory lever save, alone and combined, for one model and layout?

Pure compute: one prediction per lever set, returned as a DataFrame (bytes are ints); the CLI prints it and
`plots.levers_bar_chart` draws it.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import pandas as pd

from llmsim.enums import Loss, Optimizer, Precision, Recipe
from llmsim.errors import InputError
from llmsim.sim.allocator import AllocatorConfig
from llmsim.inputs.gpus import GpuProfile, on_gpu
from llmsim.model.losses import check_loss
from llmsim.model.step import peft_default_targets
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import ModelSpec, TrainSetup, as_loaded
from llmsim.sim.strategies import Layout, check_supported

# (label, TrainSetup overrides): each lever alone, then the combinations people use
LEVERS: list[tuple[str, dict]] = [
    ("baseline: fp32 AdamW", {}),
    ("bf16-autocast", {"precision": Precision.BF16_AUTOCAST}),
    ("bf16 (cast)", {"precision": Precision.BF16}),
    ("bf16, built in bf16", {"precision": Precision.BF16, "build_bf16": True}),
    ("checkpointing every 2 layers", {"grad_ckpt": True, "ckpt_every": 2}),
    ("checkpointing", {"grad_ckpt": True}),
    ("checkpointing, inputs offloaded", {"grad_ckpt": True, "ckpt_offload": True}),
    ("fused AdamW (fused=True)", {"fused": True, "foreach": False}),
    ("SGD with momentum", {"optimizer": Optimizer.SGD_MOMENTUM}),
    ("Adafactor (transformers)", {"optimizer": Optimizer.HF_ADAFACTOR}),
    ("8-bit AdamW (bitsandbytes)", {"optimizer": Optimizer.ADAMW_8BIT}),
    ("LoRA r=16", {"lora_rank": 16}),
    ("LoRA r=16 + LM head trained (modules_to_save)", {"lora_rank": 16, "lora_modules_to_save": ("lm_head",)}),
    ("trainable tokens (8 rows, no LoRA)", {"trainable_tokens": tuple(range(8))}),
    ("chunked NLL (TRL)", {"loss": Loss.CHUNKED_NLL}),
    ("fused linear CE (Liger)", {"loss": Loss.FUSED_LINEAR_CE}),
    ("QLoRA nf4 r=16", {"lora_rank": 16, "quant": "nf4", "double_quant": True}),
    ("bf16 + checkpointing", {"precision": Precision.BF16, "build_bf16": True, "grad_ckpt": True}),
    ("bf16 + checkpointing offloaded", {"precision": Precision.BF16, "build_bf16": True, "grad_ckpt": True,
                                        "ckpt_offload": True}),
    ("bf16 + checkpointing + LoRA r=16",
     {"precision": Precision.BF16, "build_bf16": True, "grad_ckpt": True, "lora_rank": 16}),
    ("bf16 + checkpointing + fused linear CE (Liger)",
     {"precision": Precision.BF16, "build_bf16": True, "grad_ckpt": True, "loss": Loss.FUSED_LINEAR_CE}),
    ("QLoRA nf4 + bf16-autocast + checkpointing",
     {"precision": Precision.BF16_AUTOCAST, "grad_ckpt": True, "lora_rank": 16, "quant": "nf4", "double_quant": True}),
]


# DeepSpeed's pipeline engine (recipe deepspeed-pipe) and its AutoTP (deepspeed-autotp): the JSON decides the precision
# and the optimizer, and the canonical step's other levers are not modelled with them; checkpointing is the lever
# (PipelineModule's activation_checkpoint_interval; under AutoTP transformers' gradient checkpointing: the same
# settings, labelled without PipelineModule's argument)
PIPE_LEVERS: list[tuple[str, dict]] = [
    ("baseline: the DeepSpeed JSON", {}),
    ("checkpointing every 2 layers (activation_checkpoint_interval=2)", {"grad_ckpt": True, "ckpt_every": 2}),
    ("checkpointing (activation_checkpoint_interval=1)", {"grad_ckpt": True}),
]


AUTOTP_LEVERS: list[tuple[str, dict]] = [
    ("baseline: the DeepSpeed JSON", {}),
    ("checkpointing every 2 layers", {"grad_ckpt": True, "ckpt_every": 2}),
    ("checkpointing", {"grad_ckpt": True}),
]


def compare_levers(model: ModelSpec, base: TrainSetup, layout: Layout = Layout(),
                   gpu: GpuProfile | None = None, alloc_conf: AllocatorConfig = AllocatorConfig(),
                   jobs: int = 1, progress: bool = False) -> pd.DataFrame:
    """Peak per lever set (device total with a GPU, else allocated) and its saving against the baseline; with
    offload, the host memory it costs (`peak_host_bytes`: pinned host memory, not counted on the device). Each
    lever set is its own trace: `jobs` local processes share them."""
    from llmsim.sim.processes import in_processes

    if base.recipe in (Recipe.DEEPSPEED_PIPE, Recipe.DEEPSPEED_AUTOTP):  # the JSON sets the precision and the
        base = replace(base, grad_ckpt=False, ckpt_every=1)  # optimizer: checkpointing is the lever
        levers = PIPE_LEVERS if base.recipe is Recipe.DEEPSPEED_PIPE else AUTOTP_LEVERS
        chosen = [(label, replace(base, **overrides)) for label, overrides in levers]
        rows = in_processes(functools.partial(_lever_row, model, layout, gpu, alloc_conf), chosen, jobs, progress,
                            "lever")
        frame = pd.DataFrame(rows)
        frame["saving_vs_baseline"] = 1 - frame["device_total_bytes"] / frame["device_total_bytes"].iloc[0]
        return frame
    base = replace(base, precision=Precision.FP32, grad_ckpt=False, ckpt_every=1, build_bf16=False, lora_rank=0,
                   lora_targets=None, optimizer=Optimizer.ADAMW, quant=None, double_quant=False, grad_accum=1,
                   ckpt_offload=False, fused=False,
                   loss=Loss.HF, loss_chunk=None, lora_modules_to_save=None, trainable_tokens=None)
    levers = LEVERS if peft_default_targets(model) else [_on_all_linear(label, overrides) for label, overrides in LEVERS]
    setups = [(label, overrides, as_loaded(base, **overrides)) for label, overrides in levers]
    chosen = [(label, setup) for label, overrides, setup in setups
              if _lever_modelled(model, setup, overrides, layout, gpu)]
    rows = in_processes(functools.partial(_lever_row, model, layout, gpu, alloc_conf), chosen, jobs, progress,
                        "lever")
    frame = pd.DataFrame(rows)
    frame["saving_vs_baseline"] = 1 - frame["device_total_bytes"] / frame["device_total_bytes"].iloc[0]
    return frame


def _on_all_linear(label: str, overrides: dict) -> tuple[str, dict]:
    """A LoRA lever where peft has no default targets for the model type (mixture-of-experts models): all-linear,
    said in its label."""
    if not overrides.get("lora_rank"):
        return label, overrides
    return f"{label} (all-linear)", {**overrides, "lora_targets": ("all-linear",)}


def _lever_modelled(model: ModelSpec, setup: TrainSetup, overrides: dict, layout: Layout,
                    gpu: GpuProfile | None) -> bool:
    if not _layout_modelled(setup, layout):
        return False  # a lever refused on this layout (e.g. QLoRA with several ranks, ckpt-offload with ZeRO)
    if ("lora_modules_to_save" in overrides or "trainable_tokens" in overrides) and model.config_json is None:
        return False  # peft's extras: an HF model whose module names are known
    if overrides.get("optimizer", Optimizer.ADAMW) is not Optimizer.ADAMW and layout.deepspeed is not None:
        return False  # DeepSpeed is modelled with AdamW only
    if overrides.get("fused") and layout.tp * layout.pp > 1:
        return False  # the fused kernels are modelled for tp = pp = 1
    deepspeed = layout.deepspeed
    if overrides.get("fused") and deepspeed is not None and deepspeed.optimizer_kind != "client" and \
            not deepspeed.replaces_client_optimizer:
        return False  # the JSON's "optimizer" section steps, not the client AdamW whose fused path the lever sets
    if overrides.get("quant") and model.config_json is None:
        return False  # a module factory has no checkpoint to quantize
    if "loss" in overrides and not _loss_modelled(model, setup, layout, gpu):
        return False  # TRL's torch path (no GPU); Liger on the model types it patches
    return True


def _lever_row(model: ModelSpec, layout: Layout, gpu: GpuProfile | None, alloc_conf: AllocatorConfig,
               lever: tuple[str, TrainSetup]) -> dict:
    label, setup = lever
    prediction = predict(model, setup, layout, gpu, alloc_conf)
    worst = max(prediction.ranks, key=lambda r: r.device_total_bytes)
    return {"lever": label, "peak_allocated_bytes": prediction.peak_allocated_bytes,
            "device_total_bytes": worst.device_total_bytes, "peak_phase": worst.peak.phase,
            "fits": worst.fits, "peak_host_bytes": prediction.peak_host_bytes}


def _layout_modelled(setup: TrainSetup, layout: Layout) -> bool:
    """Whether `predict` models this lever set on this layout (llmsim.sim.strategies.check_supported)."""
    try:
        check_supported(setup, layout)
    except InputError:
        return False
    return True


def _loss_modelled(model: ModelSpec, setup: TrainSetup, layout: Layout, gpu: GpuProfile | None) -> bool:
    try:
        check_loss(model, on_gpu(setup, gpu) if gpu is not None else setup)
    except InputError:
        return False
    return True
