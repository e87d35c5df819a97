"""Stage 2: per-rank plans. One module per strategy, registered here by enum (STYLE.md rule 3).

A strategy turns the single-process timeline (the canonical step traced as one process) into one
timeline per rank. Adding a strategy is one new file plus one line in STRATEGIES.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import pandas as pd

from llmsim.dsconfig import DeepSpeedSetup
from llmsim.errors import InputError
from llmsim.pipelining import Schedule
from llmsim.strategies import ddp, single


class Strategy(str, Enum):
    SINGLE = "single"  # one process, plain PyTorch: the canonical step as is
    DDP = "ddp"  # torch DistributedDataParallel
    DEEPSPEED = "deepspeed"  # DeepSpeed engine, ZeRO stage 0-3 from the JSON


@dataclass(frozen=True)
class Layout:
    """Ranks = dp x pp x tp: `strategy` is what runs across the data-parallel replicas (none for single), and
    each replica is a pipeline of `pp` stages (llmsim/pipelining.py), each stage `tp` ranks of a
    tensor-parallel group (llmsim/tensor_parallel.py). Rank = stage * tp + tp-rank within a replica."""

    strategy: Strategy = Strategy.SINGLE
    world_size: int = 1
    deepspeed: DeepSpeedSetup | None = None
    tp: int = 1
    pp: int = 1
    schedule: Schedule = Schedule.GPIPE
    n_microbatches: int = 1  # micro-batches through the pipeline per step (pp > 1)
    pp_split: tuple[int, ...] | None = None  # layers per stage (pp > 1); None: transformers' balanced split

    def __post_init__(self) -> None:
        for name, flag in (("tp", "tp"), ("pp", "pp"), ("n_microbatches", "microbatches"),
                           ("world_size", "world-size")):
            if getattr(self, name) < 1:
                raise InputError(f"{flag}({getattr(self, name)}) must be >= 1")
        if self.world_size % (self.tp * self.pp):
            raise InputError(f"dp x pp x tp must equal world-size: pp({self.pp}) x tp({self.tp}) does not divide "
                             f"world-size({self.world_size})")
        if self.strategy is Strategy.SINGLE and self.dp != 1:
            raise InputError(f"strategy single runs one replica; world-size({self.world_size}) must equal "
                             f"pp({self.pp}) x tp({self.tp}) (use --strategy ddp or --ds-config for several)")
        if self.tp * self.pp > 1 and not (self.strategy is Strategy.SINGLE or
                                          (self.strategy is Strategy.DDP and self.pp > 1 and self.tp == 1)):
            raise InputError(f"pp({self.pp}) x tp({self.tp}) with strategy {self.strategy.value} is not modelled "
                             "yet; modelled: tp and pp with single (dp = 1), and pp with ddp (tp = 1)")
        if (self.strategy is Strategy.DEEPSPEED) != (self.deepspeed is not None):
            raise InputError("strategy deepspeed needs a DeepSpeed config (--ds-config), and only it takes one")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


def _deepspeed(timeline: pd.DataFrame, layout: Layout, setup) -> dict[int, pd.DataFrame]:
    from llmsim.strategies import zero0, zero12, zero3

    stages = {0: zero0.plan, 1: zero12.plan, 2: zero12.plan, 3: zero3.plan}
    if layout.deepspeed.stage not in stages:
        raise InputError(f"DeepSpeed ZeRO stage {layout.deepspeed.stage} is not modelled yet; "
                         f"modelled stages: {', '.join(map(str, sorted(stages)))}")
    if layout.deepspeed.stage == 0 and layout.deepspeed.optimizer_kind != "client":
        raise InputError("a DeepSpeed \"optimizer\" section with ZeRO stage 0 is not modelled yet; modelled with "
                         "it: stages 1, 2 and 3")
    return stages[layout.deepspeed.stage](timeline, layout, setup)


def check_supported(setup, layout: Layout) -> None:
    """Before any trace: gradient accumulation and LoRA (QLoRA) are modelled for one process; DDP's no_sync,
    DeepSpeed's accumulation boundaries, a pipeline's own micro-batches and frozen parameters under DDP or
    DeepSpeed are not."""
    if setup.lora_rank and (layout.strategy is not Strategy.SINGLE or layout.tp * layout.pp > 1):
        raise InputError(f"LoRA with strategy {layout.strategy.value}"
                         f"{' and tp/pp' if layout.tp * layout.pp > 1 else ''} is not modelled yet; "
                         "modelled with LoRA: single")
    if setup.loss.value != "hf" and (layout.strategy is not Strategy.SINGLE or layout.tp * layout.pp > 1):
        raise InputError(f"loss {setup.loss.value} with strategy {layout.strategy.value}"
                         f"{' and tp/pp' if layout.tp * layout.pp > 1 else ''} is not modelled yet; "
                         "modelled: single")
    if setup.grad_accum > 1 and (layout.strategy is not Strategy.SINGLE or layout.tp * layout.pp > 1):
        raise InputError(f"grad-accum({setup.grad_accum}) is modelled for one process only (strategy single, "
                         "tp = pp = 1); a pipeline accumulates over its --microbatches")


def _refuse_frozen_parameters(plan):
    """DDP buckets and ZeRO partitions hold trainable parameters only; the strategies here assume all are."""
    def checked(timeline: pd.DataFrame, layout: Layout, setup) -> dict[int, pd.DataFrame]:
        if setup.lora_rank:
            raise InputError(f"LoRA with strategy {layout.strategy.value} is not modelled yet; "
                             "modelled with LoRA: single")
        if layout.strategy is Strategy.DEEPSPEED and setup.optimizer.value != "adamw":
            raise InputError(f"DeepSpeed with optimizer {setup.optimizer.value} is not modelled yet; "
                             "modelled: adamw")
        return plan(timeline, layout, setup)
    return checked


# strategy -> function(full-depth single-process timeline, layout, setup) -> {rank: timeline}
STRATEGIES: dict[Strategy, Callable[[pd.DataFrame, Layout, object], dict[int, pd.DataFrame]]] = {
    Strategy.SINGLE: single.plan,
    Strategy.DDP: _refuse_frozen_parameters(ddp.plan),
    Strategy.DEEPSPEED: _refuse_frozen_parameters(_deepspeed),
}
