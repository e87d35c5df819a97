"""Stage 1: model -> traced timeline of a reduced-depth copy, run under fake tensors (no memory).

A decoder stack repeats one layer (or a short pattern of layers: `every_n_layers` checkpointing,
alternating attention types) L times. The trace runs the canonical step on a copy with `trace_depth`
layers -- one leading group, one template group and a trailing group -- so that every edge effect
(the first layer's input, the last layer's output) is seen once, and the timeline stage replicates the
template group's events to reach L. The full-depth fake run is the tier-3 oracle, never the predictor.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmsim.spec import ModelSpec, TrainSetup
from llmsim.step import StepInfo, run_canonical_step
from llmsim.tracker import StorageTracker


@dataclass(frozen=True)
class Trace:
    timeline: pd.DataFrame  # events of the traced run, in order (see tracker.TIMELINE_COLUMNS)
    info: StepInfo
    depth: int  # decoder layers in the traced copy
    period: int  # layers repeat their behaviour with this period
    num_layers: int  # decoder layers of the real model


def layer_period(spec: ModelSpec, setup: TrainSetup) -> int:
    return math.lcm(setup.ckpt_period, spec.layer_period)


def trace_depth(num_layers: int, period: int) -> int:
    """Leading group + template group + trailing group (plus the remainder of a partial group)."""
    depth = 3 * period + num_layers % period
    return min(depth, num_layers)


def model_builder(spec: ModelSpec, setup: TrainSetup, num_layers: int | None):
    """How the canonical step builds the model (fp32 always; the cast to bf16 is part of the step)."""
    if spec.factory is not None:
        return spec.factory_callable()
    config = spec.hf_config(num_layers)

    def build():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=setup.attention.value)
    return build


def run_fake(spec: ModelSpec, setup: TrainSetup, num_layers: int | None) -> tuple[pd.DataFrame, StepInfo]:
    """The canonical step under FakeTensorMode: exact bytes, no memory."""
    tracker = StorageTracker()
    with FakeTensorMode():
        info = run_canonical_step(model_builder(spec, setup, num_layers), setup, tracker, num_layers)
    return tracker.timeline(), info


@functools.lru_cache(maxsize=32)
def trace(spec: ModelSpec, setup: TrainSetup) -> Trace:
    if spec.factory is not None:  # an arbitrary nn.Module cannot be cut to fewer layers: trace it whole
        timeline, info = run_fake(spec, setup, None)
        return Trace(timeline, info, info.num_blocks, 1, info.num_blocks)
    num_layers = spec.num_layers
    period = layer_period(spec, setup)
    depth = trace_depth(num_layers, period)
    timeline, info = run_fake(spec, setup, depth)
    return Trace(timeline, info, depth, period, num_layers)
