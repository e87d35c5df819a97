"""What a prediction is: each rank's peak, reserved and device total (`RankPrediction`), and the whole layout's
(`Prediction`), with the inputs it was made from and the torch it traced."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import numpy as np
import pandas as pd

from llmsim.inputs.gpus import GpuProfile
from llmsim.inputs.hf import recipe_facts
from llmsim.inputs.spec import ModelSpec, TrainSetup
from llmsim.model.tracker import NO_BLOCK
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
    fits: bool | None = None  # verdict == "fits": outside the margin of the card (None without a GPU)
    peak_host_bytes: int = 0  # host memory: the most checkpoint inputs offloaded at once (--ckpt-offload)
    # What the job needs of the card, CUDA context included: the reserved peak where the allocator never has to
    # release its cache within the margin; nearer the capacity, the smallest card on which the allocator model
    # runs it (at capacity PyTorch's allocator frees its cached blocks and retries before it raises OOM)
    needed_bytes: int | None = None
    margin_bytes: int | None = None
    verdict: str | None = None  # "fits" | "tight" (needs more than capacity - margin) | "oom"; None without a GPU

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
                "peak_step": self.peak.step + 1, "peak_phase": self.peak.phase, "peak_layer": self.peak.layer,
                "breakdown_bytes": dict(self.peak.breakdown_bytes), "capacity_bytes": self.capacity_bytes,
                "headroom_bytes": (self.capacity_bytes - self.needed_bytes
                                   if self.capacity_bytes is not None else None),
                "fits": self.fits, "verdict": self.verdict, "needed_bytes": self.needed_bytes,
                "margin_bytes": self.margin_bytes, "peak_host_bytes": self.peak_host_bytes}


def renamed_layers(prediction: RankPrediction, prefix: str, offset: int) -> RankPrediction:
    """`prediction` with the layers under `prefix` (`prefix.<i>`) named `prefix.<i + offset>`: a pipeline stage's
    trace names its layers from 0 (llmsim.model.pipelining.layers_prefix), the report names them as the model
    does. The peak's layer at once; the timeline's module and tensor names when the timeline is asked for."""
    if offset == 0:
        return prediction
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)(?=\.|$)")

    def rename(name):
        return pattern.sub(lambda match: f"{prefix}.{int(match.group(1)) + offset}", name) if isinstance(
            name, str) else name

    def timeline() -> pd.DataFrame:
        frame = prediction.timeline.copy()
        for column in ("module", "tensor"):  # a few thousand distinct names over the events
            names = frame[column].astype(object)
            renamed = {name: rename(name) for name in names.unique()}
            frame[column] = names.map(renamed)
        blocks = frame["block"].to_numpy()
        frame["block"] = np.where(blocks == NO_BLOCK, NO_BLOCK, blocks + offset)
        return frame

    peak = replace(prediction.peak, layer=rename(prediction.peak.layer))
    return replace(prediction, peak=peak, frame=timeline)


@dataclass(frozen=True)
class Prediction:
    model: ModelSpec
    setup: TrainSetup
    layout: Layout
    ranks: list[RankPrediction]
    graph_of: Callable[[], nx.DiGraph] = field(repr=False)  # the layer graph, built when first asked for
    gpu: GpuProfile | None = None
    alloc_conf: AllocatorConfig = AllocatorConfig()
    # With expert parallelism under a stated balanced routing: every rank as the worst routing leaves it (every
    # token's top-k onto its experts; llmsim/model/moe.py, `split_sizes`), the bound of any routing
    routing_bound: list[RankPrediction] | None = None
    # ZeRO-3's optimizer swapper (offload_optimizer "nvme"): the bytes each rank's files take under nvme_path
    nvme_bytes: list[int] | None = None

    @property
    def peak_allocated_bytes(self) -> int:
        return max(r.peak_allocated_bytes for r in self.ranks)

    @property
    def peak_host_bytes(self) -> int:
        return max(r.peak_host_bytes for r in self.ranks)

    def host_per_node_bytes(self, gpus_per_node: int) -> int:
        """The most host memory one node needs: the sum of its ranks' host peaks (ranks fill nodes in order, as
        torchrun and the deepspeed launcher number them; the ranks step together, so their peaks coincide)."""
        nodes: dict[int, int] = {}
        for r in self.ranks:
            nodes[r.rank // gpus_per_node] = nodes.get(r.rank // gpus_per_node, 0) + r.peak_host_bytes
        return max(nodes.values())

    @property
    def graph(self) -> nx.DiGraph:
        """The layer graph (llmsim/sim/graph.py) of the traced process (with pipeline stages, the last stage's)."""
        return self.graph_of()

    @property
    def deciding_rank(self) -> RankPrediction:
        """The rank the verdict is about: the worst verdict (oom, then tight, then fits), the most needed of it;
        without a GPU, the rank with the highest peak."""
        if self.gpu is None:
            return max(self.ranks, key=lambda r: r.peak_allocated_bytes)
        return max(self.ranks, key=lambda r: (_SEVERITY[r.verdict], r.needed_bytes))

    @property
    def verdict(self) -> str | None:
        return self.deciding_rank.verdict

    def breakdown(self) -> pd.DataFrame:
        """Bytes by category at each rank's peak: one row per rank."""
        return pd.DataFrame([r.peak.breakdown_bytes for r in self.ranks]).fillna(0).astype("int64")

    def to_dict(self, gpus_per_node: int = 8) -> dict:
        return {"model": self.model.name, "strategy": self.layout.strategy.value,
                "world_size": self.layout.world_size, "tp": self.layout.tp, "ep": self.layout.ep,
                "routing": self.setup.routing if self.layout.ep > 1 else None,
                "routing_bound": [r.to_dict() for r in self.routing_bound] if self.routing_bound else None,
                "pp": self.layout.pp,
                "schedule": ("deepspeed-train-schedule" if self.setup.ds_pipe is not None  # DeepSpeed's TrainSchedule
                             else self.layout.schedule.value if self.layout.pp > 1 else None),
                "recipe": self.setup.recipe.value,
                "n_microbatches": self.layout.n_microbatches,
                "pp_split": list(self.layout.pp_split) if self.layout.pp_split else None,
                "stages_per_rank": self.layout.stages_per_rank,
                "micro_batch": self.setup.micro_batch, "seq_len": self.setup.seq_len,
                "precision": self.setup.precision.value, "attention": self.setup.attention.value,
                "grad_ckpt": self.setup.grad_ckpt, "ckpt_every": self.setup.ckpt_every,
                "ckpt_offload": self.setup.ckpt_offload, "device": self.setup.device.value,
                "gpu": self.gpu.name if self.gpu else None,
                "expandable_segments": self.alloc_conf.expandable_segments,
                "peak_allocated_bytes": self.peak_allocated_bytes, "peak_host_bytes": self.peak_host_bytes,
                "gpus_per_node": gpus_per_node, "host_per_node_bytes": self.host_per_node_bytes(gpus_per_node),
                "nvme_bytes": self.nvme_bytes,
                **({"verdict": self.verdict, "verdict_rank": self.deciding_rank.rank,
                    "needed_bytes": self.deciding_rank.needed_bytes, "margin": self.gpu.margin,
                    "margin_bytes": self.gpu.margin_bytes, "verdict_why": verdict_why(self)}
                   if self.gpu is not None else {"verdict": None}),
                **recipe_facts(self.setup, self.layout.deepspeed), "torch": torch_version(),
                "ranks": [r.to_dict() for r in self.ranks]}


_SEVERITY = {"fits": 0, "tight": 1, "oom": 2}


def verdict_why(prediction: Prediction) -> str:
    """The verdict in one sentence, about the rank that decides it."""
    rank, gpu = prediction.deciding_rank, prediction.gpu
    gib = 2**30
    need, card, margin = rank.needed_bytes / gib, gpu.capacity_bytes / gib, gpu.margin_bytes / gib
    where = f"rank {rank.rank}" if len(prediction.ranks) > 1 else "the job"
    if rank.verdict == "oom":
        if rank.peak_allocated_bytes + gpu.cuda_context_bytes > gpu.capacity_bytes:
            return (f"{where}: its live tensors alone ({rank.peak_allocated_bytes / gib:.2f} GiB, with the cuBLAS "
                    f"workspaces, and the CUDA context) exceed the {card:.2f} GiB card")
        return (f"{where}: the caching allocator model runs out of the {card:.2f} GiB card even after freeing its "
                f"cache and retrying (it reserves {need:.2f} GiB unconstrained)")
    if rank.verdict == "tight":
        return (f"{where} needs {need:.2f} GiB of the {card:.2f} GiB card, inside the {margin:.2f} GiB margin "
                f"({100 * gpu.margin:g} % of the card): a prediction error that size would be an OOM")
    return (f"{where} needs {need:.2f} GiB of the {card:.2f} GiB card, "
            f"{(gpu.capacity_bytes - rank.needed_bytes) / gib:.2f} GiB to spare, more than the {margin:.2f} GiB "
            f"margin ({100 * gpu.margin:g} % of the card)")
