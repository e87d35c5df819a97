"""Sizing study: for each model, GPU and layout, the fewest GPUs (powers of 2, up to 64) on which one sample of
4096 tokens fits, and the fullest rank's device total there. (`llmsim size` adds the largest micro-batch for one
model and GPU; searching it here for every cell would take hours on 2 cores.)

Models Llama-2-7B/13B/70B, Llama-3.1-8B/70B, Mistral-7B; GPUs A100-40GB, A100-80GB, H100-80GB, H200; layouts
`llmsim size` enumerates (llmsim/app/size.py): DDP, DeepSpeed ZeRO-1/2/3, TP over all the GPUs, one pipeline stage
per GPU (1F1B, as many micro-batches as stages), TP 2/4/8 x PP; pipelines of at most 8 stages.
Setup: bf16 weights built directly in bf16 (as `from_pretrained(dtype=torch.bfloat16)` loads them: no fp32 build
on the device), full activation checkpointing,
AdamW, sequence 4096 (pure bf16 for the torch layouts: 8 bytes of model state per parameter; DeepSpeed's bf16
keeps fp32 masters: 16). Every prediction runs the GPU's own kernels and the caching-allocator model; "fits" is
the device total (reserved + CUDA context) within the GPU's capacity on every rank.

Writes experiments/sizing_study.csv and docs/figures/sizing-study.png.
Run: python experiments/sizing_study.py  (about 19 minutes on 2 cores; 1,100 s of predictions over the 240 cells)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from llmsim.enums import Precision
from llmsim.inputs.gpus import load_gpu
from llmsim.app.plots import _pyplot, _save
from llmsim.app.size import candidates, fits
from llmsim.inputs.spec import TrainSetup, load_model_spec

MODELS = ["llama-2-7b", "mistral-7b", "llama-3.1-8b", "llama-2-13b", "llama-3.1-70b", "llama-2-70b"]
GPUS = ["a100-40gb", "a100-80gb", "h100-80gb", "h200"]
MAX_GPUS, SEQ_LEN = 64, 4096
MAX_STAGES = 8  # deeper pipelines trace one stage each over as many micro-batches: too slow for this study
ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).with_suffix(".csv")
FIGURE = ROOT / "docs" / "figures" / "sizing-study.png"


def _stages(candidate) -> int:
    layout = candidate.layout_for(1) if candidate.name.startswith(("pp", "tp")) else None
    return layout.pp if layout is not None else 1


def smallest_fit(spec, setup, gpu, family_candidates) -> dict:
    """The first candidate (fewest GPUs) on which micro-batch 1 fits, and its fullest rank's device total."""
    for candidate in sorted(family_candidates, key=lambda c: c.gpus):
        ok, total = fits(spec, setup, candidate, 1, gpu)
        if ok:
            return {"gpus": candidate.gpus, "device_total_bytes": total}
    return {"gpus": None, "device_total_bytes": None}


def study() -> pd.DataFrame:
    rows = []
    setup = TrainSetup(1, SEQ_LEN, Precision.BF16, grad_ckpt=True, build_bf16=True)
    for model in MODELS:
        spec = load_model_spec(model)
        layouts: dict[str, list] = {}
        for candidate in candidates(spec, setup, MAX_GPUS):
            if _stages(candidate) <= MAX_STAGES:
                layouts.setdefault(candidate.name, []).append(candidate)
        for gpu_name in GPUS:
            gpu = load_gpu(gpu_name)
            for layout, family in layouts.items():
                start = time.perf_counter()
                rows.append({"model": model, "gpu": gpu_name, "layout": layout,
                             **smallest_fit(spec, setup, gpu, family),
                             "seconds": round(time.perf_counter() - start, 1)})
                print(rows[-1], flush=True)
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame, path: Path) -> Path:
    """One panel per GPU: models down, layouts across, each cell the fewest GPUs that fit."""
    plt = _pyplot()
    layouts = list(dict.fromkeys(frame["layout"]))
    fig, axes = plt.subplots(1, len(GPUS), figsize=(4.2 * len(GPUS), 3.6), sharey=True)
    for ax, gpu in zip(axes, GPUS):
        grid = frame[frame["gpu"] == gpu].pivot(index="model", columns="layout", values="gpus")
        grid = grid.reindex(index=MODELS, columns=layouts)
        cmap = plt.get_cmap("viridis_r").copy()
        cmap.set_bad("#DDDDDD")  # no fit within MAX_GPUS
        ax.imshow(np.ma.masked_invalid(grid.to_numpy(dtype=float)), cmap=cmap, aspect="auto",
                  norm=plt.matplotlib.colors.LogNorm(vmin=1, vmax=MAX_GPUS))
        for row in range(len(grid.index)):
            for column in range(len(grid.columns)):
                value = grid.iat[row, column]
                text = f">{MAX_GPUS}" if value != value else f"{int(value)}"
                ax.text(column, row, text, ha="center", va="center", fontsize=6.5,
                        color="black" if value != value or value < 8 else "white")
        ax.set_xticks(range(len(layouts)), layouts, rotation=60, fontsize=7)
        ax.set_yticks(range(len(MODELS)), MODELS, fontsize=7)
        ax.set_title(gpu, fontsize=9)
    fig.suptitle(f"fewest GPUs on which one {SEQ_LEN}-token sample fits (bf16, checkpointing, AdamW)", fontsize=9)
    return _save(fig, path)


def main() -> int:
    if "--figure-only" in sys.argv:  # redraw from the CSV
        figure(pd.read_csv(OUT), FIGURE)
        return 0
    frame = study()
    frame.to_csv(OUT, index=False)
    figure(frame, FIGURE)
    print(f"wrote {OUT} and {FIGURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
