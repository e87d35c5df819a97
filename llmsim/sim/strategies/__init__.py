"""Stage 2: per-rank plans. One module per strategy, registered here by enum (STYLE.md rule 3).

A strategy turns the single-process timeline (the canonical step traced as one process) into one
timeline per rank. Adding a strategy is one new file plus one line in STRATEGIES.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import pandas as pd

from llmsim.inputs.dsconfig import DEEPSPEED_OPTIMIZER_NAMES, DeepSpeedSetup
from llmsim.inputs.spec import FsdpSetup
from llmsim.enums import Device, Optimizer, Precision, Recipe
from llmsim.errors import InputError
from llmsim.model.pipelining import Schedule
from llmsim.sim.strategies import ddp, fsdp, single


class Strategy(str, Enum):
    SINGLE = "single"  # one process, plain PyTorch: the canonical step as is
    DDP = "ddp"  # torch DistributedDataParallel
    DEEPSPEED = "deepspeed"  # DeepSpeed engine, ZeRO stage 0-3 from the JSON
    FSDP = "fsdp"  # PyTorch FSDP2: fully_shard on every decoder layer, then the root


@dataclass(frozen=True)
class Layout:
    """Ranks = dp x pp x tp: `strategy` is what runs across the data-parallel replicas (none for single), and
    each replica is a pipeline of `pp` stages (llmsim/model/pipelining.py), each stage `tp` ranks of a
    tensor-parallel group (llmsim/model/tensor_parallel.py). Rank = stage * tp + tp-rank within a replica."""

    strategy: Strategy = Strategy.SINGLE
    world_size: int = 1
    deepspeed: DeepSpeedSetup | None = None
    fsdp: FsdpSetup | None = None
    tp: int = 1
    ep: int = 1  # expert parallelism over the TP group (ep == tp; llmsim/model/moe.py)
    pp: int = 1
    schedule: Schedule = Schedule.GPIPE
    n_microbatches: int = 1  # micro-batches through the pipeline per step (pp > 1)
    pp_split: tuple[int, ...] | None = None  # layers per stage (pp > 1); None: transformers' balanced split
    stages_per_rank: int = 1  # stages each pipeline rank holds (>1 under Schedule.multi_stage)

    def __post_init__(self) -> None:
        for name, flag in (("tp", "tp"), ("ep", "ep"), ("pp", "pp"), ("n_microbatches", "microbatches"),
                           ("world_size", "world-size"), ("stages_per_rank", "stages-per-rank")):
            if getattr(self, name) < 1:
                raise InputError(f"{flag}({getattr(self, name)}) must be >= 1")
        if self.ep > 1 and (self.ep != self.tp or self.pp > 1):
            raise InputError(f"ep({self.ep}) shards the experts over the TP group: it needs tp({self.tp}) = ep and "
                             f"no pipeline (pp({self.pp}) = 1)")
        if self.world_size % (self.tp * self.pp):
            raise InputError(f"dp x pp x tp must equal world-size: pp({self.pp}) x tp({self.tp}) does not divide "
                             f"world-size({self.world_size})")
        if self.strategy is Strategy.SINGLE and self.dp != 1:
            raise InputError(f"strategy single runs one replica; world-size({self.world_size}) must equal "
                             f"pp({self.pp}) x tp({self.tp}) (use --strategy ddp or --ds-config for several)")
        if self.strategy is Strategy.FSDP and self.world_size < 2:
            raise InputError(f"strategy fsdp shards over the ranks: world-size({self.world_size}) must be at least 2")
        fsdp_x_tp = (self.strategy is Strategy.FSDP and self.pp == 1 and self.fsdp is not None
                     and self.fsdp.wrap == "transformers")  # DistributedConfig(tp_size, fsdp_size): a 2-D mesh
        # DDP over TP shards is torch's replicate (llmsim/model/replicate.py): DistributedDataParallel takes no
        # DTensor parameter
        fsdp_per_layer = (self.strategy is Strategy.FSDP and self.fsdp is not None
                          and self.fsdp.wrap == "layers")  # fully_shard per layer, then the stage, over dp: a 3-D mesh
        ds_pipe = self.strategy is Strategy.DEEPSPEED and self.tp == 1  # DeepSpeed's pipeline engine, over dp
        if self.tp * self.pp > 1 and not (self.strategy in (Strategy.SINGLE, Strategy.DDP) or fsdp_x_tp
                                          or fsdp_per_layer or ds_pipe):
            raise InputError(f"pp({self.pp}) x tp({self.tp}) with strategy {self.strategy.value} is not modelled "
                             "yet; modelled: tp and pp with single (dp = 1) and with ddp (over TP shards torch's "
                             "replicate), and with fsdp per layer (--fsdp-wrap layers); tp without pp with fsdp as "
                             "transformers composes them (--fsdp-wrap transformers); pp with deepspeed (its pipeline "
                             "engine)")
        if (self.strategy is Strategy.DEEPSPEED) != (self.deepspeed is not None):
            raise InputError("strategy deepspeed needs a DeepSpeed config (--ds-config), and only it takes one")
        if (self.strategy is Strategy.FSDP) != (self.fsdp is not None):
            raise InputError("strategy fsdp needs its fully_shard settings (FsdpSetup), and only it takes them")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


def _deepspeed(timeline: pd.DataFrame, layout: Layout, setup) -> dict[int, pd.DataFrame]:
    from llmsim.sim.strategies import zero0, zero12, zero3

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
    after get_peft_model (adapters, a modules_to_save copy and trainable tokens' delta included), not before it as
    the canonical step does; under ZeRO-2/3 with gradient accumulation (they set every `.grad` to None after each
    backward's reduction) each micro-step's own gradients are named (TrainSetup.label_micro_grads)."""
    from llmsim.model.step import uses_peft

    if setup.recipe.trainer and layout.deepspeed is not None:
        setup = replace(setup, trainer_under_deepspeed=True)
    elif (uses_peft(setup) and layout.deepspeed is not None and setup.precision.cast_dtype is not None
            and (layout.deepspeed.stage in (0, 1, 2) or layout.deepspeed.offloads_params)):
        # ZeRO-3 with offload_param: the trainable partitions move into a host buffer of the model's dtype
        # (`_create_param_groups_fp16_flat_cpu_memory`), so the adapters train in it from initialize on
        setup = replace(setup, cast_after_peft=True)
    if setup.grad_accum > 1 and layout.deepspeed is not None and layout.deepspeed.stage in (2, 3):
        setup = replace(setup, label_micro_grads=True)
    if layout.strategy is Strategy.DDP and layout.tp > 1:  # torch's replicate runs in the trace (model/replicate.py)
        setup = replace(setup, replicate_dp=layout.dp)
    if layout.fsdp is not None:  # FSDP2 runs in the trace itself (llmsim/model/fsdp.py)
        fsdp = layout.fsdp
        if fsdp.wrap == "accelerate" and setup.device is Device.CUDA:
            # the Trainer leaves an FSDP model where from_pretrained loaded it, on the host; accelerate upcasts it
            # there and fully_shard copies each unit to the GPU as it shards it (FsdpSetup init "host")
            fsdp = replace(fsdp, init="host")
        setup = replace(setup, fsdp=fsdp, fsdp_world=layout.world_size)
        if layout.fsdp.offload and setup.device is Device.CUDA and setup.foreach:
            # CPUOffloadPolicy: AdamW's parameters are host tensors, for which torch takes the for-loop path
            # (`_default_to_fused_or_foreach` picks foreach for CUDA parameters only)
            setup = replace(setup, foreach=False)
    return setup


