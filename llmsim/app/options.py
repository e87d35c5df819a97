"""`llmsim`'s arguments: the parser of every command and what turns parsed arguments into llmsim's inputs
(model spec, training setup, layout), shared by the CLI, `sweep` and `llmsim.predict`. Strings become enums here;
bad input is one line (InputError). Nothing here imports torch or transformers when it loads, so `llmsim --help`
and argument errors answer at once; the readers it calls import them when they run."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from llmsim.enums import Attention, Loss, Optimizer, Precision, Recipe, parse_enum
from llmsim.errors import InputError
from llmsim.inputs.spec import LLM_INT8_THRESHOLD
from llmsim.model.quiet import quiet_libraries


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, status 2
        raise InputError(f"{self.prog}: {message}")


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise InputError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _add_cluster_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--cluster", metavar="ADDRESS", default=None,
                   help=f"a running Dask scheduler's address (tcp://HOST:8786): its workers, each with the llmsim, "
                   f"torch and transformers installed here, predict the {what} instead of --jobs local processes "
                   "(pip install 'llmsim[cluster]')")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """What defines the model and its training step (every command that predicts)."""
    p.add_argument("--model", required=True, help="zoo name (llmsim models), path to an HF config.json, "
                   "or module:factory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=str,
                   help="override a config field (JSON value), e.g. --set num_hidden_layers=4")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--precision", default=None, help="fp32 | bf16 | bf16-autocast | fp16 | fp16-autocast "
                   "(default fp32, or the DeepSpeed config's)")
    p.add_argument("--attn", default=None, help="sdpa | eager (default: transformers' choice for the model)")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--grad-accum", type=int, default=None, help="gradient accumulation: forward/backward passes per "
                   "optimizer step (default 1, or the DeepSpeed config's gradient_accumulation_steps, which it fills "
                   "where \"auto\" and must equal otherwise)")
    p.add_argument("--ckpt-every", type=int, default=1, help="checkpoint every N-th layer (every_n_layers)")
    p.add_argument("--ckpt-offload", action="store_true", help="hold the checkpointed layers' inputs in (pinned) "
                   "host memory: activation_checkpointing_enable(offload=True); needs --grad-ckpt")
    p.add_argument("--optimizer", default="adamw", help="adamw | adam | sgd | sgd-momentum | adafactor (torch.optim) "
                   "| hf-adafactor (transformers) | adamw8bit | paged-adamw | paged-adamw8bit (bitsandbytes)")
    p.add_argument("--foreach", action="store_true", help="the optimizer's foreach path (foreach=True; the default "
                   "with --gpu, as torch's for CUDA parameters; else the for-loop path, the CPU's default)")
    p.add_argument("--fused", action="store_true", help="the optimizer's fused kernel (fused=True): adamw, adam, "
                   "sgd, sgd-momentum; not with --foreach")
    p.add_argument("--build-dtype", default="fp32", help="fp32 (build, then cast: the canonical step) | bf16 "
                   "(build in bf16, as from_pretrained(dtype=bfloat16) loads; needs --precision bf16)")
    p.add_argument("--lora-rank", type=int, default=0, help="peft LoRA adapters of this rank on a frozen base")
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--quant", default=None, help="nf4 | fp4: QLoRA, a bitsandbytes 4-bit base under the LoRA "
                   "adapters | int8: an LLM.int8 8-bit base (load_in_8bit; CPU only) (needs --lora-rank)")
    p.add_argument("--int8-threshold", type=float, default=LLM_INT8_THRESHOLD, help="with --quant int8: "
                   "llm_int8_threshold, LLM.int8's outlier threshold (0: no outlier split); a CPU training step "
                   "never reads it")
    p.add_argument("--double-quant", action="store_true", help="bitsandbytes double quantization of the 4-bit "
                   "absmax (bnb_4bit_use_double_quant)")
    p.add_argument("--lora-targets", default=None, help="comma-separated module names, or all-linear (peft's "
                   "shorthand: every linear layer but the LM head; on MoE models the router and experts too); "
                   "default: peft's for the model type")
    p.add_argument("--lora-modules-to-save", default=None, help="comma-separated module names trained in full next "
                   "to the adapters (LoraConfig modules_to_save: peft trains a copy, the original stays frozen), e.g. "
                   "lm_head; needs --lora-rank")
    p.add_argument("--trainable-tokens", default=None, help="comma-separated vocabulary indices whose embedding rows "
                   "train (peft's trainable tokens: LoraConfig trainable_token_indices with --lora-rank, else "
                   "TrainableTokensConfig), e.g. 0,1,2")
    p.add_argument("--loss", default="hf", help="hf (transformers' loss over the full logits) | chunked-nll (TRL's "
                   "SFT loss: its fused LM head in vocabulary tiles) | fused-linear-ce (Liger's fused linear "
                   "cross-entropy, chunked over tokens)")
    p.add_argument("--loss-chunk", type=int, default=None, help="chunked-nll's vocabulary columns per tile "
                   "(default TRL's 32768)")
    p.add_argument("--device", default="cpu", help="cpu: the CPU's kernels are traced (--gpu switches to the "
                   "GPU's CUDA kernels)")
    p.add_argument("--training-args", default=None, metavar="FILE", help="JSON or YAML of transformers "
                   "TrainingArguments fields: predict the HF Trainer's own run (Trainer(...).train()), its batch size, "
                   "accumulation, bf16/fp16, optim, max_grad_norm and gradient checkpointing as the file sets them")
    p.add_argument("--sft-config", default=None, metavar="FILE", help="JSON or YAML of TRL's SFTConfig fields (in "
                   "place of --training-args): predict TRL's SFTTrainer(...).train(), with TRL's defaults (gradient "
                   "checkpointing on, bf16 unless fp16, max_length 1024) and its fused LM head; needs trl installed")
    p.add_argument("--peft-config", default=None, metavar="FILE", help="with --training-args: a LoraConfig as JSON "
                   "or YAML (an adapter_config.json), given to get_peft_model (with --sft-config, to SFTTrainer's "
                   "peft_config); target_modules \"all-linear\" too")
    p.add_argument("--dtype", default=None, help="from_pretrained's dtype: auto (the config's dtype, as transformers "
                   "5 loads) | float32 | bfloat16 | float16. With --training-args the Trainer's model (default auto); "
                   "without, the canonical loop trains the weights as loaded, nothing cast after (default: the "
                   "fp32 build, --build-dtype)")
    p.add_argument("--quantization-config", default=None, metavar="FILE", help="with --training-args: a "
                   "BitsAndBytesConfig as JSON or YAML, given to from_pretrained(quantization_config=...) (QLoRA: "
                   "load_in_4bit, bnb_4bit_quant_type nf4, ...); the script then calls peft's "
                   "prepare_model_for_kbit_training, as QLoRA scripts and older TRL SFTTrainers (0.13) do (trl 1.16's "
                   "does not: --no-kbit-prep)")
    p.add_argument("--no-kbit-prep", action="store_true", help="with --quantization-config: the script does not call "
                   "prepare_model_for_kbit_training (the base's other weights stay in the loaded dtype)")


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    """One layout: micro-batch, ranks, strategy, and optionally the GPU."""
    p.add_argument("--micro-batch", type=int, default=None, help="required unless the DeepSpeed config sets it")
    p.add_argument("--strategy", default=None, help="single | ddp | fsdp (PyTorch FSDP2: fully_shard on every decoder "
                   "layer, then the root) (deepspeed when --ds-config is given); ddp with --tp is torch's replicate "
                   "(replicate_with_fsdp: DistributedDataParallel takes no DTensor), per layer, then the stage")
    p.add_argument("--world-size", type=int, default=None, help="number of ranks (default: tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: transformers' TP plan on DTensor "
                   "(colwise/rowwise, the LM head's logits gathered); world-size = dp x pp x tp")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE models): transformers' EP plan over "
                   "the TP group, DistributedConfig(tp_size=N, ep_size=N); needs --tp N. Each rank holds 1/N of "
                   "every layer's experts, tokens exchanged by all-to-all")
    p.add_argument("--routing", default="balanced", help="with --ep: the routing the prediction states: balanced "
                   "(each rank's experts get an equal share; the default, and the worst case is reported beside "
                   "it) | collapsed (every token's top-k onto one rank's experts: the bound of any routing)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (torch.distributed.pipelining, layers split "
                   "as transformers splits them)")
    p.add_argument("--pp-split", default=None, help="layers per stage, e.g. 9,10,10,11 (default: transformers' "
                   "balanced split, the remainder one layer each to the first stages)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: world-size / (pp x tp))")
    p.add_argument("--schedule", default=None, help="pipeline schedule with --pp: gpipe (default) | 1f1b, one "
                   "stage a rank; several a rank (--stages-per-rank): interleaved-1f1b | looped-bfs | "
                   "interleaved-zero-bubble | zbv-zero-bubble | dualpipev (torch's ScheduleInterleaved1F1B, "
                   "ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)")
    p.add_argument("--stages-per-rank", type=int, default=None, help="with a schedule of several stages a rank: "
                   "the stages each rank holds (Megatron's virtual pipeline size, >= 2; 2 for zbv-zero-bubble and "
                   "dualpipev); the layers split over pp x this many stages, rank r holding stages r, r + pp, ... (r "
                   "and 2 pp - 1 - r in a V)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches through the pipeline per step, "
                   "each of --micro-batch samples (with --pp; default 1; with --ds-config the JSON's "
                   "gradient_accumulation_steps)")
    p.add_argument("--partition-method", default=None, help="with --ds-config and --pp (DeepSpeed's pipeline "
                   "engine): PipelineModule's partition_method: parameters (DeepSpeed's default) | uniform | "
                   "type:REGEX")
    p.add_argument("--ds-config", default=None, help="DeepSpeed JSON, as passed to deepspeed.initialize")
    p.add_argument("--accelerate-config", default=None, metavar="FILE", help="accelerate's YAML (accelerate launch "
                   "--config_file): its distributed_type (NO, MULTI_GPU, DEEPSPEED), num_processes, mixed_precision "
                   "and deepspeed_config set the layout, as accelerate builds it (llmsim/inputs/accelerate_config.py)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node, for the host memory a node needs "
                   "when ranks offload to it (ZeRO-Offload, --ckpt-offload; default 8)")
    p.add_argument("--fsdp-param-dtype", default=None, help="with --strategy fsdp: MixedPrecisionPolicy(param_dtype=): "
                   "the dtype parameters are all-gathered and computed in (fp32 | bf16 | fp16; default: the "
                   "parameters' own)")
    p.add_argument("--fsdp-reduce-dtype", default=None, help="with --strategy fsdp: MixedPrecisionPolicy("
                   "reduce_dtype=): the dtype gradients are reduce-scattered in (default: param-dtype)")
    p.add_argument("--fsdp-init", default=None, help="with --strategy fsdp: how the script builds the model: meta "
                   "(default; PyTorch's FSDP2 tutorial, torchtitan: on the meta device, sharded, then to_empty and "
                   "initialised, so no rank holds the whole model) | full (every rank builds it whole, fully_shard "
                   "shards it in place); with --training-args, where the Trainer's FSDP finds the model: full (the "
                   "CPU's one memory, the default without --gpu) | host (a GPU run's: loaded on the host, each unit "
                   "copied to the device by fully_shard; the default with --gpu)")
    p.add_argument("--fsdp-wrap", default=None, help="with --strategy fsdp: layers (default: fully_shard on every "
                   "decoder layer, then the root, as accelerate and torchtitan wrap) | transformers (the model's own "
                   "FSDP plan, as from_pretrained(distributed_config=DistributedConfig(fsdp_size=N)) applies it)")
    p.add_argument("--fsdp-offload", action="store_true", help="with --strategy fsdp: fully_shard(offload_policy="
                   "CPUOffloadPolicy()): each parameter's shard, its gradient and AdamW's states on the host, reported apart "
                   "from the device peak")
    p.add_argument("--fsdp-no-reshard", action="store_true", help="with --strategy fsdp: fully_shard("
                   "reshard_after_forward=False): each layer's parameters stay gathered from its forward to its "
                   "backward")
    p.add_argument("--gpu", default=None, help="GPU profile (data/gpus): the kernels CUDA picks on it (SDPA backend, "
                   "autocast policy, foreach AdamW), reserved via the caching-allocator model, device total, headroom")
    p.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF as the run will set it, e.g. "
                   "expandable_segments:True,max_split_size_mb:256 (with --gpu)")
    p.add_argument("--margin", default=None, metavar="PCT", help="with --gpu: the verdict's margin, in percent of "
                   "the card (default 5: the error llmsim's targets allow its GPU figures); a job predicted to "
                   "need more than capacity - margin is 'tight', not 'fits'")


def _split(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InputError(f"pp-split({text}) must be layer counts separated by commas, e.g. 10,10,12") from None


# Flags that spell a TrainingArguments field: with --training-args they set it (the file's value overridden)


TRAINING_ARGS_SHORTCUTS = {"micro_batch": "per_device_train_batch_size", "grad_accum": "gradient_accumulation_steps",
                           "grad_ckpt": "gradient_checkpointing"}
# Flags of the canonical recipe that the Trainer's files decide instead: (flag, its default, where to say it; None
# where the hf-trainer recipe does not model the flag yet). Each is refused rather than silently dropped.


TRAINER_DECIDES = (("precision", None, "bf16 / fp16 in the TrainingArguments, --dtype for the weights"),
                   ("optimizer", "adamw", "optim in the TrainingArguments"), ("fused", False, "optim adamw_torch_fused"),
                   ("foreach", False, "optim"), ("build_dtype", "fp32", "--dtype"),
                   ("lora_rank", 0, "--peft-config"), ("lora_targets", None, "target_modules in --peft-config"),
                   ("lora_alpha", 16, "lora_alpha in --peft-config"),
                   ("lora_modules_to_save", None, "modules_to_save in --peft-config"),
                   ("trainable_tokens", None, "trainable_token_indices in --peft-config"),
                   ("device", "cpu", "--gpu NAME for a GPU's kernels"),
                   ("quant", None, "--quantization-config, a BitsAndBytesConfig"),
                   ("double_quant", False, "bnb_4bit_use_double_quant in --quantization-config"),
                   ("int8_threshold", LLM_INT8_THRESHOLD, "llm_int8_threshold in --quantization-config"),
                   ("fsdp_param_dtype", None, "bf16 in the TrainingArguments: accelerate's MixedPrecisionPolicy"),
                   ("fsdp_reduce_dtype", None, "bf16 in the TrainingArguments: accelerate's MixedPrecisionPolicy"),
                   ("fsdp_no_reshard", False, "reshard_after_forward in the TrainingArguments' fsdp_config"),
                   ("fsdp_wrap", None, "accelerate wraps every decoder layer, the embedding, the final norm with "
                    "the LM head, then the root"),
                   ("fsdp_offload", False, "cpu_offload in the TrainingArguments' fsdp_config"),
                   *((flag, default, None) for flag, default in (  # None: not modelled yet with the Trainer
                       ("attn", None), ("ckpt_every", 1), ("ckpt_offload", False),
                       ("loss", "hf"), ("loss_chunk", None))))


def _trainer_inputs(args):
    """--training-args [--peft-config] [--dtype]: the HF Trainer recipe, read with the libraries' own classes."""
    from llmsim.inputs.hf import read_mapping, trainer_setup
    from llmsim.inputs.spec import load_model_spec
    from llmsim.sim.strategies import Strategy, trainer_layout

    for flag, default, where in TRAINER_DECIDES:
        if getattr(args, flag, default) != default:
            name = f"--{flag.replace('_', '-')}"
            raise InputError(f"{name} with --training-args: the Trainer's files decide it ({where})" if where else
                             f"{name} with --training-args is not modelled yet (the hf-trainer recipe)")
    world_size = args.world_size or args.dp or 1
    if args.tp * args.pp > 1 or args.strategy not in (None, "single", "ddp", "deepspeed", "fsdp") or \
            (args.strategy == "single" and world_size > 1):
        raise InputError("--training-args with tp, pp or strategy single on several ranks is not modelled yet; "
                         "modelled: one process, or --world-size N ranks of DistributedDataParallel (torchrun with "
                         "the Trainer) or of DeepSpeed ZeRO-1/2 (the TrainingArguments' deepspeed, or --ds-config)")
    spec = load_model_spec(args.model, dict(_override(t) for t in args.set))
    given = getattr(args, "given_mappings", {})  # dicts handed to llmsim.predict(...) instead of files
    sft = getattr(args, "sft_config", None)
    if sft and args.training_args:
        raise InputError("--sft-config and --training-args both name the trainer's arguments: give one (an "
                         "SFTConfig's fields for TRL's SFTTrainer, TrainingArguments' for transformers' Trainer)")
    recipe, what = (Recipe.TRL_SFT, "SFTConfig") if sft else (Recipe.HF_TRAINER, "TrainingArguments")
    fields = dict(given.get("sft_config" if sft else "training_args")
                  or read_mapping(sft or args.training_args, what))
    for flag, field in TRAINING_ARGS_SHORTCUTS.items():
        value = getattr(args, flag, None)
        if value not in (None, False):
            fields[field] = value
    args.user_training_args = dict(fields)  # what the user's script passes, before an accelerate launch's FSDP
    launch = getattr(args, "accelerate_config", None)
    if launch:  # `accelerate launch --config_file FILE train.py`: the Trainer's plugin from the launcher's variables
        from llmsim.inputs.accelerate_config import trainer_fsdp_launch

        if getattr(args, "ds_config", None):
            raise InputError(f"--ds-config with --accelerate-config {launch}: the accelerate config sets the launch")
        launched, fields = trainer_fsdp_launch(launch, fields)
        if args.world_size not in (None, launched):
            raise InputError(f"--world-size {args.world_size} contradicts --accelerate-config {launch} "
                             f"(num_processes {launched})")
        world_size = launched
    if getattr(args, "ds_config", None):  # TrainingArguments(deepspeed=path), as `--deepspeed ds.json` sets it
        if fields.get("deepspeed") not in (None, args.ds_config):
            raise InputError(f"--ds-config {args.ds_config} contradicts the TrainingArguments' deepspeed "
                             f"{fields['deepspeed']!r}")
        fields["deepspeed"] = args.ds_config
    peft = (given.get("peft_config") or read_mapping(args.peft_config, "LoraConfig")) if args.peft_config else None
    quantization_file = getattr(args, "quantization_config", None)
    quantization = (given.get("quantization_config") or read_mapping(quantization_file, "BitsAndBytesConfig")
                    if quantization_file else None)
    setup = trainer_setup(spec, args.seq_len, fields, peft, args.dtype or "auto", quantization,
                          kbit_prep=not getattr(args, "no_kbit_prep", False), recipe=recipe)
    setup, layout = trainer_layout(spec, setup, world_size, Strategy(args.strategy) if args.strategy else None)
    init = getattr(args, "fsdp_init", None)
    if init is not None:  # where the Trainer's FSDP finds the model: the CPU's one memory, or a GPU run's host
        if layout.fsdp is None:
            raise InputError("--fsdp-init with --training-args needs the TrainingArguments' fsdp (the Trainer's FSDP)")
        if init not in ("full", "host"):
            raise InputError(f"fsdp-init({init}) is not where the Trainer's FSDP finds the model; choose full (the "
                             "CPU: loaded in the one memory) or host (a GPU run: loaded on the host, fully_shard "
                             "copying each unit to the device; what --gpu predicts)")
        if init == "full" and getattr(args, "gpu", None):
            raise InputError("--fsdp-init full with --gpu: on a GPU the Trainer leaves the model where "
                             "from_pretrained loaded it, on the host (host is what --gpu predicts)")
        layout = replace(layout, fsdp=replace(layout.fsdp, init=init))
    return spec, setup, layout


