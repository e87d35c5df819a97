"""DeepSpeed ZeRO stage 0 (deepspeed/runtime/engine.py, DeepSpeed 0.19), client AdamW.

fp32: the engine uses the client optimizer as it is (`_configure_optimizer`: `self.optimizer =
basic_optimizer`), so the rank runs the single-process step plus the data-parallel reduction at the end of
every backward: `allreduce_gradients` -> `buffered_allreduce_fallback(elements_per_buffer=5e8)` walks
`named_parameters()`, splits the gradients by dtype, and `allreduce_no_retain` closes a bucket once its numel
exceeds 5e8 (the last tensor can overshoot); each bucket is flattened into a new copy, all-reduced and
copied back, and the copy is freed before the next bucket. Clipping (`gradient_clipping` defaults to 1.0)
makes only scalars.

bf16: the client optimizer is wrapped in FP16_UnfusedOptimizer (runtime/fp16/unfused_optimizer.py):
- __init__: per parameter `p.clone().float()` -- a bf16 clone, the fp32 master, the clone freed (line 78);
  `initialize_optimizer_states` (412-434) gives every bf16 parameter a zero gradient, then every fp32
  master one, runs `optimizer.step()` (Adam's states exist from then on) and drops both sets;
- step (200-243): the norm upcasts each bf16 gradient to fp32 one at a time (runtime/utils.py,
  `get_weight_norm`), then `fp32_param.grad = bf16.grad.to(fp32)` for all parameters at once, AdamW on the
  masters, each fp32 gradient freed as its master is copied back; `engine.zero_grad` then drops the bf16
  gradients in parameter order.
"""
from __future__ import annotations

import pandas as pd

from llmsim.enums import Category, Phase, Precision
from llmsim.strategies.zero_common import (FP32_BYTES, EventWriter, adamw, own_runs, parameters, rows_of,
                                           walk_phases)

ALLREDUCE_ELEMENTS_PER_BUFFER = 500_000_000  # engine.py: buffered_allreduce_fallback default
BF16_BYTES = 2


def buckets(numels: list[int], limit: int = ALLREDUCE_ELEMENTS_PER_BUFFER) -> list[int]:
    """Bucket numels of `allreduce_no_retain`."""
    out, current = [], 0
    for numel in numels:
        current += numel
        if current > limit:
            out.append(current)
            current = 0
    return out + ([current] if current else [])


class _Rank:
    def __init__(self, timeline: pd.DataFrame, setup) -> None:
        self.bf16 = setup.precision is Precision.BF16
        self.elem = BF16_BYTES if self.bf16 else FP32_BYTES
        self.params = parameters(timeline, self.elem)
        self.numels = [p.numel for p in self.params]
        self.foreach, self.fused = setup.foreach, setup.fused
        self.timeline = timeline
        self.w = EventWriter(int(timeline["serial"].max()) + 1, module="deepspeed")
        self.grads: dict[str, tuple[int, int]] = {}

    def run(self) -> pd.DataFrame:
        t = self.timeline
        optimizer = (t["phase"] == Phase.OPTIMIZER.value).to_numpy()
        gradients = ((t["phase"] == Phase.BACKWARD.value) & (t["category"] == Category.GRADIENT.value)).to_numpy()
        rows = rows_of(t)
        walk_phases(rows, self._row, self._leave, self.w, own_runs(rows, gradients | (optimizer & self.bf16)))
        return self.w.frame(t)

    def _row(self, row: tuple) -> None:
        if self.bf16 and row[1] == Phase.OPTIMIZER.value:
            return  # FP16_UnfusedOptimizer's step replaces the client optimizer's
        if row[1] == Phase.BACKWARD.value and row[6] == Category.GRADIENT.value and row[5] > 0:
            self.grads[row[7]] = (int(row[4]), int(row[5]))
        self.w.keep(row)

    def _leave(self, step: int, phase: str) -> None:
        self.w.step, self.w.phase = step, phase
        if phase == Phase.BUILD.value and self.bf16:
            self.unfused_init()
        elif phase == Phase.BACKWARD.value:
            for numel in buckets(self.numels):
                copy = self.w.alloc(numel * self.elem, Category.TEMPORARY)
                self.w.free(copy, numel * self.elem, Category.TEMPORARY)
        elif phase == Phase.OPTIMIZER.value and self.bf16:
            self.unfused_step()

    def unfused_init(self) -> None:
        for numel in self.numels:
            clone = self.w.alloc(numel * BF16_BYTES, Category.TEMPORARY)
            self.w.alloc(numel * FP32_BYTES, Category.MASTER_WEIGHTS)
            self.w.free(clone, numel * BF16_BYTES, Category.TEMPORARY)
        zero16 = [self.w.alloc(n * BF16_BYTES, Category.GRADIENT) for n in self.numels]
        zero32 = [self.w.alloc(n * FP32_BYTES, Category.GRADIENT) for n in self.numels]
        adamw(self.w, self.numels, first=True, foreach=self.foreach, fused=self.fused)
        for serial, numel in zip(zero16, self.numels):
            self.w.free(serial, numel * BF16_BYTES, Category.GRADIENT)
        for serial, numel in zip(zero32, self.numels):
            self.w.free(serial, numel * FP32_BYTES, Category.GRADIENT)

    def unfused_step(self) -> None:
        for numel in self.numels:  # get_weight_norm: p.data.float() per gradient
            upcast = self.w.alloc(numel * FP32_BYTES, Category.TEMPORARY)
            self.w.free(upcast, numel * FP32_BYTES, Category.TEMPORARY)
        grads32 = [self.w.alloc(n * FP32_BYTES, Category.GRADIENT) for n in self.numels]
        adamw(self.w, self.numels, first=False, foreach=self.foreach, fused=self.fused)
        for serial, numel in zip(grads32, self.numels):
            self.w.free(serial, numel * FP32_BYTES, Category.GRADIENT)
        for p in self.params:  # engine.zero_grad
            if p.name in self.grads:
                self.w.free(*self.grads.pop(p.name), Category.GRADIENT)


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    frame = _Rank(timeline, setup).run()
    return {rank: frame for rank in range(layout.world_size)}
