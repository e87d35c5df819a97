"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp, by hand; its compiled twin
(llmsim/sim/_allocator.c) against the Python model, on the same hand cases and on random streams."""
import pytest

from llmsim.sim import allocator as allocator_module
from llmsim.sim.allocator import (AllocatorConfig, CachingAllocator, OutOfMemory, allocation_size, replay_reserved,
                              round_size)
from llmsim.app.cli import main

MiB = 1 << 20
COMPILED = allocator_module._allocator
needs_compiled = pytest.mark.skipif(COMPILED is None, reason="llmsim.sim._allocator was not built (no C compiler)")
IMPLEMENTATIONS = [CachingAllocator, pytest.param(COMPILED and COMPILED.Allocator, marks=needs_compiled)]


@pytest.fixture(params=IMPLEMENTATIONS, ids=["python", "compiled"])
def Allocator(request):
    return request.param


def test_round_size_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert allocation_size(10 * MiB) == 10 * MiB  # >= 10 MiB: rounded up to 2 MiB
    assert allocation_size(11 * MiB + 512) == 12 * MiB


def test_small_requests_pack_into_one_segment(Allocator):
    a = Allocator()
    a.malloc(1, 100)
    a.malloc(2, 600)
    assert a.reserved_bytes == 2 * MiB and a.allocated_bytes == 512 + 1024


def test_medium_request_splits_a_20_mib_segment_and_reuses_it_after_free(Allocator):
    a = Allocator()
    a.malloc(1, 3 * MiB // 2)
    a.malloc(2, 4 * MiB)  # served from the 18.5 MiB remainder: no new segment
    assert a.reserved_bytes == 20 * MiB
    a.free(1)
    a.free(2)  # both blocks merge back into one free 20 MiB block
    a.malloc(3, 19 * MiB)
    assert a.reserved_bytes == 20 * MiB


def test_large_block_is_not_split_when_remainder_is_at_most_1_mib(Allocator):
    a = Allocator()
    a.malloc(1, 11 * MiB + 512)  # 12 MiB segment, 1 MiB - 512 left: the block is handed out whole
    assert a.reserved_bytes == 12 * MiB and a.allocated_bytes == 12 * MiB
    a.free(1)
    a.malloc(2, 3 * MiB)  # the cached 12 MiB block is split: 9 MiB > 1 MiB remains
    assert a.reserved_bytes == 12 * MiB and a.allocated_bytes == 3 * MiB


def test_cache_is_released_before_out_of_memory(Allocator):
    a = Allocator(capacity_bytes=30 * MiB)
    a.malloc(1, 12 * MiB)
    a.free(1)
    a.malloc(2, 20 * MiB)  # 12 + 20 > 30: the cached 12 MiB segment goes back first
    assert a.reserved_bytes == 20 * MiB and a.peak_reserved_bytes == 20 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(3, 12 * MiB)


def test_oversize_blocks_serve_only_oversize_requests(Allocator):
    a = Allocator(max_split_size=50 * MiB)
    a.malloc(1, 60 * MiB)
    a.free(1)
    a.malloc(2, 12 * MiB)  # must not take the 60 MiB oversize block
    assert a.reserved_bytes == 72 * MiB


def test_sizes_from_numpy_timelines_stay_python_ints():
    import numpy as np

    allocator = replay_reserved(np.array([1]), np.array([12 * MiB + 1], dtype=np.int64))
    assert type(allocator.peak_reserved_bytes) is int and allocator.peak_reserved_bytes == 14 * MiB


def test_replay_follows_storage_serials():
    allocator = replay_reserved([1, 2, 1, 3], [3 * MiB // 2, 600, -(3 * MiB // 2), 4 * MiB])
    assert allocator.peak_reserved_bytes == 22 * MiB  # one 20 MiB and one 2 MiB segment
    assert allocator.allocated_bytes == 1024 + 4 * MiB


def test_gpu_profile_reports_reserved_and_headroom(capsys):
    import json
    argv = ["predict", "--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4",
            "--set", "vocab_size=512", "--seq-len", "32", "--micro-batch", "2", "--format", "json"]
    assert main(argv + ["--gpu", "a100-40gb"]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    assert rank["peak_reserved_bytes"] >= rank["peak_allocated_bytes"]
    assert rank["peak_reserved_bytes"] % (2 * MiB) == 0  # whole segments
    assert rank["headroom_bytes"] == rank["capacity_bytes"] - rank["needed_bytes"] and rank["fits"]
    assert rank["needed_bytes"] == rank["device_total_bytes"] and rank["verdict"] == "fits"  # far from the card
    assert main(argv + ["--gpu", "b200"]) == 2
    assert "valid choices" in capsys.readouterr().err


def test_alloc_conf_parsing_and_bad_keys(capsys):
    from llmsim.sim.allocator import AllocatorConfig, parse_alloc_conf

    assert parse_alloc_conf(None) == AllocatorConfig()
    assert parse_alloc_conf("expandable_segments:True,max_split_size_mb:256") == AllocatorConfig(256 * MiB, True)
    for bad in ("garbage_collection_threshold:0.6", "max_split_size_mb:10", "expandable_segments:yes"):
        rc = main(["predict", "--model", "gpt2", "--seq-len", "64", "--micro-batch", "1", "--gpu", "a100-80gb",
                   "--alloc-conf", bad])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and bad.split(":")[0] in err


def test_expandable_segment_grows_at_its_end_in_pages(Allocator):
    """expandable_segments: no 20 MiB segment per 1-10 MiB request; pages of 20 MiB (large) / 2 MiB (small)
    mapped at the end, a free block at the end grown instead of mapping a whole request again."""
    a = Allocator(expandable=True)
    a.malloc(1, 3 * MiB)
    assert a.reserved_bytes == 20 * MiB  # one large page
    a.malloc(2, 30 * MiB)  # 17 MiB free at the end: grown by 20 MiB (pages), no new segment
    assert a.reserved_bytes == 40 * MiB
    a.malloc(3, 1000)
    assert a.reserved_bytes == 42 * MiB  # the small pool has its own segment, 2 MiB pages
    a.free(2)
    a.malloc(4, 35 * MiB)  # the free 37 MiB block at the end takes it
    assert a.reserved_bytes == 42 * MiB
    plain = Allocator()
    for key, size in ((1, 3 * MiB), (2, 30 * MiB), (3, 1000)):
        plain.malloc(key, size)
    assert plain.reserved_bytes == (20 + 30 + 2) * MiB


def test_expandable_segment_unmaps_its_free_end_before_running_out(Allocator):
    a = Allocator(capacity_bytes=62 * MiB, expandable=True)
    a.malloc(1, 20 * MiB)
    a.malloc(2, 40 * MiB)
    a.free(2)  # 60 MiB mapped, a free 40 MiB at the end of the large pool's segment
    a.malloc(3, MiB)
    a.malloc(4, MiB)  # the small pool's first 2 MiB page: 62 MiB, the capacity
    a.malloc(5, MiB)  # a second small page only fits once the large segment's free end is unmapped
    assert a.reserved_bytes == (20 + 2 + 2) * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(6, 40 * MiB)


def _stream(seed: int, n: int = 3000):
    """A random stream of allocations (1 KiB to 300 MiB), resizes and frees, by storage serial."""
    import random

    rng = random.Random(seed)
    live, serials, deltas, next_serial = {}, [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            serial = rng.choice(list(live))
            serials.append(serial)
            deltas.append(-live.pop(serial))
        elif live and rng.random() < 0.05:  # a resize
            serial = rng.choice(list(live))
            grow = rng.randint(1, 1 << 22)
            live[serial] += grow
            serials.append(serial)
            deltas.append(grow)
        else:
            size = rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 300 << 20)])
            live[next_serial] = size
            serials.append(next_serial)
            deltas.append(size)
            next_serial += 1
    return serials, deltas


@pytest.mark.parametrize("implementation", ["python", pytest.param("compiled", marks=needs_compiled)])
@pytest.mark.parametrize("expandable", [False, True])
def test_a_replay_with_events_spliced_in_is_the_replay_of_the_merged_stream(expandable, implementation,
                                                                            monkeypatch):
    """`replay(..., at, own_serials, own_deltas)`, window by window (what replay._replay_spliced plays), is the
    replay of the stream with those events inserted (np.insert): own event j before event at[j], after the last
    where at[j] is the stream's length."""
    import numpy as np

    from llmsim.sim.allocator import new_allocator

    monkeypatch.setenv("LLMSIM_ALLOCATOR", implementation)
    config = AllocatorConfig(expandable_segments=expandable)
    serials, deltas = (np.array(values, np.int64) for values in _stream(4, 1500))
    at = np.array([0, 0, 300, 300, 301, 977, 1024, 1499, 1500, 1500], np.int64)
    sizes = [5 * MiB, 700, 64 * MiB, 3 * MiB, 2000, 90 * MiB, 12 * MiB, 4096, 33 * MiB, 1]
    keys = 10**6 + np.arange(len(at), dtype=np.int64)
    own_serials = np.concatenate([keys, keys])  # each allocated, then freed a few places later (or at the end)
    own_deltas = np.concatenate([np.array(sizes, np.int64), -np.array(sizes, np.int64)])
    frees = np.minimum(at + 40, len(serials))
    order = np.argsort(np.concatenate([at, frees]), kind="stable")
    at, own_serials, own_deltas = np.concatenate([at, frees])[order], own_serials[order], own_deltas[order]
    expected = replay_reserved(np.insert(serials, at, own_serials), np.insert(deltas, at, own_deltas),
                               config=config, extra_allocations=(4096,))
    spliced = new_allocator(config=config)
    spliced.malloc(-2, 4096)
    windows = []
    for start in range(0, len(serials), 256):
        stop = min(start + 256, len(serials))
        mine = (at >= start) & ((at < stop) | (stop == len(serials)))
        windows.append(spliced.replay(serials, deltas, start, stop, at[mine], own_serials[mine], own_deltas[mine]))
    assert (spliced.peak_reserved_bytes, spliced.peak_allocated_bytes, spliced.reserved_bytes,
            spliced.allocated_bytes) == (expected.peak_reserved_bytes, expected.peak_allocated_bytes,
                                         expected.reserved_bytes, expected.allocated_bytes)
    assert max(windows) == expected.peak_reserved_bytes and spliced.same_state(expected)


