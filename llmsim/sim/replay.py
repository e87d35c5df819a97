"""Each rank's timeline replayed into its peak and, on a GPU, through the caching-allocator model into reserved
bytes and the device total (`replay_ranks`). Ranks that share a timeline (DDP, ZeRO-0, TP, a pipeline stage's) are
replayed once; ZeRO-1/2's ranks, which all differ, are replayed as one tree of allocator states (`_Chunks`), in
forked processes when there are many; replays are kept by their events' content for the next prediction."""
from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import replace
from typing import Callable

import numpy as np
import pandas as pd

from llmsim.enums import Category
from llmsim.inputs.gpus import GpuProfile
from llmsim.model.tracker import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE
from llmsim.model.offload import host_peak_bytes, host_rows, split_host
from llmsim.sim.allocator import (MIN_BLOCK_BYTES, NO_LIMIT, AllocatorConfig, OutOfMemory, PausedReplay, compiled,
                                  replay_reserved)
from llmsim.sim.peaks import Peak, replay
from llmsim.sim.prediction import RankPrediction
from llmsim.sim.processes import in_processes
from llmsim.sim.strategies.events import LazyRanks, Spliced, per_timeline


def replay_ranks(rank_timelines: dict[int, pd.DataFrame] | LazyRanks, gpu: GpuProfile | None,
                 alloc_conf: AllocatorConfig, jobs: int = 1) -> list[RankPrediction]:
    """Every rank's prediction, by rank, from the strategy's per-rank timelines."""
    if isinstance(rank_timelines, LazyRanks):
        return _lazy_ranks(rank_timelines, gpu, alloc_conf, jobs)
    replayed: dict[int, RankPrediction] = {}  # ranks that share one timeline (DDP, ZeRO-0, TP) are replayed once
    ranks = []
    for rank in sorted(rank_timelines):
        timeline = rank_timelines[rank]
        if id(timeline) not in replayed:
            replayed[id(timeline)] = _shared_prediction(timeline, gpu, alloc_conf)
        ranks.append(as_rank(replayed[id(timeline)], rank))
    return ranks


def replay_ahead(timeline: pd.DataFrame, gpu: GpuProfile | None, alloc_conf: AllocatorConfig) -> None:
    """Replay now a timeline that ranks will share, for `replay_ranks` to find (`_shared_prediction` keeps it): a
    pipeline replays each stage as it is planned, while other stages are still traced."""
    _shared_prediction(timeline, gpu, alloc_conf)


def predict_timeline(timeline: pd.DataFrame, gpu: GpuProfile | None, alloc_conf: AllocatorConfig) -> RankPrediction:
    """One timeline's prediction as rank 0, not kept (`size`'s guesses: `timeline.on_the_line`)."""
    return _predict_rank(0, timeline, gpu, alloc_conf)


def as_rank(prediction: RankPrediction, rank: int) -> RankPrediction:
    """`replace(prediction, rank=rank)` at a fraction of its cost: 1,024 ranks share one DDP prediction."""
    clone = object.__new__(RankPrediction)
    clone.__dict__.update(prediction.__dict__)
    object.__setattr__(clone, "rank", rank)
    return clone


def _predict_rank(rank: int, timeline: pd.DataFrame, gpu: GpuProfile | None,
                  alloc_conf: AllocatorConfig) -> RankPrediction:
    if gpu is None:
        device, host = split_host(timeline)  # offloaded activations are host memory, not the GPU's
        prediction = on_device(rank, replay(device), device, gpu, alloc_conf)
        return replace(prediction, peak_host_bytes=host_peak_bytes(host))
    on_host = host_rows(timeline)  # the device's events read in place; its frame made when it is asked for
    serials, deltas, peak = on_gpu(timeline, gpu, ~on_host)
    prediction = on_device(rank, peak, None, gpu, alloc_conf, events=(serials, deltas))
    return replace(prediction, frame=functools.partial(_device_frame, timeline),
                   peak_host_bytes=host_peak_bytes(timeline[on_host]))  # a few rows taken


