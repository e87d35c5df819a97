"""The whole pipeline in one place: model -> trace -> per-rank plan -> timeline -> peaks (DESIGN.md)."""
from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import networkx as nx
import numpy as np
import pandas as pd

from llmsim.allocator import NO_LIMIT, AllocatorConfig, OutOfMemory, PausedReplay, compiled, replay_reserved
from llmsim.errors import InputError
from llmsim.gpus import GpuProfile, on_gpu
from llmsim.graph import layer_graph
from llmsim.offload import host_peak_bytes, split_host
from llmsim.losses import check_loss
from llmsim.peaks import Peak, replay
from llmsim.spec import ModelSpec, TrainSetup, check_fits_positions, resolve_attention
from llmsim.step import StepInfo
from llmsim.strategies import STRATEGIES, Layout, Strategy, check_supported, traced_setup
from llmsim.strategies.events import LazyRanks, per_timeline
from llmsim.pipelining import check_pipeline
from llmsim.quantized import check_quantized
from llmsim.tensor_parallel import check_tensor_parallel
from llmsim.timeline import TRACED_STEPS, expand, repeat_last_step
from llmsim.trace import trace


@dataclass(frozen=True)
class RankPrediction:
    rank: int
    peak: Peak
    peak_reserved_bytes: int  # the caching allocator's segments (on the CPU, no allocator: == allocated)
    device_total_bytes: int  # reserved + CUDA context (on the CPU: == reserved)
    frame: pd.DataFrame | Callable[[], pd.DataFrame] = field(repr=False)  # the timeline, or how to rebuild it
    capacity_bytes: int | None = None  # the GPU's, when one is given
    fits: bool | None = None
    peak_host_bytes: int = 0  # host memory: the most checkpoint inputs offloaded at once (--ckpt-offload)

    @property
    def peak_allocated_bytes(self) -> int:
        return self.peak.allocated_bytes

    @property
    def timeline(self) -> pd.DataFrame:
        """The rank's device timeline (rebuilt on demand where the strategy does not keep one per rank)."""
        return self.frame() if callable(self.frame) else self.frame

    def to_dict(self) -> dict:
        return {"rank": self.rank, "peak_allocated_bytes": self.peak.allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "device_total_bytes": self.device_total_bytes,
                "peak_step": self.peak.step, "peak_phase": self.peak.phase, "peak_layer": self.peak.layer,
                "breakdown_bytes": dict(self.peak.breakdown_bytes), "capacity_bytes": self.capacity_bytes,
                "headroom_bytes": (self.capacity_bytes - self.device_total_bytes
                                   if self.capacity_bytes is not None else None),
                "fits": self.fits, "peak_host_bytes": self.peak_host_bytes}


@dataclass(frozen=True)
class Prediction:
    model: ModelSpec
    setup: TrainSetup
    layout: Layout
    ranks: list[RankPrediction]
    graph_of: Callable[[], nx.DiGraph] = field(repr=False)  # the layer graph, built when first asked for
    gpu: GpuProfile | None = None
    alloc_conf: AllocatorConfig = AllocatorConfig()

    @property
    def peak_allocated_bytes(self) -> int:
        return max(r.peak_allocated_bytes for r in self.ranks)

    @property
    def peak_host_bytes(self) -> int:
        return max(r.peak_host_bytes for r in self.ranks)

    @property
    def graph(self) -> nx.DiGraph:
        """The layer graph (llmsim/graph.py) of the traced process (with pipeline stages, the last stage's)."""
        return self.graph_of()

    def breakdown(self) -> pd.DataFrame:
        """Bytes by category at each rank's peak: one row per rank."""
        return pd.DataFrame([r.peak.breakdown_bytes for r in self.ranks]).fillna(0).astype("int64")

    def to_dict(self) -> dict:
        return {"model": self.model.name, "strategy": self.layout.strategy.value,
                "world_size": self.layout.world_size, "tp": self.layout.tp, "pp": self.layout.pp,
                "schedule": self.layout.schedule.value if self.layout.pp > 1 else None,
                "n_microbatches": self.layout.n_microbatches,
                "pp_split": list(self.layout.pp_split) if self.layout.pp_split else None,
                "micro_batch": self.setup.micro_batch, "seq_len": self.setup.seq_len,
                "precision": self.setup.precision.value, "attention": self.setup.attention.value,
                "grad_ckpt": self.setup.grad_ckpt, "ckpt_every": self.setup.ckpt_every,
                "ckpt_offload": self.setup.ckpt_offload, "device": self.setup.device.value,
                "gpu": self.gpu.name if self.gpu else None,
                "expandable_segments": self.alloc_conf.expandable_segments,
                "peak_allocated_bytes": self.peak_allocated_bytes, "peak_host_bytes": self.peak_host_bytes,
                "ranks": [r.to_dict() for r in self.ranks]}