@pytest.mark.parametrize("implementation", ["python", pytest.param("compiled", marks=needs_compiled)])
@pytest.mark.parametrize("expandable", [False, True])
def test_a_replay_resumed_from_a_paused_state_is_the_whole_replay(expandable, implementation, monkeypatch):
    """What replay._replay_spliced relies on: a copy of the allocator paused before event p, replayed on from p
    (`replay(start=p)`), ends as the whole replay; the windows' peaks make the whole peak."""
    import numpy as np

    from llmsim.sim.allocator import new_allocator

    monkeypatch.setenv("LLMSIM_ALLOCATOR", implementation)
    config = AllocatorConfig(expandable_segments=expandable)
    serials, deltas = _stream(1)
    paused, windows = [], []
    whole = new_allocator(config=config)
    whole.malloc(-2, 4096)
    as_int64 = (lambda values: np.array(values, np.int64)) if implementation == "compiled" else list
    for start in range(0, len(serials), 256):
        paused.append((start, whole.clone()))
        windows.append(whole.replay(as_int64(serials), as_int64(deltas), start, start + 256))
    assert [start for start, _ in paused] == list(range(0, len(serials), 256))
    assert max(windows) == whole.peak_reserved_bytes
    # another stream with the same first 1,500 events (the ranks of a ZeRO-1/2 prediction)
    other_serials, other_deltas = _stream(2)
    other_serials = serials[:1500] + [s + 10_000 for s in other_serials[:1500]]
    other_deltas = deltas[:1500] + other_deltas[:1500]
    expected = replay_reserved(other_serials, other_deltas, config=config, extra_allocations=(4096,))
    for start, state in paused:
        resumed = state.clone()
        resumed.replay(as_int64(serials), as_int64(deltas), start)
        assert (resumed.peak_reserved_bytes, resumed.peak_allocated_bytes, resumed.reserved_bytes) == (
            whole.peak_reserved_bytes, whole.peak_allocated_bytes, whole.reserved_bytes)
        if start <= 1500:
            other = state.clone()
            other.replay(as_int64(other_serials), as_int64(other_deltas), start)
            assert (other.peak_reserved_bytes, other.peak_allocated_bytes) == (expected.peak_reserved_bytes,
                                                                              expected.peak_allocated_bytes)
    assert expected.peak_reserved_bytes != whole.peak_reserved_bytes  # the suffixes do differ


