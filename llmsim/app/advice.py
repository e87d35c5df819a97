"""What would make a job fit: `llmsim predict --suggest`. Each candidate change is a full prediction of the changed
job on the same GPU (nothing is estimated from the first answer), and those that fit outside the margin are listed
cheapest first.

Cheapest means what the change costs the run, in this order: none (the same maths: a fused kernel, a chunked
loss), a small change to the updates (8-bit optimizer states), more compute (checkpointing, then its offload to
host memory over PCIe, then smaller micro-batches with more accumulation), a different fine-tune (LoRA, then a
4-bit base), then more GPUs (a higher ZeRO stage on the same GPUs, then ZeRO-3 on 2, 4 and 8 times as many). Each
candidate is one change to the job as given; when none fits alone, the canonical step's levers are also tried
together, adding one at a time in that order, and the first prefix that fits is listed (the Trainer recipe's
changes are edits of the user's files, tried one at a time). A change llmsim does not model for the job
(e.g. the 8-bit optimizer under DeepSpeed) is not tried. The changes are written as the user gives them: flags for
the canonical step, TrainingArguments / LoraConfig / BitsAndBytesConfig fields for the Trainer recipe.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmsim.enums import Loss, Optimizer, Precision, Recipe
from llmsim.errors import InputError
from llmsim.inputs.gpus import GpuProfile
from llmsim.inputs.spec import ModelSpec, TrainSetup, as_loaded
from llmsim.model.step import peft_default_targets
from llmsim.sim.allocator import AllocatorConfig
from llmsim.sim.strategies import Layout, Strategy

if TYPE_CHECKING:
    from llmsim.sim.prediction import Prediction, RankPrediction

LORA_RANK = 16  # the adapters a suggestion adds: LoRA r=16 on peft's default targets (all-linear for the Trainer)
TRAINER_LORA = {"r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
TRAINER_QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                 "bnb_4bit_compute_dtype": "bfloat16"}
MORE_GPUS = (2, 4, 8)  # ZeRO-3 on this many times the job's GPUs


@dataclass(frozen=True)
class Change:
    change: str  # what to add or set, in the user's words
    cost: str  # what it costs the run
    setup: TrainSetup
    layout: Layout
    lever: bool = True  # a lever (tried together with the others when none fits alone), not a layout


@dataclass(frozen=True)
class Suggestion:
    change: str
    cost: str
    verdict: str
    needed_bytes: int
    peak_allocated_bytes: int
    gpus: int

    def to_dict(self) -> dict:
        return {"change": self.change, "cost": self.cost, "verdict": self.verdict, "needed_bytes": self.needed_bytes,
                "peak_allocated_bytes": self.peak_allocated_bytes, "gpus": self.gpus}


def suggestions(model: ModelSpec, setup: TrainSetup, layout: Layout, gpu: GpuProfile,
                alloc_conf: AllocatorConfig = AllocatorConfig(), jobs: int = 1,
                progress: bool = False, given: Prediction | None = None) -> list[Suggestion]:
    """The changes that make the job fit on `gpu`, cheapest first (module docstring); [] when none does. With
    `given`, the job's own prediction, a pipeline is also offered the `--pp-split` that lowers its most loaded
    stage (`_split_suggestion`), after the changes that cost nothing."""
    from llmsim.sim.processes import in_processes

    changes = [c for c in candidates(model, setup, layout) if _modelled(model, c, gpu)]
    split = _split_suggestion(model, setup, layout, gpu, alloc_conf, given) if given is not None else None
    at = next((i for i, c in enumerate(changes) if not c.cost.startswith("none")), len(changes))
    predict = functools.partial(_suggestion, model, gpu, alloc_conf)
    results = in_processes(predict, changes, jobs, progress, "change")
    if split is not None:
        results.insert(at, split)
    fitting = [s for s in results if s is not None and s.verdict == "fits"]
    more_gpus = [s for s in fitting if s.gpus > layout.world_size]
    fitting = [s for s in fitting if s.gpus <= layout.world_size] + more_gpus[:1]  # the fewest GPUs that fit
    if fitting:
        return fitting
    levers = [c for c in changes if c.lever] if setup.recipe is Recipe.CANONICAL else []  # fields: one file each
    for combined in _together(levers, setup):  # none alone: the levers added one at a time
        if not _modelled(model, combined, gpu):
            continue
        result = predict(combined)
        if result is not None and result.verdict == "fits":
            return [result]
    return []


def candidates(model: ModelSpec, setup: TrainSetup, layout: Layout) -> list[Change]:
    if setup.recipe.trainer:
        return _trainer_changes(model, setup, layout)
    if setup.recipe is Recipe.DEEPSPEED_AUTOTP:  # the JSON sets the precision, the optimizer and the layout:
        return [] if setup.grad_ckpt else [Change(  # checkpointing is the script's own lever (as `compare` tries)
            "--grad-ckpt", "more compute: each layer's forward runs again in the backward",
            as_loaded(setup, grad_ckpt=True), layout)]
    return _canonical_levers(model, setup, layout) + _canonical_layouts(model, setup, layout)


def _canonical_levers(model: ModelSpec, setup: TrainSetup, layout: Layout) -> list[Change]:
    out = []

    def add(change: str, cost: str, **fields) -> None:
        out.append(Change(change, cost, as_loaded(setup, **fields), layout))
    if setup.optimizer in (Optimizer.ADAMW, Optimizer.ADAM) and not setup.fused:
        add("--fused", "none: the same optimizer in one fused kernel (no foreach temporaries)", fused=True,
            foreach=False)
    if setup.loss is Loss.HF:
        add("--loss chunked-nll", "none: the same loss, in vocabulary tiles (TRL's chunked NLL)",
            loss=Loss.CHUNKED_NLL)
    if setup.optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        add("--optimizer adamw8bit", "8-bit optimizer states (bitsandbytes): slightly different updates",
            optimizer=Optimizer.ADAMW_8BIT, fused=False, foreach=False)
    if not setup.grad_ckpt:
        add("--grad-ckpt", "more compute: each layer's forward runs again in the backward", grad_ckpt=True)
    else:
        if not setup.ckpt_offload:
            add("--ckpt-offload", "the checkpointed inputs in pinned host memory, copied over PCIe",
                ckpt_offload=True)
    if setup.micro_batch > 1 and setup.micro_batch % 2 == 0 and layout.deepspeed is None:
        add(f"--micro-batch {setup.micro_batch // 2} --grad-accum {2 * setup.grad_accum}",
            "the same samples per step in twice the passes", micro_batch=setup.micro_batch // 2,
            grad_accum=2 * setup.grad_accum)
    if not setup.lora_rank and peft_default_targets(model):
        add(f"--lora-rank {LORA_RANK}", "a different fine-tune: LoRA adapters on a frozen base", lora_rank=LORA_RANK)
    elif not setup.lora_rank:  # peft has no default targets for the model type (a mixture-of-experts model)
        add(f"--lora-rank {LORA_RANK} --lora-targets all-linear", "a different fine-tune: LoRA adapters on a frozen "
            "base (peft's all-linear: the attention and, on MoE models, the router and experts too)",
            lora_rank=LORA_RANK, lora_targets=("all-linear",))
    elif setup.quant is None:
        add("--quant nf4 --double-quant", "a different fine-tune: a 4-bit base under the adapters (QLoRA)",
            quant="nf4", double_quant=True)
    return out


def _zero_layout(model: ModelSpec, setup: TrainSetup, stage: int, world_size: int) -> Layout:
    from llmsim.inputs.dsconfig import ds_setup

    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": setup.micro_batch,
              "gradient_accumulation_steps": setup.grad_accum, "gradient_clipping": 1.0}
    precision = setup.precision if setup.precision in (Precision.FP32, Precision.BF16) else None
    if precision is None:
        raise InputError(f"precision {setup.precision.value} has no DeepSpeed counterpart modelled here")
    if precision is Precision.BF16:
        config["bf16"] = {"enabled": True}
    hidden = int(model.hf_config().hidden_size) if model.config_json is not None else 0
    return Layout(Strategy.DEEPSPEED, world_size, ds_setup(config, world_size, hidden, setup.micro_batch, precision,
                                                           setup.grad_accum))


def _with_optimizer_offload(layout: Layout) -> Layout:
    """The job's DeepSpeed JSON with its optimizer offloaded to the CPU (ZeRO-Offload, the client optimizer kept)."""
    import json

    from llmsim.inputs.dsconfig import DeepSpeedSetup

    config = layout.deepspeed.config
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config["zero_force_ds_cpu_optimizer"] = False
    return replace(layout, deepspeed=DeepSpeedSetup(json.dumps(config, sort_keys=True), layout.world_size))


