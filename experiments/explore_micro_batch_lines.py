"""Does a pipeline stage's timeline grow on a line with the micro-batch, event for event? Llama-2-70B, seq 4096, bf16,
checkpointing, H100-80GB, 1F1B: each stage's planned full-depth timeline (what `size` replays) at two micro-batches,
put on the line through them (`timeline.on_the_line`), against the traced timeline at others; and the device totals
the two give. `size` tries first where the line says its answer is (`size._lined`); this is what backs the guess.

Run: python experiments/explore_micro_batch_lines.py  (output in experiments/explore_micro_batch_lines.out; about a
minute)"""
from __future__ import annotations

import time

import numpy as np

from llmsim.enums import Precision
from llmsim.inputs.gpus import load_gpu
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.model.pipelining import Schedule
from llmsim.sim.allocator import AllocatorConfig
from llmsim.sim.pipeline import checked_stage_timeline
from llmsim.sim.replay import predict_timeline
from llmsim.sim.strategies import Layout, Strategy
from llmsim.sim.timeline import on_the_line

GIB = 1 << 30
spec, gpu = load_model_spec("llama-2-70b"), load_gpu("h100-80gb")


def at(layout: Layout, stage: int, micro_batch: int):
    return checked_stage_timeline(spec, TrainSetup(micro_batch, 4096, Precision.BF16, grad_ckpt=True), layout, stage,
                                  gpu)


def check(layout: Layout, name: str, stage: int, points: tuple[int, int], others: tuple[int, ...]) -> None:
    begin = time.perf_counter()
    line = on_the_line(*(at(layout, stage, b) for b in points), points)
    if line is None:
        a, b = (at(layout, stage, b) for b in points)
        print(f"{name}, stage {stage}: micro-batches {points[0]} and {points[1]} have not the same events "
              f"({len(a):,} and {len(b):,}): no line")
        return
    for micro_batch in others:
        guess, traced = line(micro_batch), at(layout, stage, micro_batch)
        same = len(guess) == len(traced) and np.array_equal(guess["delta_bytes"].to_numpy(),
                                                            traced["delta_bytes"].to_numpy())
        needs = [predict_timeline(frame, gpu, AllocatorConfig()).needed_bytes / GIB for frame in (guess, traced)]
        print(f"{name}, stage {stage}, micro-batch {micro_batch} on the line through {points[0]} and {points[1]}: "
              f"{len(traced):,} events, {'equal' if same else 'NOT equal'} event for event; device total "
              f"{needs[0]:.2f} GiB on the line, {needs[1]:.2f} GiB traced")
    print(f"  ({time.perf_counter() - begin:.1f} s)")


tp8pp4 = Layout(Strategy.DDP, 64, tp=8, pp=4, schedule=Schedule.ONE_F_ONE_B, n_microbatches=4)
check(tp8pp4, "DDP 2 x TP 8 x PP 4", 0, (1, 2), (3, 5, 8))
check(tp8pp4, "DDP 2 x TP 8 x PP 4", 3, (1, 2), ())
check(tp8pp4, "DDP 2 x TP 8 x PP 4", 3, (2, 3), (4, 6))
tp4pp16 = Layout(Strategy.SINGLE, 64, tp=4, pp=16, schedule=Schedule.ONE_F_ONE_B, n_microbatches=16)
check(tp4pp16, "TP 4 x PP 16", 15, (2, 7), (3, 5))
