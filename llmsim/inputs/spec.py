"""The two inputs of every prediction: which model (`ModelSpec`) and which training loop (`TrainSetup`).

Both are frozen and validated on construction, so everything downstream can trust them.
"""
from __future__ import annotations

import copy
import functools
import importlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from llmsim.enums import ROUTINGS, Attention, Device, Loss, Optimizer, Precision, Recipe
from llmsim.errors import InputError, one_line

ZOO_DIR = Path(__file__).resolve().parents[2] / "data" / "models"
CANONICAL_STEPS = 3  # DESIGN.md: the peak is taken from just before the build to the end of step 3
# Model types whose position embedding is a learned table: a longer sequence indexes past its end.
LEARNED_POSITION_MODEL_TYPES = frozenset({"gpt2", "opt", "gpt_neo", "biogpt"})


# Optimizers whose step is not traced on DTensor parameters: bitsandbytes' custom ops have no sharding rule, and
# the Adafactors' norms of a sharded parameter would need a traced all-reduce
NOT_WITH_TP = frozenset({Optimizer.ADAFACTOR, Optimizer.HF_ADAFACTOR, Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW,
                         Optimizer.PAGED_ADAMW_8BIT})

# torch.optim classes with a `fused` argument among the optimizers llmsim models (torch 2.13: Adam, AdamW, SGD)
FUSED_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.ADAM, Optimizer.SGD, Optimizer.SGD_MOMENTUM)

LLM_INT8_THRESHOLD = 6.0  # BitsAndBytesConfig's llm_int8_threshold default (transformers/utils/quantization_config.py)


# Config keys naming the number of routed experts of a mixture-of-experts model, by family (Mixtral, gpt-oss:
# num_local_experts; Qwen-MoE, OLMoE: num_experts; DeepSeek: n_routed_experts)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def num_experts(config) -> int:
    """Routed experts per MoE layer of a transformers config, 0 for a dense model."""
    for key in EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


# MixedPrecisionPolicy dtypes as llmsim spells them (torch.distributed.fsdp.MixedPrecisionPolicy takes torch dtypes)
FSDP_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# The precisions the canonical loop runs on weights loaded in each dtype (from_pretrained(dtype=...), no cast after)
LOADED_PRECISIONS = {"float32": (Precision.FP32, Precision.BF16_AUTOCAST, Precision.FP16_AUTOCAST),
                     "bfloat16": (Precision.BF16,), "float16": (Precision.FP16,)}


def as_loaded(setup: "TrainSetup", **changes) -> "TrainSetup":
    """`setup` with `changes` (a lever's), where a job that loads its weights with from_pretrained(dtype=...) keeps
    doing so: a precision lever loads them in that precision's dtype instead of casting them."""
    changed = replace(setup, **changes) if setup.load_dtype is None or setup.recipe is not Recipe.CANONICAL else None
    if changed is not None:
        return changed
    precision = changes.get("precision", setup.precision)
    load_dtype = {Precision.BF16: "bfloat16", Precision.FP16: "float16"}.get(precision, "float32")
    return replace(setup, **{**changes, "load_dtype": load_dtype, "build_bf16": load_dtype == "bfloat16"})
# "host": loaded on the host, each unit's parameters and buffers copied to the device by `fully_shard` as it shards
# them (FSDP2's `_move_states_to_device`): the HF Trainer's FSDP on a GPU, which leaves an FSDP model where
# from_pretrained loaded it (Trainer.place_model_on_device False) for accelerate to upcast and shard
FSDP_INITS = ("meta", "full", "host")
# How the model is wrapped: "layers" (fully_shard on every decoder layer, then the root: accelerate's
# TRANSFORMER_BASED_WRAP, torchtitan) or "transformers" (the model's own FSDP plan, as
# from_pretrained(distributed_config=DistributedConfig(fsdp_size=N)) applies it: the embedding and every layer
# resharded, the final norm and the LM head one group kept unsharded after the forward, then the root) or
# "accelerate" (the HF Trainer's FSDP: accelerate's `fsdp2_prepare_model` with TRANSFORMER_BASED_WRAP, run by the
# trace itself: every layer, the input embedding, the final norm with the LM head kept unsharded, then the root)
FSDP_WRAPS = ("layers", "transformers", "accelerate")


