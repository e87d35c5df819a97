"""Sizing study: for each model, GPU and layout, the fewest GPUs (powers of 2, up to 64) on which one sample of
4096 tokens fits, the fullest rank's device total there, and there the largest micro-batch that fits (`llmsim
size`'s search, up to 64) with its fullest rank's device total.

Models Llama-2-7B/13B/70B, Llama-3.1-8B/70B, Mistral-7B; GPUs A100-40GB, A100-80GB, H100-80GB, H200; layouts
`llmsim size` runs by default (llmsim/app/size.py DEFAULT_FAMILIES): DDP, DeepSpeed ZeRO-1/2/3, TP over all the
GPUs, one pipeline stage per GPU (1F1B, as many micro-batches as stages), TP 2/4/8 x PP; pipelines of up to 16
stages.
Setup: bf16 weights built directly in bf16 (as `from_pretrained(dtype=torch.bfloat16)` loads them: no fp32 build
on the device), full activation checkpointing,
AdamW, sequence 4096 (pure bf16 for the torch layouts: 8 bytes of model state per parameter; DeepSpeed's bf16
keeps fp32 masters: 16). Every prediction runs the GPU's own kernels and the caching-allocator model; "fits" is
`llmsim size`'s: the device total (reserved + CUDA context) within the GPU's capacity less the verdict's margin (5 %)
on every rank.

Writes experiments/sizing_study.csv and docs/figures/sizing-study.png; each cell's time in its `seconds` column.
The models go to 2 local processes, the 70B ones first (a model's layouts on every GPU in one process: the traces
do not depend on the GPU, so the four GPUs share them).
Run: python experiments/sizing_study.py  (its run time is printed at the end and quoted in docs/validation.md)
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
from llmsim.app.size import DEFAULT_FAMILIES, candidates, fits, largest_micro_batch
from llmsim.sim.processes import in_processes
from llmsim.inputs.spec import TrainSetup, load_model_spec

MODELS = ["llama-2-7b", "mistral-7b", "llama-3.1-8b", "llama-2-13b", "llama-3.1-70b", "llama-2-70b"]
GPUS = ["a100-40gb", "a100-80gb", "h100-80gb", "h200"]
MAX_GPUS, SEQ_LEN = 64, 4096
MAX_STAGES = 16
MAX_MICRO_BATCH = 64  # `llmsim size`'s default
JOBS = 2
ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).with_suffix(".csv")
FIGURE = ROOT / "docs" / "figures" / "sizing-study.png"


def _stages(candidate) -> int:
    layout = candidate.layout_for(1) if candidate.name.startswith(("pp", "tp")) else None
    return layout.pp if layout is not None else 1


def smallest_fit(spec, setup, gpu, family_candidates) -> dict:
    """The first candidate (fewest GPUs) on which micro-batch 1 fits, its fullest rank's device total, and there the
    largest micro-batch that fits with its fullest rank's device total."""
    for candidate in sorted(family_candidates, key=lambda c: c.gpus):
        ok, total = fits(spec, setup, candidate, 1, gpu)
        if ok:
            largest, largest_total = largest_micro_batch(spec, setup, candidate, gpu, MAX_MICRO_BATCH)
            return {"gpus": candidate.gpus, "device_total_bytes": total, "largest_micro_batch": largest,
                    "largest_device_total_bytes": largest_total}
    return {"gpus": None, "device_total_bytes": None, "largest_micro_batch": None, "largest_device_total_bytes": None}


def model_rows(model: str) -> list[dict]:
    """One model's cells: its layouts, each on every GPU in turn (the GPUs share the layout's traces)."""
    setup = TrainSetup(1, SEQ_LEN, Precision.BF16, grad_ckpt=True, build_bf16=True)
    spec = load_model_spec(model)
    layouts: dict[str, list] = {}
    for candidate in candidates(spec, setup, MAX_GPUS, DEFAULT_FAMILIES):
        if _stages(candidate) <= MAX_STAGES:
            layouts.setdefault(candidate.name, []).append(candidate)
    rows = []
    for layout, family in layouts.items():
        for gpu_name in GPUS:
            start = time.perf_counter()
            rows.append({"model": model, "gpu": gpu_name, "layout": layout,
                         **smallest_fit(spec, setup, load_gpu(gpu_name), family),
                         "seconds": round(time.perf_counter() - start, 1)})
            print(rows[-1], flush=True)
    return rows


def study() -> pd.DataFrame:
    order = sorted(MODELS, key=lambda model: "70b" not in model)  # the longest first
    by_model = dict(zip(order, in_processes(model_rows, order, JOBS, progress=False, unit="model")))
    frame = pd.DataFrame([row for model in MODELS for row in by_model[model]])
    return frame.sort_values(["model", "gpu"], key=lambda column: column.map(
        {name: i for i, name in enumerate(MODELS + GPUS)}), kind="stable").reset_index(drop=True)


def figure(frame: pd.DataFrame, path: Path) -> Path:
    """One panel per GPU: models down, layouts across, each cell the fewest GPUs that fit and, below, the largest
    micro-batch there."""
    plt = _pyplot()
    layouts = list(dict.fromkeys(frame["layout"]))
    fig, axes = plt.subplots(1, len(GPUS), figsize=(4.2 * len(GPUS), 3.8), sharey=True)
    for ax, gpu in zip(axes, GPUS):
        cells = frame[frame["gpu"] == gpu]
        grid = cells.pivot(index="model", columns="layout", values="gpus").reindex(index=MODELS, columns=layouts)
        batch = cells.pivot(index="model", columns="layout", values="largest_micro_batch").reindex(
            index=MODELS, columns=layouts)
        cmap = plt.get_cmap("viridis_r").copy()
        cmap.set_bad("#DDDDDD")  # no fit within MAX_GPUS
        ax.imshow(np.ma.masked_invalid(grid.to_numpy(dtype=float)), cmap=cmap, aspect="auto",
                  norm=plt.matplotlib.colors.LogNorm(vmin=1, vmax=MAX_GPUS))
        for row in range(len(grid.index)):
            for column in range(len(grid.columns)):
                value, micro_batch = grid.iat[row, column], batch.iat[row, column]
                text = f">{MAX_GPUS}" if value != value else f"{int(value)}\nmb {int(micro_batch)}"
                ax.text(column, row, text, ha="center", va="center", fontsize=5.5, linespacing=0.9,
                        color="black" if value != value or value < 8 else "white")
        ax.set_xticks(range(len(layouts)), layouts, rotation=60, fontsize=7)
        ax.set_yticks(range(len(MODELS)), MODELS, fontsize=7)
        ax.set_title(gpu, fontsize=9)
    fig.suptitle(f"fewest GPUs on which one {SEQ_LEN}-token sample fits, and the largest micro-batch there "
                 "(bf16, checkpointing, AdamW)", fontsize=9)
    return _save(fig, path)


def main() -> int:
    if "--figure-only" in sys.argv:  # redraw from the CSV
        figure(pd.read_csv(OUT), FIGURE)
        return 0
    start = time.perf_counter()
    frame = study()
    frame.to_csv(OUT, index=False)
    print(f"{time.perf_counter() - start:.0f} s on {JOBS} processes, {frame['seconds'].sum():.0f} s of cells")
    figure(frame, FIGURE)
    print(f"wrote {OUT} and {FIGURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