def _counters(allocator) -> tuple[int, int, int, int]:
    return (allocator.reserved_bytes, allocator.allocated_bytes, allocator.peak_reserved_bytes,
            allocator.peak_allocated_bytes)


@needs_compiled
@pytest.mark.parametrize("config", [dict(), dict(max_split_size=128 * MiB), dict(expandable=True),
                                    dict(capacity_bytes=3 << 30), dict(capacity_bytes=6 << 30),
                                    dict(capacity_bytes=3 << 30, expandable=True),
                                    dict(capacity_bytes=2 << 30, max_split_size=64 * MiB)],
                         ids=["default", "max-split", "expandable", "capacity", "capacity-6g", "capacity-expandable",
                              "capacity-max-split"])
def test_the_compiled_allocator_is_the_python_model_event_by_event(config):
    """Both replay the same random streams (allocations of 1 B to 300 MiB, resizes, frees): the same four counters
    after every event, and an out-of-memory at the same event."""
    import numpy as np

    for seed in range(4):
        serials, deltas = _stream(seed, 1500)
        serials, deltas = np.array(serials, np.int64), np.array(deltas, np.int64)
        python, compiled = CachingAllocator(**config), COMPILED.Allocator(**config)
        python.malloc(-2, 4096)
        compiled.malloc(-2, 4096)
        for i in range(len(serials)):
            outcomes = []
            for allocator in (python, compiled):
                try:
                    allocator.replay(serials, deltas, i, i + 1)
                    outcomes.append(_counters(allocator))
                except OutOfMemory:
                    outcomes.append("out of memory")
            assert outcomes[0] == outcomes[1], (seed, i)
            if outcomes[0] == "out of memory":
                break
            if i % 500 == 499:  # a copy goes on alone
                python, compiled = python.clone(), compiled.clone()


