"""A pipeline stage's later micro-batches: their model forward and backward composed from micro-batch 1's events
instead of computed (issue 23: trace each distinct piece once).

torch.distributed.pipelining runs the same model forward and backward on every micro-batch of a step, and under
fake tensors that computation is what a stage's trace spends its time on (0.2 s a micro-batch for three layers of
Llama-2-70B; 16 micro-batches, 3.3 s a stage). The trace still runs torch's own schedule for every micro-batch, so
all the schedule does stays real: its receive buffers and sends, the outputs and input gradients it keeps by its
Python names (`fwd_cache`, `bwd_cache`, the warm-up's `send_work`, the last stage's `output_chunks`) and frees where
those names let go, the last stage's loss and its backward, the merged outputs. Only the call of the stage's model
on micro-batch k >= 2, and on micro-batch 1 after the first step, is replaced, by an autograd Function
(`_Replayed`) that makes the events micro-batch 1's call made in the first step, on storages of its own, and one
real tensor at the place its real one was allocated: the forward's output, which the schedule sends and keeps.
Its backward does the same with micro-batch 1's backward of the model (from the moment the gradient of the model's
output is ready to the engine's return), the parameters' gradients accumulated in place as micro-batch 1's were
(their post-accumulate hooks' rows among its events), the gradient of the stage's input (which the schedule sends
back) real, and frees what the chunk call allocated before the model's backward where micro-batch 1's model freed
it (the last stage's gradients of its loss and logits).

Micro-batch 0 is computed in every step: its backward makes the step's gradients (zero_grad sets them to None),
and the first step's makes the first ones. That is exact where micro-batch 1's model events are those of every later
one, in every step, and touch nothing but their own storages, the output, the input's gradient and what the chunk
call allocated before. `ChunkReplay` checks the second part on the recorded events (`_Forward.check`,
`_Backward.check`) and raises `NotReplayable` otherwise; the trace is then made again with every micro-batch
computed (llmsim/model/trace.py). The first part is what the model's code does: it never branches on the
micro-batch or the step; tests/test_chunk_replay.py compares, event for event, traces made both ways on every stage
of the committed pipeline rows with more than two micro-batches and more shapes."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from llmsim.model.tracker import StorageTracker

FIRST_REPLAYED = 2  # micro-batch 0 makes the step's gradients, micro-batch 1 the template (replayed after step 0)
ENABLED = True  # tests turn it off to trace every micro-batch
# The steps whose micro-batches are replayed: the first and the steady second (timeline.TRACED_STEPS), whose
# micro-batch 1 makes the same events; a setup whose second step is not steady is traced over every step, and
# from the third on every micro-batch is computed.
REPLAYED_STEPS = 2


class NotReplayable(Exception):
    """Micro-batch 1's model events touch storages other than their own: trace every micro-batch."""


def refused(error: BaseException) -> bool:
    """Whether `error` is, or was raised from, a NotReplayable (torch re-raises what a schedule's chunk or the
    autograd engine met inside it as its own exception)."""
    while error is not None:
        if isinstance(error, NotReplayable) or "NotReplayable" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


Row = tuple  # a tracker row: (step, phase, block, module, serial, delta_bytes)


@dataclass
class _Real:
    """The one storage a replayed call makes for real: its tensor's layout and the template's serial."""
    serial: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    @staticmethod
    def of(tensor: torch.Tensor, tracker: StorageTracker, what: str) -> _Real:
        if is_traceable_wrapper_subclass(tensor) or tensor.storage_offset():
            raise NotReplayable(f"the model's {what} is a {type(tensor).__name__} at offset "
                                f"{tensor.storage_offset()}")
        live = tracker._live.get(tensor.untyped_storage()._cdata)
        nbytes = tensor.untyped_storage().nbytes()
        made = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
        if live is None or made.untyped_storage().nbytes() != nbytes:
            raise NotReplayable(f"the model's {what} is not a storage of its own")
        return _Real(live.serial, tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype, nbytes)

    def make(self, device: torch.device) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=device)


