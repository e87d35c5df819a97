"""Stage 3: the traced reduced-depth timeline -> the full-depth event timeline of one process.

Order key: events keep the traced execution order. Every maximal run of consecutive events that belong
to the template group (blocks `lead + period .. lead + 2*period-1`, after the irregular leading layers) stands for the same run in each middle group, so
it is emitted once per middle group -- in increasing layer order, except in the backward, which walks the
layers in reverse (unless the trace walks them up there: `_descending`). Blocks after the template group are renumbered to the end of the real stack. Because
identical layers make identical events, the result is the event stream of the full-depth run (the test
`test_expansion_matches_full_depth_trace` checks that against traces at full depth).

A storage allocated in a layer is not always freed inside a layer's events. A free belongs to the layer
running at that moment (tracker.StorageTracker._free), and what a wrapper frees after the last layer while
that layer is still the current one -- Liger's `lce_forward` drops the backbone's output, and with it the
`DynamicCache` holding every layer's key states (no checkpointing: `use_cache` stays on), before the model's
forward returns -- is one free per layer, all outside the template group. Such an event of a template
storage is emitted once per copy, where it happens, each copy freeing its own layer's storage
(`_frees_of_copies`). It is told apart from a storage that changes layer (layer i's output freed by layer
i+1's backward), whose frees of the other copies are already in the template group's runs.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from llmsim.enums import Phase
from llmsim.model.trace import Trace
from llmsim.model.tracker import CHUNKS, NO_BLOCK, Chunks


def expand(trace: Trace) -> pd.DataFrame:
    frame = trace.timeline
    extra_groups = (trace.num_layers - trace.depth) // trace.period
    if extra_groups == 0:
        return frame.reset_index(drop=True)  # (a pipeline stage's chunk calls stay as traced)
    first = trace.lead + trace.period  # the template group is [first, after)
    after = first + trace.period
    block = frame["block"].to_numpy()
    in_template = (block >= first) & (block < after)
    per_copy, alloc_block = _frees_of_copies(frame, in_template, trace.period)
    # Run boundaries: where membership in the template changes.
    starts = np.flatnonzero(np.diff(np.concatenate(([False], in_template))) != 0)
    bounds = np.concatenate(([0], starts, [len(frame)]))
    bounds = np.unique(bounds)
    pieces, shifts, copy_of, downwards = [], [], [], []
    backward = (frame["phase"] == Phase.BACKWARD.value).to_numpy()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if in_template[lo]:
            descending = _descending(block, lo, first, after, backward[lo])
            copies = range(extra_groups, -1, -1) if descending else range(extra_groups + 1)
            for copy in copies:
                pieces.append(np.arange(lo, hi))
                shifts.append(np.full(hi - lo, copy * trace.period))
                copy_of.append(np.full(hi - lo, copy))
                downwards.append(np.full(hi - lo, descending))
        else:
            rows = _outside_rows(lo, hi, per_copy, extra_groups)
            pieces.append(rows[:, 0])
            tail = block[rows[:, 0]] >= after
            shifts.append(np.where(tail, extra_groups * trace.period, 0))
            copy_of.append(rows[:, 1])
            downwards.append(backward[rows[:, 0]])
    order = np.concatenate(pieces)
    shift = np.concatenate(shifts)
    copy = np.concatenate(copy_of)
    out = frame.iloc[order].reset_index(drop=True)
    out["block"] = np.where(out["block"].to_numpy() == NO_BLOCK, NO_BLOCK, out["block"].to_numpy() + shift)
    out["module"] = _renumber(out["module"].to_numpy(), block[order], shift, trace.info.blocks_prefix)
    # What a storage holds is named after the layer that allocated it: a copy's event outside the template
    # names its own copy's layer.
    replicated = per_copy[order] != 0
    tensor_block = np.where(replicated, alloc_block[order], block[order])
    tensor_shift = np.where(replicated, copy * trace.period, shift)
    out["tensor"] = _renumber(out["tensor"].to_numpy(), tensor_block, tensor_shift, trace.info.blocks_prefix)
    micro_batch = _micro_batches(frame)
    layers = _LayerChange(frame, micro_batch, alloc_block, first, trace.period, extra_groups)
    out["serial"] = _pair_serials(frame, order, np.concatenate(downwards),
                                  np.where(in_template[order] | replicated, copy, -1), replicated,
                                  micro_batch[order], layers.targets(order, out["block"].to_numpy(), replicated),
                                  layers)
    out.attrs.pop(CHUNKS, None)
    chunks = _expanded_chunks(frame.attrs.get(CHUNKS), order)
    if chunks is not None:
        out.attrs[CHUNKS] = chunks
    return out


def _descending(block: np.ndarray, lo: int, first: int, after: int, backward: bool) -> bool:
    """Whether the copies of the template run starting at row `lo` are emitted from the last layer down: in the
    backward, which walks the layers in reverse, unless the run follows a lower layer's events (a walk up the layers
    inside the backward: a pipeline stage's REDUCE_GRAD, FSDP2's post-backward of every layer's group in module
    order); elsewhere upwards, unless it follows a higher layer's."""
    before = int(block[lo - 1]) if lo > 0 else NO_BLOCK
    if backward:
        return not (0 <= before < first)
    return before >= after


