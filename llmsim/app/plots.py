"""Figures (PNG), drawn at the edge from result DataFrames."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

GIB = 2**30


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def levers_bar_chart(frame: pd.DataFrame, title: str, path: Path, capacity_bytes: int | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(frame) + 1.5))
    values = frame["device_total_bytes"] / GIB
    bars = ax.barh(frame["lever"], values, color="#4C72B0")
    ax.invert_yaxis()
    for bar, saving in zip(bars, frame["saving_vs_baseline"]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {100 * saving:+.0f} %" if saving else "",
                va="center", fontsize=8)
    if capacity_bytes is not None:
        ax.axvline(capacity_bytes / GIB, color="#C44E52", linestyle="--", label="GPU capacity")
        ax.legend(loc="lower right")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


MAX_TIMELINE_POINTS = 4000  # events drawn per rank: the fullest event of each window, so no spike is lost


def category_timeline(timeline: pd.DataFrame) -> pd.DataFrame:
    """Live bytes per category after each event (columns: the categories present, in `Category` order)."""
    from llmsim.enums import Category

    deltas = timeline.pivot_table(index=timeline.index, columns="category", values="delta_bytes",
                                  aggfunc="sum", fill_value=0)
    order = [c.value for c in Category if c.value in deltas.columns]
    return deltas.reindex(index=timeline.index, columns=order, fill_value=0).cumsum()


def _category_colors() -> dict[str, object]:
    import matplotlib

    from llmsim.enums import Category

    palette = matplotlib.colormaps["tab20"]
    return {c.value: palette(i) for i, c in enumerate(Category)}


def _envelope(total, points: int) -> list[int]:
    """Indices to draw: in each of about `points` windows, the event with the most live bytes."""
    values = total.to_numpy()
    width = max(1, len(values) // points)
    return [start + int(values[start:start + width].argmax()) for start in range(0, len(values), width)]


def prediction_figure(prediction, path: Path) -> Path:
    """The fullest rank's live memory over the step, stacked by category, with its peak marked; and every
    rank's breakdown at its own peak."""
    plt = _pyplot()
    worst = max(prediction.ranks, key=lambda r: r.peak_allocated_bytes)
    live = category_timeline(worst.timeline)
    total = live.sum(axis=1)
    peak_at = int(total.to_numpy().argmax())
    shown = _envelope(total, MAX_TIMELINE_POINTS)
    colors = _category_colors()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    ax.stackplot(shown, *(live[c].to_numpy()[shown] / GIB for c in live.columns), labels=list(live.columns),
                 colors=[colors[c] for c in live.columns])
    ax.axvline(peak_at, color="black", linestyle=":", linewidth=1)
    ax.plot([peak_at], [total.iloc[peak_at] / GIB], marker="v", color="black")  # a spike can be one event wide
    ax.annotate(f"peak {total.iloc[peak_at] / GIB:.2f} GiB\nstep {worst.peak.step + 1} {worst.peak.phase}",
                (peak_at, total.iloc[peak_at] / GIB), textcoords="offset points", xytext=(6, -24), fontsize=8)
    phases = (worst.timeline["step"].astype(str) + " " + worst.timeline["phase"]).to_numpy()
    for i in np.flatnonzero(phases[1:] != phases[:-1]) + 1:  # where a phase starts
        ax.axvline(i, color="grey", linewidth=0.3)
    ax.set_xlabel("event (allocation or free), phases separated by grey lines")
    ax.set_ylabel("live bytes (GiB)")
    ax.set_title(f"rank {worst.rank}: memory over the step, by category", fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    breakdown = prediction.breakdown() / GIB
    bottom = None
    for category in breakdown.columns:
        values = breakdown[category].to_numpy()
        bars.bar(breakdown.index.astype(str), values, bottom=bottom, label=category, color=colors[category])
        bottom = values if bottom is None else bottom + values
    if prediction.gpu is not None:
        bars.axhline(prediction.gpu.capacity_bytes / GIB, color="#C44E52", linestyle="--", label="capacity")
    bars.set_xlabel("rank")
    bars.set_ylabel("peak allocated (GiB)")
    bars.set_title("each rank at its peak (colours as left)", fontsize=10)
    fig.suptitle(f"{prediction.model.name}, {prediction.layout.strategy.value} x {prediction.layout.world_size}, "
                 f"micro-batch {prediction.setup.micro_batch}, seq {prediction.setup.seq_len}", fontsize=10)
    return _save(fig, path)


def sizing_heatmap(frame: pd.DataFrame, title: str, path: Path) -> Path:
    """`size`'s answer as a grid: layouts down, GPU counts across, each cell the largest micro-batch that fits
    (0: none does)."""
    plt = _pyplot()
    grid = frame.pivot_table(index="layout", columns="gpus", values="largest_micro_batch", aggfunc="max")
    order = [name for name in ("single", "ddp", "zero1", "zero2", "zero3") if name in grid.index]
    grid = grid.reindex(index=order + [n for n in grid.index if n not in order])
    fig, ax = plt.subplots(figsize=(1.1 * len(grid.columns) + 2.5, 0.55 * len(grid) + 1.6))
    image = ax.imshow(grid.fillna(-1).to_numpy(), cmap="viridis", vmin=0, aspect="auto")
    image.cmap.set_under("#DDDDDD")  # a layout not tried at that GPU count
    for (row, column), value in pd.DataFrame(grid.to_numpy()).stack().items():
        if value != value:  # not tried
            continue
        ax.text(column, row, "no fit" if value == 0 else f"{int(value)}", ha="center", va="center", fontsize=8,
                color="white" if value < grid.max().max() / 2 else "black")
    ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
    ax.set_yticks(range(len(grid.index)), list(grid.index))
    ax.set_xlabel("GPUs")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="largest micro-batch")
    return _save(fig, path)
