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

Micro-batch 0 is computed in the first step: its backward makes the step's gradients (zero_grad sets them to None).
In the second step it is replayed from the first step's micro-batch 0 in the same way; the gradients its backward
leaves in the parameters' `.grad` are made for real where their counterparts were allocated and set there as the
engine returns (a DTensor's as a DTensor of the same placements), so that the schedule's gradient reduction and the
optimizer find them. A thread's first cuBLAS call (tracker.WORKSPACE_MARKERS) is marked once, as the tracker marks
it: the first step's micro-batch 0 made those marks.

That is exact where micro-batch 1's model events are those of every later one in every step, micro-batch 0's those of
micro-batch 0 in the second step, and each touches nothing but its own storages, the output, the input's gradient,
the gradients (micro-batch 0's) and what the chunk call allocated before. `ChunkReplay` checks the second part on the
recorded events (`_Forward.check`, `_Backward.check`). Where micro-batch 1's fail, it raises `NotReplayable` and the
trace is made again with every micro-batch computed (llmsim/model/trace.py); where micro-batch 0's fail (its backward
leaves more alive than the gradients and the input's, or FSDP2 unshards in it), micro-batch 0 is computed in every
step (`ChunkReplay.first_usable`). FSDP2's (and replicate's) per-layer groups unshard their parameters in micro-batch
0's forward and keep them to the step's gradient reduction: those calls (`_Unshard`) are made again for real where
micro-batch 0 is replayed, and must make rows of the same bytes. The first part is what the
model's code does: it never branches on the micro-batch or the step; tests/test_chunk_replay.py compares, event for
event, traces made both ways on every stage
of the committed pipeline rows and more shapes."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from llmsim.enums import Phase
from llmsim.model.tracker import _WORKSPACE_SERIALS, StorageTracker

FIRST_REPLAYED = 2  # micro-batch 0 makes the step's gradients, micro-batch 1 the template (replayed after step 0)
FIRST, LATER = 0, 1  # the two templates: micro-batch 0's (replayed for micro-batch 0) and 1's (for the others)
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
    """A micro-batch's model forward in one step: its rows, the output, and the rows after the model returned
    inside the chunk call (autocast dropping its cast cache); micro-batch 0's also FSDP2's unshards among its rows
    (`_Unshard`), made for real where it is replayed."""
    rows: list[Row]
    first_serial: int  # the tracker's next serial where `rows` begin
    output: _Real
    context: tuple[int, str]  # the tracker's (block, module) as the model returned
    after: list[Row] = field(default_factory=list)
    own: set[int] = field(default_factory=set)  # serials allocated by `rows` outside the unshards
    unshards: list[_Unshard] = field(default_factory=list)

    def check(self) -> None:
        inside = {row for unshard in self.unshards for row in range(unshard.begin, unshard.end)}
        rows = [row for index, row in enumerate(self.rows) if index not in inside]
        unsharded = {self.rows[index][4] for index in inside if self.rows[index][4] >= 0}
        if unsharded & {row[4] for row in rows + self.after}:
            raise NotReplayable("the model's forward acts on a storage FSDP2's unshard made or freed")
        self.own = _allocated(rows, self.first_serial)
        if self.output.serial not in self.own:
            raise NotReplayable("the model's output was not allocated by its forward")
        _only_own(rows, self.own, "forward")
        _only_own(self.after, self.own - {self.output.serial}, "forward's chunk call")
        if _allocated(self.after, self.first_serial) - self.own:
            raise NotReplayable("the chunk call allocates after the model's forward")


@dataclass
class _Unshard:
    """A call of FSDP2's `FSDPParamGroup.unshard` or `wait_for_unshard` (replicate's too) in micro-batch 0's model
    forward, as the group's pre-forward makes it: the rows it made (`begin`, `end` in the forward's; none where the
    all-gather is over one rank), and the call, made again for real where they are replayed (the parameters it
    unshards stay until the step's gradient reduction reshards them, outside the model's calls)."""
    begin: int
    end: int
    group: object
    name: str
    args: tuple
    kwargs: dict
    context: tuple[int, str]  # the tracker's (block, module) where it was called

    def call(self, tracker: StorageTracker) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        if self.name == "unshard":  # as FSDPParamGroup.pre_forward
            self.group._training_state = TrainingState.FORWARD
        tracker.block, tracker.module = self.context
        getattr(self.group, self.name)(*self.args, **self.kwargs)


@contextlib.contextmanager
def unshards_seen(replays: list[ChunkReplay]):
    """FSDP2's unshards (`FSDPParamGroup.unshard`, `wait_for_unshard`), told to each of `replays` as they return
    (`ChunkReplay.unsharded`)."""
    from unittest import mock

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def seen(name: str):
        original = getattr(FSDPParamGroup, name)

        def call(group, *args, **kwargs):
            tracker = replays[0].tracker
            begin, context = len(tracker._rows), (tracker.block, tracker.module)
            result = original(group, *args, **kwargs)
            for replay in replays:
                replay.unsharded(_Unshard(begin, len(tracker._rows), group, name, args, kwargs, context))
            return result
        return call

    with mock.patch.object(FSDPParamGroup, "unshard", seen("unshard")), \
            mock.patch.object(FSDPParamGroup, "wait_for_unshard", seen("wait_for_unshard")):
        yield


@dataclass
class _Backward:
    """A recorded micro-batch's model backward in one step: from the gradient of the model's output to the engine's
    return; `before`: the storages the chunk call allocated before it (the last stage's loss backward: the gradient
    of the loss, that of the logits), in order, which the model's backward may free."""
    rows: list[Row]
    first_serial: int  # the tracker's next serial where `rows` begin
    before: list[tuple[int, int]]  # (serial, bytes) allocated by the chunk call before the model's backward
    input_grad: _Real | None  # the gradient of the stage's input (None on the first stage)
    context: tuple[int, str]  # the tracker's (block, module) as the engine returned

    def check(self, forward: _Forward, between: list[Row], gradients: set[int] = frozenset()) -> None:
        """`gradients`: the storages the backward leaves in the parameters' `.grad` (micro-batch 0's)."""
        own = _allocated(self.rows, self.first_serial)
        forward_kept = forward.own - {forward.output.serial}
        before = {serial for serial, _ in self.before}
        _only_own(between, set(), "chunks between", watched=forward_kept)
        _only_own(self.rows, own | forward_kept | before, "backward")
        if any(row[5] >= 0 for row in self.rows if row[4] in before):
            raise NotReplayable("the model's backward does more than free what its chunk call allocated before it")
        alive = _alive(forward.rows + forward.after + self.rows, own | forward_kept)
        expected = ({self.input_grad.serial} if self.input_grad is not None else set()) | gradients
        if alive != expected or (self.input_grad is not None and self.input_grad.serial not in own):
            raise NotReplayable(f"the model's backward leaves {len(alive)} storages alive, not the input's gradient "
                                f"and the {len(gradients)} gradients")
        if not gradients <= own:
            raise NotReplayable("a gradient the model's backward leaves is not a storage it allocated")


@dataclass
class _Gradient:
    """A gradient micro-batch 0's model backward leaves in a parameter's `.grad`: the parameter's name in the stage
    module, its storage, and for a DTensor's its mesh, placements, shape and stride."""
    name: str
    local: _Real
    dtensor: tuple | None

    def of(self, local: torch.Tensor) -> torch.Tensor:
        """The `.grad` to set from `local`, a storage made as `self.local`."""
        from torch.distributed.tensor import DTensor

        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


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
            raise NotReplayable(f"the {where} acts on storage {serial} of another micro-batch's model or another's")


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
    """Records micro-batch 0's and micro-batch 1's model forward and backward in the first step and replays them:
    micro-batch 1's for micro-batches >= FIRST_REPLAYED and for micro-batch 1 of the later steps, micro-batch 0's for
    micro-batch 0 of the later steps (module docstring). `wrap` the stage model's forward and set `module` to the
    stage module the schedule runs (whose parameters' gradients micro-batch 0 makes); enter `forward(chunk)` around
    each forward chunk call (outside autocast, whose exit belongs to the call) and `backward(chunk)` around each
    backward one; `engine_returned` where torch's stage_backward returns."""

    calls = 0  # model calls of micro-batches >= 1 replayed in this process (tests read it)
    first_calls = 0  # and of micro-batch 0

    def __init__(self, tracker: StorageTracker) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        self.tracker = tracker
        self.module: torch.nn.Module | None = None
        with _disable_current_modes():  # no fake tensor, no row: a real leaf of no bytes
            # makes the output of a first stage (token ids in) require grad; its gradient is never made
            self.anchor = torch.empty(0, requires_grad=True)
        self.forwards: list[_Forward | None] = [None, None]  # by template: FIRST, LATER
        self.backwards: list[_Backward | None] = [None, None]
        self.gradients: list[_Gradient] = []  # what FIRST's backward leaves in `.grad`
        self._recorded_step: list[int | None] = [None, None]  # the step whose micro-batches made the templates
        self._mode: str | None = None  # "record" or "replay": what the current forward chunk call does
        self._template: int | None = None  # which template the current forward chunk call records or replays
        self._chunk: tuple[str, int] | None = None
        self._mapping: dict[int, int] | None = None  # the forward just replayed
        self._input_grad: _Real | None = None
        self._backward_begins: int | None = None
        self._chunk_begins = 0  # the row where the current backward chunk call began
        self._chunk_first_serial = self._backward_first_serial = 0
        self._recording_backward: int | None = None  # the template the current backward chunk call records
        self._forward_end = 0  # where the recorded model forward ended
        self._forward_chunk_end = [0, 0]  # where each template's forward chunk call ended
        self._between_begin: int | None = None
        self._recording_first_forward = False
        self._unshards: list[_Unshard] = []  # FSDP2's, in micro-batch 0's forward as it is recorded
        self._unshard_in_backward = False  # an FSDP2 unshard made rows in micro-batch 0's backward

    @property
    def first_usable(self) -> bool:
        """FIRST's backward recorded, its gradients found and checked: micro-batch 0 is replayed in later steps."""
        return self.backwards[FIRST] is not None

    def unsharded(self, unshard: _Unshard) -> None:
        """FSDP2 made an unshard call (`unshards_seen`)."""
        if self._recording_first_forward:
            self._unshards.append(unshard)
        elif self._recording_backward == FIRST and unshard.end > unshard.begin:
            self._unshard_in_backward = True

    # ---- the model's forward -----------------------------------------------------------------------------------
    def wrap(self, forward):
        def forward_of_a_chunk(x: torch.Tensor) -> torch.Tensor:
            if self._chunk is None:
                return forward(x)
            step, micro_batch = self.tracker.step, self._chunk[1]
            if step >= REPLAYED_STEPS:  # a setup traced over more steps than the steady two: computed there
                return forward(x)
            which = FIRST if micro_batch == 0 else LATER
            template, recorded = self.forwards[which], self._recorded_step[which]
            if template is not None and (step != recorded or micro_batch >= FIRST_REPLAYED):
                if which == FIRST and not self.first_usable:
                    return forward(x)
                self._mode, self._template = "replay", which
                return _Replayed.apply(x, self.anchor if not x.requires_grad else None, self, which)
            if template is None and micro_batch == which:
                self._mode, self._template = "record", which
                return self._record_forward(forward, x, step, which)
            return forward(x)
        return forward_of_a_chunk

    def _record_forward(self, forward, x: torch.Tensor, step: int, which: int) -> torch.Tensor:
        rows = self.tracker._rows
        begin, first_serial = len(rows), self.tracker._next_serial
        self._recording_first_forward, self._unshards = which == FIRST, []
        try:
            out = forward(x)
        finally:
            self._recording_first_forward = False
        self._forward_end = len(rows)
        unshards = [replace(unshard, begin=unshard.begin - begin, end=unshard.end - begin)
                    for unshard in self._unshards]
        try:
            output = _Real.of(out, self.tracker, "output")
        except NotReplayable:
            if which == LATER:
                raise
            return out  # micro-batch 0 is computed in every step
        self.forwards[which] = _Forward(list(rows[begin:]), first_serial, output,
                                        (self.tracker.block, self.tracker.module), unshards=unshards)
        self._recorded_step[which] = step
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
        self._chunk, self._mode, self._template = ("F", chunk), None, None
        try:
            yield
        finally:
            self._chunk = None
        if self._mode == "record" and self.forwards[self._template] is not None:
            template = self.forwards[self._template]
            template.after = list(self.tracker._rows[self._forward_end:])
            try:
                template.check()
            except NotReplayable:
                if self._template == LATER:
                    raise
                self.forwards[FIRST] = None  # micro-batch 0 is computed in every step
            self._forward_chunk_end[self._template] = len(self.tracker._rows)
        elif self._mode == "replay":
            self._emit(self.forwards[self._template].after, self._mapping)
            self._mapping = None

    # ---- the model's backward ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward(self, chunk: int):
        self._chunk = ("B", chunk)
        self._chunk_begins = len(self.tracker._rows)
        self._chunk_first_serial = self.tracker._next_serial
        which = FIRST if chunk == 0 else LATER
        recording = (chunk == which and self.forwards[which] is not None
                     and self.tracker.step == self._recorded_step[which])
        self._recording_backward = which if recording else None
        self._between_begin = self._forward_chunk_end[which] if recording else None
        self._input_grad = None
        self._unshard_in_backward = False
        try:
            yield
        finally:
            self._chunk = None

    def engine_returned(self) -> None:
        """torch's stage_backward has returned: on a recorded micro-batch, the end of the model's backward."""
        which = self._recording_backward
        if self._chunk is None or which is None:
            return
        self._recording_backward = None
        rows = self.tracker._rows
        if self._backward_begins is None:
            if which == LATER:
                raise NotReplayable("the gradient of micro-batch 1's output never reached the model")
            return
        template = _Backward(list(rows[self._backward_begins:]), self._backward_first_serial,
                             _allocations(rows[self._chunk_begins:self._backward_begins], self._chunk_first_serial),
                             self._input_grad,
                             (self.tracker.block, self.tracker.module))
        between = list(rows[self._between_begin:self._backward_begins])
        self._backward_begins = None
        if which == LATER:
            template.check(self.forwards[LATER], between)
            self.backwards[LATER] = template
            return
        try:  # micro-batch 0: replayed in the later steps only where all of this holds
            if self._unshard_in_backward:
                raise NotReplayable("FSDP2 unsharded parameters in micro-batch 0's backward")
            self.gradients = self._gradients_made()
            template.check(self.forwards[FIRST], between, {gradient.local.serial for gradient in self.gradients})
        except NotReplayable:
            return
        self.backwards[FIRST] = template

    def _gradients_made(self) -> list[_Gradient]:
        """The gradients in the stage module's parameters' `.grad` (`_Backward.check` refuses them unless micro-batch
        0's backward allocated each)."""
        from torch.distributed.tensor import DTensor

        if self.module is None:
            raise NotReplayable("no stage module to find the gradients in")
        found = []
        for name, param in self.module.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            real = _Real.of(local, self.tracker, f"gradient of {name}")
            spec = (grad.device_mesh, grad.placements, tuple(grad.shape), tuple(grad.stride())) \
                if isinstance(grad, DTensor) else None
            found.append(_Gradient(name, real, spec))
        return found

    def _free_early(self, serial: int) -> None:
        """Free real storage `serial` here, as the recorded micro-batch's model freed its counterpart; its own free,
        when the engine lets it go, is then not counted again."""
        tracker = self.tracker
        key = next((key for key, live in tracker._live.items() if live.serial == serial), None)
        if key is None:
            raise NotReplayable(f"storage {serial} is no longer live where the recorded micro-batch's model freed "
                                "its own")
        live = tracker._live.pop(key)
        tracker._rows.append((tracker.step, tracker.phase, tracker.block, tracker.module, serial, -live.nbytes))

    # ---- emitting a template's rows ----------------------------------------------------------------------------
    def _emit(self, rows: list[Row], mapping: dict[int, int], real: dict[int, callable] | None = None,
              unshards: list[_Unshard] = ()) -> None:
        """Append `rows` to the tracker's, each storage of the template on a storage of its own (`mapping`,
        extended as they are allocated); a serial in `real` is made for real there (the callable) instead, and so
        are the rows of `unshards` (FSDP2's calls made again, which must make rows of the same bytes). A thread's
        first cuBLAS (cuBLASLt) call is marked where the tracker has not marked it yet, as it marks it."""
        tracker = self.tracker
        out, step, phase = tracker._rows, tracker.step, tracker.phase
        pending = list(unshards)  # in the order they were made
        skip_to = 0
        for index, row in enumerate([*rows, None]):
            while pending and pending[0].begin == index:
                unshard, begin = pending.pop(0), len(out)
                unshard.call(tracker)
                if [made[5] for made in out[begin:]] != [made[5] for made in rows[unshard.begin:unshard.end]]:
                    raise NotReplayable(f"FSDP2's {unshard.name} made other rows than in the first step")
                skip_to = unshard.end
            if index < skip_to or row is None:
                continue
            serial = row[4]
            if serial in _WORKSPACE_SERIALS:
                marked = (phase is Phase.BACKWARD, row[3])  # tracker._blas_call's key
                if marked in tracker._blas:
                    continue
                tracker._blas.add(marked)
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
    """The stage model's call on a replayed micro-batch, from template `which` (module docstring)."""

    @staticmethod
    def forward(ctx, x, anchor, replay: ChunkReplay, which: int):
        template = replay.forwards[which]
        made: list[torch.Tensor] = []
        mapping: dict[int, int] = {}
        replay._emit(template.rows, mapping,
                     {template.output.serial: lambda: made.append(template.output.make(x.device))}, template.unshards)
        if template.unshards:  # each group's post-forward
            from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

            for group in {id(unshard.group): unshard.group for unshard in template.unshards}.values():
                group._training_state = TrainingState.IDLE
        replay.tracker.block, replay.tracker.module = template.context
        replay._mapping = mapping
        if which == FIRST:
            ChunkReplay.first_calls += 1
        else:
            ChunkReplay.calls += 1
        ctx.replay, ctx.mapping, ctx.device, ctx.which = replay, mapping, x.device, which
        ctx.input_needs_grad = x.requires_grad
        return made[0]

    @staticmethod
    def backward(ctx, grad):
        replay, tracker = ctx.replay, ctx.replay.tracker
        template = replay.backwards[ctx.which]
        if template is None:
            raise NotReplayable("no recorded backward of this template before this one")
        made: list[torch.Tensor] = []
        real = {}
        if template.input_grad is not None:
            real[template.input_grad.serial] = lambda: made.append(template.input_grad.make(ctx.device))
        gradients: list[tuple[_Gradient, torch.Tensor]] = []

        def make(gradient: _Gradient) -> None:
            gradients.append((gradient, gradient.local.make(ctx.device)))
        if ctx.which == FIRST:
            for gradient in replay.gradients:
                real[gradient.local.serial] = functools.partial(make, gradient)
        made_before = _allocations(tracker._rows[replay._chunk_begins:], replay._chunk_first_serial)
        if [nbytes for _, nbytes in made_before] != [nbytes for _, nbytes in template.before]:
            raise NotReplayable("the chunk call allocated other storages before the model's backward than "
                                "micro-batch 1's")
        for (serial, _), (own, _) in zip(template.before, made_before):
            real[serial] = functools.partial(replay._free_early, own)
        replay._emit(template.rows, ctx.mapping, real)
        tracker.block, tracker.module = template.context
        if gradients:  # where the engine would have set them: nothing but the replayed rows ran in between
            params = dict(replay.module.named_parameters())
            for gradient, local in gradients:
                param = params.get(gradient.name)
                if param is None or param.grad is not None:
                    raise NotReplayable(f"{gradient.name} has no parameter, or has a gradient, where micro-batch "
                                        "0's backward makes it")
                param.grad = gradient.of(local)
        input_grad = made[0] if made and ctx.input_needs_grad else None
        return input_grad, None, None, None
