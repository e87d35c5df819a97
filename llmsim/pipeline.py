"""The whole pipeline in one place: model -> trace -> per-rank plan -> timeline -> peaks (DESIGN.md)."""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import pandas as pd

from llmsim.enums import Device
from llmsim.graph import layer_graph
from llmsim.peaks import Peak, replay
from llmsim.spec import ModelSpec, TrainSetup, check_fits_positions, resolve_attention
from llmsim.strategies import STRATEGIES, Layout, Strategy
from llmsim.timeline import expand
from llmsim.trace import trace


@dataclass(frozen=True)
class RankPrediction:
    rank: int
    peak: Peak
    peak_reserved_bytes: int  # the CPU has no caching allocator: reserved == allocated
    device_total_bytes: int  # the CPU has no context or communicator buffers: total == reserved
    timeline: pd.DataFrame = field(repr=False)

    @property
    def peak_allocated_bytes(self) -> int:
        return self.peak.allocated_bytes

    def to_dict(self) -> dict:
        return {"rank": self.rank, "peak_allocated_bytes": self.peak.allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "device_total_bytes": self.device_total_bytes,
                "peak_step": self.peak.step, "peak_phase": self.peak.phase, "peak_layer": self.peak.layer,
                "breakdown_bytes": dict(self.peak.breakdown_bytes)}


@dataclass(frozen=True)
class Prediction:
    model: ModelSpec
    setup: TrainSetup
    layout: Layout
    ranks: list[RankPrediction]
    graph: nx.DiGraph = field(repr=False)

    @property
    def peak_allocated_bytes(self) -> int:
        return max(r.peak_allocated_bytes for r in self.ranks)

    def breakdown(self) -> pd.DataFrame:
        """Bytes by category at each rank's peak: one row per rank."""
        return pd.DataFrame([r.peak.breakdown_bytes for r in self.ranks]).fillna(0).astype("int64")

    def to_dict(self) -> dict:
        return {"model": self.model.name, "strategy": self.layout.strategy.value,
                "world_size": self.layout.world_size,
                "micro_batch": self.setup.micro_batch, "seq_len": self.setup.seq_len,
                "precision": self.setup.precision.value, "attention": self.setup.attention.value,
                "grad_ckpt": self.setup.grad_ckpt, "ckpt_every": self.setup.ckpt_every,
                "device": self.setup.device.value, "peak_allocated_bytes": self.peak_allocated_bytes,
                "ranks": [r.to_dict() for r in self.ranks]}


def predict(model: ModelSpec, setup: TrainSetup, layout: Layout = Layout()) -> Prediction:
    setup = resolve_attention(model, setup)
    check_fits_positions(model, setup)
    traced = trace(model, setup)
    timeline = expand(traced)
    ranks = []
    for rank, rank_timeline in sorted(STRATEGIES[layout.strategy](timeline, layout, setup).items()):
        peak = replay(rank_timeline)
        reserved = _reserved(peak, setup.device)
        ranks.append(RankPrediction(rank, peak, reserved, reserved, rank_timeline))
    return Prediction(model, setup, layout, ranks, layer_graph(timeline, traced.info))


def _reserved(peak: Peak, device: Device) -> int:
    assert device is Device.CPU  # the GPU allocator model comes with the GPU profiles
    return peak.allocated_bytes
