"""DDP's construction broadcast as c10d's `_broadcast_coalesced` runs it (torch/csrc/distributed/c10d/comm.cpp):
chunks from `compute_bucket_assignment_by_size`, a single-tensor chunk broadcast in place, two in flight."""
from llmsim.enums import Category
from llmsim.sim.strategies.ddp import broadcast_events, coalesced_chunks

MiB = 1 << 20


def test_chunks_close_once_they_reach_the_limit():
    sizes = [300 * MiB, 10, 10, 200 * MiB, 100 * MiB, 5]
    assert coalesced_chunks(sizes, 250 * MiB) == [[300 * MiB], [10, 10, 200 * MiB, 100 * MiB], [5]]


def test_two_broadcasts_in_flight_and_single_tensors_in_place():
    sizes = [100 * MiB, 200 * MiB, 150 * MiB, 150 * MiB, 300 * MiB, 60 * MiB, 70 * MiB]
    # chunks: [100, 200] [150, 150] [300] (one tensor: a view, no copy) [60, 70]
    events = [(offset, delta) for offset, delta, category in broadcast_events(sizes) if category is Category.TEMPORARY]
    assert events == [(0, 300 * MiB), (1, 300 * MiB),  # two in flight
                      (0, -300 * MiB),  # the oldest finishes before the third (in place) starts
                      (1, -300 * MiB), (3, 130 * MiB), (3, -130 * MiB)]
    live, peak = 0, 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    assert peak == 600 * MiB  # one chunk at a time would have been 300 MiB
