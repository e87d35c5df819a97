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
from llmsim.enums import Precision
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
    ds = layout.deepspeed
    if (ds.stage == 0 and ds.optimizer_kind == "fused" and ds.precision is Precision.BF16
            and ds.config["optimizer"].get("legacy_fusion")):
        raise InputError("DeepSpeed optimizer legacy_fusion with ZeRO stage 0 and bf16 does not run: FP16_Optimizer's "
                         "step_fused_adam calls FusedAdam.step(grads=...), which raises; drop legacy_fusion")
    return stages[layout.deepspeed.stage](timeline, layout, setup)


# Where LoRA's frozen base is modelled (measured in data/measurements/tier2_lora_cpu.csv): DDP buckets only the
# trainable gradients; ZeRO-3 partitions the frozen parameters and gathers them like any other, but gives them no
# gradient, no fp32 master and no optimizer state. ZeRO-1/2 (tier2_lora_zero12_cpu.csv) flatten and partition the
# adapters alone and leave the frozen base where it is (measured with the client AdamW, fp32 and bf16, and with a
# DeepSpeed "optimizer" section in tier2_zero0_dsopt_cpu.csv); ZeRO-0's fp16 wrappers and reduction own the adapters
# alone (tier2_zero0_dsopt_cpu.csv). Every ZeRO stage is modelled with LoRA.


def traced_setup(setup, layout: Layout):
    """The setup the single-process trace runs for `layout`: under ZeRO-0/1/2 DeepSpeed's engine casts the model
    after get_peft_model (adapters included), not before it as the canonical step does; under ZeRO-2 with gradient
    accumulation (ZeRO-2 and 3 set every `.grad` to None after each backward's reduction) each micro-step's own
    gradients are named (TrainSetup.label_micro_grads)."""
    if (setup.lora_rank and layout.deepspeed is not None and layout.deepspeed.stage in (0, 1, 2)
            and setup.precision.cast_dtype is not None):
        setup = replace(setup, cast_after_peft=True)
    if setup.grad_accum > 1 and layout.deepspeed is not None and layout.deepspeed.stage in (2, 3):
        setup = replace(setup, label_micro_grads=True)
    return setup


# Issue 5's levers under DeepSpeed (tp = pp = 1, the client torch.optim.AdamW): the ZeRO stages where each is
# modelled and measured (data/measurements/tier2_levers_zero_cpu.csv; gradient accumulation, the JSON's
# gradient_accumulation_steps, in tier2_ga_zero_cpu.csv). ZeRO-0/1/2 keep the single-process forward
# and backward and replace only what follows each gradient hook and the step (strategies/zero0.py, zero12.py):
# a loss lever changes how the LM head's gradient is made (Liger's in the forward, TRL's in its backward) and
# checkpoint offload moves checkpoint inputs to host memory, neither of which DeepSpeed's engine sees.
LEVER_ZERO_STAGES = {"loss": (0, 1, 2), "ckpt-offload": (0, 1, 2), "peft-extras": (), "grad-accum": (0, 1, 2, 3)}
# Why a lever stays refused under a ZeRO stage where the reason is known. Both losses read `lm_head.weight` in the
# model's forward without calling the lm_head module, whose ZeRO-3 hooks alone gather it: outside them it is the
# numel-0 placeholder (`free_param`, deepspeed/runtime/zero/partition_parameters.py). Real 2-rank runs fail: the
# Liger imitation in its forward ("size of tensor a (0) must match ... 128"; Liger's kernel divides by V = 0,
# linkedin/Liger-Kernel#767), TRL's port in its backward (a [0] weight gradient); TRL's own trainers gather the
# head with deepspeed.zero.GatheredParameters (`maybe_gather_lm_head_ctx`), which the ZeRO-3 replay does not model.
LEVER_ZERO_REASONS = {
    ("loss", 3): "both losses read lm_head.weight outside the lm_head module, where ZeRO-3 leaves it a numel-0 "
                 "shard (a run fails; TRL's GatheredParameters gather is not modelled)",
}


def _levers_modelled(layout: Layout, lever: str) -> bool:
    """Where issue 5's levers (peft's extras, checkpoint offload, the loss levers, gradient accumulation) are
    modelled and measured: one process, torch DDP around the whole model (tp = pp = 1; measured in
    data/measurements/tier2_levers_ddp_cpu.csv; DDP adds its broadcast chunks and reducer buckets to the
    single-process step, neither of which these levers change, llmsim/strategies/ddp.py), and the DeepSpeed ZeRO
    stages of LEVER_ZERO_STAGES with the client optimizer."""
    if layout.tp * layout.pp > 1:
        return False
    if layout.strategy in (Strategy.SINGLE, Strategy.DDP):
        return True
    return (layout.deepspeed.stage in LEVER_ZERO_STAGES[lever]
            and layout.deepspeed.optimizer_kind == "client")


