"""Stage 3: the traced reduced-depth timeline -> the full-depth event timeline of one process.

Order key: events keep the traced execution order. Every maximal run of consecutive events that belong
to the template group (blocks `period .. 2*period-1`) stands for the same run in each middle group, so
it is emitted once per middle group -- in increasing layer order, except in the backward, which walks the
layers in reverse. Blocks after the template group are renumbered to the end of the real stack. Because
identical layers make identical events, the result is the event stream of the full-depth run (the test
`test_expansion_matches_full_depth_trace` checks that against traces at full depth).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from llmsim.enums import Phase
from llmsim.trace import Trace
from llmsim.tracker import NO_BLOCK


def expand(trace: Trace) -> pd.DataFrame:
    frame = trace.timeline
    extra_groups = (trace.num_layers - trace.depth) // trace.period
    if extra_groups == 0:
        return frame.reset_index(drop=True)
    first, after = trace.period, 2 * trace.period  # the template group is [first, after)
    block = frame["block"].to_numpy()
    in_template = (block >= first) & (block < after)
    # Run boundaries: where membership in the template changes.
    starts = np.flatnonzero(np.diff(np.concatenate(([False], in_template))) != 0)
    bounds = np.concatenate(([0], starts, [len(frame)]))
    bounds = np.unique(bounds)
    pieces, shifts = [], []
    backward = (frame["phase"] == Phase.BACKWARD.value).to_numpy()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if in_template[lo]:
            copies = range(extra_groups, -1, -1) if backward[lo] else range(extra_groups + 1)
            for copy in copies:
                pieces.append(np.arange(lo, hi))
                shifts.append(np.full(hi - lo, copy * trace.period))
        else:
            pieces.append(np.arange(lo, hi))
            tail = block[lo:hi] >= after
            shifts.append(np.where(tail, extra_groups * trace.period, 0))
    order = np.concatenate(pieces)
    shift = np.concatenate(shifts)
    out = frame.iloc[order].reset_index(drop=True)
    out["block"] = np.where(out["block"].to_numpy() == NO_BLOCK, NO_BLOCK, out["block"].to_numpy() + shift)
    for column in ("module", "tensor"):
        out[column] = _renumber(out[column].to_numpy(), block[order], shift, trace.info.blocks_prefix)
    max_serial = int(frame["serial"].max()) + 1
    serial = out["serial"].to_numpy()
    out["serial"] = np.where(serial < 0, serial, serial + (shift // trace.period) * max_serial)
    return out


def _renumber(modules: np.ndarray, blocks: np.ndarray, shift: np.ndarray, prefix: str) -> list[str]:
    """Rewrite `prefix.<b>` in module names to the layer each event now stands for."""
    names = list(modules)
    if not prefix:
        return names
    for i in np.flatnonzero(shift):
        old = f"{prefix}.{blocks[i]}"
        name = names[i]
        if name == old or name.startswith(old + "."):
            names[i] = f"{prefix}.{blocks[i] + shift[i]}{name[len(old):]}"
    return names
