"""A model of PyTorch's CUDA caching allocator, replayed over a predicted timeline (DESIGN.md stage 4).

Rules from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x), one stream, default settings:
- every request is rounded up to a multiple of 512 bytes (`round_size`);
- requests <= 1 MiB use the small pool, larger ones the large pool (`get_pool`);
- a request no cached block can serve makes a new segment (`cudaMalloc`) of `get_allocation_size`:
  2 MiB for the small pool, 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- a request takes the smallest free block that fits, lowest address first (`BlockComparatorSize`);
  blocks of `max_split_size` or more serve only requests of at least that size, and then only when the
  block is less than 20 MiB larger (`get_free_block`);
- the block is split when the remainder is >= 512 B (small pool) or > 1 MiB (large pool, and the request
  is under `max_split_size`) (`should_split`);
- a freed block merges with free neighbours of its segment (`try_merge_blocks`);
- segments go back to the driver only when a new segment would not fit: first one cached unsplit block big
  enough, then every cached unsplit block (`release_available_cached_blocks`, `release_cached_blocks`);
  if the segment still does not fit, the run is out of memory.
With `expandable_segments:True` each pool is one segment whose address space grows (`ExpandableSegment`,
`try_allocate_expandable_block`, `map_block`): a request no free block serves maps pages at the segment's
end -- 2 MiB pages for the small pool, 20 MiB for the large one -- merged with a free block already at the
end; a freed block at the end is unmapped (page by page) only when the device runs out (`release_cached_blocks`,
simplified: free blocks inside the segment stay mapped).
Settings come as PYTORCH_CUDA_ALLOC_CONF reads them (`parse_alloc_conf`): max_split_size_mb,
expandable_segments. Not modelled: garbage_collection_threshold (it acts only under
`set_per_process_memory_fraction`), roundup_power2_divisions, pinned-memory settings, other streams.
"""
from __future__ import annotations

import bisect
import copy
import os
from dataclasses import dataclass, field

import numpy as np

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: largest "small" request
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: small-pool segment
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: segment for 1-10 MiB requests
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge
NO_LIMIT = 1 << 62  # max_split_size default: SIZE_MAX