def inputs(args):
    from llmsim.inputs.dsconfig import ds_setup, load_ds_config
    from llmsim.enums import Device
    from llmsim.inputs.spec import TrainSetup, load_model_spec
    from llmsim.model.pipelining import Schedule
    from llmsim.sim.strategies import Layout, Strategy

    if args.training_args or getattr(args, "sft_config", None):
        if getattr(args, "accelerate_config", None) and getattr(args, "sft_config", None):
            raise InputError("--accelerate-config with --sft-config is not modelled yet; modelled: with "
                             "--training-args (the HF Trainer under accelerate launch, distributed_type FSDP)")
        return _trainer_inputs(args)
    accelerate_ds = _apply_accelerate_config(args) if getattr(args, "accelerate_config", None) else None
    for flag, what in (("peft_config", "--peft-config"),
                       ("quantization_config", "--quantization-config"), ("no_kbit_prep", "--no-kbit-prep")):
        if getattr(args, flag, None):
            raise InputError(f"{what} is read with --training-args (the HF Trainer recipe); for the canonical step "
                             "use --lora-rank / --lora-targets, --quant and --precision / --build-dtype")
    spec = load_model_spec(args.model, dict(_override(t) for t in args.set))
    precision = parse_enum(Precision, args.precision, "precision") if args.precision else None
    load_dtype = None
    if getattr(args, "dtype", None):  # the weights as from_pretrained(dtype=...) loads them, no cast after
        load_dtype, precision = _loaded(spec, args, precision)
    if getattr(args, "routing", "balanced") != "balanced" and getattr(args, "ep", 1) == 1:
        raise InputError(f"--routing {args.routing} states how tokens reach the experts of other ranks: it needs "
                         "expert parallelism (--ep N with --tp N)")
    world_size = (args.dp or 1) * args.tp * args.pp if args.world_size is None else args.world_size
    if args.dp is not None and args.dp * args.tp * args.pp != world_size:
        raise InputError(f"dp({args.dp}) x pp({args.pp}) x tp({args.tp}) must equal world-size({world_size})")
    strategy = parse_enum(Strategy, args.strategy, "strategy") if args.strategy else None
    deepspeed = None
    if args.ds_config or accelerate_ds is not None:
        if strategy not in (None, Strategy.DEEPSPEED):
            raise InputError(f"--strategy {strategy.value} contradicts --ds-config (a DeepSpeed run)")
        strategy = Strategy.DEEPSPEED
        hidden = int(spec.hf_config().hidden_size)
        if args.pp > 1 and accelerate_ds is not None:
            raise InputError(f"--accelerate-config with --pp {args.pp}: accelerate's DeepSpeed plugin does not run "
                             "DeepSpeed's pipeline engine (a PipelineModule script does: --ds-config with --pp)")
        # under DeepSpeed's pipeline engine the batch is split over the data-parallel ranks, world / pp
        ds_world = world_size // (args.pp * args.tp) if args.pp > 1 and not world_size % (args.pp * args.tp) \
            else world_size
        deepspeed = (ds_setup(accelerate_ds, world_size, hidden, args.micro_batch, precision, args.grad_accum,
                              launcher="accelerate")
                     if accelerate_ds is not None else
                     load_ds_config(args.ds_config, ds_world, hidden, args.micro_batch, precision, args.grad_accum,
                                    pipeline=args.pp > 1))
        micro_batch, precision = deepspeed.micro_batch, deepspeed.precision
        grad_accum = deepspeed.gradient_accumulation_steps
    else:
        if args.micro_batch is None:
            raise InputError("--micro-batch is required (or a DeepSpeed config that sets it)")
        micro_batch = args.micro_batch
        grad_accum = 1 if args.grad_accum is None else args.grad_accum
    layout = Layout(strategy or (Strategy.DDP if world_size > args.tp * args.pp else Strategy.SINGLE), world_size,
                    deepspeed, fsdp=_fsdp_setup(args, strategy), tp=args.tp, ep=args.ep, pp=args.pp,
                    schedule=parse_enum(Schedule, args.schedule or Schedule.GPIPE.value, "schedule"),
                    n_microbatches=1 if args.microbatches is None else args.microbatches,
                    pp_split=_split(args.pp_split), stages_per_rank=getattr(args, "stages_per_rank", None) or 1)
    setup = TrainSetup(
        micro_batch=micro_batch, seq_len=args.seq_len, precision=precision or Precision.FP32,
        attention=parse_enum(Attention, args.attn, "attention") if args.attn else None,
        grad_ckpt=args.grad_ckpt, ckpt_every=args.ckpt_every, grad_accum=grad_accum,
        ckpt_offload=args.ckpt_offload,
        device=parse_enum(Device, args.device, "device"),
        optimizer=parse_enum(Optimizer, args.optimizer, "optimizer"), foreach=args.foreach, fused=args.fused,
        build_bf16=_build_bf16(args.build_dtype) or load_dtype == "bfloat16", load_dtype=load_dtype,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t) if args.lora_targets else None,
        quant=args.quant, double_quant=args.double_quant, int8_threshold=args.int8_threshold,
        loss=parse_enum(Loss, args.loss, "loss"),
        loss_chunk=args.loss_chunk, lora_modules_to_save=_names(args.lora_modules_to_save),
        trainable_tokens=_token_indices(args.trainable_tokens), routing=args.routing)
    if deepspeed is not None and deepspeed.autotp_size > 1 and accelerate_ds is None:  # DeepSpeed's AutoTP
        from llmsim.model.ds_script import on_autotp

        return spec, on_autotp(setup, layout), layout
    if deepspeed is not None and layout.pp > 1:
        return spec, *_on_ds_pipeline(args, setup, layout)
    if getattr(args, "partition_method", None):
        raise InputError("--partition-method is PipelineModule's: it needs --ds-config with --pp (DeepSpeed's "
                         "pipeline engine)")
    return spec, setup, layout


