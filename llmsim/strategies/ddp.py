"""torch DistributedDataParallel: every rank is the single-process step plus DDP's own buffers.

Read from torch/nn/parallel/distributed.py and torch/csrc/distributed/c10d/reducer.cpp (torch 2.13):
- construction broadcasts parameters and buffers from rank 0 with `_broadcast_coalesced`, flattening
  them into coalesced chunks of at most `broadcast_bucket_size` = 250 MiB (each freed after its broadcast;
  `take_tensors` closes a chunk once it reaches the limit);
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

import pandas as pd

from llmsim.enums import Category, Phase
from llmsim.step import uses_peft
from llmsim.strategies.events import (end_of_build, live_at_end_of_build, live_sizes_at_end_of_build, new_events,
                                     splice, trainable_names)

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DistributedDataParallel.broadcast_bucket_size


def coalesced_chunks(sizes: list[int], limit: int) -> list[int]:
    """Chunk sizes of `_broadcast_coalesced` (c10d `take_tensors`: a chunk closes once it reaches limit)."""
    chunks, current = [], 0
    for size in sizes:
        current += size
        if current >= limit:
            chunks.append(current)
            current = 0
    return chunks + ([current] if current else [])


def _trainable_bytes(timeline: pd.DataFrame, setup) -> int:
    live = live_at_end_of_build(timeline, Category.PARAMETER)
    if uses_peft(setup):  # the frozen base (LoRA, or trainable tokens alone) gets no gradient and no bucket slot
        live = live[live["name"].isin(trainable_names(timeline))]
    return int(live["nbytes"].sum())


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    params = live_sizes_at_end_of_build(timeline, Category.PARAMETER)
    buffers = live_sizes_at_end_of_build(timeline, Category.BUFFER)
    serial = int(timeline["serial"].max()) + 1
    deltas = []
    for offset, chunk in enumerate(coalesced_chunks(params + buffers, BROADCAST_BUCKET_BYTES)):
        deltas += [(offset, chunk, Category.TEMPORARY), (offset, -chunk, Category.TEMPORARY)]
    deltas.append((len(deltas), _trainable_bytes(timeline, setup), Category.REDUCE_BUCKET))
    events = new_events(deltas, "DistributedDataParallel", 0, Phase.BUILD, serial)
    rank_timeline = splice(timeline, end_of_build(timeline), events)
    return {rank: rank_timeline for rank in range(layout.world_size)}