@dataclass(frozen=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF settings the model follows (c10/cuda/CUDAAllocatorConfig.cpp)."""

    max_split_size: int = NO_LIMIT
    expandable_segments: bool = False


ALLOC_CONF_KEYS = ("max_split_size_mb", "expandable_segments")


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """"max_split_size_mb:256,expandable_segments:True" -> AllocatorConfig; one clear line when unknown."""
    from llmsim.errors import InputError

    config = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, _, value = item.partition(":")
        if key == "max_split_size_mb":
            if not value.isdigit() or int(value) <= LARGE_BUFFER_BYTES >> 20:  # CUDAAllocatorConfig: > 20 MB
                raise InputError(f"alloc-conf max_split_size_mb must be an integer above 20, got {value!r}")
            config["max_split_size"] = int(value) << 20
        elif key == "expandable_segments":
            if value not in ("True", "False"):
                raise InputError(f"alloc-conf expandable_segments must be True or False, got {value!r}")
            config["expandable_segments"] = value == "True"
        else:
            raise InputError(f"alloc-conf key {key!r} is not modelled; modelled keys: {', '.join(ALLOC_CONF_KEYS)}")
    return AllocatorConfig(**config)


def round_size(size: int) -> int:
    return max(MIN_BLOCK_BYTES, -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def allocation_size(size: int) -> int:
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


@dataclass(eq=False, slots=True)
class _Block:
    address: int
    size: int
    small: bool
    segment: int
    allocated: bool = False
    prev: "_Block | None" = None
    next: "_Block | None" = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class OutOfMemory(Exception):
    """A segment that does not fit in the device's capacity even after releasing the cache."""


@dataclass
class CachingAllocator:
    capacity_bytes: int = NO_LIMIT  # what cudaMalloc may hand out in all
    max_split_size: int = NO_LIMIT
    expandable: bool = False  # expandable_segments: one growing segment per pool
    reserved_bytes: int = 0
    allocated_bytes: int = 0  # rounded block bytes in use
    peak_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    # free blocks by pool, indexed by `small` (False: large, True: small), sorted by (size, address)
    _pools: list[list[tuple[int, int, _Block]]] = field(default_factory=lambda: [[], []])
    _live: dict[int, _Block] = field(default_factory=dict)
    _next_address: int = 0
    _segments: int = 0
    _tail: list["_Block | None"] = field(default_factory=lambda: [None, None])  # expandable: each pool's end
    _sizes: dict[int, int] = field(default_factory=dict)  # `replay`: each live storage's bytes, by serial

    def clone(self) -> "CachingAllocator":
        """An independent copy: every block (each one free in a pool or live under a key) and its links."""
        twin = copy.copy(self)
        copies: dict[int, _Block] = {}

        def of(block: _Block | None) -> _Block | None:
            if block is None:
                return None
            twin_block = copies.get(id(block))
            if twin_block is None:
                twin_block = copies[id(block)] = _Block(block.address, block.size, block.small, block.segment,
                                                        block.allocated)
            return twin_block

        twin._pools = [[(size, address, of(block)) for size, address, block in pool] for pool in self._pools]
        twin._live = {key: of(block) for key, block in self._live.items()}
        twin._tail = [of(block) for block in self._tail]
        twin._sizes = dict(self._sizes)
        for block in [entry[2] for pool in self._pools for entry in pool] + list(self._live.values()):
            twin_block = copies[id(block)]
            twin_block.prev, twin_block.next = of(block.prev), of(block.next)
        return twin

    def malloc(self, key: int, size: int) -> None:
        # round_size, inline (the replay's hottest line); timelines hand numpy integers, sizes stay Python ints
        size = ((int(size) + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES or MIN_BLOCK_BYTES
        small = size <= SMALL_SIZE_BYTES
        block = self._take_free_block(size, small) or self._new_segment(size, small)
        remaining = block.size - size  # `should_split`
        if remaining >= MIN_BLOCK_BYTES if small else (size < self.max_split_size and remaining > SMALL_SIZE_BYTES):
            rest = _Block(block.address + size, remaining, small, block.segment, False, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            if self._tail[small] is block:
                self._tail[small] = rest
            bisect.insort(self._pools[small], (remaining, rest.address, rest))
        block.allocated = True
        self._live[key] = block
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes

    def free(self, key: int) -> None:
        block = self._live.pop(key)
        block.allocated = False
        self.allocated_bytes -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove(neighbour)
                block = self._merge(block, neighbour)
        bisect.insort(self._pools[block.small], (block.size, block.address, block))

    def replay(self, serials, deltas, start: int = 0, stop: int | None = None, at=None, own_serials=None,
               own_deltas=None) -> int:
        """A timeline's events `start:stop`, by storage serial: a positive delta makes a storage (or grows one: it
        is reallocated at its new size), a negative one frees it (or shrinks it). With `at`, events of their own
        (`own_serials`, `own_deltas`) are spliced in: own event j before event at[j] (after the window's last where
        at[j] >= stop). Returns the most bytes reserved within the window (from those reserved at its start)."""
        if at is not None:
            stop = len(serials) if stop is None else min(stop, len(serials))
            where = np.clip(np.asarray(at, dtype=np.int64), start, stop) - start
            serials = np.insert(np.asarray(serials[start:stop]), where, own_serials)
            deltas = np.insert(np.asarray(deltas[start:stop]), where, own_deltas)
            start, stop = 0, None
        peak, self.peak_reserved_bytes = self.peak_reserved_bytes, self.reserved_bytes
        try:
            self._replay(serials, deltas, start, stop)
        finally:
            window = self.peak_reserved_bytes
            self.peak_reserved_bytes = max(peak, window)
        return window

    def same_state(self, other: "CachingAllocator") -> bool:
        """Whether every later event would do the same with `other` (peaks aside): the same settings and bytes,
        the same free blocks and live storages, each at the same address with the same size and split state."""
        return self._state() == other._state()

    def fingerprint(self) -> int:
        """A hash of what `same_state` compares: equal states have equal fingerprints."""
        return hash(self._state())

    def _state(self) -> tuple:
        def shape(block: _Block | None):
            return None if block is None else (block.address, block.size, block.small, block.allocated,
                                               block.prev is None, block.next is None)

        return (self.capacity_bytes, self.max_split_size, self.expandable, self.reserved_bytes, self.allocated_bytes,
                self._next_address, tuple(tuple(shape(e[2]) for e in pool) for pool in self._pools),
                tuple(shape(t) for t in self._tail),
                tuple(sorted((key, shape(block)) for key, block in self._live.items())),
                tuple(sorted(self._sizes.items())))

    def _replay(self, serials, deltas, start: int, stop: int | None) -> None:
        malloc, free, sizes = self.malloc, self.free, self._sizes
        for serial, delta in zip(_ints(serials[start:stop]), _ints(deltas[start:stop])):
            if delta > 0 and serial not in sizes:
                sizes[serial] = delta
                malloc(serial, delta)
            elif delta > 0:  # a resize: the storage is reallocated at its new size
                free(serial)
                sizes[serial] += delta
                malloc(serial, sizes[serial])
            elif delta < 0 and serial in sizes:
                sizes[serial] += delta
                free(serial)
                if sizes[serial] > 0:
                    malloc(serial, sizes[serial])
                else:
                    del sizes[serial]

    # ---- the pool ------------------------------------------------------------------------------------
    def _take_free_block(self, size: int, small: bool) -> _Block | None:
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = pool[i][2]
        if size < self.max_split_size <= block.size:
            return None  # an oversize block is kept for oversize requests
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER_BYTES:
            return None
        pool.pop(i)
        return block

    def _map_at_end(self, size: int, small: bool) -> _Block:
        """`try_allocate_expandable_block`: grow the free block at the segment's end, or map a new one there."""
        page = SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES
        tail = self._tail[small]
        grow_free_tail = tail is not None and not tail.allocated
        needed = size - tail.size if grow_free_tail else size
        mapped = -(-needed // page) * page
        if self.reserved_bytes + mapped > self.capacity_bytes:
            raise OutOfMemory(f"mapping {mapped:,} B more does not fit: {self.reserved_bytes:,} B reserved of "
                              f"{self.capacity_bytes:,} B")
        self.reserved_bytes += mapped
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        if grow_free_tail:
            self._remove(tail)
            tail.size += mapped
            return tail
        address = (tail.address + tail.size) if tail is not None else (0 if small else LARGE_BUFFER_BYTES << 32)
        block = _Block(address, mapped, small, 0 if small else 1, False, tail, None)
        if tail is not None:
            tail.next = block
        self._tail[small] = block
        return block

    def _unmap_free_tails(self) -> None:
        """On a failed mapping, `release_cached_blocks` unmaps the whole pages of free blocks
        (`release_expandable_segment_pages`); here: those of the free block at each segment's end."""
        for small in (True, False):
            tail = self._tail[small]
            if tail is None or tail.allocated:
                continue
            page = SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES
            end = tail.address + tail.size  # mappings end on page boundaries
            unmapped = end - -(-tail.address // page) * page
            if unmapped <= 0:
                continue
            self._remove(tail)
            self.reserved_bytes -= unmapped
            tail.size -= unmapped
            if tail.size:
                self._insert(tail)
            else:
                self._tail[small] = tail.prev
                if tail.prev is not None:
                    tail.prev.next = None

    def _new_segment(self, size: int, small: bool) -> _Block:
        if self.expandable:
            try:
                return self._map_at_end(size, small)
            except OutOfMemory:
                self._unmap_free_tails()
                return self._map_at_end(size, small)
        segment_bytes = allocation_size(size)
        if self.reserved_bytes + segment_bytes > self.capacity_bytes:
            self._release_cached(segment_bytes)
        if self.reserved_bytes + segment_bytes > self.capacity_bytes:
            raise OutOfMemory(f"a {segment_bytes:,}-byte segment does not fit: {self.reserved_bytes:,} B "
                              f"reserved of {self.capacity_bytes:,} B")
        block = _Block(self._next_address, segment_bytes, small, self._segments)
        self._next_address += segment_bytes
        self._segments += 1
        self.reserved_bytes += segment_bytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def _release_cached(self, needed: int) -> None:
        """`release_available_cached_blocks`, then `release_cached_blocks`: free unsplit cached segments."""
        unsplit = [entry for entry in self._pools[False] if not entry[2].is_split]
        fitting = [entry for entry in unsplit if entry[0] >= needed]
        for entry in (fitting[:1] or unsplit) + [e for e in self._pools[True] if not e[2].is_split]:
            if entry in self._pools[entry[2].small]:
                self._pools[entry[2].small].remove(entry)
                self.reserved_bytes -= entry[0]
            if self.reserved_bytes + needed <= self.capacity_bytes:
                return

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (block, neighbour) if block.address < neighbour.address else (neighbour, block)
        first.size += second.size
        first.next = second.next
        if self._tail[first.small] is second:
            self._tail[first.small] = first
        if second.next is not None:
            second.next.prev = first
        return first

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.address, block))

    def _remove(self, block: _Block) -> None:
        pool = self._pools[block.small]
        pool.pop(bisect.bisect_left(pool, (block.size, block.address)))


try:  # the same model compiled (llmsim/sim/_allocator.c, built by `pip install`): replays ~10x faster
    from llmsim.sim import _allocator
except ImportError:  # no C compiler where llmsim was installed: this module's Python model
    _allocator = None
else:
    _allocator.set_out_of_memory(OutOfMemory)


def compiled() -> bool:
    """Whether replays run the compiled model (LLMSIM_ALLOCATOR=python picks the Python one)."""
    return _allocator is not None and os.environ.get("LLMSIM_ALLOCATOR", "compiled") != "python"


def new_allocator(capacity_bytes: int = NO_LIMIT, config: AllocatorConfig = AllocatorConfig()):
    """A `CachingAllocator`, or its compiled twin (the same methods and byte counters)."""
    if compiled():
        return _allocator.Allocator(capacity_bytes, min(config.max_split_size, NO_LIMIT), config.expandable_segments)
    return CachingAllocator(capacity_bytes=capacity_bytes, max_split_size=config.max_split_size,
                            expandable=config.expandable_segments)


@dataclass
class PausedReplay:
    """An allocator paused between two chunks of a replay (never changed: a replay goes on from a clone of it)."""

    allocator: CachingAllocator
    _fingerprint: int | None = None

    def fingerprint(self) -> int:
        """The paused allocator's fingerprint, kept once computed."""
        if self._fingerprint is None:
            self._fingerprint = self.allocator.fingerprint()
        return self._fingerprint


def replay_reserved(serials, deltas, capacity_bytes: int = NO_LIMIT, config: AllocatorConfig = AllocatorConfig(),
                    extra_allocations: tuple[int, ...] = ()) -> CachingAllocator:
    """Run a timeline's allocations and frees (by storage serial) through the allocator model.
    `extra_allocations` are made first and kept (the cuBLAS workspace)."""
    allocator = new_allocator(capacity_bytes, config)
    for i, size in enumerate(extra_allocations):
        allocator.malloc(-2 - i, size)
    if not isinstance(allocator, CachingAllocator):  # the compiled one reads int64 buffers
        serials, deltas = np.ascontiguousarray(serials, np.int64), np.ascontiguousarray(deltas, np.int64)
    allocator.replay(serials, deltas)
    return allocator


def _ints(values) -> list[int]:
    """Python ints: numpy scalars are several times slower to hash and compare in the replay loop."""
    return values.tolist() if hasattr(values, "tolist") else list(values)