def _on_ds_pipeline(args, setup, layout):
    """--ds-config with --pp: DeepSpeed's pipeline engine (the deepspeed-pipe recipe, llmsim/model/ds_pipe.py). Its
    micro-batches per step are the JSON's gradient_accumulation_steps and its order DeepSpeed's TrainSchedule, so
    --microbatches may only repeat the one and --schedule, --pp-split are not taken (PipelineModule's
    partition_method splits the layers: --partition-method)."""
    from llmsim.model.ds_pipe import on_engine

    micro_batches = layout.deepspeed.gradient_accumulation_steps
    if args.microbatches is not None and args.microbatches != micro_batches:
        raise InputError(f"--microbatches({args.microbatches}) contradicts the DeepSpeed config's "
                         f"gradient_accumulation_steps({micro_batches}): DeepSpeed's pipeline engine runs that many "
                         "micro-batches per train_batch")
    for flag, value in (("--schedule", args.schedule), ("--pp-split", args.pp_split),
                        ("--stages-per-rank", getattr(args, "stages_per_rank", None))):
        if value is not None:
            raise InputError(f"{flag} with --ds-config and --pp: DeepSpeed's pipeline engine runs its own "
                             "TrainSchedule and splits the layers by PipelineModule's partition_method "
                             "(--partition-method)")
    layout = replace(layout, n_microbatches=micro_batches)
    method = getattr(args, "partition_method", None) or "parameters"  # checked with the rest (ds_pipe.checked_setup)
    return on_engine(setup, layout, method), layout


