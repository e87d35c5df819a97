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

Under FSDP2 a call's events also depend on the kind of the call before it: torch's PipelineStage runs every
backward without resharding (`set_reshard_after_backward(False)`; `perform_reduce_grad` reshards and reduces after
the step's last), so a forward or backward that follows a forward all-gathers its layers' parameters (where FSDP2
reshards after the forward) and one that follows a backward finds them unsharded.

So a template stage's rows, cut at its chunk calls (tracker.CHUNKS), are put in the other stage's call order, each
call running the rows of a template call of its kind that follows a call of the same kind (`_sources`: its own
where the orders agree), with O_f's free moved to where that stage's schedule frees it: every row moves whole (no
layer runs between a backward's return and the next chunk call, so the frees there name the same block and
module). The storages a call allocates are its own, and those of a micro-batch that later rows name (what its
forward leaves for its backward, its output, the input's gradient its backward leaves) are those its own calls
allocated (`_crossing`). Serials are then numbered in allocation order, as the tracker numbers them, and a forward
storage's activation/temporary category taken again from whether it outlives the step's last forward
(tracker.StorageTracker._category). `tests/test_compose_1f1b.py` traces each stage and compares.

Over more micro-batches than the template's (`composed` with `template_microbatches`; traced.widened: a stage of a
shallower pipeline with the same layers and the same shape of schedule), each call runs the rows of the template's
call of the same role (`_roles`: its kind, the kinds of the calls around it, and its micro-batch: the first, the
second, the last or another), the calls that repeat a template call each on storages of their own. What the
pipeline makes one a micro-batch outside the calls is made for all of them: the receive buffers before the first
call (`_buffers_widened`), the step's batch, and on the last stage (which computes each micro-batch's loss after
its forward call and keeps every output and loss to the step's end) the frees of what it kept, in runs after the
step (`_kept_runs`), and the merge of its outputs (`_inputs_widened`). A storage a repeated call leaves past the
step is the one of the call as far from the step's last micro-batch."""
from __future__ import annotations

from collections import Counter

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
    last fired send (W - 2), where its backward comes by then; None where there is none (a warm-up of one: the last
    stage)."""
    held = warmup_chunks - 2
    return held if 0 <= held <= n_microbatches - warmup_chunks else None


def composed(template: pd.DataFrame, template_warmup: int, warmup_chunks: int, n_microbatches: int,
             template_microbatches: int | None = None, buffer_runs: int = 0,
             outputs_kept: bool = False) -> pd.DataFrame | None:
    """The timeline of the stage with warm-up `warmup_chunks` over `n_microbatches`, from `template`, a traced
    stage's (tracker.CHUNKS in its attrs) of equal layers whose warm-up is `template_warmup`, over
    `template_microbatches` (the same by default: a middle stage from another; fewer: its receive buffers,
    `buffer_runs` runs of one a micro-batch, widened too). `outputs_kept`: the last stage, whose schedule computes
    each micro-batch's loss after its forward call and keeps its output and loss to the step's end (frees of one
    a micro-batch after the step, widened too). (Module docstring.) None where the template's rows between chunk
    calls are not the frees the module docstring names, it has no call of the kind a call needs, or two calls'
    storages do not correspond (then trace the stage)."""
    chunks = template.attrs.get(CHUNKS)
    m = n_microbatches
    m_t = m if template_microbatches is None else template_microbatches
    if not chunks or (m_t == m and min(template_warmup, warmup_chunks) < 2):
        return None
    serial, delta = template["serial"].to_numpy(), template["delta_bytes"].to_numpy()
    first_row, last_row = _first_and_last_rows(serial)
    by_first = np.flatnonzero(first_row >= 0)  # every storage, in order of its first row (its allocation)
    by_first = by_first[np.argsort(first_row[by_first])]
    first_of = first_row[by_first]

    def sizes(storages: list[int]) -> list[int]:
        return delta[first_row[storages]].tolist() if storages else []

    fresh = iter(range(int(serial.max()) + 1, 2**62))
    pieces: list[tuple[np.ndarray, dict[int, int]]] = []
    marks, done, count = [], 0, 0  # done: template rows taken in order; count: rows composed
    carried: dict[int, int] = {}  # the template's storages of a micro-batch -> this stage's, for the rows after

    def emit(rows: np.ndarray, mapping: dict[int, int], kind: str = "", mb: int = 0, step: int = 0) -> None:
        nonlocal count
        if kind:
            marks.append((kind, mb, step, count, count + len(rows)))
        pieces.append((rows, mapping))
        count += len(rows)

    sources = (_sources(m, template_warmup, warmup_chunks) if m_t == m else
               _sources_by_role(m, m_t, template_warmup, warmup_chunks))
    if sources is None:
        return None
    # the template micro-batch whose rows stand for each of this stage's: its own where M is the template's (the
    # calls of one micro-batch correspond, whichever template call runs their rows), else the forward's source
    as_template = {mb: mb if m_t == m else sources[("F", mb)][1] for mb in range(m)}
    shared = Counter(sources.values())  # how many of this stage's calls run each template call's rows
    if outputs_kept and (m_t == m or min(template_warmup, warmup_chunks) != 1):
        return None
    previous_step: tuple | None = None  # (crossing, made) of the step before: its outputs are freed after it
    merged: set[int] = set()  # storages that hold every micro-batch's output at once (`after_step`)
    kept_sizes: set[int] = set()  # the sizes of what a forward call leaves past its step

    def after_step(rows: np.ndarray) -> bool:
        """Emit rows after a step, each free of a micro-batch's kept output or loss (a run of one a micro-batch,
        `_kept_runs`) made one a micro-batch here; False where a row names a repeated call's storage otherwise."""
        if previous_step is None or not outputs_kept:
            emit(rows, carried)
            return True
        crossing_before, made_before = previous_step
        owner = {storage: (mb, i) for (kind, mb), storages in crossing_before.items() if kind == "F"
                 for i, storage in enumerate(storages)}
        # the schedule's outputs merged (one storage the size of m_t kept outputs, the last step's never freed):
        # made for m
        runs = _kept_runs(rows, serial, delta, owner, m_t)
        kept_sizes.update(int(delta[first_row[serial[piece[0]]]]) for piece, run in runs if run is not None)
        merged.update(int(storage) for storage in serial[rows] if storage >= 0 and first_row[storage] in rows
                      and last_row[storage] in rows and delta[first_row[storage]] % m_t == 0
                      and delta[first_row[storage]] // m_t in kept_sizes)
        repeated = {source[1] for source, calls in shared.items() if source[0] == "F" and calls > 1}
        for piece, run in runs:
            if run is None:
                if any(owner.get(int(storage), (None,))[0] in repeated for storage in serial[piece]):
                    return False
                emit(piece, carried)
                continue
            order = range(m - 1, -1, -1) if run[0] > run[-1] else range(m)
            by_mb = dict(zip(run, piece))
            for mb in order:
                row = by_mb[sources[("F", mb)][1]]
                emit(np.array([row]), {int(serial[row]): made_before[("F", mb)][owner[int(serial[row])][1]]})
        return True

    for step in sorted({chunk[2] for chunk in chunks}):
        spans = {(kind, mb): (begin, end) for kind, mb, s, begin, end in chunks if s == step}
        cut = _cut(template, spans, template_warmup, m_t, outputs_kept)
        if cut is None:
            return None
        body, after, output_free = cut
        reach = dict(spans)  # what a call allocates: a kept-output stage's forward with its loss after it
        if outputs_kept:
            reach.update({call: (spans[call][0], spans[call][1] + len(after[call])) for call in spans
                          if call[0] == "F"})
        crossing = {call: _crossing(by_first, first_of, last_row, *span) for call, span in reach.items()}
        start = np.arange(done, min(begin for begin, _ in spans.values()))  # the optimizer, the step's start
        if step == min(chunk[2] for chunk in chunks) and m != m_t:  # the receive buffers, one a micro-batch
            start = _buffers_widened(template, start, first_row, last_row, m_t, m, buffer_runs)
            if start is None:
                return None
            cuts = np.flatnonzero(start < 0)
            for piece in np.split(start, np.sort(np.concatenate([cuts, cuts + 1]))):
                if len(piece) == 1 and piece[0] < 0:  # a buffer of its own: the template's row, a storage of its own
                    emit(np.array([-piece[0] - 1]), {int(serial[-piece[0] - 1]): next(fresh)})
                elif len(piece):
                    emit(piece, carried)
        elif not after_step(start):
            return None
        made: dict[Chunk, list[int]] = {}  # each call's storages that outlive it, as this stage numbers them
        held = held_output(m, warmup_chunks)
        for kind, mb in call_order(m, warmup_chunks):
            source = sources[(kind, mb)]
            begin, end = reach[source]
            allocated = np.sort(_allocated_between(by_first, first_of, begin, end))
            mapping = {} if source == (kind, mb) else {int(s): next(fresh) for s in allocated}
            own = as_template[mb]
            if kind == "B":  # the forward's storages this backward frees are its own micro-batch's
                if sizes(crossing[("F", source[1])]) != sizes(crossing[sources[("F", mb)]]):
                    return None
                mapping.update(_as_made(crossing[("F", source[1])], made[("F", mb)]))
            if sizes(crossing[source]) != sizes(crossing[(kind, own)]):
                return None
            made[(kind, mb)] = [mapping.get(s, s) for s in crossing[source]]
            rows = body[source]
            if m_t != m and kind == "B" and not outputs_kept and (mb in (held, m - 1)) != \
                    (source[1] in (held_output(m_t, template_warmup), m_t - 1)):
                return None  # the template's call keeps its output where this one frees it, or the reverse
            if kind == "B" and mb not in (held, m - 1) and not outputs_kept:  # its output freed as it returns
                if own not in output_free:
                    return None
                mapping = {**mapping, **_as_made(crossing[("F", own)], made[("F", mb)])}
                rows = np.append(rows, output_free[own])
            emit(rows, mapping, kind, mb, step)
            if m_t == m and kind == "B" and mb > 0:  # the previous backward's input gradient, freed after this one
                emit(after[(kind, mb)], _as_made(crossing[("B", mb - 1)], made[("B", mb - 1)]))
            elif m_t == m:
                emit(after[(kind, mb)], {})
            elif kind == "B" and mb > 0:  # the same from the template call of its role, on this stage's storages
                previous = sources[("B", mb - 1)]
                if len(after[source]) != (len(after[source]) and mb < m - 1) or \
                        sizes(crossing[("B", source[1] - 1)]) != sizes(crossing[previous]):
                    return None
                emit(after[source], _as_made(crossing[("B", source[1] - 1)], made[("B", mb - 1)]))
            elif kind == "F" and outputs_kept:  # the loss, computed after the forward call: the call's storages
                emit(after[source], mapping)
            else:
                emit(after[source], {})
            if kind == "B" and mb == m - warmup_chunks and held is not None:
                if as_template[held] not in output_free:
                    return None
                emit(np.array([output_free[as_template[held]]]),
                     _as_made(crossing[("F", as_template[held])], made[("F", held)]))
        carried = {}
        end_of_step = max(end for _, end in spans.values())
        for call, storages in made.items():  # the template's storages the rows after the step name, as made here
            if m_t == m:
                carried.update(_as_made(crossing[call], storages))
                continue
            # over fewer micro-batches: the call of its role; a call repeated here stands for the template's as
            # far from the step's last micro-batch (the input gradient of the one before the last, freed after
            # the step)
            source = sources[call]
            if shared[source] == 1 or m - 1 - call[1] == m_t - 1 - source[1]:
                carried.update(_as_made(crossing[source], storages))
            elif outputs_kept and call[0] == "F":  # its kept output and loss: freed in runs (after_step)
                continue
            elif np.any(last_row[crossing[source]] >= end_of_step):
                if not any(m - 1 - other[1] == m_t - 1 - source[1] for other, same in sources.items()
                           if same == source):
                    return None  # named after the step, and no call here stands where it stands
        done = end_of_step
        previous_step = (crossing, made)
    if not after_step(np.arange(done, len(template))):
        return None
    rows = np.concatenate([piece for piece, _ in pieces])
    serials = np.concatenate([_mapped(serial[piece], mapping) for piece, mapping in pieces])
    frame = template.iloc[rows].reset_index(drop=True)
    if m != m_t and not _inputs_widened(frame, m_t, m, np.isin(serials, list(merged))):
        return None
    if not _numbered_in_allocation_order(frame, serials, int(serial[serial >= 0].min())):
        return None
    _recategorized(frame, marks)
    frame.attrs[CHUNKS] = Chunks(marks)
    return frame


Cut = tuple[dict[Chunk, np.ndarray], dict[Chunk, np.ndarray], dict[int, int]]


def _cut(template: pd.DataFrame, spans: dict[Chunk, tuple[int, int]], template_warmup: int, m: int,
         outputs_kept: bool = False) -> Cut | None:
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
    for f in range(m - 1 if not outputs_kept else 0):  # the last stage keeps its outputs to the step's end
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
    # G_{b-1} freed after B_b; none where the stage's input takes no gradient (the first stage's token ids)
    gradient = 1 if any(len(after[("B", b)]) for b in range(1, m - 1)) else 0
    expected = {("B", b): gradient for b in range(1, m)} | {("B", 0): 0, ("B", m - 1): 0}
    if any(len(after[call]) != expected.get(call, 0) or np.any(delta[after[call]] >= 0) for call in calls
           if not (outputs_kept and call[0] == "F")):  # the last stage's loss follows its forward call
        return None
    return body, after, output_free


def _allocated_in(serial: np.ndarray, storage: int, span: tuple[int, int]) -> bool:
    return bool(np.any(serial[span[0]:span[1]] == storage))


def _recategorized(frame: pd.DataFrame, marks: list[tuple[str, int, int, int, int]]) -> None:
    """A forward storage is an activation where it outlives its step's last forward (it is freed at or after the
    first backward call that follows the step's last forward call, or never), else a temporary: the tracker's rule
    (`StorageTracker._category`), whose phase ends move with the order of the calls."""
    category = frame["category"]  # compared column-wise (as Python objects: 12 ms of a 30 ms composition)
    was_activation = (category == Category.ACTIVATION.value).to_numpy(bool)
    inferred = was_activation | (category == Category.TEMPORARY.value).to_numpy(bool)
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
    active[storages] = (frame["phase"].take(first) == Phase.FORWARD.value).to_numpy(bool) & (freed[storages] >= ends)
    activation = real & inferred
    activation[activation] = active[serial[activation]]
    # an inferred row is a temporary unless its storage is active (one without a storage never is, as before); the
    # few rows whose category moves are set (a few hundred of 54k on a 70B stage: a whole column's rewrite was most
    # of the composition)
    to_activation, to_temporary = activation & ~was_activation, inferred & ~activation & was_activation
    if to_activation.any() or to_temporary.any():
        categories = category.array.copy()
        categories[to_activation] = Category.ACTIVATION.value
        categories[to_temporary] = Category.TEMPORARY.value
        frame["category"] = categories


def _previous_kinds(order: list[Chunk]) -> dict[Chunk, str | None]:
    """The kind of the chunk call before each one in a step's `order` (None for the step's first)."""
    return {call: (order[i - 1][0] if i else None) for i, call in enumerate(order)}


def _sources(m: int, template_warmup: int, warmup_chunks: int) -> dict[Chunk, Chunk] | None:
    """For each chunk call of the stage with `warmup_chunks`, the template's call whose rows it runs: its own where
    the call before it is of the same kind in both orders, else the nearest template call of its kind (not the
    micro-batch 0 one, which makes the step's gradients) that follows a call of that kind; None where the template
    has none."""
    template_previous = _previous_kinds(call_order(m, template_warmup))
    sources = {}
    for call, previous in _previous_kinds(call_order(m, warmup_chunks)).items():
        if template_previous[call] == previous:
            sources[call] = call
            continue
        kind, mb = call
        alike = [other for other, before in template_previous.items()
                 if other[0] == kind and other[1] != 0 and before == previous]
        if mb == 0 or not alike:
            return None
        sources[call] = min(alike, key=lambda other: (abs(other[1] - mb), other[1]))
    return sources


def _roles(order: list[Chunk], m: int) -> dict[Chunk, tuple]:
    """Each call's role in a step's `order`: its kind, the kinds of the calls before and after it, and its
    micro-batch as the schedule and the chunk replay tell them apart (0, 1, the last, or another)."""
    kinds = [kind for kind, _ in order]
    return {call: (call[0], kinds[i - 1] if i else None, kinds[i + 1] if i + 1 < len(kinds) else None,
                   call[1] if call[1] < 2 else "last" if call[1] == m - 1 else "other")
            for i, call in enumerate(order)}


def _sources_by_role(m: int, m_t: int, template_warmup: int, warmup_chunks: int) -> dict[Chunk, Chunk] | None:
    """For each call of the stage over `m` micro-batches, the call of a template over fewer (`m_t`) of the same
    role (`_roles`): its own micro-batch where the template has it in that role, else the nearest; None where a
    role is missing from the template (then trace the stage)."""
    template_roles = _roles(call_order(m_t, template_warmup), m_t)
    sources = {}
    for call, role in _roles(call_order(m, warmup_chunks), m).items():
        alike = [other for other, other_role in template_roles.items() if other_role == role]
        if not alike:
            return None
        sources[call] = min(alike, key=lambda other: (abs(other[1] - call[1]), other[1]))
    return sources


def _kept_runs(rows: np.ndarray, serial: np.ndarray, sizes: np.ndarray, owner: dict[int, tuple[int, int]],
               m_t: int):
    """`rows` cut into pieces: (rows, None), or (rows, micro-batches) for a run of `m_t` frees of one size
    (`sizes`: each row's bytes), one of each micro-batch's kept storage (`owner`: a storage -> (its micro-batch,
    its place among what the forward left)), in order of micro-batch up or down (the schedule letting go of its
    lists)."""
    out, i, plain = [], 0, []
    while i < len(rows):
        window = [owner.get(int(storage)) for storage in serial[rows[i:i + m_t]]]
        mbs = [entry[0] for entry in window if entry is not None]
        if len(mbs) == m_t and len(set(sizes[rows[i:i + m_t]].tolist())) == 1 and \
                mbs in (list(range(m_t)), list(range(m_t - 1, -1, -1))):
            if plain:
                out.append((np.array(plain, dtype=rows.dtype), None))
                plain = []
            out.append((rows[i:i + m_t], mbs))
            i += m_t
        else:
            plain.append(rows[i])
            i += 1
    if plain:
        out.append((np.array(plain, dtype=rows.dtype), None))
    return out


def _inputs_widened(frame: pd.DataFrame, m_t: int, m: int, merged: np.ndarray) -> bool:
    """The step's inputs (the batch every stage is given, split into its micro-batches by the schedule) and the
    rows of `merged` (the last stage's outputs merged) made for `m` micro-batches where the template's were for
    `m_t`: their bytes scaled (False where they do not divide)."""
    inputs = (frame["category"] == Category.INPUT.value).to_numpy(bool) | merged
    if not inputs.any():
        return True
    delta = frame["delta_bytes"].to_numpy().copy()
    if np.any(delta[inputs] % m_t):
        return False
    delta[inputs] = delta[inputs] // m_t * m
    frame["delta_bytes"] = delta
    return True


def _buffers_widened(template: pd.DataFrame, rows: np.ndarray, first_row: np.ndarray, last_row: np.ndarray,
                     m_t: int, m: int, runs_expected: int) -> np.ndarray | None:
    """The rows that begin the first step (`rows`, template rows) with the receive buffers PipelineStage makes per
    micro-batch (`_prepare_forward_infra` / `_prepare_backward_infra`: the last rows before the first chunk call,
    `runs_expected` runs of `m_t` like allocations, one a micro-batch, that no later row names) made `m` each: a
    row to repeat as a storage of its own comes back as -(row + 1). None where the rows before the first call are
    not such runs."""
    serial = template["serial"].to_numpy()
    alike = template[["delta_bytes", "phase", "block", "module", "category"]]
    runs, end = [], len(rows)
    while len(runs) < runs_expected and end >= m_t:
        run = rows[end - m_t:end]
        storages = serial[run]
        if np.any(storages < 0) or np.any(first_row[storages] != run) or np.any(last_row[storages] != run) or \
                len(alike.iloc[run].drop_duplicates()) != 1:
            return None
        runs.insert(0, run)
        end -= m_t
    if len(runs) != runs_expected:
        return None
    widened = [rows[:end]]
    for run in runs:
        widened += [run, np.full(m - m_t, -run[-1] - 1)]
    return np.concatenate(widened)


def _first_and_last_rows(serial: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each storage's first and last row (indexed by serial; -1 for a serial no row names)."""
    size = int(serial.max()) + 1 if len(serial) else 0
    first, last = np.full(size, -1), np.full(size, -1)
    real = np.flatnonzero(serial >= 0)
    np.maximum.at(last, serial[real], real)
    first[serial[real][::-1]] = real[::-1]  # the last assignment wins: the smallest row
    return first, last


def _allocated_between(by_first: np.ndarray, first_of: np.ndarray, begin: int, end: int) -> np.ndarray:
    """The storages whose first row is in rows begin..end-1 (`by_first`: every storage in order of its first row,
    `first_of` those rows), in that order."""
    return by_first[np.searchsorted(first_of, begin):np.searchsorted(first_of, end)]


def _crossing(by_first: np.ndarray, first_of: np.ndarray, last_row: np.ndarray, begin: int, end: int) -> list[int]:
    """The storages a chunk call (rows begin..end-1) allocates that a later row names, in order of allocation."""
    storages = _allocated_between(by_first, first_of, begin, end)
    return storages[last_row[storages] >= end].tolist()


def _as_made(template_storages: list[int], made: list[int]) -> dict[int, int]:
    return dict(zip(template_storages, made))


def _mapped(serials: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    """`serials` with each key of `mapping` replaced by its value."""
    if not mapping:
        return serials
    keys = np.fromiter(mapping, dtype=serials.dtype, count=len(mapping))
    values = np.fromiter(mapping.values(), dtype=serials.dtype, count=len(mapping))
    order = np.argsort(keys)
    keys, values = keys[order], values[order]
    at = np.minimum(np.searchsorted(keys, serials), len(keys) - 1)
    return np.where(keys[at] == serials, values[at], serials)


def _numbered_in_allocation_order(frame: pd.DataFrame, serials: np.ndarray, base: int) -> bool:
    """`frame`'s serials: `serials` numbered from `base` in order of first row, as the tracker numbers storages;
    False where a storage's first row is not its allocation (a free or a resize to nothing before it)."""
    real = np.flatnonzero(serials >= 0)
    storages, first = np.unique(serials[real], return_index=True)
    if np.any(frame["delta_bytes"].to_numpy()[real[first]] < 0):
        return False
    number = np.empty(len(storages), dtype=np.int64)
    number[np.argsort(first)] = np.arange(base, base + len(storages))
    numbered = frame["serial"].to_numpy().copy()
    numbered[real] = number[np.searchsorted(storages, serials[real])]
    frame["serial"] = numbered
    return True