# Issue 5's levers under DeepSpeed (tp = pp = 1, the client torch.optim.AdamW): the ZeRO stages where each is
# modelled and measured (data/measurements/tier2_levers_zero_cpu.csv; gradient accumulation, the JSON's
# gradient_accumulation_steps, in tier2_ga_zero_cpu.csv). ZeRO-0/1/2 keep the single-process forward
# and backward and replace only what follows each gradient hook and the step (strategies/zero0.py, zero12.py):
# a loss lever changes how the LM head's gradient is made (Liger's in the forward, TRL's in its backward) and
# checkpoint offload moves checkpoint inputs to host memory, neither of which DeepSpeed's engine sees.
LEVER_ZERO_STAGES = {
    "loss": (0, 1, 2),
    "ckpt-offload": (0, 1, 2, 3),
    "peft-extras": (0, 1, 2),
    "grad-accum": (0, 1, 2, 3),
}
# The levers also modelled with a DeepSpeed JSON "optimizer" section (FusedAdam or `torch_adam`) under those stages
# (data/measurements/tier2_zero_extras_cpu.csv): the optimizer is built and stepped by DeepSpeed's part alone
# (zero_common.step_optimizer), which none of these levers touches.
LEVER_ZERO_DS_OPTIMIZER = frozenset({"loss", "ckpt-offload", "peft-extras"})
# ... and with DeepSpeed's CPU Adam (the offloaded optimizer an "optimizer" section builds, or accelerate swaps in):
# gradient accumulation, which changes the host's gradient buffers and not the step (tier2_offload_cpu.csv)
LEVER_ZERO_CPU_ADAM = frozenset({"grad-accum"})
# Why a lever stays refused under a ZeRO stage where the reason is known. Both losses read `lm_head.weight` in the
# model's forward without calling the lm_head module, whose ZeRO-3 hooks alone gather it: outside them it is the
# numel-0 placeholder (`free_param`, deepspeed/runtime/zero/partition_parameters.py). Real 2-rank runs fail: the
# Liger imitation in its forward ("size of tensor a (0) must match ... 128"; Liger's kernel divides by V = 0,
# linkedin/Liger-Kernel#767), TRL's port in its backward (a [0] weight gradient); TRL's own trainers gather the
# head with deepspeed.zero.GatheredParameters (`maybe_gather_lm_head_ctx`), which the ZeRO-3 replay does not model.
# peft's own ZeRO-3 paths: `ModulesToSaveWrapper.update` gathers the module's partitions (GatheredParameters) to
# deep-copy it, which makes a trainable copy in the base's dtype outside zero.Init (not the fp32 adapters zero3.py
# models); `TrainableTokensLayer._collect_token_weights` builds the rows on CUDA on every rank but 0 (a CPU run
# fails: "Torch not compiled with CUDA enabled").
LEVER_ZERO_REASONS = {
    ("loss", 3): "both losses read lm_head.weight outside the lm_head module, where ZeRO-3 leaves it a numel-0 "
                 "shard (a run fails; TRL's GatheredParameters gather is not modelled)",
    ("peft-extras", 3): "peft gathers the module's partitions to deep-copy it (a base-dtype copy outside zero.Init, "
                        "not modelled) and builds trainable tokens' rows on CUDA only (no CPU run measures it)",
}


