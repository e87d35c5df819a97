"""Stage 4: replay a timeline into its peak, the category breakdown at the peak and where it happens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from llmsim.enums import Category


@dataclass(frozen=True)
class Peak:
    allocated_bytes: int  # what torch.cuda.max_memory_allocated() reports: max of live tensor bytes
    event: int  # index of the event that reaches the peak (the first one, if the peak repeats)
    step: int
    phase: str
    layer: str  # module FQN running at the peak
    breakdown_bytes: dict[str, int]  # live bytes by category at the peak; sums to allocated_bytes


def replay(timeline: pd.DataFrame) -> Peak:
    delta = timeline["delta_bytes"].to_numpy(dtype=np.int64)
    live = np.cumsum(delta)
    index = int(np.argmax(live)) if len(live) else 0
    upto = timeline.iloc[: index + 1]
    by_category = upto.groupby("category", sort=False)["delta_bytes"].sum()
    breakdown = {c.value: int(by_category.get(c.value, 0)) for c in Category if by_category.get(c.value, 0)}
    row = timeline.iloc[index]
    return Peak(int(live[index]) if len(live) else 0, index, int(row["step"]), str(row["phase"]),
                str(row["module"]), breakdown)
