"""A 1F1B middle stage's traced timeline composed from another middle stage's of equal layers.

torch's `Schedule1F1B._step_microbatches` (torch/distributed/pipelining/schedules.py) runs stage s's micro-batch
forwards F0..F{M-1} and backwards B0..B{M-1} in an order set by its warm-up W = min(M, num_stages - s): W forwards,
then B_i, F_{W+i} for i < M - W, B_{M-W}, then the cool-down B_{M-W+1}..B_{M-1}. Each chunk call makes the same
events on every middle stage of equal layers; what moves with W is where the stage's output O_f (the hidden states
sent forward) and input gradient G_b (sent back) are freed, decided by the Python names that hold them:

- G_b: `bwd_cache` until `get_bwd_send_ops(b)`, then `bwd_sends` (and the cool-down's `send_work`) until both are
  rebound after the next backward: freed right after B_{b+1} on every stage (B_{M-1}'s at the step's end).
- O_f: `fwd_cache` until B_f pops it, and the warm-up's `fwd_sends` / `send_work` / `output` for one more forward;
  so freed as B_f returns, except O_{M-1}, which `output` and `fwd_sends` hold to the step's end, and O_{W-2},
  which the warm-up's last fired `send_work` holds until it is rebound after the last steady backward
  (`send_work = _batch_p2p(bwd_sends)`): where B_{W-2} has returned by then (W - 2 <= M - W), O_{W-2} is freed
  right after B_{M-W}, after G_{M-W-1}.

So a template stage's rows, cut at its chunk calls (tracker.CHUNKS), are reordered into the other stage's call
order with O_f's free moved to where that stage's schedule frees it: every row moves whole (no layer runs between
a backward's return and the next chunk call, so the frees there name the same block and module). Serials are then
numbered again in allocation order, as the tracker numbers them, and a forward storage's activation/temporary
category taken again from whether it outlives the step's last forward (tracker.StorageTracker._category).
`tests/test_compose_1f1b.py` traces each stage and compares."""
from __future__ import annotations

import numpy as np
import pandas as pd

from llmsim.enums import Category, Phase
from llmsim.model.tracker import CHUNKS, Chunks

Chunk = tuple[str, int]  # ("F" or "B", micro-batch)


def warmup(n_microbatches: int, num_stages: int, stage: int) -> int:
    """Schedule1F1B's `warmup_chunks`."""
    return min(n_microbatches, num_stages - stage)


def call_order(n_microbatches: int, warmup_chunks: int) -> list[Chunk]:
    """The chunk calls of one `Schedule1F1B._step_microbatches`, in order."""
    m, w = n_microbatches, warmup_chunks
    order = [("F", f) for f in range(w)]
    for i in range(m - w + 1):
        order.append(("B", i))
        if i < m - w:
            order.append(("F", w + i))
    return order + [("B", b) for b in range(m - w + 1, m)]


def held_output(n_microbatches: int, warmup_chunks: int) -> int | None:
    """The micro-batch whose output outlives its backward until the last steady backward returns: the warm-up's
    last fired send (W - 2), where its backward comes by then."""
    held = warmup_chunks - 2
    return held if held <= n_microbatches - warmup_chunks else None


def composed(template: pd.DataFrame, template_warmup: int, warmup_chunks: int,
             n_microbatches: int) -> pd.DataFrame | None:
    """The timeline of the middle stage with warm-up `warmup_chunks`, from `template`, a traced middle stage's
    (tracker.CHUNKS in its attrs) of equal layers whose warm-up is `template_warmup`; None where the template's
    rows between chunk calls are not the frees the module docstring names (then trace the stage)."""
    chunks = template.attrs.get(CHUNKS)
    if not chunks or min(template_warmup, warmup_chunks) < 2:
        return None
    pieces, marks, done, count = [], [], 0, 0  # done: template rows taken in order; count: rows composed
    for step in sorted({chunk[2] for chunk in chunks}):
        spans = {(kind, mb): (begin, end) for kind, mb, s, begin, end in chunks if s == step}
        cut = _cut(template, spans, template_warmup, n_microbatches)
        if cut is None:
            return None
        between = np.arange(done, min(begin for begin, _ in spans.values()))  # the optimizer, the step's start
        for kind, mb, piece in [("", 0, between), *_reordered(cut, warmup_chunks, n_microbatches)]:
            if kind:
                marks.append((kind, mb, step, count, count + len(piece)))
            pieces.append(piece)
            count += len(piece)
        done = max(end for _, end in spans.values())
    rows = np.concatenate([*pieces, np.arange(done, len(template))])
    frame = template.iloc[rows].reset_index(drop=True)
    if not _renumbered(frame, template, rows):
        return None
    _recategorized(frame, marks)
    frame.attrs[CHUNKS] = Chunks(marks)
    return frame


Cut = tuple[dict[Chunk, np.ndarray], dict[Chunk, np.ndarray], dict[int, int]]