@dataclass(frozen=True)
class DsAutoTpSetup:
    """DeepSpeed's AutoTP training (recipe deepspeed-autotp, llmsim/model/ds_script.py): the resolved DeepSpeed config
    (canonical JSON), the world size (autotp_size x the data-parallel ranks) and the traced rank."""

    config_json: str
    world_size: int
    rank: int = 0

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)


@dataclass(frozen=True)
class DsPipeSetup:
    """DeepSpeed's pipeline engine (recipe deepspeed-pipe, llmsim/model/ds_pipe.py): the resolved DeepSpeed config
    (canonical JSON), the data-parallel degree, the traced rank's place among the replicas, and PipelineModule's
    `partition_method` (DeepSpeed's default "parameters", or "uniform", or "type:<regex>")."""

    config_json: str
    dp: int = 1
    dp_rank: int = 0
    partition_method: str = "parameters"

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)


@dataclass(frozen=True)
class FsdpSetup:
    """PyTorch FSDP2 as `fully_shard(module, mesh=..., reshard_after_forward=..., mp_policy=MixedPrecisionPolicy(
    param_dtype, reduce_dtype))` is called on every decoder layer and then on the root (llmsim/model/fsdp.py).
    The dtypes are torch's names ("bfloat16"); None is MixedPrecisionPolicy's own default (no cast). `init`: how the
    script builds the model: "meta" as PyTorch's FSDP2 tutorial and torchtitan do (built on the meta device,
    sharded, then `to_empty` and initialised: no rank ever holds the whole model), or "full" (every rank builds the
    whole model, which fully_shard then shards in place), or "host" (the HF Trainer's on a GPU: loaded on the host,
    each unit copied to the device by fully_shard as it shards it). `offload`: `offload_policy=CPUOffloadPolicy()` (each
    parameter's shard, its gradient and AdamW's states and step on the host; each unit's shards copied to the
    device for its all-gather). `cpu_ram_efficient_loading` (the Trainer's, wrap "accelerate": the plugin's switch of
    that name, accelerate launch's default): accelerate's `fsdp2_prepare_model` moves the model to the meta device
    before sharding (the other ranks before the fp32 upcast) and `fsdp2_load_full_state_dict` then broadcasts rank
    0's state dict, parameter by parameter, each rank keeping its shard: rank 0 runs apart from the others.
    `activation_checkpointing` (the Trainer's, wrap "accelerate": the plugin's switch of that name): accelerate's
    `fsdp2_apply_ac` wraps every decoder layer in torch's `checkpoint_wrapper` (non-reentrant, no RNG state kept)
    before sharding."""

    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    init: str = "meta"
    wrap: str = "layers"  # FSDP_WRAPS
    offload: bool = False
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in FSDP_DTYPES.values():
                raise InputError(f"fsdp {name.replace('_', '-')}({value}) is not a dtype FSDP2 is modelled with; "
                                 f"choose one of {', '.join(FSDP_DTYPES)}")
        if self.init not in FSDP_INITS:
            raise InputError(f"fsdp-init({self.init}) is not a way to build the model; choose one of "
                             f"{', '.join(FSDP_INITS)}")
        if self.wrap not in FSDP_WRAPS:
            raise InputError(f"fsdp-wrap({self.wrap}) is not a way to wrap the model; choose one of "
                             f"{', '.join(FSDP_WRAPS)}")
        if self.wrap == "transformers":
            # DistributedConfig's switches: fsdp_mixed_precision is MixedPrecisionPolicy(bf16, fp32), nothing else
            if (self.param_dtype, self.reduce_dtype) not in ((None, None), ("bfloat16", "float32")):
                raise InputError("transformers' FSDP plan takes DistributedConfig(fsdp_mixed_precision=True), i.e. "
                                 "--fsdp-param-dtype bf16 --fsdp-reduce-dtype fp32, or no mixed precision")
            if not self.reshard_after_forward or self.init != "meta":
                raise InputError("transformers' FSDP plan decides the resharding itself and builds on the meta "
                                 "device: --fsdp-no-reshard and --fsdp-init full do not apply to it")
        if self.init == "host" and self.wrap != "accelerate":
            raise InputError("fsdp-init(host) is how the HF Trainer's FSDP builds on a GPU (from_pretrained on the "
                             "host, fully_shard moving each unit to the device); with --strategy fsdp choose meta or "
                             "full")
        if self.offload and self.wrap == "transformers":
            raise InputError("fsdp-offload with fsdp-wrap(transformers) is not modelled yet; modelled: CPUOffloadPolicy "
                             "with fully_shard on every decoder layer, then the root (fsdp-wrap layers), and the HF "
                             "Trainer's fsdp_config cpu_offload")
        if self.cpu_ram_efficient_loading and self.wrap != "accelerate":
            raise InputError("cpu_ram_efficient_loading is accelerate's FSDP plugin switch (the HF Trainer's "
                             "fsdp_config, accelerate launch's fsdp_cpu_ram_efficient_loading); with --strategy fsdp "
                             "choose --fsdp-init meta for a model no rank holds whole")
        if self.activation_checkpointing and self.wrap != "accelerate":
            raise InputError("activation_checkpointing is accelerate's FSDP plugin switch (the HF Trainer's "
                             "fsdp_config, accelerate launch's fsdp_activation_checkpointing); with --strategy fsdp "
                             "choose --grad-ckpt")

    def as_json(self) -> str:
        """The fields; accelerate's plugin switches with wrap "accelerate" only (fully_shard has no such switch)."""
        fields = {"reshard_after_forward": self.reshard_after_forward, "param_dtype": self.param_dtype,
                  "reduce_dtype": self.reduce_dtype, "init": self.init, "wrap": self.wrap, "offload": self.offload}
        if self.wrap == "accelerate":
            fields["cpu_ram_efficient_loading"] = self.cpu_ram_efficient_loading
            fields["activation_checkpointing"] = self.activation_checkpointing
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FsdpSetup":
        """A row's `fsdp_config`: every field stated (a row says how it was built, never a default)."""
        fields = json.loads(text)
        names = ["init", "offload", "param_dtype", "reduce_dtype", "reshard_after_forward", "wrap"]
        if fields.get("wrap") == "accelerate":
            names += ["activation_checkpointing", "cpu_ram_efficient_loading"]
        unknown, missing = sorted(set(fields) - set(names)), sorted(set(names) - set(fields))
        if unknown or missing:
            raise InputError(f"fsdp_config {'has unknown field ' + unknown[0] if unknown else 'lacks ' + missing[0]}"
                             f"; its fields: {', '.join(names)}")
        return cls(**fields)


