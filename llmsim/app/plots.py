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


def reserved_curve(timeline: pd.DataFrame, gpu, alloc_conf, indices: list[int]) -> np.ndarray:
    """The allocator model's reserved bytes up to each of `indices` (sorted event indices): at each, the most it
    reserved since the previous one, so that no spike between drawn points is lost. The replay `on_device` runs
    unbounded, with each thread's cuBLAS and cuBLASLt workspaces where it first calls them (llmsim/sim/replay.py,
    `on_gpu`)."""
    from llmsim.sim.allocator import NO_LIMIT, new_allocator
    from llmsim.sim.replay import on_gpu

    allocator = new_allocator(NO_LIMIT, alloc_conf)
    serials, deltas, _ = on_gpu(timeline, gpu)
    serials = np.ascontiguousarray(serials, np.int64)
    deltas = np.ascontiguousarray(deltas, np.int64)
    out, start = [], 0
    for index in indices:
        out.append(allocator.replay(serials, deltas, start, index + 1) if index + 1 > start
                   else allocator.reserved_bytes)
        start = index + 1
    return np.asarray(out)


MAX_PHASE_TICKS = 24


def _phase_ticks(ax, timeline: pd.DataFrame) -> None:
    """The x-axis in phases: a tick and a grey line where each (step, phase) starts, labelled "2 backward"."""
    steps, phases = timeline["step"].to_numpy(), timeline["phase"].to_numpy()
    starts = [0, *(np.flatnonzero((steps[1:] != steps[:-1]) | (phases[1:] != phases[:-1])) + 1)]
    for i in starts[1:]:
        ax.axvline(i, color="grey", linewidth=0.3)
    shown = starts[::max(1, -(-len(starts) // MAX_PHASE_TICKS))]
    ax.set_xticks(shown, [f"{steps[i] + 1} {phases[i]}" for i in shown], rotation=60, ha="right", fontsize=7)


def prediction_figure(prediction, path: Path) -> Path:
    """The rank that decides the verdict (on the CPU: the fullest) over the step: live memory stacked by
    category, on a GPU the allocator model's reserved memory against the card and its margin, phases on the x-axis;
    beside it, every rank's breakdown at its own peak."""
    from llmsim.app.report import layout_text

    plt = _pyplot()
    gpu = prediction.gpu
    rank = prediction.deciding_rank if gpu is not None else max(prediction.ranks, key=lambda r: r.peak_allocated_bytes)
    timeline = rank.timeline.reset_index(drop=True)
    live = category_timeline(timeline)
    total = live.sum(axis=1)
    peak_at = int(total.to_numpy().argmax())
    shown = _envelope(total, MAX_TIMELINE_POINTS)
    colors = _category_colors()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 1]})
    ax.stackplot(shown, *(live[c].to_numpy()[shown] / GIB for c in live.columns), labels=list(live.columns),
                 colors=[colors[c] for c in live.columns])
    ax.axvline(peak_at, color="black", linestyle=":", linewidth=1)
    ax.plot([peak_at], [total.iloc[peak_at] / GIB], marker="v", color="black")  # a spike can be one event wide
    ax.annotate(f"peak allocated {total.iloc[peak_at] / GIB:.2f} GiB\nstep {rank.peak.step + 1} {rank.peak.phase}",
                (peak_at, total.iloc[peak_at] / GIB), textcoords="offset points", xytext=(6, -24), fontsize=8)
    if gpu is not None:
        ax.plot(shown, reserved_curve(timeline, gpu, prediction.alloc_conf, shown) / GIB, color="black",
                linewidth=0.9, label="reserved (allocator model)")
        usable = gpu.capacity_bytes - gpu.cuda_context_bytes
        ax.axhline(usable / GIB, color="#C44E52", linestyle="--", linewidth=1,
                   label=f"{gpu.name} less the CUDA context")
        ax.axhline((usable - gpu.margin_bytes) / GIB, color="#DD8452", linestyle=":", linewidth=1,
                   label=f"less the {100 * gpu.margin:g} % margin")
    _phase_ticks(ax, timeline)
    ax.set_xlabel("step and phase")
    ax.set_ylabel("GiB")
    which = f"decides the verdict: {rank.verdict}" if gpu is not None else "the fullest"
    ax.set_title(f"rank {rank.rank} ({which}): memory over the step, by category", fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    breakdown = prediction.breakdown() / GIB
    bottom = None
    for category in breakdown.columns:
        values = breakdown[category].to_numpy()
        bars.bar(breakdown.index.astype(str), values, bottom=bottom, label=category, color=colors[category])
        bottom = values if bottom is None else bottom + values
    if gpu is not None:
        bars.axhline(gpu.capacity_bytes / GIB, color="#C44E52", linestyle="--", label="capacity")
    bars.set_xlabel("rank")
    bars.set_ylabel("peak allocated (GiB)")
    bars.set_title("each rank at its peak (colours as left)", fontsize=10)
    fig.suptitle(f"{prediction.model.name}: {layout_text(prediction.layout)}, micro-batch "
                 f"{prediction.setup.micro_batch}, seq {prediction.setup.seq_len}"
                 + (f", on {gpu.name}" if gpu is not None else ""), fontsize=10)
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
