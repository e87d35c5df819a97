"""Stage 2: per-rank plans. One module per strategy, registered here by enum (STYLE.md rule 3).

A strategy turns the single-process timeline (the canonical step traced as one process) into one
timeline per rank. Adding a strategy is one new file plus one line in STRATEGIES.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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


# Where LoRA's frozen base is modelled (measured in data/measurements/tier2_lora_cpu.csv): DDP buckets only the
# trainable gradients; ZeRO-3 partitions the frozen parameters and gathers them like any other, but gives them no
# gradient, no fp32 master and no optimizer state. ZeRO-1/2 (tier2_lora_zero12_cpu.csv) flatten and partition the
# adapters alone and leave the frozen base where it is (measured with the client AdamW, fp32 and bf16).
LORA_DEEPSPEED_STAGES = (1, 2, 3)


def traced_setup(setup, layout: Layout):
    """The setup the single-process trace runs for `layout`: under ZeRO-1/2 DeepSpeed's engine casts the model
    after get_peft_model (adapters included), not before it as the canonical step does."""
    if (setup.lora_rank and layout.deepspeed is not None and layout.deepspeed.stage in (1, 2)
            and setup.precision.cast_dtype is not None):
        return replace(setup, cast_after_peft=True)
    return setup


def _levers_modelled(layout: Layout) -> bool:
    """Where issue 5's levers (peft's extras, checkpoint offload, the loss levers, gradient accumulation) are
    modelled and measured: one process, or torch DDP around the whole model (tp = pp = 1; measured in
    data/measurements/tier2_levers_ddp_cpu.csv). DDP adds its broadcast chunks and reducer buckets to the
    single-process step, neither of which these levers change (llmsim/strategies/ddp.py)."""
    return layout.tp * layout.pp == 1 and layout.strategy in (Strategy.SINGLE, Strategy.DDP)


LEVERS_MODELLED = "modelled: single and ddp (tp = pp = 1)"


def check_supported(setup, layout: Layout) -> None:
    """Before any trace: gradient accumulation, checkpoint offload, the loss levers and peft's extras are modelled
    for one process and DDP, LoRA for one process, DDP and ZeRO-1/2/3; DeepSpeed's accumulation boundaries and a
    pipeline's own micro-batches are not."""
    if layout.deepspeed is not None:
        check_deepspeed_optimizer(setup, layout.deepspeed)
    if setup.lora_rank:
        _check_lora(setup, layout)
    where = f"strategy {layout.strategy.value}{' and tp/pp' if layout.tp * layout.pp > 1 else ''}"
    extras = [name for name, on in (("lora-modules-to-save", setup.lora_modules_to_save),
                                    ("trainable-tokens", setup.trainable_tokens)) if on]
    if extras and not _levers_modelled(layout):
        raise InputError(f"{' and '.join(extras)} with {where} is not modelled yet; {LEVERS_MODELLED}")
    if setup.ckpt_offload and not _levers_modelled(layout):
        raise InputError(f"ckpt-offload with {where} is not modelled yet; {LEVERS_MODELLED}")
    if setup.loss.value != "hf" and not _levers_modelled(layout):
        raise InputError(f"loss {setup.loss.value} with {where} is not modelled yet; {LEVERS_MODELLED}")
    if setup.grad_accum > 1 and not _levers_modelled(layout):
        raise InputError(f"grad-accum({setup.grad_accum}) with {where} is not modelled yet; {LEVERS_MODELLED} "
                         "(DDP all-reducing every backward, no no_sync); a pipeline accumulates over its "
                         "--microbatches")


