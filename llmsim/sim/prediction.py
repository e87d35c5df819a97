"""What a prediction is: each rank's peak, reserved and device total (`RankPrediction`), and the whole layout's
(`Prediction`), with the inputs it was made from and the torch it traced."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import pandas as pd

from llmsim.inputs.gpus import GpuProfile
from llmsim.inputs.hf import recipe_facts
from llmsim.inputs.spec import ModelSpec, TrainSetup
from llmsim.sim.allocator import AllocatorConfig
from llmsim.sim.peaks import Peak
from llmsim.sim.strategies import Layout

if TYPE_CHECKING:  # networkx loads when a graph is first asked for
    import networkx as nx


def torch_version() -> str:
    """The torch the trace ran on: its kernels and autograd decide the bytes, so a prediction names it."""
    import torch

    return torch.__version__


@dataclass(frozen=True)
class RankPrediction:
    rank: int
    peak: Peak
    peak_reserved_bytes: int  # the caching allocator's segments (on the CPU, no allocator: == allocated)
    device_total_bytes: int  # reserved + CUDA context (on the CPU: == reserved)
    frame: pd.DataFrame | Callable[[], pd.DataFrame] = field(repr=False)  # the timeline, or how to rebuild it
    capacity_bytes: int | None = None  # the GPU's, when one is given
    fits: bool | None = None
    peak_host_bytes: int = 0  # host memory: the most checkpoint inputs offloaded at once (--ckpt-offload)

    @property
    def peak_allocated_bytes(self) -> int:
        return self.peak.allocated_bytes

    @property
    def timeline(self) -> pd.DataFrame:
        """The rank's device timeline (rebuilt on demand where the strategy does not keep one per rank)."""
        return self.frame() if callable(self.frame) else self.frame

    def to_dict(self) -> dict:
        return {"rank": self.rank, "peak_allocated_bytes": self.peak.allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "device_total_bytes": self.device_total_bytes,
                "peak_step": self.peak.step, "peak_phase": self.peak.phase, "peak_layer": self.peak.layer,
                "breakdown_bytes": dict(self.peak.breakdown_bytes), "capacity_bytes": self.capacity_bytes,
                "headroom_bytes": (self.capacity_bytes - self.device_total_bytes
                                   if self.capacity_bytes is not None else None),
                "fits": self.fits, "peak_host_bytes": self.peak_host_bytes}


@dataclass(frozen=True)
class Prediction:
    model: ModelSpec
    setup: TrainSetup
    layout: Layout
    ranks: list[RankPrediction]
    graph_of: Callable[[], nx.DiGraph] = field(repr=False)  # the layer graph, built when first asked for
    gpu: GpuProfile | None = None
    alloc_conf: AllocatorConfig = AllocatorConfig()

    @property
    def peak_allocated_bytes(self) -> int:
        return max(r.peak_allocated_bytes for r in self.ranks)

    @property
    def peak_host_bytes(self) -> int:
        return max(r.peak_host_bytes for r in self.ranks)

    @property
    def graph(self) -> nx.DiGraph:
        """The layer graph (llmsim/sim/graph.py) of the traced process (with pipeline stages, the last stage's)."""
        return self.graph_of()

    def breakdown(self) -> pd.DataFrame:
        """Bytes by category at each rank's peak: one row per rank."""
        return pd.DataFrame([r.peak.breakdown_bytes for r in self.ranks]).fillna(0).astype("int64")

    def to_dict(self) -> dict:
        return {"model": self.model.name, "strategy": self.layout.strategy.value,
                "world_size": self.layout.world_size, "tp": self.layout.tp, "pp": self.layout.pp,
                "schedule": self.layout.schedule.value if self.layout.pp > 1 else None,
                "n_microbatches": self.layout.n_microbatches,
                "pp_split": list(self.layout.pp_split) if self.layout.pp_split else None,
                "micro_batch": self.setup.micro_batch, "seq_len": self.setup.seq_len,
                "precision": self.setup.precision.value, "attention": self.setup.attention.value,
                "grad_ckpt": self.setup.grad_ckpt, "ckpt_every": self.setup.ckpt_every,
                "ckpt_offload": self.setup.ckpt_offload, "device": self.setup.device.value,
                "gpu": self.gpu.name if self.gpu else None,
                "expandable_segments": self.alloc_conf.expandable_segments,
                "peak_allocated_bytes": self.peak_allocated_bytes, "peak_host_bytes": self.peak_host_bytes,
                **recipe_facts(self.setup), "torch": torch_version(),
                "ranks": [r.to_dict() for r in self.ranks]}