def _device_frame(timeline: pd.DataFrame) -> pd.DataFrame:
    return split_host(timeline)[0]


def on_gpu(timeline: pd.DataFrame, gpu: GpuProfile,
           device_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, Peak]:
    """A device timeline's events as they run on `gpu`, and their peak as `torch.cuda.max_memory_allocated()`
    counts it (`device_rows`: which of `timeline`'s rows are the device's, the others left out; the peak's index is
    then among those rows, as in split_host's device frame). Each thread's first cuBLAS and cuBLASLt call (the
    tracker's WORKSPACE_MARKERS rows) allocates that workspace there, kept to the end of the process, each under a
    serial of its own past the timeline's; and the caching allocator counts every block at its rounded size
    (`round_size`: 512-byte multiples, 512 B at least; measured on an H200: Llama-2-7B's 291 four-byte Adam `step`
    counters were 149 KB of allocated bytes). The events go to the allocator model as they are (it rounds them
    itself)."""
    rows_of = np.arange(len(timeline)) if device_rows is None else np.flatnonzero(device_rows)
    serials = timeline["serial"].to_numpy()
    deltas = timeline["delta_bytes"].to_numpy(dtype=np.int64)
    if device_rows is not None:
        serials, deltas = serials[rows_of], deltas[rows_of]
    cublas, cublaslt = serials == CUBLAS_WORKSPACE, serials == CUBLASLT_WORKSPACE
    rows = np.flatnonzero(cublas | cublaslt)
    if len(rows):
        deltas, serials = deltas.copy(), serials.copy()
        deltas[cublas] = gpu.cublas_workspace_bytes
        deltas[cublaslt] = gpu.cublaslt_workspace_bytes
        serials[rows] = np.arange(len(rows)) + max(int(serials.max()), -1) + 1
    if not len(deltas):
        return serials, deltas, replay(timeline.iloc[rows_of])
    blocks = _rounded(serials, deltas)
    live = np.cumsum(blocks)
    index = int(np.argmax(live))
    categories = timeline["category"].array[rows_of[: index + 1]]  # grouped as they are stored (not as objects)
    upto = pd.Series(blocks[: index + 1]).groupby(categories, sort=False).sum()
    breakdown = {c.value: int(upto.get(c.value, 0)) for c in Category if upto.get(c.value, 0)}
    row = timeline.iloc[rows_of[index]]
    return serials, deltas, Peak(int(live[index]), index, int(row["step"]), str(row["phase"]), str(row["module"]),
                                 breakdown)


