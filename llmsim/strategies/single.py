"""One process, plain PyTorch: the rank's timeline is the traced canonical step itself."""
from __future__ import annotations

import pandas as pd

from llmsim.errors import InputError


def plan(timeline: pd.DataFrame, world_size: int) -> dict[int, pd.DataFrame]:
    if world_size != 1:
        raise InputError(f"strategy single runs one process; world-size({world_size}) must be 1")
    return {0: timeline}