class _LayerChange:
    """Where a storage changes layer (allocated by layer i, freed by layer i + d: layer i's output, saved by layer
    i + 1's checkpoint and freed by its backward), which storage of the full-depth run each emitted free acts on.

    The trace frees, in layer b + d, the storage that layer b allocated; the full-depth run frees, in each layer B,
    the one layer B - d allocated, with the same place in that layer's allocations (the layers are alike). A free
    emitted at full-depth layer B therefore acts on the storage allocated at B - d: the traced storage that holds
    the same place among the allocations of its own traced layer (the leading group's, a copy of the template's,
    the trailing group's), in the same step, phase and micro-batch. Only between layers less than a period apart,
    whose distance the expansion keeps."""

    def __init__(self, frame: pd.DataFrame, micro_batch: np.ndarray, alloc_block: np.ndarray, first: int,
                 period: int, extra_groups: int) -> None:
        self.first, self.period, self.extra = first, period, extra_groups
        serials, blocks = frame["serial"].to_numpy(), frame["block"].to_numpy()
        self.block, self.alloc_block = blocks, alloc_block
        valid = np.flatnonzero(serials >= 0)
        _, first_rows = np.unique(serials[valid], return_index=True)
        rows = valid[first_rows]  # each storage's allocation row
        allocations = pd.DataFrame({"serial": serials[rows], "step": frame["step"].to_numpy()[rows],
                                    "phase": frame["phase"].to_numpy()[rows], "batch": micro_batch[rows],
                                    "block": blocks[rows], "row": rows}).sort_values("row")
        allocations["place"] = allocations.groupby(["step", "phase", "batch", "block"]).cumcount()
        keys = zip(allocations["step"].tolist(), allocations["phase"].tolist(), allocations["batch"].tolist(),
                   allocations["block"].tolist(), allocations["place"].tolist())
        self.serial_at = dict(zip(keys, allocations["serial"].tolist()))
        self.role = {serial: key for key, serial in self.serial_at.items()}

    def targets(self, order: np.ndarray, expanded_block: np.ndarray, replicated: np.ndarray) -> list:
        """Per emitted row, None or (traced layer, copy) of the storage its free acts on, the layer's allocation at
        the freed storage's place (`partner`): copy -1 in the leading or trailing group, else the template copy."""
        traced_block, alloc_block = self.block[order], self.alloc_block[order]
        distance = np.abs(traced_block - alloc_block)  # neighbours within a period (not the optimizer's step
        # from the last layer's parameters to the first's, which the trace makes at another distance than the run)
        changing = (traced_block >= 0) & (alloc_block >= 0) & (distance > 0) & (distance <= self.period) & ~replicated
        result: list = [None] * len(order)
        template_end = self.first + (self.extra + 1) * self.period
        for i in np.flatnonzero(changing).tolist():
            target = int(expanded_block[i]) - int(traced_block[i] - alloc_block[i])
            if target < self.first:
                block, copy = target, -1
            elif target < template_end:
                block, copy = self.first + (target - self.first) % self.period, (target - self.first) // self.period
            else:
                block, copy = target - self.extra * self.period, -1
            result[i] = (block, copy)
        return result

    def partner(self, serial: int, block: int) -> int | None:
        """The traced storage at `serial`'s place among the allocations of traced layer `block`."""
        step, phase, batch, _, place = self.role[serial]
        return self.serial_at.get((step, phase, batch, block, place))