def _cut(template: pd.DataFrame, spans: dict[Chunk, tuple[int, int]], template_warmup: int, m: int) -> Cut | None:
    """One step of the template cut up: each chunk call's rows without its output's free, the rows after it up to
    the next call without O_{W-2}'s free (G_{b-1}'s free after B_b), and the row of each O_f's free (f < M - 1);
    None where the rows between calls are not those frees."""
    serial, delta = template["serial"].to_numpy(), template["delta_bytes"].to_numpy()
    calls = sorted(spans, key=lambda chunk: spans[chunk][0])
    body, after, output_free = {}, {}, {}
    for call, following in zip(calls, calls[1:] + [None]):
        begin, end = spans[call]
        body[call] = np.arange(begin, end)
        after[call] = np.arange(end, spans[following][0] if following else end)
    w = template_warmup
    for f in range(m - 1):
        if f == held_output(m, w):  # held by the warm-up's send_work: the last row after B_{M-W}
            row = after[("B", m - w)][-1] if len(after[("B", m - w)]) == 2 else -1
            after[("B", m - w)] = after[("B", m - w)][:-1]
        else:  # freed as B_f returns: its last row
            row = body[("B", f)][-1]
            body[("B", f)] = body[("B", f)][:-1]
        forward = spans[("F", f)]
        if row < 0 or delta[row] >= 0 or not _allocated_in(serial, serial[row], forward):
            return None
        output_free[f] = row
    expected = {("B", b): 1 for b in range(1, m)} | {("B", 0): 0, ("B", m - 1): 0}
    if any(len(after[call]) != expected.get(call, 0) or np.any(delta[after[call]] >= 0) for call in calls):
        return None
    return body, after, output_free


def _allocated_in(serial: np.ndarray, storage: int, span: tuple[int, int]) -> bool:
    return bool(np.any(serial[span[0]:span[1]] == storage))


def _reordered(cut: Cut, warmup_chunks: int, m: int):
    """(kind, micro-batch, rows) of one step in the order of the stage with `warmup_chunks`; kind "" for the
    moved frees and the rows after a chunk."""
    body, after, output_free = cut
    held = held_output(m, warmup_chunks)
    for kind, mb in call_order(m, warmup_chunks):
        freed_on_return = kind == "B" and mb not in (held, m - 1)
        yield kind, mb, np.append(body[(kind, mb)], output_free[mb]) if freed_on_return else body[(kind, mb)]
        yield "", mb, after[(kind, mb)]
        if kind == "B" and mb == m - warmup_chunks and held is not None:
            yield "", mb, np.array([output_free[held]])


def _renumbered(frame: pd.DataFrame, template: pd.DataFrame, rows: np.ndarray) -> bool:
    """Serials in order of allocation, `frame` being `template`'s `rows`: the template's own serials, which count up
    in allocation order (the tracker's `_next_serial`, the expansion's from its first new one), given out again in
    the new order; False where a storage's first row is no longer its allocation (a free or resize moved before
    it)."""
    serial = frame["serial"].to_numpy()
    real = np.flatnonzero(serial >= 0)
    storages, first = np.unique(serial[real], return_index=True)
    traced = template["serial"].to_numpy()
    traced_real = np.flatnonzero(traced >= 0)
    given, allocation = np.unique(traced[traced_real], return_index=True)  # the same storages, sorted alike
    if not np.array_equal(rows[real[first]], traced_real[allocation]):
        return False
    number = np.empty(storages.max() + 1 if len(storages) else 0, dtype=serial.dtype)
    number[storages[np.argsort(first)]] = given
    frame.loc[real, "serial"] = number[serial[real]]
    return True


def _recategorized(frame: pd.DataFrame, marks: list[tuple[str, int, int, int, int]]) -> None:
    """A forward storage is an activation where it outlives its step's last forward (it is freed at or after the
    first backward call that follows the step's last forward call, or never), else a temporary: the tracker's rule
    (`StorageTracker._category`), whose phase ends move with the order of the calls."""
    categories = frame["category"].to_numpy(dtype=object)
    inferred = (categories == Category.ACTIVATION.value) | (categories == Category.TEMPORARY.value)
    serial, delta = frame["serial"].to_numpy(), frame["delta_bytes"].to_numpy()
    forward_end = {}
    for step in {mark[2] for mark in marks}:
        calls = sorted((begin, kind) for kind, _, s, begin, _ in marks if s == step)
        last_forward = max(i for i, (_, kind) in enumerate(calls) if kind == "F")
        forward_end[step] = calls[last_forward + 1][0]
    real = serial >= 0
    if not real.any():
        return
    freed = np.full(serial[real].max() + 1, -1)  # each storage's last free, or the frame's end: never freed
    freeing = np.flatnonzero(real & (delta < 0))
    np.maximum.at(freed, serial[freeing], freeing)
    freed[freed < 0] = len(frame)
    storages, first = np.unique(serial[real], return_index=True)
    first = np.flatnonzero(real)[first]  # each storage's first row: its allocation
    steps = frame["step"].to_numpy()[first]
    ends = np.full(steps.max() + 1, len(frame))  # a step without a forward call: the frame's end
    ends[list(forward_end)] = list(forward_end.values())
    ends = ends[steps]
    active = np.zeros(len(freed), dtype=bool)
    active[storages] = (frame["phase"].to_numpy(dtype=object)[first] == Phase.FORWARD.value) & (freed[storages] >= ends)
    fill = real & inferred
    categories[fill] = np.where(active[serial[fill]], Category.ACTIVATION.value, Category.TEMPORARY.value)
    categories[inferred & ~real] = Category.TEMPORARY.value  # no storage: never an activation (as before)
    frame["category"] = pd.array(categories, dtype=frame["category"].dtype)