def checked(model: ModelSpec, setup: TrainSetup, layout: Layout, gpu: GpuProfile | None = None) -> TrainSetup:
    """What `predict` checks before any trace (one line of InputError for what is refused), and the setup it
    traces: on this GPU, transformers' attention resolved, the strategy's tracing flags, the TP degree."""
    if gpu is not None:
        setup = on_gpu(setup, gpu)
    setup = resolve_attention(model, setup)
    check_supported(setup, layout)
    check_quantized(model, setup)
    check_loss(model, setup)
    if layout.deepspeed is not None and layout.deepspeed.stage == 3:
        setup = replace(setup, zero3_hooks=True)
    setup = traced_setup(setup, layout)
    if layout.tp > 1:
        check_tensor_parallel(model.hf_config(), layout.tp)
        setup = replace(setup, tp=layout.tp)
    check_pipeline(model.hf_config(), layout.pp, layout.n_microbatches, layout.schedule, layout.pp_split,
                   setup.precision)
    check_fits_positions(model, setup)
    return setup


def predict(model: ModelSpec, setup: TrainSetup, layout: Layout = Layout(),
            gpu: GpuProfile | None = None, alloc_conf: AllocatorConfig = AllocatorConfig(),
            progress: bool = False, jobs: int = 1) -> Prediction:
    """`progress`: a bar over a pipeline's stages (one trace each: seconds apiece for big models); `jobs`: trace
    the stages not yet cached in that many local processes, and replay ZeRO-1/2's ranks (each its own events)
    on a GPU in up to that many."""
    if jobs < 1:
        raise InputError(f"jobs({jobs}) must be >= 1")
    setup = checked(model, setup, layout, gpu)
    if layout.pp > 1:  # one trace per stage, shared by the stage's TP ranks
        rank_timelines = {}
        for stage, (timeline, graph) in enumerate(_stage_timelines(model, setup, layout, progress, jobs)):
            rank_timelines.update(dict.fromkeys(stage_ranks(layout, stage), timeline))
    else:
        timeline, graph = expanded(model, setup)
        rank_timelines = _plan(timeline, layout, setup)
    ranks = []
    replayed: dict[int, RankPrediction] = {}  # ranks that share one timeline (DDP, ZeRO-0, TP) are replayed once
    lazy = isinstance(rank_timelines, LazyRanks)
    if lazy and _REPLAYED_PLAN[0]() is not rank_timelines:  # another layout's ranks share little: let theirs go
        _REPLAYED.clear()
        _REPLAYED_PLAN[0] = weakref.ref(rank_timelines)
    processes = min(jobs, len(rank_timelines) // _RANKS_PER_PROCESS) if lazy and gpu is not None else 1
    if processes > 1:
        ranks = _lazy_ranks_in_processes(rank_timelines, gpu, alloc_conf, processes)
        return Prediction(model, setup, layout, ranks, graph, gpu, alloc_conf)
    for rank in sorted(rank_timelines):
        if lazy:  # built for this rank alone: predicted, then let go
            ranks.append(_predict_lazy_rank(rank_timelines, rank, gpu, alloc_conf))
            continue
        rank_timeline = rank_timelines[rank]
        if id(rank_timeline) not in replayed:
            replayed[id(rank_timeline)] = _shared_prediction(rank_timeline, gpu, alloc_conf)
        ranks.append(_as_rank(replayed[id(rank_timeline)], rank))
    return Prediction(model, setup, layout, ranks, graph, gpu, alloc_conf)


def predict_stage(model: ModelSpec, setup: TrainSetup, layout: Layout, stage: int, gpu: GpuProfile | None = None,
                  alloc_conf: AllocatorConfig = AllocatorConfig()) -> list[RankPrediction]:
    """The ranks of one pipeline stage (`layout.pp > 1`), as `predict` gives them: one trace, shared by the stage's
    TP ranks in every replica. `size` asks stage by stage, so that a micro-batch one stage cannot fit costs no
    other stage's trace."""
    setup = checked(model, setup, layout, gpu)
    timeline = _stage_timeline(model, setup, layout, stage)[0]
    shared = _shared_prediction(timeline, gpu, alloc_conf)
    return [_as_rank(shared, rank) for rank in stage_ranks(layout, stage)]


def stage_ranks(layout: Layout, stage: int) -> list[int]:
    """The global ranks of pipeline stage `stage`: its TP ranks in every data-parallel replica."""
    per_replica = layout.pp * layout.tp
    return [replica * per_replica + stage * layout.tp + t for replica in range(layout.dp) for t in range(layout.tp)]


def _stage_timeline(model: ModelSpec, setup: TrainSetup, layout: Layout,
                    stage: int) -> tuple[pd.DataFrame, Callable[[], nx.DiGraph]]:
    return _stage_planned(expanded(model, _stage_setup(setup, layout, stage)), layout, setup)


def _stage_timelines(model: ModelSpec, setup: TrainSetup, layout: Layout, progress: bool = False,
                     jobs: int = 1) -> list[tuple[pd.DataFrame, Callable[[], nx.DiGraph]]]:
    """Every stage's `_stage_timeline`; with `jobs` > 1 the stages not cached are traced in that many processes
    (the traces are independent), then cached here as if traced here."""
    from tqdm import tqdm

    from llmsim.sweep import in_processes

    keys = [(model, _stage_setup(setup, layout, stage)) for stage in range(layout.pp)]
    found = {key: _EXPANDED[key] for key in keys if key in _EXPANDED}
    missing = [key for key in keys if key not in found]
    if jobs > 1 and len(missing) > 1:
        # the bar is in_processes' (a stage a tick, as its trace comes back), left on screen like sweep's
        for key, result in zip(missing, in_processes(_expand_key, missing, min(jobs, len(missing)), progress,
                                                     "stage")):
            found[key] = _remember(key, *result)
        progress = False
    stages = []
    with tqdm(total=layout.pp, disable=not progress, unit="stage", leave=False) as bar:  # cleared at the end
        for key in keys:
            stages.append(_stage_planned(found[key] if key in found else expanded(*key), layout, setup))
            bar.update()
    return stages


def _stage_setup(setup: TrainSetup, layout: Layout, stage: int) -> TrainSetup:
    return replace(setup, pp=layout.pp, pp_stage=stage, schedule=layout.schedule.value,
                   n_microbatches=layout.n_microbatches, pp_split=layout.pp_split)


def _stage_planned(traced: tuple[pd.DataFrame, Callable[[], nx.DiGraph]], layout: Layout, setup: TrainSetup):
    timeline, graph = traced
    if layout.strategy is not Strategy.SINGLE:  # the stage's DDP buffers, the same in every replica
        timeline = _plan(timeline, layout, setup)[0]
    return timeline, graph


@per_timeline(maxsize=32)
def _plan(timeline: pd.DataFrame, layout: Layout, setup: TrainSetup):
    """The strategy's per-rank timelines, kept for the next prediction of the same layout on the same traced
    timeline (another GPU or allocator setting of a sweep, `size` trying GPUs): a ZeRO-3 plan walks every event
    of the step. The last few are kept (as many as a 32-stage pipeline's stages, each with its DDP buffers); a
    ZeRO-1/2 plan keeps one template walk (about 9 MiB at 70B)."""
    return STRATEGIES[layout.strategy](timeline, layout, setup)


def _as_rank(prediction: RankPrediction, rank: int) -> RankPrediction:
    """`replace(prediction, rank=rank)` at a fraction of its cost: 1,024 ranks share one DDP prediction."""
    clone = object.__new__(RankPrediction)
    clone.__dict__.update(prediction.__dict__)
    object.__setattr__(clone, "rank", rank)
    return clone


def _predict_rank(rank: int, timeline: pd.DataFrame, gpu: GpuProfile | None,
                  alloc_conf: AllocatorConfig, shared_ranks: bool = False) -> RankPrediction:
    device, host = split_host(timeline)  # offloaded activations are host memory, not the GPU's
    return replace(_on_device(rank, replay(device), device, gpu, alloc_conf, shared_ranks),
                   peak_host_bytes=host_peak_bytes(host))


@per_timeline(maxsize=32)
def _shared_prediction(timeline: pd.DataFrame, gpu: GpuProfile | None, alloc_conf: AllocatorConfig) -> RankPrediction:
    """The prediction of a timeline that ranks share (DDP's, TP's, a pipeline stage's), as rank 0 (`_as_rank`
    gives the others), kept for the next prediction of it on the same GPU and allocator setting (a pipeline's
    stages, `size`'s screens). Its frame keeps the timeline alive: as many as `_plan` keeps."""
    return _predict_rank(0, timeline, gpu, alloc_conf)


def _predict_lazy_rank(rank_timelines: LazyRanks, rank: int, gpu: GpuProfile | None,
                       alloc_conf: AllocatorConfig) -> RankPrediction:
    """A rank of a strategy whose ranks all differ: from its events where the strategy gives them without a
    timeline (`LazyRanks.events`), else from its timeline, built for this rank alone and let go."""
    frame = functools.partial(_device_timeline, rank_timelines, rank)
    if rank_timelines.events is None:
        return replace(_predict_rank(rank, rank_timelines[rank], gpu, alloc_conf, shared_ranks=True), frame=frame)
    events = rank_timelines.events(rank)
    return replace(_on_device(rank, events.peak, None, gpu, alloc_conf, True, events.arrays), frame=frame,
                   peak_host_bytes=events.peak_host_bytes)


def _lazy_ranks_in_processes(rank_timelines: LazyRanks, gpu: GpuProfile, alloc_conf: AllocatorConfig,
                             processes: int) -> list[RankPrediction]:
    """`_predict_lazy_rank` for every rank, in forked processes that inherit the strategy's plan: one block of
    neighbouring ranks each (neighbours share the most chunks of replay, `_replay_shared`). The frames stay
    here, rebuilt on demand as in one process."""
    from llmsim.sweep import in_processes

    blocks = [block.tolist() for block in np.array_split(np.array(sorted(rank_timelines)), 4 * processes)]
    _FORKED[:] = [rank_timelines, gpu, alloc_conf]
    try:
        done = [prediction for block in in_processes(_lazy_block, blocks, processes, False, "block", forked=True)
                for prediction in block]
    finally:
        _FORKED.clear()
    return [replace(prediction, frame=functools.partial(_device_timeline, rank_timelines, prediction.rank))
            for prediction in done]


def _lazy_block(ranks: list[int]) -> list[RankPrediction]:
    rank_timelines, gpu, alloc_conf = _FORKED
    return [replace(_predict_lazy_rank(rank_timelines, rank, gpu, alloc_conf), frame=None) for rank in ranks]


_RANKS_PER_PROCESS = 64  # fewer ZeRO-1/2 ranks a process: not worth a fork (~0.5-5 ms a rank)
_FORKED: list = []  # what `_lazy_block` reads in a forked process: the plan, the GPU, the allocator setting


def _device_timeline(rank_timelines: LazyRanks, rank: int) -> pd.DataFrame:
    return split_host(rank_timelines[rank])[0]


def expanded(model: ModelSpec, setup: TrainSetup) -> tuple[pd.DataFrame, Callable[[], nx.DiGraph]]:
    """The full-depth timeline of one traced process and its layer graph (built when first asked for), kept for
    the next prediction with the same inputs (the latest `_MAX_EXPANDED`; the strategies and the replay read
    them, never change them). With pipeline stages, the graph is the last stage's."""
    key = (model, setup)
    if key in _EXPANDED:
        _EXPANDED[key] = _EXPANDED.pop(key)  # the most recently used is the last to go
        return _EXPANDED[key]
    return _remember(key, *_expand_key(key))


def _expand_key(key: tuple[ModelSpec, TrainSetup]) -> tuple[pd.DataFrame, StepInfo]:
    """Trace and expand to full depth (what `expanded` keeps). Two steps are traced and the steady second one
    repeated (`repeat_last_step`)."""
    model, setup = key
    traced = trace(model, replace(setup, steps=min(setup.steps, TRACED_STEPS)))
    timeline = repeat_last_step(expand(traced), setup.steps)
    if timeline is None:  # the last traced step is not steady: trace every step
        traced = trace(model, setup)
        timeline = expand(traced)
    return timeline, traced.info


def _remember(key: tuple[ModelSpec, TrainSetup], timeline: pd.DataFrame,
              info: StepInfo) -> tuple[pd.DataFrame, Callable[[], nx.DiGraph]]:
    if len(_EXPANDED) >= _MAX_EXPANDED:
        _EXPANDED.pop(next(iter(_EXPANDED)))
    _EXPANDED[key] = (timeline, functools.cache(functools.partial(layer_graph, timeline, info)))
    return _EXPANDED[key]


_MAX_EXPANDED = 16
_EXPANDED: dict[tuple[ModelSpec, TrainSetup], tuple[pd.DataFrame, Callable[[], nx.DiGraph]]] = {}


def _on_device(rank: int, peak: Peak, timeline: pd.DataFrame | None, gpu: GpuProfile | None,
               alloc_conf: AllocatorConfig, shared_ranks: bool = False,
               arrays: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None) -> RankPrediction:
    """Reserved and device total: the caching allocator model on a GPU; the live bytes themselves on the CPU.
    The allocator model reads the timeline's (serials, delta bytes), or `arrays()` where there is no timeline."""
    if gpu is None:
        return RankPrediction(rank, peak, peak.allocated_bytes, peak.allocated_bytes, timeline)
    usable = gpu.capacity_bytes - gpu.cuda_context_bytes
    serials, deltas = arrays() if arrays is not None else (timeline["serial"].to_numpy(),
                                                           timeline["delta_bytes"].to_numpy())
    extra = (gpu.cublas_workspace_bytes,)
    # Unbounded first: when its reserved peak fits, the bounded run (whose only difference is releasing the
    # cache when a segment would not fit) is the same run; when even the live bytes cannot fit, it is an OOM.
    reserved = _replay_reserved(serials, deltas, NO_LIMIT, alloc_conf, extra, shared_ranks)
    fits = reserved <= usable
    if not fits and peak.allocated_bytes + sum(extra) <= usable:
        try:
            reserved = _replay_reserved(serials, deltas, usable, alloc_conf, extra)
            fits = True
        except OutOfMemory:
            pass
    total = reserved + gpu.cuda_context_bytes
    return RankPrediction(rank, peak, reserved, total, timeline, gpu.capacity_bytes,
                          fits and total <= gpu.capacity_bytes)


def _replay_reserved(serials: np.ndarray, deltas: np.ndarray, capacity_bytes: int, config: AllocatorConfig,
                     extra: tuple[int, ...], shared_ranks: bool = False) -> int:
    """The allocator model's reserved peak, kept by the events' content: ranks and layouts that differ only in
    what the allocator does not see (DDP at any world size, ZeRO ranks alike, another GPU of the same
    kernels) replay once. With `shared_ranks` (the ranks of one ZeRO-1/2 prediction, whose events are those of
    the ranks before them but for the few that depend on the rank's partition), the replay reuses the earlier
    ranks' paused replays (`_replay_shared`)."""
    if shared_ranks:
        return _replay_shared(serials, deltas, capacity_bytes, config, extra)
    key = (hashlib.blake2b(serials.tobytes() + b"|" + deltas.tobytes(), digest_size=16).digest(),
           capacity_bytes, config, extra)
    if key not in _RESERVED:
        if len(_RESERVED) >= 256:
            _RESERVED.pop(next(iter(_RESERVED)))
        _RESERVED[key] = replay_reserved(serials, deltas, capacity_bytes, config, extra).peak_reserved_bytes
    return _RESERVED[key]


def _replay_shared(serials: np.ndarray, deltas: np.ndarray, capacity_bytes: int, config: AllocatorConfig,
                   extra: tuple[int, ...]) -> int:
    """The reserved peak of one of a ZeRO-1/2 prediction's ranks, replayed in chunks of events against the ranks
    replayed before it (`_Replayed`, the latest `_MAX_REPLAYED`). It starts from the paused state of the earlier
    rank it shares the most first chunks with. After each chunk it replays itself, it looks for an earlier rank
    that was in the same allocator state there (the same free blocks and live storages, byte for byte:
    `same_state`) and has the same next chunks of events: those chunks would do there what they did in that
    rank, so it takes that rank's peaks for them and goes on from that rank's paused state after them. Exact by
    construction; `tests/test_distributed.py` checks every rank against its own whole replay."""
    setting = (capacity_bytes, config, extra)
    if setting not in _REPLAYED:  # one setting at a time (and one layout: `predict`): paused states hold allocators
        _REPLAYED.clear()
        _REPLAYED[setting] = _Earlier()
    earlier = _REPLAYED[setting]
    every = CHECKPOINT_EVERY if compiled() else max(256, len(serials) // 32)  # Python states copy slowly
    this = _Replayed.of(_int64(serials), _int64(deltas), every)
    chunks = len(this.keys)
    k, allocator, rejoin = 0, None, False
    start, shared = 0, None
    for other in earlier.ranks:  # the earlier rank sharing the most first chunks (by hash, then confirmed)
        if other.every == every and _key_run(this, other, 0) > start:
            run = _first_same(this, other)
            if run > start:
                start, shared = run, other
    if shared is not None and start == chunks and len(shared.serials) == len(this.serials):
        return shared.peak_reserved_bytes  # the same events
    start = min(start, len(shared.states) - 1) if shared is not None else 0
    if start > 0:
        this.take(shared, 0, start)
        k, allocator = start, shared.states[start].allocator.clone()
    else:
        allocator = replay_reserved(this.serials[:0], this.deltas[:0], capacity_bytes, config, extra)
    while k < chunks:
        if rejoin:
            rejoin = False
            other, run = _rejoin(this, earlier.index.get(_Earlier.key(this, k, allocator), ()), k, allocator)
            if run:
                this.take(other, k, k + run)
                k += run
                if k < chunks:
                    allocator = other.states[k].allocator.clone()
            continue
        this.states.append(PausedReplay(allocator.clone()))
        this.window_peaks.append(allocator.replay(this.serials, this.deltas, k * every, (k + 1) * every))
        this.replayed += 1
        k, rejoin = k + 1, True
    this.peak_reserved_bytes = max(this.window_peaks, default=allocator.peak_reserved_bytes)  # no events: the extras
    earlier.add(this)
    return this.peak_reserved_bytes


class _Earlier:
    """The ranks replayed before (the latest `_MAX_REPLAYED`), and an index of their paused states by chunk,
    chunk hash and the bytes reserved and allocated there: where a rank may rejoin one."""

    def __init__(self) -> None:
        self.ranks: list[_Replayed] = []
        self.index: dict[tuple, list[_Replayed]] = {}

    @staticmethod
    def key(replayed: "_Replayed", k: int, allocator) -> tuple:
        return replayed.every, k, int(replayed.keys[k]), allocator.reserved_bytes, allocator.allocated_bytes

    def add(self, replayed: "_Replayed") -> None:
        if len(self.ranks) >= _MAX_REPLAYED:
            oldest = self.ranks.pop(0)
            for k, state in enumerate(oldest.states):
                self.index[self.key(oldest, k, state.allocator)].remove(oldest)
        self.ranks.append(replayed)
        for k, state in enumerate(replayed.states):
            self.index.setdefault(self.key(replayed, k, state.allocator), []).append(replayed)


@dataclass(eq=False)
class _Replayed:
    """A rank's events, a hash of each chunk of `every` events (`keys`; equal keys are confirmed event by event
    before use), the allocator's paused state before each chunk (shared with the rank it was taken from) and the
    most bytes reserved within each chunk."""

    serials: np.ndarray
    deltas: np.ndarray
    every: int
    keys: np.ndarray
    states: list[PausedReplay] = field(default_factory=list)
    window_peaks: list[int] = field(default_factory=list)
    peak_reserved_bytes: int = 0
    replayed: int = 0  # chunks this rank replayed itself

    @classmethod
    def of(cls, serials: np.ndarray, deltas: np.ndarray, every: int) -> "_Replayed":
        with np.errstate(over="ignore"):
            mixed = (serials.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                     + deltas.view(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F))
            mixed *= np.arange(1, 2 * len(mixed), 2, dtype=np.uint64)  # where in the chunk counts too
        keys = np.add.reduceat(mixed, np.arange(0, len(mixed), every)) if len(mixed) else mixed
        return cls(serials, deltas, every, keys)

    def take(self, other: "_Replayed", first: int, stop: int) -> None:
        """Chunks `first:stop` as `other` replayed them (their events are the same, from the same state)."""
        self.states.extend(other.states[first:stop])
        self.window_peaks.extend(other.window_peaks[first:stop])

    def same_events(self, other: "_Replayed", first: int, stop: int) -> bool:
        lo, hi = first * self.every, stop * self.every
        return (np.array_equal(self.serials[lo:hi], other.serials[lo:hi])
                and np.array_equal(self.deltas[lo:hi], other.deltas[lo:hi]))


def _key_run(this: _Replayed, other: _Replayed, k: int) -> int:
    """How many chunks from `k` on have the same hash in `this` and `other`."""
    n = min(len(this.keys), len(other.keys))
    differ = np.flatnonzero(this.keys[k:n] != other.keys[k:n])
    return int(differ[0]) if len(differ) else max(n - k, 0)


def _first_same(this: _Replayed, other: _Replayed) -> int:
    """How many first chunks `this` and `other` share, event for event."""
    run = _key_run(this, other, 0)
    while run and not this.same_events(other, 0, run):  # a hash collision: fall back a chunk at a time
        run -= 1
    return run


def _rejoin(this: _Replayed, candidates: list[_Replayed], k: int, allocator) -> tuple[_Replayed | None, int]:
    """The earlier rank whose chunks from `k` on `this` may take, and how many: one that was in this allocator
    state before chunk k (by fingerprint, then compared), with the most next chunks of the same events; (None, 0)
    when there is none. Ranks that took chunk k's paused state from one another are compared once."""
    best, most, fingerprint, compared = None, 0, None, {}
    for other in candidates:
        state = other.states[k]
        if id(state) not in compared:
            if fingerprint is None:
                fingerprint = allocator.fingerprint()
            compared[id(state)] = (state.fingerprint() == fingerprint
                                   and allocator.same_state(state.allocator))
        if compared[id(state)]:
            run = _same_run(this, other, k)
            if run > most:
                best, most = other, run
    return best, most


def _same_run(this: _Replayed, other: _Replayed, k: int) -> int:
    """How many chunks from `k` on `this` may take from `other`, which was in the same allocator state before
    chunk k: those holding the same events (`other` must have a paused state after them, unless they end both
    streams)."""
    run = _key_run(this, other, k)
    if k + run != len(this.keys) or len(this.keys) != len(other.keys):
        run = min(run, len(other.states) - 1 - k)
    return run if run > 0 and this.same_events(other, k, k + run) else 0


def _int64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, np.int64)


CHECKPOINT_EVERY = 2048  # events in a chunk (compiled allocator: a paused state copies in microseconds)
_MAX_REPLAYED = 32  # earlier ranks kept, with their paused states
_REPLAYED: dict[tuple, _Earlier] = {}
_REPLAYED_PLAN: list[weakref.ref] = [lambda: None]  # the layout (its LazyRanks) whose ranks _REPLAYED holds
_RESERVED: dict[tuple, int] = {}