def _micro_batches(frame: pd.DataFrame) -> np.ndarray:
    """Per traced row, the micro-batch whose chunk call it is in (a pipeline stage's, tracker.CHUNKS), else -1."""
    micro_batch = np.full(len(frame), -1, dtype=np.int64)
    for _, mb, _, begin, end in frame.attrs.get(CHUNKS) or ():
        micro_batch[begin:end] = mb
    return micro_batch


def _expanded_chunks(chunks, order: np.ndarray):
    """A pipeline stage's chunk calls (tracker.CHUNKS) as rows of the expanded timeline, whose row i stands for
    traced row `order[i]`: each call's rows stay together, a template layer's runs repeated in place; None where a
    call's rows are not one span (a template run across two calls)."""
    if not chunks:
        return None
    spans = []
    for kind, mb, step, begin, end in chunks:
        rows = np.flatnonzero((order >= begin) & (order < end))
        if not len(rows) or rows[-1] - rows[0] + 1 != len(rows):
            return None
        spans.append((kind, mb, step, int(rows[0]), int(rows[-1]) + 1))
    return Chunks(spans)


def _outside_rows(lo: int, hi: int, per_copy: np.ndarray, extra_groups: int) -> np.ndarray:
    """(row, copy) of a run outside the template group: each row once (copy -1), except the events of template
    storages that stand for one event per copy, emitted in place as the trace ordered its copies' frees
    (`per_copy` +1: oldest copy first, -1: newest first)."""
    rows = np.arange(lo, hi)
    if not per_copy[lo:hi].any():
        return np.stack([rows, np.full(hi - lo, -1)], axis=1)
    emitted = []
    for row in rows:
        if per_copy[row] == 0:
            emitted.append((row, -1))
            continue
        copies = range(extra_groups + 1) if per_copy[row] > 0 else range(extra_groups, -1, -1)
        emitted.extend((row, c) for c in copies)
    return np.array(emitted, dtype=np.int64)