def zoo_names() -> list[str]:
    return sorted(p.stem for p in ZOO_DIR.glob("*.json"))


def check_fused_layout(tp: int, pp: int) -> None:
    """A fused optimizer is modelled in one process and under DDP: TP and PP refuse it (one line)."""
    if tp > 1 or pp > 1:
        raise InputError(f"fused optimizer with tp({tp}) / pp({pp}) is not modelled yet; modelled: one process and "
                         "ddp (tp = pp = 1)")


@dataclass(frozen=True)
class TrainSetup:
    """One process's canonical training loop (DESIGN.md, "The canonical training step")."""

    micro_batch: int
    seq_len: int
    precision: Precision = Precision.FP32
    attention: Attention | None = None  # None: transformers' own choice (sdpa where supported, else eager)
    grad_ckpt: bool = False
    ckpt_every: int = 1  # transformers' `every_n_layers`: layer i is checkpointed iff i % ckpt_every == 0
    steps: int = CANONICAL_STEPS
    device: Device = Device.CPU
    cuda_capability: str | None = None  # with device cuda: "8.0", "9.0", ... (the kernels CUDA picks depend on it)
    foreach: bool = False  # the optimizer's foreach path: torch's default for CUDA parameters, not for CPU ones
    optimizer: Optimizer = Optimizer.ADAMW
    build_bf16: bool = False  # build directly in bf16, as from_pretrained(dtype=torch.bfloat16) loads (else the
    # canonical fp32 build and cast, whose 4 bytes/parameter can be the whole step's peak)
    lora_rank: int = 0  # 0: full fine-tuning; else peft LoRA adapters of this rank on a frozen base
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] | None = None  # None: peft's default target modules for the model type
    zero3_hooks: bool = False  # trace with DeepSpeed ZeRO-3's module hooks mirrored (llmsim/model/zero3_hooks.py)
    tp: int = 1  # tensor-parallel degree: trace one rank of transformers' TP plan (llmsim/model/tensor_parallel.py)
    tp_rank: int = 0  # the TP rank traced (ranks with shorter uneven shards: tensor_parallel.tp_rank_classes)
    ep: int = 1  # expert-parallel degree (1, or tp: transformers' EP plan over the TP group; llmsim/model/moe.py)
    routing: str = "balanced"  # with ep > 1: the routing the trace states (llmsim.model.moe.ROUTINGS)
    pp: int = 1  # pipeline stages: trace stage `pp_stage` of the canonical PP step (llmsim/model/pipelining.py)
    pp_stage: int = 0
    schedule: str = "gpipe"  # llmsim.model.pipelining.Schedule
    n_microbatches: int = 1  # micro-batches per step through the pipeline (each `micro_batch` samples)
    pp_split: tuple[int, ...] | None = None  # layers per stage; None: transformers' balanced split
    # stages each pipeline rank holds (Schedule.multi_stage): rank pp_stage holds pp_stage, pp_stage + pp, ... (in a V:
    # pp_stage and 2 pp - 1 - pp_stage; pipelining.rank_stages)
    stages_per_rank: int = 1
    grad_accum: int = 1  # forward/backward passes per optimizer step (the loss divided by it)
    quant: str | None = None  # "nf4" | "fp4" | "int8": a bitsandbytes 4-/8-bit base under LoRA (llmsim/model/quantized.py)
    double_quant: bool = False  # bnb_4bit_use_double_quant
    ckpt_offload: bool = False  # activation_checkpointing_enable(offload=True): checkpoint inputs held in host memory
    # The step runs under `with torch.device("cuda")` (the GPU kit's canonical loop, experiments/gpu_validation.py):
    # tensors made without a device land on the GPU, torch Adam/AdamW's `step` among them (step.host_state)
    cuda_default_device: bool = False
    loss: Loss = Loss.HF  # transformers' loss, TRL's chunked NLL or Liger's fused linear CE (llmsim/model/losses.py)
    loss_chunk: int | None = None  # chunked-nll's vocabulary tile width; None: TRL's 32768 (losses.TRL_CHUNK_SIZE)
    # LoraConfig(modules_to_save=...): peft's ModulesToSaveWrapper keeps each matched module frozen and trains a
    # deepcopy of it (peft/utils/other.py); module names matched by their FQN's ending, as peft matches them
    lora_modules_to_save: tuple[str, ...] | None = None
    # Vocabulary rows trained alone (peft's TrainableTokensLayer on the input embedding): through LoraConfig's
    # `trainable_token_indices` with a LoRA rank, else peft's own TrainableTokensConfig(token_indices=...)
    trainable_tokens: tuple[int, ...] | None = None
    # DeepSpeed's engine (no zero.Init) casts the parameters after get_peft_model instead of the canonical cast
    # before it: every parameter, the adapters included, to the precision's dtype, the buffers left as built
    # (deepspeed/runtime/engine.py, `_cast_module_mixed_precision`); set for LoRA under ZeRO-1/2 (llmsim.sim.strategies)
    cast_after_peft: bool = False
    # torch.optim's `fused=True`: the optimizer's fused kernel (`_fused_adamw_`, `_fused_adam_`, `_fused_sgd_`),
    # which updates every state in place (no temporaries) and keeps AdamW's `step` on the parameters' device
    fused: bool = False
    # Name each micro-step's own gradient (what autograd hands a parameter's AccumulateGrad) a GRADIENT of that
    # parameter, where it is added in place into the accumulated one: DeepSpeed ZeRO-2 sets every `param.grad` to
    # None at the end of each backward (stage_1_and_2.py, `_clear_param_grad_only`), so there autograd keeps that
    # storage as the new `.grad` and the reduction takes it over (llmsim.sim.strategies, `traced_setup`). The events
    # are those of the canonical step; only their names change.
    label_micro_grads: bool = False
    # BitsAndBytesConfig(llm_int8_threshold=...) with quant int8: LLM.int8's outlier threshold (bitsandbytes' default
    # 6.0); a CPU training step never reads it (llmsim/model/quantized.py), so it changes no byte there
    int8_threshold: float = LLM_INT8_THRESHOLD
    # The recipe (llmsim.enums.Recipe). With HF_TRAINER or TRL_SFT the fields below are the user's own inputs, as
    # canonical JSON (llmsim/inputs/hf.py reads and validates them); the loop fields above are derived from them, for
    # the report and the checks, while the trace runs the Trainer itself.
    recipe: Recipe = Recipe.CANONICAL
    training_args: str | None = None  # TrainingArguments (TRL_SFT: SFTConfig) fields as the user's file gives them
    peft_config: str | None = None  # LoraConfig fields (an adapter_config.json), or None: full fine-tuning
    # from_pretrained(dtype=...) resolved: "float32" | "bfloat16" | "float16". The build is then in that dtype and
    # the canonical loop casts nothing after it (the rotary tables transformers keeps in fp32 stay so)
    load_dtype: str | None = None
    # Trace flag (llmsim.sim.strategies.traced_setup): the HF Trainer recipe under DeepSpeed ZeRO, whose engine owns
    # the precision (it casts the model after get_peft_model; no autocast) and the step: the trace runs the
    # Trainer without `deepspeed`, `bf16` and `fp16`, casts as the engine does, and the strategy replaces the step
    trainer_under_deepspeed: bool = False
    # BitsAndBytesConfig fields as the user's file gives them (`quant`, `double_quant`, `int8_threshold` derived from
    # them), and whether the script calls peft's prepare_model_for_kbit_training before get_peft_model
    quantization_config: str | None = None
    kbit_prep: bool = False
    # Trace flag (llmsim.sim.strategies.traced_setup): the step with PyTorch FSDP2's `fully_shard` over
    # `fsdp_world` ranks of a fake process group, traced as rank `fsdp_rank` (llmsim/model/fsdp.py)
    fsdp: FsdpSetup | None = None
    fsdp_world: int = 1
    fsdp_rank: int = 0
    # Trace flag (llmsim.sim.strategies.traced_setup): DDP over TP shards, i.e. torch's `replicate` (each decoder
    # layer, then the model or pipeline stage) over this many data-parallel replicas of a fake process group of
    # replicate_dp x pp x tp ranks, traced as replica 0's rank (llmsim/model/replicate.py); 0: no replicate
    replicate_dp: int = 0
    # The deepspeed-pipe recipe's DeepSpeed config and traced rank (its pp_stage above; the steps' micro-batches are
    # n_microbatches, DeepSpeed's gradient_accumulation_steps)
    ds_pipe: DsPipeSetup | None = None
    # The deepspeed-autotp recipe's DeepSpeed config, world and traced rank (tp above is its autotp_size)
    ds_autotp: DsAutoTpSetup | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "ckpt_every", "steps", "tp", "ep", "pp", "n_microbatches",
                     "grad_accum", "stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise InputError(f"lora-rank must be a positive integer (or 0 for full fine-tuning), "
                             f"got {self.lora_rank!r}")
        if self.lora_targets is not None and not self.lora_rank:
            raise InputError("lora-targets needs a LoRA rank (--lora-rank)")
        self._check_peft_extras()
        if self.build_bf16 and self.precision is not Precision.BF16:
            raise InputError(f"build-dtype bf16 needs precision bf16, got {self.precision.value}")
        if self.recipe.trainer != (self.training_args is not None) or \
                (self.recipe.trainer and self.load_dtype is None):
            raise InputError("the hf-trainer and trl-sft recipes need their TrainingArguments (SFTConfig) and load "
                             "dtype (and only they take them)")
        if self.load_dtype is not None and self.load_dtype not in ("float32", "bfloat16", "float16"):
            raise InputError(f"load dtype {self.load_dtype!r}: float32, bfloat16 or float16")
        if self.load_dtype is not None and self.recipe is Recipe.CANONICAL:
            allowed = LOADED_PRECISIONS[self.load_dtype]
            if self.precision not in allowed or self.build_bf16 != (self.load_dtype == "bfloat16"):
                raise InputError(f"weights loaded in {self.load_dtype} train as "
                                 f"{', '.join(p.value for p in allowed)}, not {self.precision.value} (the canonical "
                                 "loop casts nothing after from_pretrained)")
        if (self.recipe is Recipe.DEEPSPEED_PIPE) != (self.ds_pipe is not None):
            raise InputError("the deepspeed-pipe recipe needs its DeepSpeed config (DsPipeSetup), and only it takes one")
        if (self.recipe is Recipe.DEEPSPEED_AUTOTP) != (self.ds_autotp is not None):
            raise InputError("the deepspeed-autotp recipe needs its DeepSpeed config (DsAutoTpSetup), and only it "
                             "takes one")
        if (self.quantization_config is not None or self.kbit_prep) and not self.recipe.trainer:
            raise InputError("a BitsAndBytesConfig file is read with --training-args (the hf-trainer recipe); for "
                             "the canonical step use --quant")
        if (self.device is Device.CUDA) != (self.cuda_capability is not None):
            raise InputError("device cuda needs a GPU (--gpu NAME), whose compute capability picks the kernels")
        if self.loss_chunk is not None:
            if not isinstance(self.loss_chunk, int) or self.loss_chunk < 1:
                raise InputError(f"loss-chunk must be a positive integer, got {self.loss_chunk!r}")
            if self.loss is not Loss.CHUNKED_NLL:
                raise InputError(f"loss-chunk({self.loss_chunk}) needs --loss chunked-nll (TRL's vocabulary tile); "
                                 f"loss {self.loss.value} has no chunk to set (Liger derives its own)")
        if self.optimizer.paged and self.device is Device.CUDA:
            raise InputError(f"optimizer {self.optimizer.value} on a GPU is not modelled: its states of 1e5 elements "
                             "or more live in CUDA unified memory outside PyTorch's allocator (bitsandbytes "
                             "get_paged); on the CPU bitsandbytes falls back to ordinary buffers")
        if self.tp > 1 and self.optimizer in NOT_WITH_TP:
            raise InputError(f"optimizer {self.optimizer.value} with tp({self.tp}) is not modelled yet; modelled "
                             "with tp: adamw, adam, sgd, sgd-momentum")
        self._check_fused()
        if self.routing not in ROUTINGS:
            raise InputError(f"routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if not isinstance(self.int8_threshold, (int, float)) or not self.int8_threshold >= 0:
            raise InputError(f"int8-threshold must be a number >= 0 (0 turns LLM.int8's outlier split off), "
                             f"got {self.int8_threshold!r}")
        if self.int8_threshold != LLM_INT8_THRESHOLD and self.quant != "int8":
            raise InputError(f"int8-threshold({self.int8_threshold}) is LLM.int8's outlier threshold: it needs "
                             "--quant int8")
        if self.ckpt_every != 1 and not self.grad_ckpt:
            raise InputError(f"ckpt-every({self.ckpt_every}) needs activation checkpointing (--grad-ckpt)")
        if self.ckpt_offload and not self.grad_ckpt:
            raise InputError("ckpt-offload offloads the checkpointed layers' inputs: it needs activation "
                             "checkpointing (--grad-ckpt)")

    def _check_fused(self) -> None:
        if not self.fused:
            return
        if self.foreach:  # torch/optim/adam.py, sgd.py: the constructors raise this
            raise InputError("fused and foreach cannot both be on (torch.optim raises \"`fused` and `foreach` "
                             "cannot be `True` together\"); pick one")
        if self.optimizer not in FUSED_OPTIMIZERS:
            raise InputError(f"optimizer {self.optimizer.value} has no fused path; fused: "
                             f"{', '.join(o.value for o in FUSED_OPTIMIZERS)}")
        check_fused_layout(self.tp, self.pp)

    def _check_peft_extras(self) -> None:
        if self.lora_modules_to_save is not None:
            if not self.lora_rank:
                raise InputError("lora-modules-to-save is a LoraConfig field (modules_to_save): it needs a LoRA rank "
                                 "(--lora-rank)")
            if not self.lora_modules_to_save or not all(self.lora_modules_to_save):
                raise InputError(f"lora-modules-to-save needs module names, got {self.lora_modules_to_save!r}")
        if self.trainable_tokens is not None:
            tokens = self.trainable_tokens
            if not tokens or not all(isinstance(t, int) for t in tokens):
                raise InputError(f"trainable-tokens must be vocabulary indices, e.g. 0,1,2; got {tokens!r}")
            if negative := [t for t in tokens if t < 0]:
                raise InputError(f"trainable-tokens must be vocabulary indices >= 0, got {negative}")
            if len(set(tokens)) != len(tokens):
                raise InputError(f"trainable-tokens lists an index twice: {list(tokens)}")
        if (self.lora_modules_to_save or self.trainable_tokens) and self.quant is not None:
            raise InputError(f"lora-modules-to-save / trainable-tokens with quant {self.quant} are not modelled yet; "
                             "modelled: an fp32 or bf16 base")

    @property
    def ckpt_period(self) -> int:
        """Layers repeat their memory behaviour with this period."""
        return self.ckpt_every if self.grad_ckpt else 1


@dataclass(frozen=True)
class ModelSpec:
    """A causal LM: an HF config (zoo name or config.json path, plus overrides) or a `module:factory`."""

    name: str
    config_json: str | None = None  # canonical JSON of the HF config dict, overrides applied
    factory: str | None = None  # "package.module:function" returning an nn.Module
    overrides: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def config_dict(self) -> dict[str, Any]:
        assert self.config_json is not None
        return json.loads(self.config_json)

    def hf_config(self, num_layers: int | None = None):
        """The transformers config, optionally cut to `num_layers` decoder layers (for the trace)."""
        config = copy.deepcopy(_hf_config_from_json(self.config_json))  # from_config mutates its config
        if num_layers is not None:
            _set_depth(config, num_layers)
        return config

    @property
    def num_layers(self) -> int:
        return int(self.hf_config().num_hidden_layers)

    @property
    def layer_period(self) -> int:
        """Smallest period of the per-layer attention types (1 for homogeneous models)."""
        types = getattr(self.hf_config(), "layer_types", None) or []
        return _smallest_period(list(types)) if types else 1

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config().vocab_size)

    @property
    def max_positions(self) -> int | None:
        config = self.hf_config()
        for key in ("max_position_embeddings", "n_positions"):
            value = getattr(config, key, None)
            if isinstance(value, int):
                return value
        return None

    def factory_callable(self) -> Callable[[], Any]:
        module_name, _, attr = self.factory.partition(":")  # type: ignore[union-attr]
        return getattr(importlib.import_module(module_name), attr)