def _levers_modelled(layout: Layout, lever: str) -> bool:
    """Where issue 5's levers (peft's extras, checkpoint offload, the loss levers, gradient accumulation) are
    modelled and measured: one process, torch DDP around the whole model (tp = pp = 1; measured in
    data/measurements/tier2_levers_ddp_cpu.csv; DDP adds its broadcast chunks and reducer buckets to the
    single-process step, neither of which these levers change, llmsim/sim/strategies/ddp.py), and the DeepSpeed ZeRO
    stages of LEVER_ZERO_STAGES with the client optimizer."""
    if layout.tp * layout.pp > 1:
        return False
    if layout.strategy in (Strategy.SINGLE, Strategy.DDP):
        return True
    if layout.strategy is Strategy.FSDP:  # gradient accumulation alone measured with FSDP2 (tier2_fsdp_cpu.csv)
        return lever == "grad-accum"
    kind = layout.deepspeed.optimizer_kind
    return (layout.deepspeed.stage in LEVER_ZERO_STAGES[lever]
            and (kind == "client" or lever in LEVER_ZERO_DS_OPTIMIZER
                 or (kind == "cpu_adam" and lever in LEVER_ZERO_CPU_ADAM)))


def levers_modelled_text(lever: str) -> str:
    stages = "/".join(map(str, LEVER_ZERO_STAGES[lever]))
    optimizer = "" if lever in LEVER_ZERO_DS_OPTIMIZER else " with the client optimizer"
    zero = f", and DeepSpeed ZeRO-{stages}{optimizer}" if stages else ""
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