def _frees_of_copies(frame: pd.DataFrame, in_template: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray]:
    """Which events outside the template group act on a storage the template group allocated and must be
    emitted once per copy: per row, 0 (emitted once) or the order of the copies (+1 oldest first, -1 newest
    first); and per row, the block that allocated its storage.

    A template storage freed in the trace but not inside the template group leaves each extra copy alive
    unless another storage's free inside the template group stands for it: a storage that changes layer (see
    `_pair_serials`) is allocated in every layer and freed by the next (or, in the backward, the previous) one,
    so the free of the leading (trailing) group's storage of the same size, allocated in the same step and
    phase, sits in the template group and frees one copy per layer. What is left is freed once per layer
    where the trace frees it: the storage's events outside the template are the frees of every copy."""
    serials = frame["serial"].to_numpy()
    deltas = frame["delta_bytes"].to_numpy()
    blocks = frame["block"].to_numpy()
    alloc_block = np.full(len(frame), NO_BLOCK, dtype=np.int64)
    per_copy = np.zeros(len(frame), dtype=np.int64)
    valid = np.flatnonzero(serials >= 0)
    if not len(valid):
        return per_copy, alloc_block
    events = pd.DataFrame({"serial": serials[valid], "delta": deltas[valid], "row": valid,
                           "template": in_template[valid]})
    events["template_delta"] = np.where(events["template"], events["delta"], 0)
    per_serial = events.groupby("serial", sort=False).agg(
        alloc_row=("row", "first"), net=("delta", "sum"), template_net=("template_delta", "sum"))
    alloc_rows = per_serial["alloc_row"].to_numpy()
    alloc_block[valid] = blocks[per_serial.loc[serials[valid], "alloc_row"].to_numpy()]
    steps, phases = frame["step"].to_numpy(), frame["phase"].to_numpy()
    key = [(int(steps[r]), phases[r], abs(int(n)), int(blocks[r]))
           for r, n in zip(alloc_rows, per_serial["template_net"].to_numpy())]
    freed = per_serial["net"].to_numpy() == 0
    surplus = freed & ~in_template[alloc_rows] & (per_serial["template_net"].to_numpy() < 0)
    spare: dict[tuple, int] = {}
    for k in (k for k, s in zip(key, surplus) if s):
        spare[k] = spare.get(k, 0) + 1
    deficit = freed & in_template[alloc_rows] & (per_serial["template_net"].to_numpy() > 0)
    lonely = []
    for serial, (step, phase, nbytes, block), short in zip(per_serial.index, key, deficit):
        if not short:
            continue
        partner = next((k for k in ((step, phase, nbytes, block - period), (step, phase, nbytes, block + period))
                        if spare.get(k, 0)), None)
        if partner is None:
            lonely.append(serial)
        else:
            spare[partner] -= 1
    if not lonely:
        return per_copy, alloc_block
    rows = valid[np.isin(serials[valid], lonely) & ~in_template[valid]]
    per_copy[rows] = [_copy_order(frame, row, per_serial) for row in rows]
    return per_copy, alloc_block


def _copy_order(frame: pd.DataFrame, row: int, per_serial: pd.DataFrame) -> int:
    """+1 when the trace frees its layers' storages oldest first around `row`, -1 when newest first (a
    Python list dropping its items frees them from the end); without a neighbouring free, oldest first in the
    forward, newest first in the backward."""
    serials, deltas = frame["serial"].to_numpy(), frame["delta_bytes"].to_numpy()
    own = per_serial.at[serials[row], "alloc_row"]
    for neighbour, later in ((row - 1, -1), (row + 1, 1)):
        if 0 <= neighbour < len(frame) and serials[neighbour] >= 0 and deltas[neighbour] < 0:
            other = per_serial.at[serials[neighbour], "alloc_row"]
            if other != own:
                return 1 if (other - own) * later > 0 else -1
    return -1 if frame["phase"].iat[row] == Phase.BACKWARD.value else 1