def _canonical_layouts(model: ModelSpec, setup: TrainSetup, layout: Layout) -> list[Change]:
    """Higher ZeRO stages on the job's GPUs, then ZeRO-3 on more of them (data parallelism alone: tp = pp = 1)."""
    if layout.strategy is Strategy.FSDP:  # it already shards everything: the same FSDP2 on more GPUs
        return [Change(f"the same FSDP2 on {layout.world_size * factor} GPUs (--world-size {layout.world_size * factor})",
                       f"{layout.world_size * (factor - 1)} more GPUs", setup,
                       replace(layout, world_size=layout.world_size * factor), lever=False) for factor in MORE_GPUS]
    if layout.tp * layout.pp > 1 or setup.precision not in (Precision.FP32, Precision.BF16):
        return []
    current = layout.deepspeed.stage if layout.deepspeed is not None else -1
    gpus = layout.world_size
    out = []
    for stage in (1, 2, 3):
        if stage > current and gpus > 1:
            try:
                zero = _zero_layout(model, setup, stage, gpus)
            except InputError:
                continue
            out.append(Change(f"DeepSpeed ZeRO-{stage} on the same {gpus} GPUs (zero_optimization.stage {stage})",
                              "more communication: states, gradients"
                              + (" and parameters" if stage == 3 else "") + " partitioned over the ranks",
                              setup, zero, lever=False))
    if layout.deepspeed is not None and current in (1, 2, 3) and not layout.deepspeed.offloads_optimizer:
        offloaded = _with_optimizer_offload(layout)
        out.append(Change(f"the same ZeRO-{current} with the optimizer offloaded to the CPU (zero_optimization."
                          "offload_optimizer {\"device\": \"cpu\", \"pin_memory\": true}, "
                          "\"zero_force_ds_cpu_optimizer\": false)",
                          "AdamW steps on the host: slower steps, and host memory on every node", setup, offloaded,
                          lever=False))
    for factor in MORE_GPUS:
        try:
            zero = _zero_layout(model, setup, 3, gpus * factor)
        except InputError:
            continue
        more = gpus * factor - gpus
        out.append(Change(f"DeepSpeed ZeRO-3 on {gpus * factor} GPUs", f"{more} more GPU{'s' if more > 1 else ''}",
                          setup, zero, lever=False))
    return out


