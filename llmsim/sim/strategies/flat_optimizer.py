"""The client optimizer as DeepSpeed ZeRO steps it: on flat fp32 partitions, recorded from the library's own step.

DeepSpeed hands the client optimizer new parameters: ZeRO-1/2 one flat 1-D fp32 tensor per param group
(deepspeed/runtime/zero/stage_1_and_2.py: `param_group['params'] = [self.single_partition_of_fp32_groups[i]]`;
`_optimizer_step` steps it with its fp32 gradient set as `.grad`), ZeRO-3 one per sub-group (stage3.py
`_optimizer_step`: `param_groups[g]['params'] = [fp32_param]`, `step()`, then `[]`). What the optimizer allocates
there depends on its class, its defaults and those numels alone. A factored optimizer sees vectors: torch's and
transformers' Adafactor keep a full second moment of the partition (their factoring needs `dim() >= 2`), and
bitsandbytes' 8-bit AdamW quantizes the whole partition blockwise (one absmax per 256 elements; 32-bit states
when the partition is under `min_8bit_size`).

Rather than restate each library's step, `recorded_steps` runs it: the optimizer `make_optimizer` builds (the
class and defaults of the canonical step), on fake fp32 vectors of those numels under FakeTensorMode and a
StorageTracker, stepped as DeepSpeed steps it, once per training step; the values its step reads are answered as
in the single-process trace (llmsim/model/optimizer_values.py). What its constructor allocates (bitsandbytes' quantile
maps) is left out: the real run allocates it when the client builds the optimizer on the model's parameters, and
the single-process trace already holds that. `FlatOptimizer` replays the events into a rank.
"""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmsim.enums import Category, Optimizer, Phase
from llmsim.model.optimizer_values import answered_optimizer_values
from llmsim.inputs.spec import TrainSetup
from llmsim.model.step import make_optimizer, optimizer_class
from llmsim.sim.strategies.zero_common import EventWriter
from llmsim.model.tracker import StorageTracker

Event = tuple[int, int, str]  # (serial in the recording, delta bytes, category)


@functools.lru_cache(maxsize=64)
def recorded_steps(optimizer: Optimizer, numels: tuple[int, ...], steps: int, foreach: bool,
                   fused: bool = False) -> tuple[tuple[tuple[Event, ...], ...], ...]:
    """[step][sub-group] -> the events of `optimizer` stepping the fp32 vector of `numels[sub-group]` elements."""
    optimizer_class(optimizer)  # imported for real: a module imported under the fake mode keeps fakes
    tracker = StorageTracker()
    with FakeTensorMode(), answered_optimizer_values(optimizer), tracker:
        # Made under the tracker (in its build phase, left out below), so that it knows their storages: an
        # in-place update of a storage it has never seen would count as an allocation.
        params = [torch.nn.Parameter(torch.empty(numel, dtype=torch.float32)) for numel in numels]
        for param in params:
            param.grad = torch.empty(param.numel(), dtype=torch.float32)
        opt = make_optimizer(params, TrainSetup(1, 1, optimizer=optimizer, foreach=foreach, fused=fused))
        group = opt.param_groups[0]
        for step in range(steps):
            for index, param in enumerate(params):
                tracker.set_phase(step * len(numels) + index, Phase.OPTIMIZER)  # one (step, sub-group) each
                group["params"] = [param]
                opt.step()
                group["params"] = []
                tracker.label([t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)],
                              Category.OPTIMIZER_STATE)
        tracker.finish()
    timeline = tracker.timeline()
    built = set(timeline.loc[timeline["phase"] == Phase.BUILD.value, "serial"])
    calls = timeline[(timeline["phase"] == Phase.OPTIMIZER.value) & ~timeline["serial"].isin(built)]
    by_call: list[list[Event]] = [[] for _ in range(steps * len(numels))]
    for call, serial, delta, category in zip(calls["step"], calls["serial"], calls["delta_bytes"], calls["category"]):
        by_call[int(call)].append((int(serial), int(delta), str(category)))
    return tuple(tuple(tuple(by_call[step * len(numels) + index]) for index in range(len(numels)))
                 for step in range(steps))


class FlatOptimizer:
    """One rank's client optimizer over its fp32 partitions of `numels` elements: the recorded events, replayed with
    the rank's own serials (a state made at one step and replaced at a later one is freed under the same serial)."""

    def __init__(self, optimizer: Optimizer, numels: list[int], steps: int, foreach: bool,
                 fused: bool = False) -> None:
        self.events = recorded_steps(optimizer, tuple(numels), steps, foreach, fused)
        self.serials: dict[int, int] = {}

    def step(self, w: EventWriter, step: int, group: int) -> None:
        """`optimizer.step()` on partition `group` at training step `step`."""
        for serial, delta, category in self.events[step][group]:
            own = self.serials.get(serial)
            if own is None:
                self.serials[serial] = w.alloc(delta, Category(category))
            else:
                w.free(own, -delta, Category(category))  # a free, or a resize by `delta`