@dataclass
class _Forward:
    """Micro-batch 1's model forward in one step: its rows, the output, and the rows after the model returned
    inside the chunk call (autocast dropping its cast cache)."""
    rows: list[Row]
    first_serial: int  # the tracker's next serial where `rows` begin
    output: _Real
    context: tuple[int, str]  # the tracker's (block, module) as the model returned
    after: list[Row] = field(default_factory=list)
    own: set[int] = field(default_factory=set)  # serials allocated by `rows`

    def check(self) -> None:
        self.own = _allocated(self.rows, self.first_serial)
        if self.output.serial not in self.own:
            raise NotReplayable("the model's output was not allocated by its forward")
        _only_own(self.rows, self.own, "forward")
        _only_own(self.after, self.own - {self.output.serial}, "forward's chunk call")
        if _allocated(self.after, self.first_serial) - self.own:
            raise NotReplayable("the chunk call allocates after the model's forward")


@dataclass
class _Backward:
    """Micro-batch 1's model backward in one step: from the gradient of the model's output to the engine's return;
    `before`: the storages the chunk call allocated before it (the last stage's loss backward: the gradient of the
    loss, that of the logits), in order, which the model's backward may free."""
    rows: list[Row]
    first_serial: int  # the tracker's next serial where `rows` begin
    before: list[tuple[int, int]]  # (serial, bytes) allocated by the chunk call before the model's backward
    input_grad: _Real | None  # the gradient of the stage's input (None on the first stage)
    context: tuple[int, str]  # the tracker's (block, module) as the engine returned

    def check(self, forward: _Forward, between: list[Row]) -> None:
        own = _allocated(self.rows, self.first_serial)
        forward_kept = forward.own - {forward.output.serial}
        before = {serial for serial, _ in self.before}
        _only_own(between, set(), "chunks between", watched=forward_kept)
        _only_own(self.rows, own | forward_kept | before, "backward")
        if any(row[5] >= 0 for row in self.rows if row[4] in before):
            raise NotReplayable("the model's backward does more than free what its chunk call allocated before it")
        alive = _alive(forward.rows + forward.after + self.rows, own | forward_kept)
        expected = {self.input_grad.serial} if self.input_grad is not None else set()
        if alive != expected or (self.input_grad is not None and self.input_grad.serial not in own):
            raise NotReplayable(f"micro-batch 1's model leaves {len(alive)} storages alive, not the input's gradient")


def _allocated(rows: list[Row], first_serial: int) -> set[int]:
    """The storages `rows` allocate (`_allocations`)."""
    return {serial for serial, _ in _allocations(rows, first_serial)}


def _only_own(rows: list[Row], allowed: set[int], where: str, watched: set[int] | None = None) -> None:
    """Every storage event of `rows` acts on `allowed`; with `watched`, none acts on those."""
    for row in rows:
        serial = row[4]
        if serial < 0:
            continue
        if (watched is None and serial not in allowed) or (watched is not None and serial in watched):
            raise NotReplayable(f"the {where} acts on storage {serial} of micro-batch 1's model or another's")


def _allocations(rows: list[Row], first_serial: int) -> list[tuple[int, int]]:
    """(serial, bytes) of each storage `rows` allocate, in order: the tracker numbers storages as they are
    allocated, so those from `first_serial`, its next serial where `rows` begin (a zero-byte one too: a GPU's
    attention makes some), each at its first row."""
    seen, made = set(), []
    for row in rows:
        if row[4] >= first_serial and row[4] not in seen:
            seen.add(row[4])
            made.append((row[4], row[5]))
    return made


def _alive(rows: list[Row], storages: set[int]) -> set[int]:
    """Which of `storages`, each allocated by `rows`, are still alive where they end: a storage is freed by the row
    that brings its bytes back to 0 (a zero-byte storage's second row)."""
    held: dict[int, int] = {}
    for row in rows:
        serial = row[4]
        if serial not in storages:
            continue
        if serial not in held:
            held[serial] = row[5]
        elif serial in held and held[serial] is not None:
            held[serial] += row[5]
            if held[serial] == 0 and row[5] <= 0:
                held[serial] = None  # freed
    return {serial for serial, nbytes in held.items() if nbytes is not None}


