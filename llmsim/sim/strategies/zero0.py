"""DeepSpeed ZeRO stage 0 (deepspeed/runtime/engine.py, DeepSpeed 0.19): the client AdamW, or the one a JSON
"optimizer" section builds (`_configure_basic_optimizer`: FusedAdam, or torch's AdamW with `torch_adam`).

fp32: the engine uses the (client or JSON) optimizer as it is (`_configure_optimizer`: `self.optimizer =
basic_optimizer`), so the rank runs the single-process step plus the data-parallel reduction at the end of
every backward: `allreduce_gradients` -> `buffered_allreduce_fallback(elements_per_buffer=5e8)` walks
`named_parameters()`, splits the gradients by dtype, and `allreduce_no_retain` closes a bucket once its numel
exceeds 5e8 (the last tensor can overshoot); each bucket is flattened into a new copy, all-reduced and
copied back, and the copy is freed before the next bucket. Clipping (`gradient_clipping` defaults to 1.0)
makes only scalars. A FusedAdam (zero_common.step_optimizer) replaces the trace's AdamW, then `engine.zero_grad`
drops the gradients in parameter order.

bf16 (`_do_optimizer_sanity_check` -> DDP_BFLOAT16 -> `_configure_fp16_optimizer`): a torch AdamW (the client's
or `torch_adam`) is wrapped in FP16_UnfusedOptimizer (runtime/fp16/unfused_optimizer.py):
- __init__: per parameter `p.clone().float()` -- a bf16 clone, the fp32 master, the clone freed (line 78);
  `initialize_optimizer_states` (412-434) gives every bf16 parameter a zero gradient, then every fp32
  master one, runs `optimizer.step()` (Adam's states exist from then on) and drops both sets;
- step (200-243): the norm upcasts each bf16 gradient to fp32 one at a time (runtime/utils.py,
  `get_weight_norm`), then `fp32_param.grad = bf16.grad.to(fp32)` for all parameters at once, AdamW on the
  masters, each fp32 gradient freed as its master is copied back; `engine.zero_grad` then drops the bf16
  gradients in parameter order.
A FusedAdam is wrapped in FP16_Optimizer instead (runtime/fp16/fused_optimizer.py, `use_fused_optimizer`):
- __init__ (81-98): `_flatten_dense_tensors([p.clone().detach() ...])` -- every bf16 clone at once, the flat bf16
  buffer, the clones dropped (a list frees from its end) -- then `p.data = q.data` moves every parameter into
  the flat buffer (each own storage freed in parameter order), and `flat.clone().float()` is the flat fp32
  master (the bf16 clone freed); `initialize_optimizer_states` gives the master a zero gradient, steps
  (FusedAdam's two states) and drops it;
- step (273-367): `_flatten_dense_tensors([p.grad.to(fp32) ...])` -- every upcast at once, then the flat fp32
  gradient, the upcasts dropped -- then every bf16 gradient set to None in parameter order; the norm of an
  fp32 tensor and the in-place clip make scalars, FusedAdam steps in place, the flat gradient is dropped.
Either wrapper owns only `is_optimized_parameter`s (requires_grad): with LoRA the adapters, which DeepSpeed has
cast to bf16 after get_peft_model (TrainSetup.cast_after_peft); the reduction walks those alone too.
Gradient accumulation (gradient_accumulation_steps n): the gradients accumulate on the parameters as in the
single-process step, and `allreduce_gradients` runs at the accumulation boundary only (n-th backward); the
wrappers step there, as without it.
The loss levers and checkpoint offload change only the single-process forward and backward the rank keeps
(tier2_levers_zero_cpu.csv); a gradient Liger's loss makes in the forward is dropped by `engine.zero_grad` too.
"""
from __future__ import annotations

import pandas as pd

from llmsim.enums import Category, Phase, Precision
from llmsim.model.step import uses_peft
from llmsim.sim.strategies.events import live_at_end_of_build, trainable_names
from llmsim.sim.strategies.zero12 import GRADIENT_PHASES
from llmsim.sim.strategies.zero_common import (FP32_BYTES, adamw, construct_optimizer, optimizer_of, rank_writer,
                                           own_runs, parameters, rows_of, step_optimizer, torch_fused,
                                           walk_phases)

ALLREDUCE_ELEMENTS_PER_BUFFER = 500_000_000  # engine.py: buffered_allreduce_fallback default
BF16_BYTES = 2


def buckets(numels: list[int], limit: int = ALLREDUCE_ELEMENTS_PER_BUFFER) -> list[int]:
    """Numels of the flat copies `allreduce_no_retain` makes, one per bucket of two or more gradients: torch's
    `_flatten_dense_tensors` returns a view of a lone tensor (`flatten_dense_tensors` in
    torch/csrc/utils/tensor_flatten.h), which `allreduce_bucket` then reduces in place (trainable tokens alone
    have a single trainable parameter)."""
    out, current, count = [], 0, 0
    for numel in numels:
        current, count = current + numel, count + 1
        if current > limit:
            out.append((current, count))
            current, count = 0, 0
    out += [(current, count)] if count else []
    return [numel for numel, count in out if count > 1]