@needs_compiled
def test_the_compiled_allocator_takes_int64_buffers_only_and_unknown_keys_fail_as_in_python():
    import numpy as np

    a = COMPILED.Allocator()
    with pytest.raises(TypeError, match="int64"):
        a.replay(np.array([1], np.int32), np.array([5], np.int32))
    a.replay(np.array([1], np.int64), np.array([12 * MiB + 1], np.int64))
    assert type(a.peak_reserved_bytes) is int and a.peak_reserved_bytes == 14 * MiB
    with pytest.raises(KeyError):
        a.free(7)
    with pytest.raises(KeyError):
        CachingAllocator().free(7)


@pytest.mark.parametrize("implementation", ["python", pytest.param("compiled", marks=needs_compiled)])
@pytest.mark.parametrize("max_states", [1024, 3], ids=["states-kept", "states-let-go"])
def test_ranks_taking_chunks_from_earlier_ranks_replay_like_alone(implementation, max_states, monkeypatch):
    """replay._replay_spliced on streams built like a ZeRO-1/2 prediction's ranks: one template stream with, at
    the same few places, a temporary of the rank's own size (a float64 upcast) or a kept allocation
    (grads_in_partition), some of which leave the allocator as the others left it. Every rank's peak is its own
    whole replay's, also when the tree lets paused states go (and replays them again when asked for)."""
    import numpy as np

    from llmsim.sim import replay
    from llmsim.sim.strategies.events import Spliced

    monkeypatch.setenv("LLMSIM_ALLOCATOR", implementation)
    monkeypatch.setattr(replay, "CHECKPOINT_EVERY", 64)
    monkeypatch.setattr(replay, "_MAX_STATES", max_states)
    monkeypatch.setattr(replay, "_REPLAYED", {})
    serials, deltas = (np.array(values, np.int64) for values in _stream(3, 2000))
    for rank in range(12):
        own = []  # (template position, key, bytes)
        for place in (500, 1200, 1700):  # the rank's own events, at the same places in every rank
            size = (rank % 4 + 1) * 3 * MiB + rank * 4096 if rank % 3 else 64 * 1024
            own += [(place, 10**6 + place, size)]
            own += [(place + 150 if rank % 5 == 4 else place, 10**6 + place, -size)]  # kept until a later place
        own.sort(key=lambda event: event[0])
        at, keys, sizes = (np.array(column, np.int64) for column in zip(*own))
        events = Spliced(serials, deltas, at, keys, sizes)
        expected = replay_reserved(*events.arrays(), config=AllocatorConfig(),
                                   extra_allocations=(4096,)).peak_reserved_bytes
        assert replay._replay_spliced(events, allocator_module.NO_LIMIT, AllocatorConfig(), (4096,)) == expected
    chunks = next(iter(replay._REPLAYED.values()))
    assert chunks.replayed[0] == chunks.count
    assert sum(own < chunks.count for own in chunks.replayed) >= 8  # most ranks took chunks from earlier ones
    assert len(chunks.kept) <= max_states