def _trainer_changes(model: ModelSpec, setup: TrainSetup, layout: Layout) -> list[Change]:
    """The Trainer recipe's levers, as fields of the user's files."""
    from llmsim.inputs.hf import training_arguments, trainer_setup

    fields = json.loads(setup.training_args)
    peft = json.loads(setup.peft_config) if setup.peft_config else None
    quant = json.loads(setup.quantization_config) if setup.quantization_config else None
    args = training_arguments(fields)
    optim = str(getattr(args.optim, "value", args.optim))
    out = []

    def add(change: str, cost: str, new_fields=None, new_peft=None, new_quant=None) -> None:
        try:
            changed = trainer_setup(model, setup.seq_len, new_fields or fields, new_peft or peft, setup.load_dtype,
                                    new_quant or quant, kbit_prep=setup.kbit_prep if quant else True)
        except InputError:
            return
        out.append(Change(change, cost, changed, layout))
    if optim == "adamw_torch":
        add("optim: adamw_torch_fused", "none: the same AdamW in one fused kernel",
            {**fields, "optim": "adamw_torch_fused"})
    if optim in ("adamw_torch", "adamw_torch_fused"):
        add("optim: adamw_8bit", "8-bit optimizer states (bitsandbytes): slightly different updates",
            {**fields, "optim": "adamw_8bit"})
    if not args.gradient_checkpointing:
        add("gradient_checkpointing: true", "more compute: each layer's forward runs again in the backward",
            {**fields, "gradient_checkpointing": True})
    batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if batch > 1 and batch % 2 == 0:
        add(f"per_device_train_batch_size: {batch // 2}, gradient_accumulation_steps: {2 * accumulation}",
            "the same samples per step in twice the passes",
            {**fields, "per_device_train_batch_size": batch // 2, "gradient_accumulation_steps": 2 * accumulation})
    if peft is None:
        add(f"--peft-config with r {LORA_RANK} on all-linear", "a different fine-tune: LoRA adapters on a frozen base",
            new_peft=TRAINER_LORA)
    elif quant is None and layout.world_size == 1:
        add("--quantization-config nf4, double quantization", "a different fine-tune: a 4-bit base (QLoRA)",
            new_quant=TRAINER_QLORA)
    return out


def _together(levers: list[Change], original: TrainSetup) -> list[Change]:
    """The levers added one at a time: each prefix of two or more, as one setup. A lever that cannot be combined with
    an earlier one (the 8-bit optimizer has no fused kernel) replaces it in that prefix."""
    import dataclasses

    def diff(setup: TrainSetup) -> dict:
        return {f.name: getattr(setup, f.name) for f in dataclasses.fields(TrainSetup)
                if getattr(setup, f.name) != getattr(original, f.name)}

    def combined(indices: list[int]) -> TrainSetup:
        return replace(original, **{k: v for i in indices for k, v in diffs[i].items()})
    diffs = [diff(lever.setup) for lever in levers]
    out, kept = [], []
    for index in range(len(levers)):
        for dropped in [None, *reversed(kept)]:  # as is, else without the latest earlier lever that conflicts
            trial = [i for i in kept if i != dropped] + [index]
            try:
                setup = combined(trial)
            except InputError:
                continue
            kept = trial
            break
        else:
            continue  # combines with nothing kept: left out
        if len(kept) > 1:
            out.append(Change("together: " + " ".join(levers[i].change for i in kept),
                              "; ".join(levers[i].cost for i in kept), setup, levers[0].layout))
    return out


def _modelled(model: ModelSpec, change: Change, gpu: GpuProfile) -> bool:
    from llmsim.sim.pipeline import checked

    try:
        checked(model, change.setup, change.layout, gpu)
    except InputError:
        return False
    return True


SPLIT_COST = "the same maths; the stages' compute uneven (the slowest stage sets the pipeline's pace)"


def _split_suggestion(model: ModelSpec, setup: TrainSetup, layout: Layout, gpu: GpuProfile,
                      alloc_conf: AllocatorConfig, given: Prediction) -> Suggestion | None:
    """The `--pp-split` whose most needing stage needs least, of those `partition.rebalanced` tries from `given`
    (each predicted in full); None where the layout has no split to change (one stage, several stages a rank,
    DeepSpeed's engines) or none tried needs less than the job's own."""
    from llmsim.model.pipelining import layers_per_stage, layers_prefix
    from llmsim.sim import partition
    from llmsim.sim.pipeline import predict

    if layout.pp == 1 or layout.stages_per_rank > 1 or setup.recipe in (Recipe.DEEPSPEED_PIPE,
                                                                       Recipe.DEEPSPEED_AUTOTP):
        return None
    split = layers_per_stage(layout.pp, model.num_layers, layout.pp_split)
    deciding, prefix = _stage_deciders(given, layout), layers_prefix(model.hf_config())
    lines = [partition.StageLine(layers, rank.needed_bytes,
                                 partition.layer_bytes(rank.timeline, rank.peak.event, prefix) / layers)
             for layers, rank in zip(split, deciding)]
    predictions: dict[tuple[int, ...], Prediction] = {}

    def predicted(trial: tuple[int, ...]) -> list[int]:  # here, not in `jobs` processes: the stages' traces stay
        # for the next split (a stage is traced as its first layers whatever the split: trace.stage_split)
        predictions[trial] = predict(model, setup, replace(layout, pp_split=trial), gpu, alloc_conf)
        return [rank.needed_bytes for rank in _stage_deciders(predictions[trial], layout)]
    try:
        found = partition.rebalanced(split, [line.needed_bytes for line in lines], lines, predicted)
    except InputError:  # a split the checks refuse for this job: no suggestion
        return None
    if found is None:
        return None
    rank = predictions[found[0]].deciding_rank
    return Suggestion(f"--pp-split {','.join(map(str, found[0]))}", SPLIT_COST, rank.verdict, rank.needed_bytes,
                      rank.peak_allocated_bytes, layout.world_size)


def _stage_deciders(prediction: Prediction, layout: Layout) -> list[RankPrediction]:
    """Each pipeline stage's most needing rank (a stage's ranks: `rank // tp % pp`, traced.stage_ranks)."""
    deciders: dict[int, RankPrediction] = {}
    for rank in prediction.ranks:
        stage = rank.rank // layout.tp % layout.pp
        if stage not in deciders or rank.needed_bytes > deciders[stage].needed_bytes:
            deciders[stage] = rank
    return [deciders[stage] for stage in range(layout.pp)]


def _suggestion(model: ModelSpec, gpu: GpuProfile, alloc_conf: AllocatorConfig, change: Change) -> Suggestion | None:
    from llmsim.sim.pipeline import predict

    try:
        prediction = predict(model, change.setup, change.layout, gpu, alloc_conf)
    except InputError:
        return None  # refused inside the trace (a setup the checks let through)
    rank = prediction.deciding_rank
    return Suggestion(change.change, change.cost, rank.verdict, rank.needed_bytes, rank.peak_allocated_bytes,
                      change.layout.world_size)