def _pair_serials(frame: pd.DataFrame, order: np.ndarray, backward: np.ndarray, copy_index: np.ndarray,
                  replicated: np.ndarray, micro_batch: np.ndarray, changes: list | None = None,
                  layers: _LayerChange | None = None) -> np.ndarray:
    """A serial per storage of the full-depth run. Every copy of a replicated allocation is a new storage; a
    later event of the traced storage (resize, free) acts on one of its live copies: the oldest when it runs
    in the same direction as the allocation (forward after forward), the newest when the direction turned (an
    activation of the forward freed by the backward, which walks the layers in reverse).
    A storage can also change layer between its allocation and its free (layer i's output, saved as layer
    i+1's checkpointed input, is freed by layer i+1's backward): the traced run then allocates it once per
    traced layer under different serials, and the expanded stream holds more frees of one serial than
    copies of it, and more copies of the next than frees. Such a free takes a live copy of the same size
    from a serial with copies to spare, by the same direction rule. The byte stream is unchanged; the
    pairing matters to the caching-allocator model and to the strategies, which follow storages by serial.
    An event outside the template emitted once per copy (`replicated`, see `_frees_of_copies`) acts on the copy
    of its own index (`copy_index`: the copy of the template group each emitted event stands for, -1 for none).
    In a pipeline stage a free takes a spare copy of its own micro-batch (`micro_batch`, per emitted row: the
    micro-batch of its chunk call, -1 outside them): under 1F1B or GPipe later micro-batches' forwards run before
    an earlier one's backward, and their copies are the newest. A free that changes layer (`changes`, per emitted
    row: `_LayerChange.targets`) takes the copy at its place in the layer it stands for, where that one is live.
    `backward` says, per emitted row, whether it was emitted going down the layers (the backward's walk; a template
    run that follows a lower layer inside the backward goes up: `_descending`). A copy freed or resized to 0 bytes
    stays known: a later resize up of its traced storage (FSDP2's unsharded parameters, up and back to 0 in every
    step) revives it, the copy of the same index where there is one, so every step resizes each layer's own storage."""
    serials = frame["serial"].to_numpy()
    sizes = frame["delta_bytes"].to_numpy()
    first_event = np.zeros(len(frame), dtype=bool)
    first_event[np.unique(serials, return_index=True)[1]] = True
    emitted, emitted_sizes, emitted_first = serials[order], sizes[order], first_event[order]
    allocs = pd.Series(emitted[emitted_first]).value_counts()
    frees = pd.Series(emitted[~emitted_first & (emitted_sizes < 0)]).value_counts()
    freed = frees.reindex(allocs.index, fill_value=0).to_numpy()
    spare = set(allocs.index[(freed > 0) & (freed < allocs.to_numpy())].astype(np.int64).tolist())
    traced = emitted.tolist()  # Python values: the loop below reads each row once
    result = list(traced)  # a serial per emitted row, the negative ones kept
    live: dict[int, list[list]] = {}  # traced serial -> live copies [new serial, bytes, allocated backward, copy]
    dormant: dict[int, list[list]] = {}  # traced serial -> its copies freed or resized to 0 bytes, in that order
    serial_batch: dict[int, int] = {}  # traced serial -> the micro-batch that allocated it
    next_serial = int(serials.max()) + 1 if len(serials) else 0
    rows = zip(traced, emitted_sizes.tolist(), backward.tolist(), emitted_first.tolist(), copy_index.tolist(),
               replicated.tolist(), micro_batch.tolist())
    for i, (serial, delta, turned, first, copy_of, own_copy, batch) in enumerate(rows):
        if serial < 0:
            continue
        if first:
            live.setdefault(serial, []).append([next_serial, delta, turned, copy_of])
            serial_batch[serial] = batch
            result[i] = next_serial
            next_serial += 1
            continue
        if delta > 0 and dormant.get(serial):  # resized up again (FSDP2's unsharded parameters): the same storage
            copies = dormant[serial]
            position = next((p for p, c in enumerate(copies) if c[3] == copy_of), None)
            if position is None:
                position = 0 if copies[0][2] == turned else -1
            copy = copies.pop(position)
            copy[1] += delta
            revived = live.setdefault(serial, [])
            revived.append(copy)
            revived.sort(key=lambda c: c[0])  # live copies stay in the order they were made (oldest first)
            result[i] = copy[0]
            continue
        change = changes[i] if changes is not None else None
        if change is not None and delta < 0:  # a storage that changed layer: the one at its place (_LayerChange)
            block, wanted = change
            owner = serial if layers.role[serial][3] == block else layers.partner(serial, block)
            found = live.get(owner, ()) if owner is not None else ()
            position = next((p for p, c in enumerate(found) if c[3] == wanted and c[1] == -delta), None)
            if position is not None:
                copy = found.pop(position)
                copy[1] = 0
                dormant.setdefault(owner, []).append(copy)
                result[i] = copy[0]
                continue
        key = serial
        copies = live.get(serial)
        if not copies:
            owners = spare if batch < 0 else {s for s in spare if serial_batch.get(s) == batch}
            key = _spare_copy_owner(live, owners, -delta, turned)
            copies = live.get(key)
        if not copies:  # nothing to pair with: a storage of its own
            result[i] = next_serial
            next_serial += 1
            continue
        position = next((p for p, c in enumerate(copies) if c[3] == copy_of), None) if own_copy else None
        if position is None:
            position = 0 if copies[0][2] == turned else -1
        copy = copies[position]
        copy[1] += delta
        result[i] = copy[0]
        if copy[1] <= 0:  # freed, or resized to nothing (which a later resize may undo)
            dormant.setdefault(key, []).append(copies.pop(position))
    return np.array(result, dtype=np.int64)