def _check_lora(setup, layout: Layout) -> None:
    stages = ", ".join(f"ZeRO-{s}" for s in LORA_DEEPSPEED_STAGES)
    modelled = f"modelled with LoRA: single, ddp and DeepSpeed {stages} (tp = pp = 1)"
    if layout.tp * layout.pp > 1:
        raise InputError(f"LoRA with tp/pp is not modelled yet; {modelled}")
    if layout.strategy is Strategy.SINGLE:
        return
    if setup.quant is not None:
        raise InputError(f"LoRA with strategy {layout.strategy.value} and a quantized base (quant {setup.quant}) is "
                         "not modelled yet; modelled with QLoRA: single")
    if layout.strategy is Strategy.DEEPSPEED and layout.deepspeed.stage not in LORA_DEEPSPEED_STAGES:
        raise InputError(f"LoRA with DeepSpeed ZeRO stage {layout.deepspeed.stage} is not modelled yet; {modelled}")
    if (layout.strategy is Strategy.DEEPSPEED and layout.deepspeed.stage in (1, 2)
            and layout.deepspeed.optimizer_kind != "client"):
        raise InputError(f"LoRA with DeepSpeed ZeRO-{layout.deepspeed.stage} and a DeepSpeed \"optimizer\" "
                         "section is not modelled yet; modelled: the client torch.optim.AdamW")


# Where DeepSpeed is modelled with a client optimizer other than torch.optim.AdamW (measured in
# data/measurements/tier2_optim_zero_cpu.csv): ZeRO-1/2 and ZeRO-3 step it on their flat fp32 partitions
# (llmsim/strategies/flat_optimizer.py). ZeRO-0 is not: in bf16 it wraps the client optimizer in
# FP16_UnfusedOptimizer (per-parameter fp32 masters, an initial step), modelled for AdamW only.
CLIENT_OPTIMIZER_STAGES = (1, 2, 3)
ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"  # deepspeed/runtime/constants.py, default False


def deepspeed_tested(optimizer) -> bool:
    """Whether DeepSpeed takes this client optimizer under ZeRO without zero_allow_untested_optimizer: its type is
    in ZERO_SUPPORTED_OPTIMIZERS (deepspeed/runtime/zero/utils.py, `is_zero_supported_optimizer`: torch's Adam,
    AdamW and Adagrad, DeepSpeed's own)."""
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    from llmsim.step import optimizer_class

    return optimizer_class(optimizer) in ZERO_SUPPORTED_OPTIMIZERS


def check_deepspeed_optimizer(setup, deepspeed: DeepSpeedSetup) -> None:
    """The client optimizer `--optimizer` names, as DeepSpeed takes it: replaced by a JSON "optimizer" section
    (modelled with adamw only), refused by `_do_optimizer_sanity_check` under ZeRO (stage >= 1) when it is not a
    type in ZERO_SUPPORTED_OPTIMIZERS and the JSON does not set zero_allow_untested_optimizer (engine.py)."""
    if setup.optimizer.value == "adamw":
        return
    if deepspeed.optimizer_kind != "client":
        raise InputError(f"optimizer {setup.optimizer.value} is a client optimizer, which the DeepSpeed config's "
                         "\"optimizer\" section replaces; modelled with it: adamw")
    if deepspeed.stage not in CLIENT_OPTIMIZER_STAGES:
        raise InputError(f"DeepSpeed ZeRO stage {deepspeed.stage} with optimizer {setup.optimizer.value} is not "
                         f"modelled yet; modelled: adamw, or stages {', '.join(map(str, CLIENT_OPTIMIZER_STAGES))}")
    if not deepspeed_tested(setup.optimizer) and not deepspeed.config.get(ZERO_ALLOW_UNTESTED_OPTIMIZER, False):
        raise InputError(f"DeepSpeed refuses optimizer {setup.optimizer.value} under ZeRO: 'You are using an "
                         f"untested ZeRO Optimizer. Please add <\"{ZERO_ALLOW_UNTESTED_OPTIMIZER}\": true> in the "
                         "configuration file to use it.'")


# strategy -> function(full-depth single-process timeline, layout, setup) -> {rank: timeline}
STRATEGIES: dict[Strategy, Callable[[pd.DataFrame, Layout, object], dict[int, pd.DataFrame]]] = {
    Strategy.SINGLE: single.plan,
    Strategy.DDP: ddp.plan,
    Strategy.DEEPSPEED: _deepspeed,
}