def _apply_accelerate_config(args) -> dict | None:
    """--accelerate-config: the launch's strategy, world size and precision in place of the flags, which may repeat
    them but not contradict them; returns its DeepSpeed JSON (None for a launch without DeepSpeed)."""
    from llmsim.inputs.accelerate_config import read_accelerate_config

    launch = read_accelerate_config(args.accelerate_config)
    path = args.accelerate_config
    if args.ds_config:
        raise InputError(f"--ds-config with --accelerate-config {path}: the accelerate config sets the DeepSpeed JSON "
                         "(its deepspeed_config_file)")
    if args.strategy not in (None, launch.strategy):
        raise InputError(f"--strategy {args.strategy} contradicts --accelerate-config {path} ({launch.strategy})")
    if args.world_size not in (None, launch.world_size):
        raise InputError(f"--world-size {args.world_size} contradicts --accelerate-config {path} "
                         f"(num_processes {launch.world_size})")
    if launch.precision is not None:
        if args.precision not in (None, launch.precision.value):
            raise InputError(f"--precision {args.precision} contradicts --accelerate-config {path} "
                             f"(mixed_precision: {launch.precision.value})")
        args.precision = launch.precision.value
    args.strategy = None if launch.strategy == "deepspeed" else launch.strategy
    args.world_size = launch.world_size
    return launch.ds_config