# The layouts of the HF Trainer recipe (data/measurements/trainer_cpu.csv, trainer_ddp_cpu.csv,
# trainer_deepspeed_cpu.csv): one process; `torchrun --nproc_per_node N` of it, where accelerate wraps the model in
# DistributedDataParallel (ddp.plan on the Trainer's traced step: DDP's broadcast and buckets are DDP's own whatever
# loop drives it); and TrainingArguments(deepspeed=...) under ZeRO-1/2, where accelerate hands the model and the
# Trainer's optimizer to deepspeed.initialize (zero12.plan on the Trainer's traced step, traced as the engine runs it:
# `trainer_under_deepspeed`); under ZeRO-3 the same with ZeRO-3's module hooks in the trace (zero3.plan), the model
# loaded partitioned under zero.Init in the config's dtype (trainer_zero3_cpu.csv)
TRAINER_STRATEGIES = (Strategy.SINGLE, Strategy.DDP, Strategy.DEEPSPEED, Strategy.FSDP)
TRAINER_ZERO_STAGES = (1, 2, 3)
# what steps under the Trainer with DeepSpeed (DeepSpeedSetup.optimizer_kind), measured through Trainer.train()
# (trainer_deepspeed_cpu.csv, trainer_offload_cpu.csv, trainer_zero3_cpu.csv)
TRAINER_DEEPSPEED_OPTIMIZERS = ("client", "cpu_adam")


def trainer_layout(model, setup, world_size: int, strategy: "Strategy | None" = None):
    """The layout of the Trainer recipe's run on `world_size` ranks, and the setup it runs: under DeepSpeed (the
    TrainingArguments' `deepspeed`, a JSON path or a dict, with "auto" values resolved from the arguments as
    transformers' HfTrainerDeepSpeedConfig does) the engine's precision; else DDP (or one process)."""
    import json

    from llmsim.inputs.dsconfig import ds_setup
    from llmsim.inputs.hf import read_mapping, training_arguments

    fields = json.loads(setup.training_args)
    source = fields.get("deepspeed")
    if not source and fields.get("fsdp"):  # accelerate's FSDP2 (TrainingArguments.fsdp_plugin_args)
        from llmsim.inputs.hf import trainer_fsdp

        if strategy not in (None, Strategy.FSDP):
            raise InputError(f"--strategy {strategy.value} contradicts the TrainingArguments' fsdp (an FSDP run)")
        if world_size < 2:
            raise InputError("the TrainingArguments' fsdp shards over the ranks torchrun starts: give --world-size "
                             "N (2 or more)")
        return setup, Layout(Strategy.FSDP, world_size, fsdp=trainer_fsdp(training_arguments(fields)))
    if not source:
        if strategy is Strategy.DEEPSPEED:
            raise InputError("strategy deepspeed with --training-args needs the TrainingArguments' deepspeed (a JSON "
                             "path or a dict), or --ds-config")
        if world_size == 1 and strategy is not Strategy.DDP:
            return setup, Layout()
        return setup, Layout(Strategy.DDP, world_size)
    if strategy not in (None, Strategy.DEEPSPEED):
        raise InputError(f"--strategy {strategy.value} contradicts the TrainingArguments' deepspeed (a DeepSpeed run)")
    config = dict(source) if isinstance(source, dict) else read_mapping(str(source), "DeepSpeed config")
    args = training_arguments(fields)
    if args.fp16:
        raise InputError("the Trainer with DeepSpeed and fp16=True is not modelled (DeepSpeed refuses fp16 on CPU, "
                         "so no run measures it); modelled: bf16 or fp32")
    if config.get("gradient_clipping") == "auto":  # HfTrainerDeepSpeedConfig: fill_match("gradient_clipping", ...)
        config["gradient_clipping"] = args.max_grad_norm
    hidden = int(model.hf_config().hidden_size)
    deepspeed = ds_setup(config, world_size, hidden, args.per_device_train_batch_size,
                         Precision.BF16 if args.bf16 else Precision.FP32, args.gradient_accumulation_steps,
                         launcher="accelerate")
    if deepspeed.stage not in TRAINER_ZERO_STAGES:
        raise InputError(f"the Trainer with DeepSpeed ZeRO-{deepspeed.stage} is not modelled yet; modelled: ZeRO-"
                         f"{', ZeRO-'.join(map(str, TRAINER_ZERO_STAGES))} (the canonical DeepSpeed step covers "
                         "ZeRO-0: --ds-config without --training-args)")
    if deepspeed.optimizer_kind not in TRAINER_DEEPSPEED_OPTIMIZERS:
        raise InputError(f"the Trainer with a DeepSpeed \"optimizer\" section that builds "
                         f"{DEEPSPEED_OPTIMIZER_NAMES[deepspeed.optimizer_kind]} is not modelled yet; modelled: the "
                         "Trainer's own optimizer (no \"optimizer\" section) and, with offload_optimizer, "
                         "DeepSpeed's CPU Adam (an Adam/AdamW section, or the Trainer's optimizer as accelerate "
                         "replaces it)")
    if deepspeed.optimizer_kind == "cpu_adam":
        # the Trainer's `optim` is not what steps: with an "optimizer" section it builds none (DummyOptim), without
        # one accelerate hands DeepSpeed a DeepSpeedCPUAdam over its param groups in its place (Adam's two states
        # whichever torch or bitsandbytes optimizer it was: map_pytorch_optim_to_deepspeed)
        setup = replace(setup, optimizer=Optimizer.ADAMW, fused=False, foreach=False)
    setup = replace(setup, precision=deepspeed.precision)
    if deepspeed.stage == 3 and deepspeed.precision is Precision.BF16 and setup.load_dtype != "bfloat16":
        # TrainingArguments(deepspeed=...) made first (HfDeepSpeedConfig): from_pretrained builds under zero.Init,
        # which creates every parameter in the config's bf16, whatever dtype= says (partition_parameters.py)
        setup = replace(setup, load_dtype="bfloat16", build_bf16=True)
    return setup, Layout(Strategy.DEEPSPEED, world_size, deepspeed)