def _rounded(serials: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """Each event's change of its storage's block size: the caching allocator's 512-byte rounding of the storage's
    size before and after it (a resize_ moves a storage between sizes; a free leaves nothing)."""
    after = pd.Series(deltas).groupby(serials, sort=False).cumsum().to_numpy()
    before = after - deltas
    return _block(after) - _block(before)


def _block(size: np.ndarray) -> np.ndarray:
    """`allocator.round_size` over an array, 0 for no storage."""
    return np.where(size > 0, np.maximum(-(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES, MIN_BLOCK_BYTES), 0)


def _workspaces(serials: np.ndarray, gpu: GpuProfile) -> tuple[int, ...]:
    """The workspaces a spliced rank's events allocate (its template's WORKSPACE_MARKERS rows), as the allocator
    model's `extra` allocations, made first and kept: the allocated peak counts them all (at most one cuBLAS
    workspace over, where the peak comes before the backward's first matmul)."""
    return ((gpu.cublas_workspace_bytes,) * int(np.count_nonzero(serials == CUBLAS_WORKSPACE))
            + (gpu.cublaslt_workspace_bytes,) * int(np.count_nonzero(serials == CUBLASLT_WORKSPACE)))


@per_timeline(maxsize=32)
def _shared_prediction(timeline: pd.DataFrame, gpu: GpuProfile | None, alloc_conf: AllocatorConfig) -> RankPrediction:
    """The prediction of a timeline that ranks share (DDP's, TP's, a pipeline stage's), as rank 0 (`as_rank`
    gives the others), kept for the next prediction of it on the same GPU and allocator setting (a pipeline's
    stages, `size`'s screens). Its frame keeps the timeline alive: as many as `traced.plan` keeps."""
    return _predict_rank(0, timeline, gpu, alloc_conf)


def _lazy_ranks(rank_timelines: LazyRanks, gpu: GpuProfile | None, alloc_conf: AllocatorConfig,
                jobs: int) -> list[RankPrediction]:
    """Every rank of a strategy whose ranks all differ (`_predict_lazy_rank`), in up to `jobs` processes on a GPU;
    kept for the next prediction of the same layout on the same GPU and allocator setting (the latest layout's)."""
    if _REPLAYED_PLAN[0]() is not rank_timelines:  # another layout's ranks share little: let theirs go
        _REPLAYED.clear()
        _LAZY_PREDICTED.clear()
        _REPLAYED_PLAN[0] = weakref.ref(rank_timelines)
    key = (gpu, alloc_conf)
    if key not in _LAZY_PREDICTED:
        processes = min(jobs, len(rank_timelines) // _RANKS_PER_PROCESS) if gpu is not None else 1
        if processes > 1:
            ranks = _lazy_ranks_in_processes(rank_timelines, gpu, alloc_conf, processes)
        else:  # each built for this rank alone: predicted, then let go
            ranks = [_predict_lazy_rank(rank_timelines, rank, gpu, alloc_conf) for rank in sorted(rank_timelines)]
        if len(_LAZY_PREDICTED) >= 8:
            _LAZY_PREDICTED.pop(next(iter(_LAZY_PREDICTED)))
        _LAZY_PREDICTED[key] = ranks
    return list(_LAZY_PREDICTED[key])


def _predict_lazy_rank(rank_timelines: LazyRanks, rank: int, gpu: GpuProfile | None,
                       alloc_conf: AllocatorConfig) -> RankPrediction:
    """A rank of a strategy whose ranks all differ: from its events where the strategy gives them without a
    timeline (`LazyRanks.events`), else from its timeline, built for this rank alone and let go."""
    frame = functools.partial(_device_timeline, rank_timelines, rank)
    if rank_timelines.events is None:
        return replace(_predict_rank(rank, rank_timelines[rank], gpu, alloc_conf), frame=frame)
    events = rank_timelines.events(rank)
    return replace(on_device(rank, events.peak, None, gpu, alloc_conf, events.spliced), frame=frame,
                   peak_host_bytes=events.peak_host_bytes)


def _lazy_ranks_in_processes(rank_timelines: LazyRanks, gpu: GpuProfile, alloc_conf: AllocatorConfig,
                             processes: int) -> list[RankPrediction]:
    """`_predict_lazy_rank` for every rank, in forked processes that inherit the strategy's plan: one block of
    neighbouring ranks each (neighbours share the most chunks of replay, `_replay_spliced`). The frames stay
    here, rebuilt on demand as in one process. The forks inherit `predict`'s paused collector (a fork's collection
    would also copy every page of the objects it walks)."""
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
    return _device_frame(rank_timelines[rank])


def on_device(rank: int, peak: Peak, timeline: pd.DataFrame | None, gpu: GpuProfile | None,
              alloc_conf: AllocatorConfig, spliced: Callable[[], Spliced] | None = None,
              events: tuple[np.ndarray, np.ndarray] | None = None) -> RankPrediction:
    """Reserved, device total, what the job needs and the verdict: the caching allocator model on a GPU; the live
    bytes themselves on the CPU. The allocator model reads `events` (the timeline's serials and delta bytes as they
    run on the GPU, `on_gpu`, `peak` theirs), or `spliced()` where there is no timeline (a ZeRO-1/2 rank:
    `_replay_spliced`; its workspaces are allocated first, and added to `peak`, the peak of its tensors)."""
    if gpu is None:
        return RankPrediction(rank, peak, peak.allocated_bytes, peak.allocated_bytes, timeline)
    usable = gpu.capacity_bytes - gpu.cuda_context_bytes
    spliced_events = spliced() if spliced is not None else None
    if spliced_events is not None:
        extra = _workspaces(spliced_events.serials, gpu)
        peak = replace(peak, allocated_bytes=peak.allocated_bytes + sum(extra),
                       breakdown_bytes={**peak.breakdown_bytes, Category.WORKSPACE.value: sum(extra)})
    else:
        extra = ()
        if events is None:  # the timeline's own events: its peak on the GPU counts the workspaces
            serials, deltas, peak = on_gpu(timeline, gpu)
            events = (serials, deltas)

    @functools.cache
    def arrays():  # built once, when a replay needs them (a ZeRO-1/2 rank's splice copies the template's)
        return spliced_events.arrays() if spliced_events is not None else events
    # Unbounded first: when its reserved peak fits, the bounded run (whose only difference is releasing the
    # cache when a segment would not fit) is the same run; when even the live bytes cannot fit, it is an OOM.
    if spliced_events is not None:
        reserved = _replay_spliced(spliced_events, NO_LIMIT, alloc_conf, extra)
    else:
        reserved = _replay_reserved(*arrays(), NO_LIMIT, alloc_conf, extra)
    needed = reserved  # the allocator never has to release its cache: what it reserves is what the job needs
    runs = reserved <= usable
    if not runs and peak.allocated_bytes <= usable:  # the live bytes, workspaces in them
        try:
            reserved = _replay_reserved(*arrays(), usable, alloc_conf, extra)
            runs = True
        except OutOfMemory:
            pass
    room = usable - gpu.margin_bytes
    if runs and needed > room:  # near the card: the least it runs on (an OOM keeps its unbounded reserved peak)
        needed = _least_capacity(*arrays(), peak.allocated_bytes, min(needed, usable), alloc_conf, extra)
    total = reserved + gpu.cuda_context_bytes
    needed_total = max(needed, peak.allocated_bytes) + gpu.cuda_context_bytes
    verdict = "oom" if not runs or total > gpu.capacity_bytes else \
        "tight" if needed_total > gpu.capacity_bytes - gpu.margin_bytes else "fits"
    return RankPrediction(rank, peak, reserved, total, timeline, gpu.capacity_bytes, verdict == "fits",
                          needed_bytes=needed_total, margin_bytes=gpu.margin_bytes, verdict=verdict)


def _least_capacity(serials: np.ndarray, deltas: np.ndarray, lo: int, hi: int, config: AllocatorConfig,
                    extra: tuple[int, ...]) -> int:
    """The smallest capacity, to 2 MiB, on which the allocator model runs the events without OOM, between `lo`
    (the live bytes: nothing runs below) and `hi` (a capacity it runs on), by bisection over bounded replays (at
    capacity the model frees its cached blocks and retries, as PyTorch's does). The verdict reads it only where
    the unbounded reserved peak comes within the margin of the card; whether it fits there is the bounded replay
    at the card itself, never this search."""
    key = (_digest(serials, deltas), lo, hi, config, extra)
    if key not in _LEAST:
        low, high = lo - 1, hi  # replays at `high` run; at `low` they cannot
        while high - low > _LEAST_STEP:
            middle = (low + high) // 2
            try:
                replay_reserved(serials, deltas, middle, config, extra)
                high = middle
            except OutOfMemory:
                low = middle
        if len(_LEAST) >= 256:
            _LEAST.pop(next(iter(_LEAST)))
        _LEAST[key] = high
    return _LEAST[key]


def _replay_reserved(serials: np.ndarray, deltas: np.ndarray, capacity_bytes: int, config: AllocatorConfig,
                     extra: tuple[int, ...]) -> int:
    """The allocator model's reserved peak, kept by the events' content: ranks and layouts that differ only in
    what the allocator does not see (DDP at any world size, ZeRO ranks alike, another GPU of the same
    kernels) replay once."""
    key = (_digest(serials, deltas), capacity_bytes, config, extra)
    if key not in _RESERVED:
        if len(_RESERVED) >= 256:
            _RESERVED.pop(next(iter(_RESERVED)))
        _RESERVED[key] = replay_reserved(serials, deltas, capacity_bytes, config, extra).peak_reserved_bytes
    return _RESERVED[key]


def _digest(serials: np.ndarray, deltas: np.ndarray) -> bytes:
    """The events' content, as the replay caches key it."""
    return hashlib.blake2b(serials.tobytes() + b"|" + deltas.tobytes(), digest_size=16).digest()


def _replay_spliced(events: Spliced, capacity_bytes: int, config: AllocatorConfig, extra: tuple[int, ...]) -> int:
    """The reserved peak of one of a ZeRO-1/2 prediction's ranks: its events are every rank's (the template's)
    with its own spliced in (`Spliced`), replayed chunk by chunk of the template's events in the tree of the
    ranks replayed before (`_Chunks`, one per template and allocator setting)."""
    setting = (capacity_bytes, config, extra)
    chunks = _REPLAYED.get(setting)
    if chunks is None or chunks.template is not events.serials:  # one template and setting at a time: the tree
        _REPLAYED.clear()                                             # holds paused allocators
        chunks = _REPLAYED[setting] = _Chunks(events.serials, events.deltas, capacity_bytes, config, extra)
    return chunks.peak(events)


class _Node:
    """An allocator state between two chunks: where the ranks that reached it go on to, by their next chunk's own
    events (`children`: key -> (node after it, the most bytes reserved within it)), and the state itself, paused
    (None once let go: it is replayed again from an earlier node when asked for)."""

    __slots__ = ("depth", "state", "children")

    def __init__(self, depth: int, state: PausedReplay | None) -> None:
        self.depth, self.state, self.children = depth, state, {}


class _Chunks:
    """The ranks of one ZeRO-1/2 prediction, replayed in chunks of `every` template events (each with the rank's
    own events spliced among them) as a tree of allocator states. A rank walks it from the root, one chunk at a
    time, keyed by the chunk's own events (positions, keys, bytes; most chunks have none): a chunk another rank
    replayed from the same node is the same events from the same state, so its peak is taken, not replayed.
    A chunk replayed anew ends in a state; where an earlier rank's walk reached the same state after as many
    chunks (`same_state`: the same free blocks and live storages, byte for byte), the walks join there and share
    what follows. Exact by construction: every rank's peak is its own whole replay's (tests/test_allocator.py,
    tests/test_distributed.py). The latest `_MAX_STATES` paused states are kept."""

    def __init__(self, serials: np.ndarray, deltas: np.ndarray, capacity_bytes: int, config: AllocatorConfig,
                 extra: tuple[int, ...]) -> None:
        self.template = serials  # the template's own array: which template the tree is for
        self.serials, self.deltas = _int64(serials), _int64(deltas)
        n = len(self.serials)
        self.every = CHECKPOINT_EVERY if compiled() else max(256, n // 32)  # Python states copy slowly
        self.count = max(1, -(-n // self.every))
        start = replay_reserved(self.serials[:0], self.deltas[:0], capacity_bytes, config, extra)
        self.root, self.start_peak = _Node(0, PausedReplay(start)), start.peak_reserved_bytes
        self.kept: dict[_Node, None] = {}  # nodes holding a state (the root aside), least recently used first
        self.index: dict[tuple, list[_Node]] = {}  # (depth, fingerprint) -> the nodes holding such a state
        self.replayed: list[int] = []  # chunks each walk replayed itself

    def peak(self, events: Spliced) -> int:
        keys = self._keys(events)
        node, peak, path, replayed = self.root, self.start_peak, [], 0
        for k in range(self.count):
            path.append(node)
            if node.state is not None and node is not self.root:
                self.kept[node] = self.kept.pop(node)  # used: the last to go
            key = keys.get(k, ())
            edge = node.children.get(key)
            if edge is None:
                edge = node.children[key] = self._replay(path, k, events)
                replayed += 1
            node, window = edge
            peak = max(peak, window)
        self.replayed.append(replayed)
        return peak

    def _keys(self, events: Spliced) -> dict[int, tuple]:
        """Chunk -> its own events (position in the chunk, key, bytes), for the chunks that have any."""
        if not len(events.at):
            return {}
        chunk = self._chunk(events.at)
        where = (events.at - chunk * self.every).tolist()
        own = list(zip(where, events.own_serials.tolist(), events.own_deltas.tolist()))
        keys: dict[int, list] = {}
        for k, event in zip(chunk.tolist(), own):
            keys.setdefault(k, []).append(event)
        return {k: tuple(value) for k, value in keys.items()}

    def _chunk(self, at: np.ndarray) -> np.ndarray:
        """The chunk of each own event placed before template event `at` (the last chunk: those at its end)."""
        return np.minimum(at // self.every, self.count - 1)

    def _play(self, allocator, k: int, events: Spliced) -> int:
        """Replay chunk k on `allocator`: the template's events with the rank's own that fall in the chunk
        spliced in. Returns the most bytes reserved within it."""
        lo, hi = k * self.every, min((k + 1) * self.every, len(self.serials))
        first, last = np.searchsorted(self._chunk(events.at), [k, k + 1])
        if first == last:
            return allocator.replay(self.serials, self.deltas, lo, hi)
        return allocator.replay(self.serials, self.deltas, lo, hi, events.at[first:last],
                                events.own_serials[first:last], events.own_deltas[first:last])

    def _replay(self, path: list[_Node], k: int, events: Spliced) -> tuple[_Node, int]:
        """Replay chunk k from the state of `path[k]` (the walk's node there): the node after it (a new one, or
        one reached before in the same state) and the most bytes reserved within it."""
        allocator = self._state(path, k, events).allocator.clone()
        window = self._play(allocator, k, events)
        depth = k + 1
        if depth == self.count:  # the walks end here: nothing to go on from
            return _Node(depth, None), window
        state = PausedReplay(allocator)
        for node in self.index.get((depth, state.fingerprint()), ()):
            if allocator.same_state(node.state.allocator):
                return node, window
        node = _Node(depth, state)
        self._keep(node)
        return node, window

    def _state(self, path: list[_Node], k: int, events: Spliced) -> PausedReplay:
        """The paused state at `path[k]`, replayed again from the walk's latest node that still holds one if it
        was let go (the walk's own events lead there: the nodes on its path were reached by them, or in the same
        state)."""
        node = path[k]
        if node.state is not None:
            return node.state
        start = max(i for i in range(k) if path[i].state is not None)
        allocator = path[start].state.allocator.clone()
        for i in range(start, k):
            self._play(allocator, i, events)
        node.state = PausedReplay(allocator)
        self._keep(node)
        return node.state

    def _keep(self, node: _Node) -> None:
        """Index the node's new state and keep it, letting the least recently used state go past `_MAX_STATES`."""
        self.index.setdefault((node.depth, node.state.fingerprint()), []).append(node)
        self.kept[node] = None
        if len(self.kept) > _MAX_STATES:
            oldest = next(iter(self.kept))
            del self.kept[oldest]
            key = (oldest.depth, oldest.state.fingerprint())
            self.index[key].remove(oldest)
            if not self.index[key]:
                del self.index[key]
            oldest.state = None


def _int64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, np.int64)


CHECKPOINT_EVERY = 2048  # template events in a chunk (compiled allocator: a paused state copies in microseconds)
_MAX_STATES = 1024  # paused states `_Chunks` keeps (~0.1 MB each at 70B)
_REPLAYED: dict[tuple, _Chunks] = {}
_REPLAYED_PLAN: list[weakref.ref] = [lambda: None]  # the layout (its LazyRanks) whose ranks _REPLAYED holds
_LAZY_PREDICTED: dict[tuple, list[RankPrediction]] = {}  # that layout's ranks, by GPU and allocator setting
_RESERVED: dict[tuple, int] = {}
_LEAST: dict[tuple, int] = {}
_LEAST_STEP = 2 << 20  # the least capacity's precision: one small segment of the allocator