def _fsdp_setup(args, strategy):
    """--strategy fsdp's fully_shard settings; its flags without it are refused, not dropped."""
    from llmsim.inputs.spec import FSDP_DTYPES, FsdpSetup
    from llmsim.sim.strategies import Strategy

    given = [flag for flag, on in (("--fsdp-param-dtype", getattr(args, "fsdp_param_dtype", None)),
                                   ("--fsdp-reduce-dtype", getattr(args, "fsdp_reduce_dtype", None)),
                                   ("--fsdp-no-reshard", getattr(args, "fsdp_no_reshard", False)),
                                   ("--fsdp-init", getattr(args, "fsdp_init", None)),
                                   ("--fsdp-wrap", getattr(args, "fsdp_wrap", None)),
                                   ("--fsdp-offload", getattr(args, "fsdp_offload", False))) if on]
    if strategy is not Strategy.FSDP:
        if given:
            raise InputError(f"{given[0]} needs --strategy fsdp")
        return None

    def dtype(flag: str, value: str | None) -> str | None:
        if value is None:
            return None
        if value not in FSDP_DTYPES:
            raise InputError(f"{flag}({value}) is not a dtype; choose one of {', '.join(FSDP_DTYPES)}")
        return FSDP_DTYPES[value]
    return FsdpSetup(reshard_after_forward=not args.fsdp_no_reshard, init=args.fsdp_init or "meta",
                     param_dtype=dtype("fsdp-param-dtype", args.fsdp_param_dtype),
                     reduce_dtype=dtype("fsdp-reduce-dtype", args.fsdp_reduce_dtype),
                     wrap=getattr(args, "fsdp_wrap", None) or "layers",
                     offload=bool(getattr(args, "fsdp_offload", False)))