def check_supported(setup, layout: Layout) -> None:
    """Before any trace: peft's extras, checkpoint offload, the loss levers and gradient accumulation are modelled
    for one process and DDP, and under the DeepSpeed ZeRO stages of LEVER_ZERO_STAGES (gradient accumulation as the
    JSON's gradient_accumulation_steps); LoRA for one process, DDP and ZeRO-0/1/2/3; a pipeline's own micro-batches
    are not."""
    if setup.recipe is not Recipe.CANONICAL and (
            layout.strategy not in TRAINER_STRATEGIES or layout.tp * layout.pp > 1
            or (layout.deepspeed is not None and layout.deepspeed.stage not in TRAINER_ZERO_STAGES)):
        raise InputError(f"recipe {setup.recipe.value} with strategy {layout.strategy.value} (world size "
                         f"{layout.world_size}, tp {layout.tp}, pp {layout.pp}) is not modelled yet; modelled: one "
                         "process, ddp (the Trainer under torchrun), DeepSpeed ZeRO-1/2/3 and the Trainer's FSDP2")
    if layout.deepspeed is not None and layout.pp > 1:
        raise InputError(f"DeepSpeed with pp({layout.pp}) runs DeepSpeed's pipeline engine: the deepspeed-pipe "
                         f"recipe (llmsim/model/ds_pipe.py), not recipe {setup.recipe.value}")
    if layout.deepspeed is not None and layout.deepspeed.autotp_size > 1:
        raise InputError(f"DeepSpeed's AutoTP (tensor_parallel.autotp_size {layout.deepspeed.autotp_size}) is "
                         "modelled as the DeepSpeed script runs it (the deepspeed-autotp recipe, --ds-config), not "
                         f"as recipe {setup.recipe.value}")
    if layout.deepspeed is not None:
        check_deepspeed_optimizer(setup, layout.deepspeed)
        if layout.deepspeed.offloads_optimizer:
            _check_optimizer_offload(setup, layout.deepspeed)
    if layout.fsdp is not None:
        fsdp.check_supported(setup, layout)
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
        others = [name for name, on in ((" and ".join(extras), extras), ("ckpt-offload", setup.ckpt_offload),
                                        (f"loss {setup.loss.value}", setup.loss.value != "hf")) if on]
        if others:  # each is measured under ZeRO without accumulation only (tier2_ga_zero_cpu.csv: full fine-tuning
            # and LoRA)
            raise InputError(f"grad-accum({setup.grad_accum}) with {' and '.join(others)} under DeepSpeed is not "
                             "modelled yet; measured: with full fine-tuning or LoRA, and transformers' loss")
    if setup.grad_accum > 1:
        _refuse_lever("grad-accum", f"grad-accum({setup.grad_accum})", layout,
                      " (DDP all-reducing every backward, no no_sync); a pipeline accumulates over its "
                      "--microbatches")


