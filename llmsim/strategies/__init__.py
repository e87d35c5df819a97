"""Stage 2: per-rank plans. One module per strategy, registered here by enum (STYLE.md rule 3).

A strategy turns the single-process timeline into one timeline per rank. Adding a strategy is one new
file plus one line in STRATEGIES.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable

import pandas as pd

from llmsim.strategies import single


class Strategy(str, Enum):
    SINGLE = "single"  # one process, plain PyTorch: the canonical step as is


# strategy -> function(full-depth single-process timeline, world_size) -> {rank: timeline}
STRATEGIES: dict[Strategy, Callable[[pd.DataFrame, int], dict[int, pd.DataFrame]]] = {
    Strategy.SINGLE: single.plan,
}