def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(t.strip() for t in text.split(",") if t.strip()) if text else None


def _token_indices(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InputError(f"trainable-tokens({text}) must be vocabulary indices separated by commas, e.g. 0,1,2") \
            from None


def _loaded(spec, args, precision):
    """--dtype without --training-args: the canonical loop on the weights from_pretrained(dtype=...) loads, which it
    then trains as they are (no model.to() cast: the rotary tables transformers keeps in fp32 stay fp32)."""
    from llmsim.inputs.hf import resolve_load_dtype
    from llmsim.inputs.spec import LOADED_PRECISIONS

    if args.build_dtype != "fp32":
        raise InputError("--dtype is how from_pretrained loads the weights; --build-dtype is the canonical build's: "
                         "give one")
    load_dtype = resolve_load_dtype(spec, args.dtype)
    allowed = LOADED_PRECISIONS[load_dtype]
    precision = precision or allowed[0]
    if precision not in allowed:
        raise InputError(f"weights loaded in {load_dtype} train as {', '.join(p.value for p in allowed)}, not "
                         f"{precision.value} (the loop casts nothing after from_pretrained)")
    return load_dtype, precision


def _build_bf16(value: str) -> bool:
    if value not in ("fp32", "bf16"):
        raise InputError(f"unknown build-dtype {value!r}; valid choices: fp32, bf16")
    return value == "bf16"


def alloc_conf(args):
    from llmsim.sim.allocator import parse_alloc_conf

    if getattr(args, "alloc_conf", None) and not args.gpu:
        raise InputError("--alloc-conf configures the CUDA caching allocator: it needs --gpu NAME")
    return parse_alloc_conf(getattr(args, "alloc_conf", None))


def gpu_of(args):
    """--gpu NAME [--margin PCT]: the GPU profile with the verdict's margin, or None (the CPU)."""
    from llmsim.inputs.gpus import load_gpu

    text = getattr(args, "margin", None)
    if text is not None and not args.gpu:
        raise InputError("--margin is the verdict's margin on a GPU: it needs --gpu NAME")
    if not args.gpu:
        return None
    margin = None
    if text is not None:
        try:
            margin = float(str(text).strip().removesuffix("%")) / 100
        except ValueError:
            raise InputError(f"margin({text}) must be a percentage of the card, e.g. 5 or 5%") from None
    return load_gpu(args.gpu, margin)


def prediction(args, progress: bool):
    from llmsim.sim.pipeline import predict

    gpu = gpu_of(args)
    if getattr(args, "gpus_per_node", 1) < 1:
        raise InputError(f"gpus-per-node({args.gpus_per_node}) must be >= 1")
    return predict(*inputs(args), gpu=gpu, alloc_conf=alloc_conf(args), progress=progress, jobs=args.jobs)


def prediction_from_options(model, seq_len: int, micro_batch: int | None, options: dict):
    """`llmsim.predict(...)`: keyword options become `llmsim predict`'s argv and go through its parser, so the
    Python API and the CLI share every name, default and refusal."""
    from llmsim.inputs.spec import ModelSpec

    argv = ["predict", "--quiet"]
    if isinstance(model, ModelSpec):
        options = {**options, "set": {**dict(model.overrides), **dict(options.get("set") or {})}}
        model = model.name
    options = {"model": model, "seq_len": seq_len, "micro_batch": micro_batch, **options}
    quiet_libraries()
    parser = build_parser()
    actions = {a.dest: a for a in parser.predict_parser._actions}
    dicts = {}
    for key, value in options.items():
        if key not in actions or key in ("help", "format", "plot", "quiet", "suggest", "snapshot"):
            valid = sorted(k for k in actions if k not in ("help", "format", "plot", "quiet", "suggest", "snapshot"))
            raise InputError(f"unknown option {key!r}; valid options: {', '.join(valid)}")
        if value is None or value is False:
            continue
        flag = actions[key].option_strings[0]
        if key in ("training_args", "sft_config", "peft_config", "quantization_config") and isinstance(value, dict):
            dicts[key] = value
            value = f"<{key}>"  # read back from `dicts` below
        if key == "set":
            argv += [arg for k, v in dict(value).items() for arg in ("--set", f"{k}={json.dumps(v)}")]
        elif value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    args = parser.parse_args(argv)
    args.given_mappings = dicts
    return prediction(args, progress=False)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="llmsim", description="Predict per-GPU peak memory of LLM fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("predict", help="predict one layout: per-rank peak and breakdown")
    _add_model_args(p)
    _add_layout_args(p)
    p.add_argument("--snapshot", metavar="FILE.pickle", help="also write the deciding (or, on the CPU, the fullest) "
                   "rank's predicted step as a PyTorch memory snapshot, for https://pytorch.org/memory_viz")
    p.add_argument("--suggest", action=argparse.BooleanOptionalAction, default=None,
                   help="when the verdict on --gpu is tight or oom (the default there; --no-suggest skips it): predict "
                   "the changes (levers, then more GPUs) that would make the job fit, and list those that do, "
                   "cheapest first (llmsim/app/advice.py)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--plot", metavar="PNG", help="also draw the fullest rank's memory over the step, stacked by "
                   "category with the peak marked, and every rank's breakdown at its peak")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="local processes to trace a pipeline's stages in, or to replay ZeRO-1/2's ranks on a GPU "
                   "(default: every core)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (a pipeline's stages)")
    parser.predict_parser = p  # its options are llmsim.predict's keywords
    p = sub.add_parser("compare", help="the peak under each memory lever and common combinations (+ PNG chart)")
    _add_model_args(p)
    _add_layout_args(p)
    p.add_argument("--out", default="llmsim-levers.png", help="where to write the bar chart")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="local processes to share the lever sets (one trace each; default: every core)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("size", help="layouts that fit a GPU, each with its largest micro-batch")
    _add_model_args(p)
    p.add_argument("--gpu", required=True, help="GPU profile (data/gpus)")
    p.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True")
    p.add_argument("--margin", default=None, metavar="PCT", help="the verdict's margin in percent of the card "
                   "(default 5): a layout must need less than capacity - margin to fit")
    p.add_argument("--max-gpus", type=int, default=8)
    p.add_argument("--max-micro-batch", type=int, default=64)
    p.add_argument("--layouts", default=None, help="layout families to try, comma-separated (default all but "
                   "offload, fsdp, 3d and fsdpxpp): single, ddp, zero, offload (ZeRO-1/2/3 with the optimizer "
                   "offloaded to the CPU, pinned, the client AdamW), fsdp (FSDP2 built on the meta device, no "
                   "mixed-precision policy, without and with CPUOffloadPolicy), tp, pp, tpxpp, 3d (DDP x TP x PP, "
                   "torch's replicate over the TP shards, on 2 replicas: a rank holds the same with more), fsdpxpp "
                   "(FSDP2 per layer x PP, every split)")
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step each layout must "
                   "make up (data-parallel replicas split it, one process accumulates, a pipeline splits it into "
                   "micro-batches)")
    p.add_argument("--allow", default=None, help="levers size may switch on to make a layout fit, comma-separated, "
                   "fewest first: ckpt, bf16, lora, offload")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--plot", metavar="PNG", help="also draw the answer as a heatmap: layout x GPUs -> largest "
                   "micro-batch")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="local processes (layouts in parallel)")
    _add_cluster_arg(p, "layouts")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(strategy=None, world_size=None, ds_config=None, tp=1, ep=1, routing="balanced", pp=1,
                   schedule="gpipe",
                   microbatches=1, pp_split=None, dp=None)
    p = sub.add_parser("sweep", help="predict every combination of a YAML/JSON grid of predict's options")
    p.add_argument("file", help="YAML or JSON: option -> value or list of values (llmsim/app/sweep.py)")
    p.add_argument("--out", default="llmsim-sweep.csv", help=".csv or .parquet")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="local processes")
    _add_cluster_arg(p, "configurations")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("measure", help="run the step for real on this CPU (the canonical loop, or the Trainer with --training-args) and append its rows")
    _add_model_args(p)
    _add_layout_args(p)
    p.add_argument("--out", default=None, help="CSV to append to (default ./llmsim-measurements.csv)")
    p.add_argument("--dry-run", action="store_true", help="measure but write nothing")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a multi-process run is killed")
    p.add_argument("--recipe", choices=["canonical", "from-pretrained"], default="canonical", help="with --tp: "
                   "canonical (llmsim's loop) | from-pretrained (the user's: from_pretrained(tp_plan=\"auto\"), "
                   "with --ep DistributedConfig(tp_size=N, ep_size=N), then a plain AdamW loop; "
                   "llmsim/model/from_pretrained_recipe.py). --routing router keeps the router's own choice")
    p = sub.add_parser("validate", help="re-predict every measured row; exit 1 if any is out of tolerance")
    p.add_argument("csv", nargs="*", help="measurement CSVs (default: data/measurements/*.csv)")
    p.add_argument("--jobs", type=int, default=1, help="local processes to share the rows between")
    p = sub.add_parser("models", help="list the model zoo")
    p = sub.add_parser("gpus", help="list the GPU profiles (data/gpus) --gpu takes")
    return parser
