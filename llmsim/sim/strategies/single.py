"""One replica, plain PyTorch: the rank's timeline is the traced canonical step itself. With tensor
parallelism the trace is one rank of the TP group, which every rank runs (where shards are uneven,
`pipeline.predict` traces a rank of each group of equal shards instead: tensor_parallel.tp_rank_classes)."""
from __future__ import annotations

import pandas as pd


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    return {rank: timeline for rank in range(layout.world_size)}