def _smallest_period(items: list) -> int:
    for period in range(1, len(items) + 1):
        if all(items[i] == items[i % period] for i in range(len(items))):
            return period
    return len(items)


def _set_depth(config, num_layers: int) -> None:
    types = getattr(config, "layer_types", None)
    config.num_hidden_layers = num_layers  # attribute_map turns this into n_layer for GPT-2, BLOOM, CodeGen
    if isinstance(types, list):
        config.layer_types = types[:num_layers]


@functools.lru_cache(maxsize=64)
def _hf_config_from_json(config_json: str):
    from transformers import AutoConfig

    config_dict = json.loads(config_json)
    return AutoConfig.for_model(**config_dict)


def load_model_spec(name: str, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Resolve `name` (zoo name, path to an HF config.json, or module:factory) into a validated spec."""
    overrides = dict(overrides or {})
    if ":" in name and not Path(name).exists():
        if overrides:
            raise InputError(f"config overrides {sorted(overrides)} cannot apply to a module:factory model")
        spec = ModelSpec(name=name, factory=name)
        try:
            spec.factory_callable()
        except (ImportError, AttributeError, ValueError) as exc:
            raise InputError(f"cannot load model factory {name!r}: {exc}") from None
        return spec
    config_dict = _read_config(name)
    config_dict.update(overrides)
    _check_architecture(name, config_dict)
    _check_checkpoint_quantization(name, config_dict)
    config_json = json.dumps(config_dict, sort_keys=True)
    try:
        config = _hf_config_from_json(config_json)
    except Exception as exc:  # transformers raises many types for invalid configs
        raise InputError(f"invalid config for model {name!r}: {one_line(exc)}") from None
    spec = ModelSpec(name=name, config_json=config_json,
                     overrides=tuple(sorted((key, _frozen(value)) for key, value in overrides.items())))
    if getattr(config, "num_hidden_layers", 0) < 1:
        raise InputError(f"model {name!r} has num_hidden_layers({config.num_hidden_layers}); need >= 1")
    return spec


class _FrozenDict(dict):
    """A dict-valued override (`--set rope_scaling={...}`), hashable; JSON writes it as the dict it is."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True))


def _frozen(value: Any) -> Any:
    """An override's value, hashable (a spec keys the trace cache): lists as tuples and dicts as `_FrozenDict`s,
    which JSON writes back as lists and dicts."""
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, dict):
        return _FrozenDict({key: _frozen(item) for key, item in value.items()})
    return value