def _check_optimizer_offload(setup, deepspeed: DeepSpeedSetup) -> None:
    """ZeRO-Offload is modelled and measured (data/measurements/tier2_offload_cpu.csv, trainer_deepspeed_cpu.csv)
    for the canonical step and the HF Trainer with the client torch.optim.AdamW on its for-loop or fused path (the
    Trainer's default `adamw_torch_fused`), LoRA and gradient accumulation; the rest is refused, one line each. On
    a GPU the setup's foreach is torch's CUDA default; the offloaded AdamW steps host tensors, for
    which torch's default (`_default_to_fused_or_foreach`) is the for-loop path, the one modelled."""
    from llmsim.enums import Device

    modelled = ("modelled with offload_optimizer: the canonical step and the HF Trainer, the client "
                "torch.optim.AdamW (for-loop or fused path) or DeepSpeed's CPU Adam, LoRA, gradient accumulation")
    refused = [what for what, on in (
        (f"optimizer {setup.optimizer.value}", setup.optimizer.value != "adamw"),
        ("--foreach", setup.foreach and setup.device is not Device.CUDA),
        ("ckpt-offload", setup.ckpt_offload), (f"loss {setup.loss.value}", setup.loss.value != "hf"),
        ("lora-modules-to-save", setup.lora_modules_to_save), ("trainable-tokens", setup.trainable_tokens),
        (f"quant {setup.quant}", setup.quant is not None)) if on]
    if refused:
        raise InputError(f"DeepSpeed ZeRO-{deepspeed.stage} offload_optimizer with {refused[0]} is not modelled "
                         f"yet; {modelled}")


def _check_lora(setup, layout: Layout) -> None:
    modelled = "modelled with LoRA: single, ddp and DeepSpeed ZeRO-0/1/2/3 (tp = pp = 1)"
    if layout.tp * layout.pp > 1:
        raise InputError(f"LoRA with tp/pp is not modelled yet; {modelled}")
    if layout.strategy is Strategy.SINGLE:
        return
    if setup.quant is not None:
        raise InputError(f"LoRA with strategy {layout.strategy.value} and a quantized base (quant {setup.quant}) is "
                         "not modelled yet; modelled with QLoRA: single")


# Where DeepSpeed is modelled with a client optimizer other than torch.optim.AdamW (measured in
# data/measurements/tier2_optim_zero_cpu.csv): ZeRO-1/2 and ZeRO-3 step it on their flat fp32 partitions
# (llmsim/sim/strategies/flat_optimizer.py). ZeRO-0 is not: in bf16 it wraps the client optimizer in
# FP16_UnfusedOptimizer (per-parameter fp32 masters, an initial step), modelled for AdamW only.
CLIENT_OPTIMIZER_STAGES = (1, 2, 3)
ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"  # deepspeed/runtime/constants.py, default False


def deepspeed_tested(optimizer) -> bool:
    """Whether DeepSpeed takes this client optimizer under ZeRO without zero_allow_untested_optimizer: its type is
    in ZERO_SUPPORTED_OPTIMIZERS (deepspeed/runtime/zero/utils.py, `is_zero_supported_optimizer`: torch's Adam,
    AdamW and Adagrad, DeepSpeed's own)."""
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    from llmsim.model.step import optimizer_class

    return optimizer_class(optimizer) in ZERO_SUPPORTED_OPTIMIZERS


def check_deepspeed_optimizer(setup, deepspeed: DeepSpeedSetup) -> None:
    """The client optimizer `--optimizer` names, as DeepSpeed takes it: replaced by a JSON "optimizer" section
    (modelled with adamw only), refused by `_do_optimizer_sanity_check` under ZeRO (stage >= 1) when it is not a
    type in ZERO_SUPPORTED_OPTIMIZERS and the JSON does not set zero_allow_untested_optimizer (engine.py)."""
    if setup.optimizer.value == "adamw":
        return
    if deepspeed.replaces_client_optimizer:
        raise InputError(f"optimizer {setup.optimizer.value} with the optimizer offloaded under accelerate is "
                         "replaced by DeepSpeed's CPU Adam (map_pytorch_optim_to_deepspeed), modelled for adamw only; "
                         "set \"zero_force_ds_cpu_optimizer\": false to keep it")
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
    Strategy.FSDP: fsdp.plan,
}
