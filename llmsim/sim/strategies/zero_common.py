"""What every ZeRO stage reads from the single-process timeline, and how it writes its own events.

The single-process trace already holds the forward and backward of one rank (activations do not change
under data parallelism); a ZeRO stage keeps them, replaces what happens to parameters, gradients and
optimizer state, and adds its buffers. Sources: deepspeed/runtime/zero/stage_1_and_2.py, stage3.py,
partition_parameters.py, runtime/engine.py (DeepSpeed 0.19).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from llmsim.enums import Category, Device, Phase
from llmsim.sim.strategies.events import live_at_end_of_build, per_timeline
from llmsim.model.tracker import NO_BLOCK, TIMELINE_COLUMNS

FP32_BYTES = 4
OWN, KEEP, DROP = 1, 0, -1  # what a strategy's walk does with a run of rows (`own_runs`)
FP64_BYTES = 8  # the gradient norm upcasts each gradient slice to float64 (stage_1_and_2.py, get_grad_norm_direct)
ADAM_STEP_BYTES = 4  # AdamW's `step` is a 0-dim fp32 tensor on the host (torch/optim/adamw.py, _init_group)


def rank_writer(timeline: pd.DataFrame, setup, module: str = "deepspeed") -> "EventWriter":
    """The writer of a rank's timeline, serials after the single-process trace's; on a GPU a torch AdamW's `step`
    counters it writes are host memory (`EventWriter.steps_on_host`)."""
    return EventWriter(int(timeline["serial"].max()) + 1, module=module, steps_on_host=setup.device is Device.CUDA)


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    elem_bytes: int


def parameters(timeline: pd.DataFrame, elem_bytes: int) -> list[Param]:
    """Trainable parameters as `model.parameters()` orders them (the order of their final allocation)."""
    live = live_at_end_of_build(timeline, Category.PARAMETER)
    return [Param(name, int(nbytes) // elem_bytes, elem_bytes) for name, nbytes in zip(live["name"], live["nbytes"])]


# The timeline's attribute naming the parameters of the optimizer's weight-decay-free param group, where the traced
# run's optimizer has one (the HF Trainer's `create_optimizer`; llmsim/sim/traced.py sets it): DeepSpeed flattens,
# partitions and steps each param group apart
NO_DECAY = "no_decay"


def optimizer_groups(params: list[Param], timeline: pd.DataFrame) -> list[list[Param]]:
    """The trainable parameters in the optimizer's param groups, each in model order: one group (the canonical step's
    `AdamW(model.parameters())`), or the Trainer's two (weight decay, then none; an empty one is kept: DeepSpeed
    keeps it, of no elements)."""
    no_decay = timeline.attrs.get(NO_DECAY)
    if no_decay is None:
        return [params]
    unknown = no_decay - {p.name for p in params}
    if unknown:  # the meta model's names and the trace's disagree: a modelling error, not the user's input
        raise AssertionError(f"the optimizer's groups name parameters the trace has not: {sorted(unknown)[:3]}")
    return [[p for p in params if p.name not in no_decay], [p for p in params if p.name in no_decay]]


def param_storages(timeline: pd.DataFrame) -> list[tuple[int, int]]:
    """(serial, bytes) of the parameter storages alive when the build ends."""
    live = live_at_end_of_build(timeline, Category.PARAMETER)
    return [(int(serial), int(nbytes)) for serial, nbytes in live["nbytes"].items()]


@dataclass
class EventWriter:
    """Builds a rank's timeline: copies single-process rows and appends its own events in order. Rows are
    copied one by one (`keep`) or, where the strategy has nothing to do, as a run of source rows by index
    (`keep_run`), so that a rank costs what its own events cost rather than the whole timeline."""

    next_serial: int
    rows: list[tuple] = field(default_factory=list)  # rows kept one by one and the strategy's own events
    step: int = 0
    phase: str = Phase.BUILD.value
    module: str = ""
    order: list[int] = field(default_factory=list)  # the output: >= 0 a source row, < 0 `rows[-1 - i]`
    # the rank's parameters are on a GPU, where torch AdamW's for-loop and foreach paths keep `step` on the host
    steps_on_host: bool = False

    def keep(self, row: tuple) -> None:
        self.step, self.phase = row[0], row[1]
        self._append(row)

    def keep_run(self, rows: list[tuple], start: int, stop: int) -> None:
        self.step, self.phase = rows[stop - 1][0], rows[stop - 1][1]
        self.order.extend(range(start, stop))

    def alloc(self, nbytes: int, category: Category, module: str | None = None) -> int:
        serial = self.next_serial
        self.next_serial += 1
        self._emit(serial, nbytes, category, module)
        return serial

    def free(self, serial: int, nbytes: int, category: Category, module: str | None = None) -> None:
        self._emit(serial, -nbytes, category, module)

    def _emit(self, serial: int, delta: int, category: Category, module: str | None) -> None:
        if delta:
            self._append((self.step, self.phase, NO_BLOCK, module or self.module, serial, delta, category.value, ""))

    def _append(self, row: tuple) -> None:
        self.order.append(-1 - len(self.rows))
        self.rows.append(row)

    def frame(self, source: pd.DataFrame) -> pd.DataFrame:
        """The rank's timeline: `source`'s rows kept in runs, and the rest, in output order."""
        return frame_of(source, np.asarray(self.order, dtype=np.int64), self.rows)


def frame_of(source: pd.DataFrame, order: np.ndarray, rows: list[tuple]) -> pd.DataFrame:
    """A timeline from `order` (>= 0 a row of `source`, < 0 `rows[-1 - i]`)."""
    copied = order >= 0
    own = pd.DataFrame(rows, columns=TIMELINE_COLUMNS)
    if not copied.any():
        return own
    both = pd.concat([source[TIMELINE_COLUMNS].iloc[order[copied]], own], ignore_index=True)
    n_copied = int(copied.sum())
    at = np.empty(len(order), dtype=np.int64)
    at[copied] = np.arange(n_copied)
    at[~copied] = n_copied - 1 - order[~copied]
    return both.take(at).reset_index(drop=True)


def host_buffer(w: EventWriter, nbytes, pinned: bool) -> int:
    """A host buffer of DeepSpeed's offload, its serial. `pinned` (pin_memory on a GPU): the pinned copy
    `get_accelerator().pin_memory(t)` makes replaces the pageable buffer, which is freed at once (DeepSpeed's CPU
    accelerator returns `t` itself, so the CPU rows measure the unpinned path)."""
    pageable = w.alloc(nbytes, Category.HOST_OFFLOAD)
    if not pinned:
        return pageable
    serial = w.alloc(nbytes, Category.HOST_OFFLOAD)
    w.free(pageable, nbytes, Category.HOST_OFFLOAD)
    return serial


def adamw(w: EventWriter, numels: list[int], first: bool, foreach: bool, fused: bool = False,
          on_host: bool = False, states: list | None = None) -> None:
    """torch.optim.AdamW's step over fp32 parameters of `numels` elements (torch/optim/adam.py):
    `_init_group` creates `step`, `exp_avg` and `exp_avg_sq` for every parameter at the first step; then
    `_single_tensor_adam` (CPU default) makes `sqrt` and `denom` per parameter, the previous `denom` freed when
    the next replaces it, while `_multi_tensor_adam` (foreach, CUDA default) makes one `_foreach_sqrt` list
    that lives until the step ends. `_fused_adam` (fused=True) adds 1 to the steps in place and runs
    `torch._fused_adamw_`, which updates parameters and states in place: no temporaries (its `step` lives on
    the parameters' device, 4 bytes as well; the other paths' on the host, which a GPU rank's writer marks,
    `EventWriter.steps_on_host`). Scalar temporaries are left out. `on_host`: the parameters are on the host
    (ZeRO-Offload), and so are the states and temporaries (`step` is where it always is: `device="cpu"`, the
    CPU standing in for the device in a CPU run, the host on a GPU). `states`: a list the (serial, bytes) of each
    `exp_avg` and `exp_avg_sq` made are appended to."""
    step_category = Category.HOST_OPTIMIZER_STATE if w.steps_on_host and not fused else Category.OPTIMIZER_STATE
    if on_host and fused:  # the fused path's `step` is on the parameters' device: the host
        step_category = Category.HOST_OFFLOAD
    state = Category.HOST_OFFLOAD if on_host else Category.OPTIMIZER_STATE
    temporary = Category.HOST_OFFLOAD if on_host else Category.TEMPORARY
    if first:
        for numel in numels:
            w.alloc(ADAM_STEP_BYTES, step_category)
            made = [(w.alloc(numel * FP32_BYTES, state), numel * FP32_BYTES) for _ in ("exp_avg", "exp_avg_sq")]
            if states is not None:
                states.extend(made)
    if fused:
        return
    if foreach:
        sqrts = [(w.alloc(n * FP32_BYTES, temporary), n) for n in numels]
        for serial, numel in reversed(sqrts):  # a Python list drops its items from the end
            w.free(serial, numel * FP32_BYTES, temporary)
        return
    previous = None
    for numel in numels:
        sqrt = w.alloc(numel * FP32_BYTES, temporary)
        denom = w.alloc(numel * FP32_BYTES, temporary)
        w.free(sqrt, numel * FP32_BYTES, temporary)
        if previous is not None:
            w.free(*previous, temporary)
        previous = (denom, numel * FP32_BYTES)
    if previous is not None:
        w.free(*previous, temporary)


FUSED_ADAM_OVERFLOW_BUF_BYTES = 4  # FusedAdam.__init__: `_dummy_overflow_buf = IntTensor([0])`


def step_optimizer(w: EventWriter, numels: list[int], first: bool, foreach: bool, kind: str,
                   fused: bool = False, on_host: bool = False, states: list | None = None) -> None:
    """The optimizer step a ZeRO stage runs on its fp32 partitions: a torch AdamW (the client's, or `torch_adam`),
    DeepSpeed's FusedAdam (deepspeed/ops/adam/fused_adam.py) or, with the optimizer offloaded, its CPU Adam
    (deepspeed/ops/adam/cpu_adam.py, `DeepSpeedCPUAdam.step`). Both DeepSpeed optimizers create `exp_avg` and
    `exp_avg_sq` with `zeros_like` at the first step in fp32 (CPU Adam's `fp32_optimizer_states`, default True,
    only matters for a master that is not fp32), keep `step` as a Python int and update parameters and states
    in place in compiled code (FusedAdam's multi-tensor kernel; CPU Adam's `ds_opt_adam.adam_update`, SIMD tiles
    over the tensors themselves): no tensor temporaries. CPU Adam steps the host partition, so its states are
    host memory. `states`: as adamw's."""
    if kind not in ("fused", "cpu_adam"):
        adamw(w, numels, first, foreach, fused, on_host, states)
        return
    state = Category.HOST_OFFLOAD if on_host else Category.OPTIMIZER_STATE
    if first:
        for numel in numels:
            made = [(w.alloc(numel * FP32_BYTES, state), numel * FP32_BYTES) for _ in ("exp_avg", "exp_avg_sq")]
            if states is not None:
                states.extend(made)


def optimizer_of(deepspeed, setup) -> tuple[str, bool]:
    """(kind, foreach) of the optimizer DeepSpeed steps with (`DeepSpeedSetup.optimizer_kind`)."""
    kind = deepspeed.optimizer_kind
    foreach = setup.foreach
    if kind == "torch":
        requested = deepspeed.config["optimizer"].get("params", {}).get("foreach")
        foreach = setup.foreach if requested is None else bool(requested)
    return kind, foreach


def torch_fused(deepspeed, setup) -> bool:
    """Whether the torch AdamW DeepSpeed steps takes its fused path: the client's `fused=True` (--fused), or
    `"fused": true` among a `torch_adam` optimizer's params (engine.py passes them to torch.optim.AdamW)."""
    from llmsim.errors import InputError

    kind = deepspeed.optimizer_kind
    if deepspeed.replaces_client_optimizer:
        return False  # the client's AdamW, fused or not, is replaced by DeepSpeed's CPU Adam
    if setup.fused and kind != "client":
        raise InputError("--fused sets the client torch.optim.AdamW, which a DeepSpeed \"optimizer\" section "
                         "replaces; put \"torch_adam\": true, \"fused\": true in its params instead")
    if kind != "torch":
        return kind == "client" and setup.fused
    params = deepspeed.config["optimizer"].get("params", {})
    if params.get("fused") and params.get("foreach"):
        raise InputError("the DeepSpeed optimizer's params set both fused and foreach (torch.optim raises "
                         "\"`fused` and `foreach` cannot be `True` together\"); pick one")
    return bool(params.get("fused"))


def construct_optimizer(w: EventWriter, kind: str) -> None:
    """What building the optimizer allocates before the ZeRO optimizer wraps it."""
    if kind == "fused":
        w.alloc(FUSED_ADAM_OVERFLOW_BUF_BYTES, Category.OPTIMIZER_STATE)


def walk_phases(rows: list[tuple], handle, leave, writer: EventWriter, runs: list[tuple[int, int, int]]) -> None:
    """Call `handle(row)` for every row the strategy acts on and `leave(step, phase)` when a (step, phase) ends:
    where a strategy adds what happens at the end of the build, of each backward and of each optimizer step.
    `runs` (`own_runs`) are those rows one by one, runs of the others, which `writer` copies as they are, and runs
    of rows the strategy replaces (DROP), which it skips."""
    previous = None
    for start, stop, kind in runs:
        row = rows[start]
        key = (row[0], row[1])
        if previous is not None and key != previous:
            leave(*previous)
        previous = key
        if kind == OWN:
            handle(row)
        elif kind == KEEP:
            writer.keep_run(rows, start, stop)
    if previous is not None:
        leave(*previous)


def own_runs(rows: list[tuple], own, drop=None) -> list[tuple[int, int, int]]:
    """[start, stop, kind) runs of `rows`: a single row a strategy acts on (`own`, a boolean per row: OWN), or rows
    none of which is, all in one (step, phase), copied (KEEP) or, where `drop` is set, left out (DROP: the client
    optimizer's step, which DeepSpeed's replaces); computed once for all of a strategy's ranks."""
    n = len(rows)
    if n == 0:
        return []
    steps = np.fromiter((row[0] for row in rows), dtype=np.int64, count=n)
    phases = pd.factorize(pd.Series([row[1] for row in rows]))[0]
    drop = np.zeros(n, dtype=bool) if drop is None else np.asarray(drop, dtype=bool)
    own = np.asarray(own, dtype=bool) & ~drop
    cut = np.zeros(n + 1, dtype=bool)
    cut[0] = cut[n] = True
    cut[1:n] |= (steps[1:] != steps[:-1]) | (phases[1:] != phases[:-1]) | (drop[1:] != drop[:-1])
    cut[:n] |= own
    cut[1:] |= own
    kind = np.where(own, OWN, np.where(drop, DROP, KEEP))
    edges = np.flatnonzero(cut).tolist()
    return [(start, stop, int(kind[start])) for start, stop in zip(edges[:-1], edges[1:])]


@per_timeline
def rows_of(timeline: pd.DataFrame) -> list[tuple]:
    """The timeline as plain tuples (in TIMELINE_COLUMNS order), read once for all ranks and layouts (callers
    must not change the list)."""
    return list(zip(*(timeline[column].tolist() for column in TIMELINE_COLUMNS)))