class ChunkReplay:
    """Records micro-batch 1's model forward and backward in the first step and replays them for micro-batches
    >= FIRST_REPLAYED, and for micro-batch 1 of the later steps (module docstring). `wrap` the stage model's
    forward; enter `forward(chunk)` around each forward chunk call (outside autocast, whose exit belongs to the
    call) and `backward(chunk)` around each backward one; `engine_returned` where torch's stage_backward returns."""

    calls = 0  # model calls replayed in this process (tests read it)

    def __init__(self, tracker: StorageTracker) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        self.tracker = tracker
        with _disable_current_modes():  # no fake tensor, no row: a real leaf of no bytes
            # makes the output of a first stage (token ids in) require grad; its gradient is never made
            self.anchor = torch.empty(0, requires_grad=True)
        self.forward_template: _Forward | None = None
        self.backward_template: _Backward | None = None
        self._recorded_step: int | None = None  # the step whose micro-batch 1 made the templates
        self._mode: str | None = None  # "record" or "replay": what the current forward chunk call does
        self._chunk: tuple[str, int] | None = None
        self._mapping: dict[int, int] | None = None  # the forward just replayed
        self._input_grad: _Real | None = None
        self._backward_begins: int | None = None
        self._chunk_begins = 0  # the row where the current backward chunk call began
        self._chunk_first_serial = self._backward_first_serial = 0
        self._recording_backward = False
        self._forward_end = self._forward_chunk_end = 0  # where the recorded model forward and its chunk call ended
        self._between_begin: int | None = None

    # ---- the model's forward -----------------------------------------------------------------------------------
    def wrap(self, forward):
        def forward_of_a_chunk(x: torch.Tensor) -> torch.Tensor:
            if self._chunk is None or self._chunk[1] < 1:
                return forward(x)
            step, micro_batch = self.tracker.step, self._chunk[1]
            if step >= REPLAYED_STEPS:  # a setup traced over more steps than the steady two: computed there
                return forward(x)
            if self.forward_template is not None and (micro_batch >= FIRST_REPLAYED or step != self._recorded_step):
                self._mode = "replay"
                return _Replayed.apply(x, self.anchor if not x.requires_grad else None, self)
            if micro_batch == 1 and self.forward_template is None:
                self._mode = "record"
                return self._record_forward(forward, x, step)
            return forward(x)
        return forward_of_a_chunk

    def _record_forward(self, forward, x: torch.Tensor, step: int) -> torch.Tensor:
        rows = self.tracker._rows
        begin, first_serial = len(rows), self.tracker._next_serial
        out = forward(x)
        self._forward_end = len(rows)
        self.forward_template = _Forward(list(rows[begin:]), first_serial, _Real.of(out, self.tracker, "output"),
                                         (self.tracker.block, self.tracker.module))
        self._recorded_step = step
        self._input_grad = None
        if x.requires_grad:  # torch's stage_backward reads the input's .grad and sets it to None: take it here
            def input_grad_made(grad: torch.Tensor) -> None:
                self._input_grad = _Real.of(grad, self.tracker, "input's gradient")
            x.register_hook(input_grad_made)

        def backward_begins(grad: torch.Tensor) -> None:
            self._backward_begins = len(self.tracker._rows)
            self._backward_first_serial = self.tracker._next_serial

        out.register_hook(backward_begins)
        return out

    @contextlib.contextmanager
    def forward(self, chunk: int):
        self._chunk, self._mode = ("F", chunk), None
        try:
            yield
        finally:
            self._chunk = None
        template = self.forward_template
        if self._mode == "record":
            template.after = list(self.tracker._rows[self._forward_end:])
            template.check()
            self._forward_chunk_end = len(self.tracker._rows)
        elif self._mode == "replay":
            self._emit(template.after, self._mapping)
            self._mapping = None

    # ---- the model's backward ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward(self, chunk: int):
        self._chunk = ("B", chunk)
        self._chunk_begins = len(self.tracker._rows)
        self._chunk_first_serial = self.tracker._next_serial
        self._recording_backward = chunk == 1 and self.tracker.step == self._recorded_step
        self._between_begin = self._forward_chunk_end if self._recording_backward else None
        try:
            yield
        finally:
            self._chunk = None

    def engine_returned(self) -> None:
        """torch's stage_backward has returned: on micro-batch 1, the end of the model's backward."""
        if self._chunk is None or not self._recording_backward:
            return
        rows = self.tracker._rows
        if self._backward_begins is None:
            raise NotReplayable("the gradient of micro-batch 1's output never reached the model")
        template = _Backward(list(rows[self._backward_begins:]), self._backward_first_serial,
                             _allocations(rows[self._chunk_begins:self._backward_begins], self._chunk_first_serial),
                             self._input_grad,
                             (self.tracker.block, self.tracker.module))
        template.check(self.forward_template, list(rows[self._between_begin:self._backward_begins]))
        self.backward_template = template
        self._backward_begins = None

    def _free_early(self, serial: int) -> None:
        """Free real storage `serial` here, as micro-batch 1's model freed its counterpart; its own free, when the
        engine lets it go, is then not counted again."""
        tracker = self.tracker
        key = next((key for key, live in tracker._live.items() if live.serial == serial), None)
        if key is None:
            raise NotReplayable(f"storage {serial} is no longer live where micro-batch 1's model freed its own")
        live = tracker._live.pop(key)
        tracker._rows.append((tracker.step, tracker.phase, tracker.block, tracker.module, serial, -live.nbytes))

    # ---- emitting a template's rows ----------------------------------------------------------------------------
    def _emit(self, rows: list[Row], mapping: dict[int, int], real: dict[int, callable] | None = None) -> None:
        """Append `rows` to the tracker's, each storage of the template on a storage of its own (`mapping`,
        extended as they are allocated); a serial in `real` is made for real there (the callable) instead."""
        tracker = self.tracker
        out, step, phase = tracker._rows, tracker.step, tracker.phase
        for row in rows:
            serial = row[4]
            if serial >= 0:
                if real is not None and serial in real:
                    tracker.block, tracker.module = row[2], row[3]
                    real[serial]()
                    continue
                own = mapping.get(serial)
                if own is None:
                    own = mapping[serial] = tracker._next_serial
                    tracker._next_serial += 1
                    tracker._alloc_row[own] = len(out)
                    tracker._alloc_phase[own] = (step, phase)
                    if serial in tracker._labels:  # what a labelled storage holds and whose it is, as the template's
                        tracker._labels[own] = tracker._labels[serial]
                        for names in (tracker._serial_name, tracker._serial_block):
                            if serial in names:
                                names[own] = names[serial]
                serial = own
            out.append((step, phase, row[2], row[3], serial, row[5]))