@pytest.mark.parametrize("Allocator", IMPLEMENTATIONS)
def test_same_state_and_fingerprint_see_what_later_events_depend_on(Allocator):
    """A copy is in the same state; a temporary served by a free block and freed again leaves the same state (the
    split block merges back); one that needs a segment of its own does not (the segment stays cached)."""
    a = Allocator()
    a.malloc(1, 30 * MiB)
    a.malloc(2, 5 * MiB)
    a.free(1)
    twin = a.clone()
    assert a.same_state(twin) and a.fingerprint() == twin.fingerprint()
    twin.malloc(3, 7 * MiB)  # fits the free 30 MiB block
    assert not a.same_state(twin)
    twin.free(3)
    assert a.same_state(twin) and a.fingerprint() == twin.fingerprint()
    twin.malloc(4, 100 * MiB)  # a new segment, cached after the free
    twin.free(4)
    assert not a.same_state(twin) and a.fingerprint() != twin.fingerprint()
    assert twin.peak_reserved_bytes > a.peak_reserved_bytes


@needs_compiled
@pytest.mark.parametrize("config", [dict(), dict(expandable=True), dict(max_split_size=128 * MiB)],
                         ids=["default", "expandable", "max-split"])
def test_the_compiled_fingerprint_is_equal_whenever_the_states_are(config):
    """The compiled fingerprint is kept as sums updated event by event; a stream with temporaries inserted (most
    of them served by a free block and merged back) reaches the base stream's states by another history: wherever
    the states are the same (as `same_state` and the Python model say), so are the fingerprints."""
    import random

    import numpy as np

    serials, deltas = _stream(5, 1500)
    rng = random.Random(5)
    base, variant = COMPILED.Allocator(**config), COMPILED.Allocator(**config)
    python_base, python_variant = CachingAllocator(**config), CachingAllocator(**config)
    same = 0
    for i, event in enumerate(zip(serials, deltas)):
        free_large = [entry[0] for entry in python_variant._pools[False]  # (blocks of max_split_size or more
                      if 2 * MiB < entry[0] < config.get("max_split_size", 1 << 62)]  # serve only as large)
        events = [event]
        if free_large and rng.random() < 0.3:  # a temporary that a free block serves, made and freed first
            size = rng.randint(MiB + 1, max(free_large))
            events = [(10**6 + i, size), (10**6 + i, -size), event]
        var_s, var_d = np.array([e[0] for e in events], np.int64), np.array([e[1] for e in events], np.int64)
        one_s, one_d = np.array([event[0]], np.int64), np.array([event[1]], np.int64)
        base.replay(one_s, one_d)
        python_base.replay(one_s, one_d)
        variant.replay(var_s, var_d)
        python_variant.replay(var_s, var_d)
        assert base.same_state(variant) == python_base.same_state(python_variant)
        if base.same_state(variant):
            same += 1
            assert base.fingerprint() == variant.fingerprint()
    assert same > 300