def levers_modelled_text(lever: str) -> str:
    stages = "/".join(map(str, LEVER_ZERO_STAGES[lever]))
    zero = f", and DeepSpeed ZeRO-{stages} with the client optimizer" if stages else ""
    return f"modelled: single and ddp{zero} (tp = pp = 1)"


LEVERS_MODELLED = levers_modelled_text("peft-extras")  # the text for a lever modelled for single and ddp alone


def _refuse_lever(lever: str, what: str, layout: Layout, note: str = "") -> None:
    if _levers_modelled(layout, lever):
        return
    where = f"strategy {layout.strategy.value}{' and tp/pp' if layout.tp * layout.pp > 1 else ''}"
    if layout.deepspeed is not None and layout.tp * layout.pp == 1:
        where = f"DeepSpeed ZeRO-{layout.deepspeed.stage}"
        if layout.deepspeed.stage in LEVER_ZERO_STAGES[lever]:
            where += " and a DeepSpeed \"optimizer\" section"
        reason = LEVER_ZERO_REASONS.get((lever, layout.deepspeed.stage))
        if reason:
            raise InputError(f"{what} with {where} is not modelled: {reason}; {levers_modelled_text(lever)}")
    raise InputError(f"{what} with {where} is not modelled yet; {levers_modelled_text(lever)}{note}")


def check_supported(setup, layout: Layout) -> None:
    """Before any trace: peft's extras are modelled for one process and DDP, checkpoint offload and the loss levers
    also for DeepSpeed ZeRO-0/1/2, gradient accumulation for ZeRO-0/1/2/3 (LEVER_ZERO_STAGES), where it must be the
    JSON's gradient_accumulation_steps; LoRA for one process, DDP and ZeRO-0/1/2/3; a pipeline's own micro-batches
    are not."""
    if setup.lora_rank:
        _check_lora(setup, layout)
    extras = [name for name, on in (("lora-modules-to-save", setup.lora_modules_to_save),
                                    ("trainable-tokens", setup.trainable_tokens)) if on]
    if extras:
        _refuse_lever("peft-extras", " and ".join(extras), layout)
    if setup.ckpt_offload:
        _refuse_lever("ckpt-offload", "ckpt-offload", layout)
    if setup.loss.value != "hf":
        _refuse_lever("loss", f"loss {setup.loss.value}", layout)
    if layout.deepspeed is not None and setup.grad_accum != layout.deepspeed.gradient_accumulation_steps:
        raise InputError(f"grad-accum({setup.grad_accum}) contradicts the DeepSpeed config's "
                         f"gradient_accumulation_steps({layout.deepspeed.gradient_accumulation_steps})")
    if setup.grad_accum > 1 and layout.deepspeed is not None:
        others = [name for name, on in (("LoRA", setup.lora_rank), ("ckpt-offload", setup.ckpt_offload),
                                        (f"loss {setup.loss.value}", setup.loss.value != "hf")) if on]
        if others:  # each is measured under ZeRO without accumulation only (tier2_ga_zero_cpu.csv: full fine-tuning)
            raise InputError(f"grad-accum({setup.grad_accum}) with {' and '.join(others)} under DeepSpeed is not "
                             "modelled yet; measured: with full fine-tuning and transformers' loss")
    if setup.grad_accum > 1:
        _refuse_lever("grad-accum", f"grad-accum({setup.grad_accum})", layout,
                      " (DDP all-reducing every backward, no no_sync); a pipeline accumulates over its "
                      "--microbatches")


def _check_lora(setup, layout: Layout) -> None:
    modelled = "modelled with LoRA: single, ddp and DeepSpeed ZeRO-0/1/2/3 (tp = pp = 1)"
    if layout.tp * layout.pp > 1:
        raise InputError(f"LoRA with tp/pp is not modelled yet; {modelled}")
    if layout.strategy is Strategy.SINGLE:
        return
    if setup.quant is not None:
        raise InputError(f"LoRA with strategy {layout.strategy.value} and a quantized base (quant {setup.quant}) is "
                         "not modelled yet; modelled with QLoRA: single")


def _check_optimizer(plan):
    """DeepSpeed is modelled with a (client or JSON) AdamW only."""
    def checked(timeline: pd.DataFrame, layout: Layout, setup) -> dict[int, pd.DataFrame]:
        if setup.optimizer.value != "adamw":
            raise InputError(f"DeepSpeed with optimizer {setup.optimizer.value} is not modelled yet; "
                             "modelled: adamw")
        return plan(timeline, layout, setup)
    return checked


# strategy -> function(full-depth single-process timeline, layout, setup) -> {rank: timeline}
STRATEGIES: dict[Strategy, Callable[[pd.DataFrame, Layout, object], dict[int, pd.DataFrame]]] = {
    Strategy.SINGLE: single.plan,
    Strategy.DDP: ddp.plan,
    Strategy.DEEPSPEED: _check_optimizer(_deepspeed),
}
