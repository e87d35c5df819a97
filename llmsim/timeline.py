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
    out["serial"] = _pair_serials(frame, order, out["phase"].to_numpy() == Phase.BACKWARD.value)
    return out


def _pair_serials(frame: pd.DataFrame, order: np.ndarray, backward: np.ndarray) -> np.ndarray:
    """A serial per storage of the full-depth run. Every copy of a replicated allocation is a new storage; a
    later event of the traced storage (resize, free) acts on one of its live copies: the oldest when it runs
    in the same direction as the allocation (forward after forward), the newest when the direction turned (an
    activation of the forward freed by the backward, which walks the layers in reverse).
    A storage can also change layer between its allocation and its free (layer i's output, saved as layer
    i+1's checkpointed input, is freed by layer i+1's backward): the traced run then allocates it once per
    traced layer under different serials, and the expanded stream holds more frees of one serial than
    copies of it, and more copies of the next than frees. Such a free takes a live copy of the same size
    from a serial with copies to spare, by the same direction rule. The byte stream is unchanged; the
    pairing matters to the caching-allocator model and to the strategies, which follow storages by serial."""
    serials = frame["serial"].to_numpy()
    sizes = frame["delta_bytes"].to_numpy()
    first_event = np.zeros(len(frame), dtype=bool)
    first_event[np.unique(serials, return_index=True)[1]] = True
    emitted = serials[order]
    allocs = pd.Series(emitted[first_event[order]]).value_counts()
    frees = pd.Series(emitted[~first_event[order] & (sizes[order] < 0)]).value_counts()
    spare = {int(s) for s, n in allocs.items() if 0 < frees.get(s, 0) < n}
    result = np.empty(len(order), dtype=np.int64)
    live: dict[int, list[list]] = {}  # traced serial -> live copies [new serial, bytes, allocated backward]
    next_serial = int(serials.max()) + 1 if len(serials) else 0
    for i, row in enumerate(order):
        serial, delta, turned = int(serials[row]), int(sizes[row]), bool(backward[i])
        if serial < 0:
            result[i] = serial
            continue
        if first_event[row]:
            live.setdefault(serial, []).append([next_serial, delta, turned])
            result[i] = next_serial
            next_serial += 1
            continue
        owner, copies = serial, live.get(serial)
        if not copies:
            owner = _spare_copy_owner(live, spare, -delta, turned)
            copies = live.get(owner)
        if not copies:  # nothing to pair with: a storage of its own
            result[i] = next_serial
            next_serial += 1
            continue
        position = 0 if copies[0][2] == turned else -1
        copy = copies[position]
        copy[1] += delta
        result[i] = copy[0]
        if copy[1] <= 0:
            copies.pop(position)
    return result


def _spare_copy_owner(live: dict, spare: set[int], nbytes: int, backward: bool) -> int | None:
    """The serial whose spare live copy of `nbytes` a free takes: the newest copy in the backward, else the
    oldest."""
    candidates = [(copy[0], serial) for serial in spare for copy in live.get(serial, ()) if copy[1] == nbytes]
    if not candidates:
        return None
    return (max(candidates) if backward else min(candidates))[1]


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
