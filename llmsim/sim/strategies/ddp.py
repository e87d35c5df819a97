"""torch DistributedDataParallel: every rank is the single-process step plus DDP's own buffers.

Read from torch/nn/parallel/distributed.py and torch/csrc/distributed/c10d/reducer.cpp (torch 2.13):
- construction broadcasts parameters and buffers from rank 0 with `_broadcast_coalesced`
  (c10d/comm.cpp): `compute_bucket_assignment_by_size` groups them into chunks of `broadcast_bucket_size`
  = 250 MiB (a chunk closes once it reaches the limit), each chunk is flattened into one new tensor
  (`flatten_dense_tensors`: a chunk of one tensor is a view of it, no copy) and at most 2 broadcasts are in
  flight: the oldest finishes, and its flat tensor is freed, before a third starts;
- the Reducer allocates one flat gradient buffer per bucket; the buckets cover every parameter that
  requires grad, so together they hold one more copy of the gradients (gradient_as_bucket_view=False,
  the default). After the first backward the buckets are rebuilt in gradient order: the old buffers are
  freed before the new ones are allocated, so the total does not change.
  The buckets hold only parameters that require grad (`_build_params_for_reducer`), while the broadcast
  (`_sync_module_states`) sends every parameter: with LoRA the frozen base is broadcast but not bucketed.
Issue 5's levers add nothing of DDP's own (measured in data/measurements/tier2_levers_ddp_cpu.csv):
- gradient accumulation without `no_sync` (`require_backward_grad_sync` stays True) all-reduces every backward
  through the same buckets: `mark_variable_ready_dense` copies each gradient into its bucket view
  (`at::mul_out`), and `copy_bucket_to_grad` copies the average back into the existing `.grad`, which
  AccumulateGrad then accumulates in place; the rebuild of the buckets moves to the first forward after the
  first backward (the second pass of the first step), freeing the old buffers before allocating the new ones;
- peft's extras: the `ModulesToSaveWrapper`'s frozen original and the frozen base under trainable tokens are
  broadcast, not bucketed; the trained copy, the token delta (fp32 on a bf16 base) and its buffer of original
  rows are broadcast too (the delta bucketed). Every trainable parameter receives a gradient in every
  backward, so `find_unused_parameters=False` holds;
- the loss levers patch the wrapped module's forward, which DDP calls as is; their custom autograd Functions
  (TRL's ChunkedLogProbFunction, Liger's gradient computed in the forward) hand `lm_head.weight` its gradient
  in the backward, where AccumulateGrad's post hook fires DDP's as for any parameter;
- checkpoint offload (`save_on_cpu`) wraps each checkpointed layer's saved inputs; the reducer never sees it.
"""
from __future__ import annotations

import collections
import functools

import pandas as pd
import torch
import torch.distributed as dist

from llmsim.enums import Category, Phase
from llmsim.model.step import uses_peft
from llmsim.sim.strategies.events import (end_of_build, live_at_end_of_build, live_sizes_at_end_of_build, new_events,
                                     per_timeline, splice, trainable_names)

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DistributedDataParallel.broadcast_bucket_size
MAX_IN_FLIGHT = 2  # c10d broadcast_coalesced: `max_in_flight`


def coalesced_chunks(sizes, limit: int) -> list[list[int]]:
    """The tensors (their byte sizes) of each `_broadcast_coalesced` chunk, from c10d's own
    `compute_bucket_assignment_by_size` (run on meta tensors of these sizes: one dtype, which is what the
    timeline knows; tensors of different dtypes would go to separate chunks)."""
    return [list(chunk) for chunk in _chunks(tuple(sizes), limit)]


@functools.lru_cache(maxsize=32)
def _chunks(sizes: tuple[int, ...], limit: int) -> tuple[tuple[int, ...], ...]:
    """Kept per model: every DDP prediction of one traced model broadcasts the same parameters."""
    tensors = [torch.empty(size, dtype=torch.uint8, device="meta") for size in sizes]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [limit])
    return tuple(tuple(sizes[i] for i in bucket) for bucket in buckets)


def broadcast_events(sizes: list[int], limit: int = BROADCAST_BUCKET_BYTES) -> list[tuple[int, int, Category]]:
    """(serial offset, delta, category) of the flat chunks `_broadcast_coalesced` allocates and frees."""
    deltas, in_flight = [], collections.deque()
    for offset, chunk in enumerate(_chunks(tuple(sizes), limit)):
        if len(in_flight) >= MAX_IN_FLIGHT:
            done, nbytes = in_flight.popleft()
            deltas.append((done, -nbytes, Category.TEMPORARY))
        nbytes = sum(chunk) if len(chunk) > 1 else 0  # a single tensor is broadcast in place
        if nbytes:
            deltas.append((offset, nbytes, Category.TEMPORARY))
        in_flight.append((offset, nbytes))
    deltas += [(offset, -nbytes, Category.TEMPORARY) for offset, nbytes in in_flight if nbytes]
    return [d for d in deltas if d[1]]


def _trainable_bytes(timeline: pd.DataFrame, setup) -> int:
    live = live_at_end_of_build(timeline, Category.PARAMETER)
    if uses_peft(setup):  # the frozen base (LoRA, or trainable tokens alone) gets no gradient and no bucket slot
        live = live[live["name"].isin(trainable_names(timeline))]
    return int(live["nbytes"].sum())


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    """Every rank's timeline: the traced one with DDP's buffers, or over TP shards the traced one as it is (torch's
    replicate ran in the trace: llmsim/model/replicate.py)."""
    rank_timeline = timeline if setup.replicate_dp else replica_timeline(timeline, setup)
    return {rank: rank_timeline for rank in range(layout.world_size)}


@per_timeline(maxsize=32)
def replica_timeline(timeline: pd.DataFrame, setup) -> pd.DataFrame:
    """Every DDP rank's timeline, the same at any world size: kept for the next world size (and its replay with
    it, `replay._shared_prediction`), as many as a 32-stage pipeline's stages."""
    params = live_sizes_at_end_of_build(timeline, Category.PARAMETER)
    buffers = live_sizes_at_end_of_build(timeline, Category.BUFFER)
    serial = int(timeline["serial"].max()) + 1
    deltas = broadcast_events(params + buffers)
    deltas.append((len(params) + len(buffers), _trainable_bytes(timeline, setup), Category.REDUCE_BUCKET))
    events = new_events(deltas, "DistributedDataParallel", 0, Phase.BUILD, serial)
    return splice(timeline, end_of_build(timeline), events)