class _Replayed(torch.autograd.Function):
    """The stage model's call on a replayed micro-batch (module docstring)."""

    @staticmethod
    def forward(ctx, x, anchor, replay: ChunkReplay):
        template = replay.forward_template
        made: list[torch.Tensor] = []
        mapping: dict[int, int] = {}
        replay._emit(template.rows, mapping,
                     {template.output.serial: lambda: made.append(template.output.make(x.device))})
        replay.tracker.block, replay.tracker.module = template.context
        replay._mapping = mapping
        ChunkReplay.calls += 1
        ctx.replay, ctx.mapping, ctx.device = replay, mapping, x.device
        ctx.input_needs_grad = x.requires_grad
        return made[0]

    @staticmethod
    def backward(ctx, grad):
        replay, tracker = ctx.replay, ctx.replay.tracker
        template = replay.backward_template
        if template is None:
            raise NotReplayable("no recorded backward of micro-batch 1 before this one")
        made: list[torch.Tensor] = []
        real = {}
        if template.input_grad is not None:
            real[template.input_grad.serial] = lambda: made.append(template.input_grad.make(ctx.device))
        made_before = _allocations(tracker._rows[replay._chunk_begins:], replay._chunk_first_serial)
        if [nbytes for _, nbytes in made_before] != [nbytes for _, nbytes in template.before]:
            raise NotReplayable("the chunk call allocated other storages before the model's backward than "
                                "micro-batch 1's")
        for (serial, _), (own, _) in zip(template.before, made_before):
            real[serial] = functools.partial(replay._free_early, own)
        replay._emit(template.rows, ctx.mapping, real)
        tracker.block, tracker.module = template.context
        input_grad = made[0] if made and ctx.input_needs_grad else None
        return input_grad, None, None
