"""One replica, plain PyTorch: the rank's timeline is the traced canonical step itself. With tensor
parallelism the trace is one rank of the TP group; the plan shards evenly, so every rank runs the same."""
from __future__ import annotations

import pandas as pd


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    return {rank: timeline for rank in range(layout.world_size)}
