"""DeepSpeed ZeRO stage 0 in fp32 (deepspeed/runtime/engine.py, DeepSpeed 0.19), client AdamW.

With no ZeRO and no mixed precision the engine uses the client optimizer as it is (engine.py,
`_configure_optimizer`: `self.optimizer = basic_optimizer`), so the rank runs the single-process step,
plus the data-parallel reduction at the end of every backward: `allreduce_gradients` ->
`buffered_allreduce_fallback(elements_per_buffer=5e8)` walks `named_parameters()`, splits the gradients by
dtype and `allreduce_no_retain` closes a bucket once its numel exceeds 5e8 (so the last tensor can
overshoot); each bucket is flattened into a new copy, all-reduced and copied back, and the copy is freed
before the next bucket. The step's gradient clipping (`gradient_clipping` defaults to 1.0) makes only
scalars. bf16 wraps the client optimizer in FP16_UnfusedOptimizer, which is not modelled yet.
"""
from __future__ import annotations

import pandas as pd

from llmsim.enums import Category, Phase, Precision
from llmsim.errors import InputError
from llmsim.strategies.zero_common import EventWriter, parameters

ALLREDUCE_ELEMENTS_PER_BUFFER = 500_000_000  # engine.py: buffered_allreduce_fallback default


def buckets(numels: list[int], limit: int = ALLREDUCE_ELEMENTS_PER_BUFFER) -> list[int]:
    """Bucket numels of `allreduce_no_retain`."""
    out, current = [], 0
    for numel in numels:
        current += numel
        if current > limit:
            out.append(current)
            current = 0
    return out + ([current] if current else [])


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    if setup.precision is not Precision.FP32:
        raise InputError("DeepSpeed ZeRO stage 0 with bf16 (FP16_UnfusedOptimizer) is not modelled yet; "
                         "modelled: stage 0 in fp32, stages 1-3 in fp32 and bf16")
    params = parameters(timeline, 4)
    sizes = [n * 4 for n in buckets([p.numel for p in params])]
    w = EventWriter(int(timeline["serial"].max()) + 1, module="deepspeed.allreduce_gradients")
    previous = None
    for row in timeline.itertuples(index=False, name=None):
        key = (int(row[0]), row[1])
        if previous is not None and previous[1] == Phase.BACKWARD.value and key != previous:
            for nbytes in sizes:
                copy = w.alloc(nbytes, Category.TEMPORARY)
                w.free(copy, nbytes, Category.TEMPORARY)
        w.keep(row)
        previous = key
    frame = w.frame()
    return {rank: frame for rank in range(layout.world_size)}