def _read_config(name: str) -> dict[str, Any]:
    path = ZOO_DIR / f"{name}.json"
    if not path.exists():
        path = Path(name)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise InputError(f"unknown model {name!r}; valid zoo names: {', '.join(zoo_names())} "
                             "(or a path to an HF config.json, or module:factory)")
    try:
        config_dict = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read model config {str(path)!r}: {exc}") from None
    if not isinstance(config_dict, dict):
        raise InputError(f"model config {str(path)!r} is not a JSON object")
    return config_dict


def _check_checkpoint_quantization(name: str, config_dict: dict[str, Any]) -> None:
    """A config.json that says its checkpoint is quantized (`quantization_config`) is not silently predicted as the
    unquantized model."""
    quantization = config_dict.get("quantization_config")
    if not quantization:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == "mxfp4":
        raise InputError(f"model {name!r} is an MXFP4 checkpoint (quantization_config quant_method mxfp4): "
                         "transformers trains it dequantized to bf16 (from_pretrained with "
                         "Mxfp4Config(dequantize=True), as it also does where its MXFP4 kernels cannot run), which is "
                         "the model llmsim predicts without quantization_config (the zoo's gpt-oss-20b, gpt-oss-120b)")
    if method == "bitsandbytes":
        raise InputError(f"model {name!r} is a pre-quantized bitsandbytes checkpoint: give its quantization_config "
                         "as --quantization-config (with the Trainer recipe) and the config without it")
    raise InputError(f"model {name!r} has quantization_config quant_method {method!r}, which is not modelled "
                     "(modelled: bitsandbytes 4-bit and 8-bit through --quantization-config); remove it to predict "
                     "the unquantized model")


