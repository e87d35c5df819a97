"""Llama-2-70B PP 16 (1F1B, 16 micro-batches, bf16, checkpointing, seq 4096) on H100s: stages 0, 5 and 15 traced
at their full depth (5 layers; the chunk replay as in any prediction) against the prediction's expansion of the
3-layer trace, replayed through the caching-allocator model: peak allocated and reserved, and the events compared
storage for storage (serials numbered in allocation order, bulk frees sorted as tests/test_pipeline_stages.py does).
Run: python experiments/check_stage_expansion_70b.py  (output in experiments/check_stage_expansion_70b.out)"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from llmsim.enums import Precision
from llmsim.inputs.gpus import load_gpu
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.model.pipelining import Schedule
from llmsim.model.trace import _run_replaying_chunks, trace
from llmsim.sim import traced
from llmsim.sim.allocator import AllocatorConfig
from llmsim.sim.pipeline import checked
from llmsim.sim.replay import _predict_rank
from llmsim.sim.strategies import Layout
from llmsim.sim.timeline import expand

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_expansion import _allocation_order  # noqa: E402
from test_pipeline_stages import frees_in_serial_order  # noqa: E402

COLUMNS = ["step", "phase", "block", "serial", "delta_bytes", "category"]


def main() -> None:
    spec, gpu = load_model_spec("llama-2-70b"), load_gpu("h100-80gb")
    layout = Layout(world_size=16, pp=16, schedule=Schedule.ONE_F_ONE_B, n_microbatches=16)
    setup = checked(spec, TrainSetup(1, 4096, Precision.BF16, grad_ckpt=True), layout, gpu)
    for stage in (0, 5, 15):
        stage_setup = replace(traced._stage_setup(setup, layout, stage), steps=2)
        reduced = trace(spec, stage_setup)
        full, _ = _run_replaying_chunks(spec, stage_setup, reduced.num_layers)
        expanded = expand(reduced)
        peaks = [_predict_rank(0, t.reset_index(drop=True), gpu, AllocatorConfig()) for t in (full, expanded)]
        a, b = (frees_in_serial_order(_allocation_order(t))[COLUMNS].to_numpy() for t in (full, expanded))
        differing = int(np.any(a != b, axis=1).sum()) if a.shape == b.shape else "lengths differ"
        print(f"stage {stage}: {reduced.num_layers} layers, traced at {reduced.depth}; full depth allocated "
              f"{peaks[0].peak_allocated_bytes:,} B reserved {peaks[0].peak_reserved_bytes:,} B; expanded allocated "
              f"{peaks[1].peak_allocated_bytes:,} B reserved {peaks[1].peak_reserved_bytes:,} B; "
              f"{len(full):,} events, {differing} differing", flush=True)


if __name__ == "__main__":
    main()