class _Rank:
    def __init__(self, timeline: pd.DataFrame, layout, setup) -> None:
        self.bf16 = setup.precision is Precision.BF16
        self.elem = BF16_BYTES if self.bf16 else FP32_BYTES
        self.params = parameters(timeline, self.elem)
        storages = live_at_end_of_build(timeline, Category.PARAMETER)
        self.storages = [(int(serial), int(nbytes)) for serial, nbytes in storages["nbytes"].items()]
        if uses_peft(setup):  # the wrappers and the reduction own the trainable parameters alone
            names = trainable_names(timeline)
            self.storages = [s for s, p in zip(self.storages, self.params) if p.name in names]
            self.params = [p for p in self.params if p.name in names]
        self.numels = [p.numel for p in self.params]
        self.kind, self.foreach = optimizer_of(layout.deepspeed, setup)
        self.fused = torch_fused(layout.deepspeed, setup)
        self.flat = self.bf16 and self.kind == "fused"  # FP16_Optimizer, else FP16_UnfusedOptimizer
        # the trace's AdamW step is replaced unless it is the one that runs (fp32, a torch AdamW as traced)
        self.replace_step = (self.bf16 or self.kind == "fused" or self.foreach != setup.foreach
                             or self.fused != setup.fused)
        self.timeline = timeline
        self.w = rank_writer(timeline, setup)
        self.grads: dict[str, tuple[int, int]] = {}
        self.grad_accum = setup.grad_accum
        self.micro = 0  # the micro-step of the optimizer step whose backward runs

    def run(self) -> pd.DataFrame:
        t = self.timeline
        optimizer = (t["phase"] == Phase.OPTIMIZER.value).to_numpy()
        gradients = (t["phase"].isin(GRADIENT_PHASES) & (t["category"] == Category.GRADIENT.value)).to_numpy()
        rows = rows_of(t)
        own = gradients | (optimizer & self.replace_step)
        walk_phases(rows, self._row, self._leave, self.w, own_runs(rows, own))
        return self.w.frame(t)

    def _row(self, row: tuple) -> None:
        if self.replace_step and row[1] == Phase.OPTIMIZER.value:
            return  # the wrapper's (or FusedAdam's) step replaces the traced one
        if row[1] in GRADIENT_PHASES and row[6] == Category.GRADIENT.value and row[5] > 0:
            self.grads[row[7]] = (int(row[4]), int(row[5]))
        self.w.keep(row)

    def _leave(self, step: int, phase: str) -> None:
        self.w.step, self.w.phase = step, phase
        if phase == Phase.BUILD.value:
            construct_optimizer(self.w, self.kind)
            if self.flat:
                self.flat_init()
            elif self.bf16:
                self.unfused_init()
        elif phase == Phase.BACKWARD.value:
            self.micro += 1
            if self.micro == self.grad_accum:  # allreduce_gradients at the accumulation boundary only
                for numel in buckets(self.numels):
                    copy = self.w.alloc(numel * self.elem, Category.TEMPORARY)
                    self.w.free(copy, numel * self.elem, Category.TEMPORARY)
        elif phase == Phase.OPTIMIZER.value:
            self.micro = 0
            if self.flat:
                self.flat_step()
            elif self.bf16:
                self.unfused_step()
            elif self.replace_step:
                step_optimizer(self.w, self.numels, step == 0, self.foreach, self.kind, self.fused)
                self.zero_grad()

    def zero_grad(self) -> None:
        for p in self.params:
            if p.name in self.grads:
                self.w.free(*self.grads.pop(p.name), Category.GRADIENT)

    def flat_init(self) -> None:
        total = sum(self.numels)
        clones = [(self.w.alloc(n * BF16_BYTES, Category.TEMPORARY), n) for n in self.numels]
        self.w.alloc(total * BF16_BYTES, Category.PARAMETER)
        for serial, numel in reversed(clones):
            self.w.free(serial, numel * BF16_BYTES, Category.TEMPORARY)
        for serial, nbytes in self.storages:  # p.data = q.data
            self.w.free(serial, nbytes, Category.PARAMETER)
        clone = self.w.alloc(total * BF16_BYTES, Category.TEMPORARY)
        self.w.alloc(total * FP32_BYTES, Category.MASTER_WEIGHTS)
        self.w.free(clone, total * BF16_BYTES, Category.TEMPORARY)
        zero = self.w.alloc(total * FP32_BYTES, Category.GRADIENT)
        step_optimizer(self.w, [total], True, self.foreach, self.kind, self.fused)
        self.w.free(zero, total * FP32_BYTES, Category.GRADIENT)

    def flat_step(self) -> None:
        total = sum(self.numels)
        upcasts = [(self.w.alloc(n * FP32_BYTES, Category.TEMPORARY), n) for n in self.numels]
        flat = self.w.alloc(total * FP32_BYTES, Category.GRADIENT)
        for serial, numel in reversed(upcasts):
            self.w.free(serial, numel * FP32_BYTES, Category.TEMPORARY)
        self.zero_grad()  # `p.grad = None` for every bf16 parameter
        step_optimizer(self.w, [total], False, self.foreach, self.kind, self.fused)
        self.w.free(flat, total * FP32_BYTES, Category.GRADIENT)

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
        self.zero_grad()  # engine.zero_grad


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    frame = _Rank(timeline, layout, setup).run()
    return {rank: frame for rank in range(layout.world_size)}
