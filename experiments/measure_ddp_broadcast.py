"""DDP's construction broadcast at a size with several 250 MiB chunks: a real 2-rank run (torchrun, gloo, the tracker
in every rank) of a 116M-parameter Llama-2 shape, its rows to data/measurements/tier2_ddp_broadcast_cpu.csv, and the
build phase's most live bytes, measured (from the ranks' kept timelines) against predicted.
Run: python experiments/measure_ddp_broadcast.py   (about a minute on 2 cores, 3 GB per rank)"""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pandas as pd

import llmsim.measure.runs as measure
from llmsim.enums import Phase
from llmsim.measure.launch import run_ranks
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.inputs.zoo import shrink

CSV = measure.MEASUREMENTS_DIR / "tier2_ddp_broadcast_cpu.csv"


def build_max(timeline: pd.DataFrame) -> int:
    return int(timeline["delta_bytes"].cumsum()[timeline["phase"] == Phase.BUILD.value].max())


def main() -> None:
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 1024, 4, 32000, 8))
    setup, layout = TrainSetup(1, 32), Layout(Strategy.DDP, 2)
    with tempfile.TemporaryDirectory() as kept:
        measure.run_ranks = functools.partial(run_ranks, keep=Path(kept))  # keep each rank's timeline
        rows = measure.measure_distributed(spec, setup, layout)
        measured = {r["rank"]: build_max(pd.read_csv(Path(kept) / f"rank{r['rank']}.timeline.csv")) for r in rows}
    measure.append_rows(rows, CSV)
    prediction = predict(spec, setup, layout)
    for r in rows:
        rank = prediction.ranks[r["rank"]]
        print(f"rank {r['rank']}: peak {r['peak_allocated_bytes']:,} B measured, {rank.peak_allocated_bytes:,} "
              f"predicted; build {measured[r['rank']]:,} B measured, {build_max(rank.timeline):,} predicted")


if __name__ == "__main__":
    main()
