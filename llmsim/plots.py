"""Figures (PNG), drawn at the edge from result DataFrames."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

GIB = 2**30


def levers_bar_chart(frame: pd.DataFrame, title: str, path: Path, capacity_bytes: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
