"""Issue 5's question: how much does each memory lever save, alone and combined, for one model and layout?

Pure compute: one prediction per lever set, returned as a DataFrame (bytes are ints); the CLI prints it and
`plots.levers_bar_chart` draws it.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from llmsim.enums import Optimizer, Precision
from llmsim.allocator import AllocatorConfig
from llmsim.gpus import GpuProfile
from llmsim.pipeline import predict
from llmsim.spec import ModelSpec, TrainSetup
from llmsim.strategies import Layout

# (label, TrainSetup overrides): each lever alone, then the combinations people use
LEVERS: list[tuple[str, dict]] = [
    ("baseline: fp32 AdamW", {}),
    ("bf16-autocast", {"precision": Precision.BF16_AUTOCAST}),
    ("bf16 (cast)", {"precision": Precision.BF16}),
    ("bf16, built in bf16", {"precision": Precision.BF16, "build_bf16": True}),
    ("checkpointing every 2 layers", {"grad_ckpt": True, "ckpt_every": 2}),
    ("checkpointing", {"grad_ckpt": True}),
    ("SGD with momentum", {"optimizer": Optimizer.SGD_MOMENTUM}),
    ("Adafactor (transformers)", {"optimizer": Optimizer.HF_ADAFACTOR}),
    ("8-bit AdamW (bitsandbytes)", {"optimizer": Optimizer.ADAMW_8BIT}),
    ("LoRA r=16", {"lora_rank": 16}),
    ("QLoRA nf4 r=16", {"lora_rank": 16, "quant": "nf4", "double_quant": True}),
    ("bf16 + checkpointing", {"precision": Precision.BF16, "build_bf16": True, "grad_ckpt": True}),
    ("bf16 + checkpointing + LoRA r=16",
     {"precision": Precision.BF16, "build_bf16": True, "grad_ckpt": True, "lora_rank": 16}),
    ("QLoRA nf4 + bf16-autocast + checkpointing",
     {"precision": Precision.BF16_AUTOCAST, "grad_ckpt": True, "lora_rank": 16, "quant": "nf4", "double_quant": True}),
]


def compare_levers(model: ModelSpec, base: TrainSetup, layout: Layout = Layout(),
                   gpu: GpuProfile | None = None, alloc_conf: AllocatorConfig = AllocatorConfig()) -> pd.DataFrame:
    """Peak per lever set (device total with a GPU, else allocated) and its saving against the baseline."""
    rows = []
    base = replace(base, precision=Precision.FP32, grad_ckpt=False, ckpt_every=1, build_bf16=False, lora_rank=0,
                   lora_targets=None, optimizer=Optimizer.ADAMW, quant=None, double_quant=False, grad_accum=1)
    for label, overrides in LEVERS:
        setup = replace(base, **overrides)
        if overrides.get("lora_rank") and layout.world_size > 1:
            continue  # LoRA (and QLoRA) is modelled for one process only
        if overrides.get("optimizer", Optimizer.ADAMW) is not Optimizer.ADAMW and layout.deepspeed is not None:
            continue  # DeepSpeed is modelled with AdamW only
        if overrides.get("quant") and model.config_json is None:
            continue  # a module factory has no checkpoint to quantize
        prediction = predict(model, setup, layout, gpu, alloc_conf)
        worst = max(prediction.ranks, key=lambda r: r.device_total_bytes)
        rows.append({"lever": label, "peak_allocated_bytes": prediction.peak_allocated_bytes,
                     "device_total_bytes": worst.device_total_bytes, "peak_phase": worst.peak.phase,
                     "fits": worst.fits})
    frame = pd.DataFrame(rows)
    frame["saving_vs_baseline"] = 1 - frame["device_total_bytes"] / frame["device_total_bytes"].iloc[0]
    return frame