def _spare_copy_owner(live: dict, spare: set[int], nbytes: int, backward: bool) -> int | None:
    """The serial whose spare live copy of `nbytes` a free takes: the newest copy in the backward, else the
    oldest."""
    candidates = [(copy[0], serial) for serial in spare for copy in live.get(serial, ()) if copy[1] == nbytes]
    if not candidates:
        return None
    return (max(candidates) if backward else min(candidates))[1]


def _renumber(modules: np.ndarray, blocks: np.ndarray, shift: np.ndarray, prefix: str) -> list[str]:
    """Rewrite `prefix.<b>` in module names to the layer each event now stands for (once per distinct name,
    layer and shift: the full depth repeats a few thousand of them over its events)."""
    names = np.asarray(modules, dtype=object).copy()
    rows = np.flatnonzero(shift)
    if not prefix or not len(rows):
        return list(names)
    codes, uniques = pd.factorize(names[rows])
    rows, codes = rows[codes >= 0], codes[codes >= 0]  # no module name: nothing to rewrite
    key = np.stack([codes, blocks[rows].astype(np.int64), shift[rows].astype(np.int64)], axis=1)
    low = key.min(axis=0)
    span = key.max(axis=0) - low + 1
    packed = ((key[:, 0] - low[0]) * span[1] + key[:, 1] - low[1]) * span[2] + key[:, 2] - low[2]  # one int64 each
    _, first, inverse = np.unique(packed, return_index=True, return_inverse=True)  # (a 1-D sort: far quicker
    rewritten = []                                                                   # than unique rows, axis=0)
    for code, block, step in key[first].tolist():
        name, old = uniques[code], f"{prefix}.{block}"
        rewritten.append(f"{prefix}.{block + step}{name[len(old):]}"
                         if name == old or name.startswith(old + ".") else name)
    names[rows] = np.asarray(rewritten, dtype=object)[inverse.ravel()]
    return list(names)

TRACED_STEPS = 2  # the first step (lazy optimizer state, the first gradients) and one steady step


def on_the_line(first: pd.DataFrame, second: pd.DataFrame, micro_batches: tuple[int, int] = (1, 2)):
    """From the timelines of two micro-batches (`first` at `micro_batches[0]`, `second` at the larger
    `micro_batches[1]`), micro-batch b's with each event's bytes on the line through that event's bytes at the two,
    as a function of b; None where the two have not the same events (the same rows but for their bytes: a
    micro-batch of one skips copies that larger ones make, such as the loss's shifted labels) or an event's bytes
    are not on a line of whole bytes per sample. A guess, not a prediction: whether every event grows on a line
    is not known without tracing b (it does for every stage checked, where two micro-batches have the same
    events). `size` tries next where this guess says its answer is, and predicts what it answers."""
    if len(first) != len(second) or list(first.columns) != list(second.columns):
        return None
    for column in first.columns:
        if column != "delta_bytes" and not np.array_equal(first[column].to_numpy(), second[column].to_numpy()):
            return None
    low, high = micro_batches
    at_low = first["delta_bytes"].to_numpy(np.int64)
    slope, uneven = np.divmod(second["delta_bytes"].to_numpy(np.int64) - at_low, high - low)
    if np.any(uneven):
        return None

    def at(micro_batch: int) -> pd.DataFrame:
        return first.assign(delta_bytes=at_low + (micro_batch - low) * slope)
    return at