def _check_architecture(name: str, config_dict: dict[str, Any]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config_dict.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        valid = ", ".join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
        raise InputError(f"model {name!r} has model_type {model_type!r}, which transformers cannot build as a "
                         f"causal LM; valid model types: {valid}")


def check_fits_positions(spec: ModelSpec, setup: TrainSetup) -> None:
    """A sequence longer than a learned position table cannot run at all."""
    if spec.config_json is None:
        return
    limit = spec.max_positions
    learned = spec.config_dict.get("model_type") in LEARNED_POSITION_MODEL_TYPES
    if limit is not None and learned and setup.seq_len > limit:
        raise InputError(f"seq-len({setup.seq_len}) exceeds {spec.name}'s max positions({limit})")


def resolve_attention(spec: ModelSpec, setup: TrainSetup) -> TrainSetup:
    """Fix the attention implementation the way transformers would, and reject one the model lacks."""
    if spec.config_json is None:
        return setup if setup.attention is not None else replace(setup, attention=Attention.SDPA)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(spec.hf_config())]
    supported = [Attention.EAGER] + ([Attention.SDPA] if model_class._supports_sdpa else [])
    if setup.attention is None:
        return replace(setup, attention=supported[-1])
    if setup.attention not in supported:
        raise InputError(f"{spec.name} ({model_class.__name__}) does not support attention "
                         f"{setup.attention.value!r}; valid choices: {', '.join(a.value for a in supported)}")
    return setup