def repeat_last_step(frame: pd.DataFrame, steps: int) -> pd.DataFrame | None:
    """The timeline of `steps` steps from one whose last step is steady: each further step repeats the last
    traced one event for event, on storages of its own; None when the last step is not seen to be steady.

    The last step (L) starts from the state the one before it left and leaves one of the same shape when what
    crosses its start and its end match: the storages it frees that an earlier step allocated (A: the previous
    step's loss and whatever else a Python name kept alive into the next step) and the storages it allocates
    that outlive it (B) pair one to one, in allocation order, byte for byte, and it touches nothing older
    otherwise but storages it resizes and leaves as large as it found them (FSDP2's unsharded parameters), whose
    resizes every further step repeats on the same storage. Step L + 1 then begins where step L began, up to renaming A as B; the canonical step's code does
    not branch on the step's index, so it makes the same events, freeing B where step L freed A. (An `.item()`
    answered by the fake trace, llmsim.model.optimizer_values, is answered alike in every step.) The rows in
    data/measurements/ were measured over every step and check the repetition against real runs."""
    step = frame["step"].to_numpy()
    last = int(step.max()) if len(step) else 0
    if steps <= last + 1:
        return frame
    tail = int(np.searchsorted(step, last))
    if tail == 0 or np.any(np.diff(step) < 0):
        return None
    serials, deltas = frame["serial"].to_numpy(), frame["delta_bytes"].to_numpy()
    valid = serials >= 0
    head = pd.DataFrame({"serial": serials[:tail][valid[:tail]], "delta": deltas[:tail][valid[:tail]]})
    before = head.groupby("serial", sort=False)["delta"].sum()  # bytes of each older storage when L starts
    last_rows = pd.DataFrame({"serial": serials[tail:], "delta": deltas[tail:]})[valid[tail:]]
    older = last_rows["serial"].isin(before.index).to_numpy()
    touched = last_rows[older].groupby("serial", sort=False)["delta"].agg(["sum", "size"])
    whole = pd.Series(False, index=touched.index)
    if len(touched):
        held = before.loc[touched.index].to_numpy()
        # every older storage L touches, L frees whole in one event (A), or resizes and leaves as large as it
        # found it (FSDP2's unsharded parameters, `resize_`d up and back to 0 in every step: they keep their serial)
        whole = (touched["sum"].to_numpy() == -held) & (touched["size"].to_numpy() == 1) & (held != 0)
        if np.any(~whole & (touched["sum"].to_numpy() != 0)):
            return None
        whole = pd.Series(whole, index=touched.index)
    freed = before.index[before.index.isin(whole.index[whole.to_numpy()])].tolist()  # A, in allocation order
    fresh = last_rows[~older].groupby("serial", sort=False)["delta"].agg(["sum", "size"])
    alive = (fresh["sum"] > 0) | ((fresh["sum"] == 0) & (fresh["size"] == 1))  # a 0-byte storage: one event
    kept = fresh.loc[alive, "sum"]  # B, in allocation order
    if len(kept) != len(freed) or np.any(kept.to_numpy() != before.loc[freed].to_numpy()):
        return None
    offset = int(serials.max()) + 1
    block = frame.iloc[tail:]
    own = block["serial"].to_numpy()
    born = np.isin(own, fresh.index.to_numpy())
    counterpart = pd.Series(kept.index.to_numpy(), index=freed, dtype=np.int64)  # A[i] -> B[i]
    crossing = pd.Series(own).map(counterpart).fillna(-1).to_numpy(dtype=np.int64)
    copies = []
    for k in range(1, steps - last):
        copy = block.copy()
        copy["step"] = last + k
        copy["serial"] = np.where(born, own + k * offset,
                                  np.where(crossing >= 0, crossing + (k - 1) * offset, own))
        copies.append(copy)
    return pd.concat([frame, *copies], ignore_index=True)
