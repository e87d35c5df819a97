"""The files users already have, read with the ecosystem's own classes: TrainingArguments, LoraConfig and
BitsAndBytesConfig.

`--training-args FILE` (JSON or YAML of `TrainingArguments` fields), `--peft-config FILE` (`LoraConfig` fields, an
`adapter_config.json`) and `--quantization-config FILE` (`BitsAndBytesConfig` fields, as a script passes them to
`from_pretrained(quantization_config=...)` or a quantized checkpoint's config.json holds them) become one
`TrainSetup` of the HF Trainer recipe. The libraries validate them, so their
defaults and their refusals hold (transformers 5's `TrainingArguments.__post_init__`, peft's `LoraConfig`); llmsim
adds one line where a value is outside what it has measured. Precision has the ecosystem's two axes:
- the dtype the weights are loaded in, `from_pretrained(dir, dtype=...)`: "auto" (transformers 5's default) is the
  config's `dtype` / `torch_dtype`, float32 where the config names none;
- mixed precision, the Trainer's `bf16` / `fp16`: autocast (and, for fp16, accelerate's GradScaler).
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from llmsim.enums import Optimizer, Precision, Recipe
from llmsim.errors import InputError, one_line
from llmsim.inputs.spec import LLM_INT8_THRESHOLD, ModelSpec, TrainSetup

LOAD_DTYPES = ("auto", "float32", "bfloat16", "float16")  # from_pretrained's `dtype` words
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # llmsim's short words for the same
# The Trainer's `optim` values measured through Trainer.train() (data/measurements/trainer_cpu.csv), with the
# optimizer transformers builds for each (transformers/trainer_optimizer.py, `_OPTIMIZER_HANDLERS`): (llmsim's name
# for it, fused). The trace runs the Trainer's own factory; this table names the result in the report and checks.
TRAINER_OPTIMS = {
    "adamw_torch": (Optimizer.ADAMW, False),  # torch.optim.AdamW
    "adamw_torch_fused": (Optimizer.ADAMW, True),  # torch.optim.AdamW(fused=True): the Trainer's default
    "adafactor": (Optimizer.HF_ADAFACTOR, False),  # transformers' Adafactor(scale_parameter=False, relative_step=False)
    "sgd": (Optimizer.SGD, False),  # torch.optim.SGD
    "adamw_8bit": (Optimizer.ADAMW_8BIT, False),  # bitsandbytes AdamW(optim_bits=8)
    "adamw_bnb_8bit": (Optimizer.ADAMW_8BIT, False),
    # bitsandbytes' paged AdamW (the QLoRA paper's optim): on a GPU its large states live in CUDA unified memory,
    # refused there (TrainSetup); on the CPU bitsandbytes falls back to ordinary buffers
    "paged_adamw_32bit": (Optimizer.PAGED_ADAMW, False),
    "paged_adamw_8bit": (Optimizer.PAGED_ADAMW_8BIT, False),
}
# Fields whose run is not one process of the Trainer on its own; refused until a strategy module models them
NOT_MODELLED_FIELDS = {
    "torch_compile": "torch.compile",
}
# The Trainer's FSDP as transformers hands it to accelerate (TrainingArguments.fsdp_plugin_args, made by
# `_process_fsdp_args` from `fsdp` and `fsdp_config`): what is measured through Trainer.train() under torchrun
# (data/measurements/trainer_fsdp_cpu.csv) is FSDP2 with accelerate's TRANSFORMER_BASED_WRAP, resharding after
# the forward or not; the plugin's other switches are refused, one line each
FSDP_PLUGIN_MODELLED = {
    "fsdp_version": (2,),
    "auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",),
    "cpu_offload": (False, True),  # CPUOffloadPolicy(): shards, gradients and AdamW on the host (host_memory.py)
    # the model moved to the meta device before sharding, rank 0's state dict broadcast to every rank's shards
    "cpu_ram_efficient_loading": (False, True),
    "activation_checkpointing": (False, True),  # accelerate's checkpoint_wrapper on every decoder layer
}
# SFTConfig fields whose run is not modelled yet with TRL's SFTTrainer (the trace runs the trainer, but its rows
# measure none of them)
SFT_NOT_MODELLED_FIELDS = {
    "packing": "packing (several rows per sequence, padding-free)",
    "padding_free": "padding-free batches",
    "use_liger_kernel": "Liger's kernels",
    "model_init_kwargs": "a model the trainer loads itself",
    "activation_offloading": "activation offloading",
    "pad_to_multiple_of": "padding rows to a multiple (padded batches)",
    "completion_only_loss": "a loss on completions only (a prompt-completion dataset)",
    "assistant_only_loss": "a loss on assistant turns only (a conversational dataset)",
    "chat_template_path": "a cloned chat template (added tokens)",
}
# Fields the run itself sets (llmsim/model/trainer_recipe.py, MEASUREMENT_ARGS): the CPU the trace plays, three steps,
# nothing written; a user's value for them changes no byte of a step's memory
FORCED_FIELDS = ("use_cpu", "max_steps", "report_to", "save_strategy", "disable_tqdm", "output_dir")


def read_mapping(path: str, what: str) -> dict[str, Any]:
    """A JSON or YAML file holding one mapping of field names to values."""
    import yaml

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} file {path!r}: {exc}") from None
    try:
        fields = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"{what} file {path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{one_line(exc)}") from None
    if not isinstance(fields, dict):
        raise InputError(f"{what} file {path!r} must hold a mapping of field names to values")
    return fields


def arguments_class(recipe: Recipe = Recipe.HF_TRAINER):
    """The arguments dataclass the recipe's Trainer reads: transformers' TrainingArguments, or TRL's SFTConfig (its
    subclass, with TRL's own defaults: `gradient_checkpointing=True`, `bf16=True` unless `fp16`, `max_length=1024`,
    `learning_rate=2e-5`). TRL is an optional dependency (`pip install "llmsim[trl]"`)."""
    if recipe is not Recipe.TRL_SFT:
        from transformers import TrainingArguments

        return TrainingArguments
    try:
        from trl import SFTConfig
    except ImportError:
        raise InputError("--sft-config (TRL's SFTTrainer) needs trl installed: pip install \"llmsim[trl]\" "
                         f"(measured with trl {TRL_MEASURED})") from None
    return SFTConfig


TRL_MEASURED = "1.16.0"  # the trl the committed trl-sft rows were measured with (constraints.txt pins it for CI)


def training_arguments(fields: dict[str, Any], recipe: Recipe = Recipe.HF_TRAINER, **forced: Any):
    """`TrainingArguments(**fields, **forced)` (with recipe trl-sft, `SFTConfig`) on this machine's CPU, the
    library's own validation and defaults; one line when it refuses. `forced`: the run's own FORCED_FIELDS (the
    user's values for them are set aside)."""
    import dataclasses

    cls = arguments_class(recipe)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [name for name in fields if name not in valid]
    if unknown:
        hints = {name: difflib.get_close_matches(name, valid, n=1) for name in unknown}
        said = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for n, h in hints.items())
        module = "trl" if recipe is Recipe.TRL_SFT else "transformers"
        raise InputError(f"unknown {cls.__name__} field {said}; see {module}.{cls.__name__} for the "
                         f"{len(valid)} valid fields")
    not_modelled = {**NOT_MODELLED_FIELDS, **(SFT_NOT_MODELLED_FIELDS if recipe is Recipe.TRL_SFT else {})}
    for name, why in not_modelled.items():
        if fields.get(name) and not (name == "pad_to_multiple_of" and fields[name] == "auto"):
            raise InputError(f"{cls.__name__} {name}={fields[name]!r}: {why} is not modelled yet for the "
                             f"{recipe.value} recipe")
    # TRL's own fields state their choices in the field's metadata, which SFTConfig does not check itself
    for field in dataclasses.fields(cls):
        choices = field.metadata.get("choices")
        if recipe is Recipe.TRL_SFT and choices and field.name in fields and fields[field.name] not in choices:
            raise InputError(f"SFTConfig {field.name}={fields[field.name]!r}: valid choices: {', '.join(choices)}")
    # `deepspeed` (a JSON path or a dict) is read by llmsim.sim.strategies.trainer_layout: TrainingArguments would
    # start DeepSpeed's integration (and its process group) here
    settable = {k: v for k, v in fields.items() if k not in FORCED_FIELDS and k != "deepspeed"}
    try:
        return cls(**{"output_dir": "trainer_output", **settable, "use_cpu": True, **forced})
    except (ValueError, TypeError) as exc:
        raise InputError(f"invalid {cls.__name__}: {one_line(exc)}") from None


def trainer_fsdp(args):
    """The FsdpSetup of TrainingArguments `args` whose `fsdp` is on: the plugin transformers builds for accelerate,
    read from `args.fsdp_plugin_args` (transformers' own translation of `fsdp` and `fsdp_config`, legacy strings
    included), its dtypes as accelerate's `set_mixed_precision` sets them from bf16/fp16 (param and reduce dtype
    both); None when FSDP is off."""
    if not args.fsdp:
        return None
    plugin = getattr(args, "fsdp_plugin_args", None)
    if not plugin:  # transformers builds no accelerate plugin for torch_xla's FSDP
        raise InputError("TrainingArguments fsdp_config: xla=True (torch_xla's FSDP, on TPUs) is not modelled; "
                         "modelled: accelerate's FSDP (xla false, its default)")
    from llmsim.inputs.spec import FsdpSetup

    for name, modelled in FSDP_PLUGIN_MODELLED.items():
        value = plugin.get(name, modelled[0])
        if value not in modelled:
            raise InputError(f"TrainingArguments fsdp_config: {name}={value!r} is not modelled yet; modelled: "
                             f"{name}={modelled[0]!r} (FSDP2, accelerate's TRANSFORMER_BASED_WRAP, reshard_after_"
                             "forward true or false)")
    if args.fp16:
        raise InputError("the Trainer with FSDP and fp16=True is not modelled yet (no run measures it); modelled: "
                         "bf16 or fp32")
    if plugin.get("activation_checkpointing") and args.gradient_checkpointing:  # the Trainer's own refusal
        raise InputError("TrainingArguments: fsdp_config['activation_checkpointing'] (FSDP's own activation "
                         "checkpointing) and the activation_checkpointing (gradient_checkpointing) training argument "
                         "can't both be set to True; the Trainer refuses it: keep FSDP's")
    dtype = "bfloat16" if args.bf16 else None
    return FsdpSetup(reshard_after_forward=bool(plugin.get("reshard_after_forward", True)), param_dtype=dtype,
                     reduce_dtype=dtype, init="full", wrap="accelerate", offload=bool(plugin.get("cpu_offload")),
                     cpu_ram_efficient_loading=bool(plugin.get("cpu_ram_efficient_loading")),
                     activation_checkpointing=bool(plugin.get("activation_checkpointing")))


def lora_config(fields: dict[str, Any]):
    """`LoraConfig(**fields)`, peft's validation; an adapter_config.json's own bookkeeping keys are accepted."""
    from peft import LoraConfig

    fields = dict(fields)
    peft_type = fields.pop("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InputError(f"peft config of peft_type {peft_type!r} is not modelled; modelled: LORA (LoraConfig)")
    try:
        return LoraConfig(**fields)
    except (ValueError, TypeError) as exc:
        raise InputError(f"invalid LoraConfig: {one_line(exc)}") from None


# Fields whose run is not modelled: (field, the value every measured row has, why)
BNB_NOT_MODELLED = (("llm_int8_enable_fp32_cpu_offload", False, "modules kept in fp32 on the host"),
                    ("llm_int8_has_fp16_weight", False, "an int8 base that keeps fp16 weights"))


def bitsandbytes_config(fields: dict[str, Any]):
    """`BitsAndBytesConfig(**fields)`, transformers' validation; one line when it refuses. The class accepts (and
    drops, with a log line) any keyword it does not know: a typo'd field would quantize as the defaults do, so
    unknown fields are refused here."""
    import inspect

    from transformers import BitsAndBytesConfig

    valid = [n for n in inspect.signature(BitsAndBytesConfig.__init__).parameters if n not in ("self", "kwargs")]
    fields = dict(fields)
    method = fields.pop("quant_method", "bitsandbytes")
    if str(getattr(method, "value", method)) != "bitsandbytes":
        raise InputError(f"quantization config of quant_method {method!r} is not modelled; modelled: bitsandbytes "
                         "(BitsAndBytesConfig)")
    for private in ("_load_in_4bit", "_load_in_8bit"):  # to_dict() writes both spellings; they must agree
        public = private[1:]
        if private in fields:
            value = fields.pop(private)
            if fields.setdefault(public, value) != value:
                raise InputError(f"BitsAndBytesConfig {private}={value!r} contradicts {public}={fields[public]!r}")
    unknown = [name for name in fields if name not in valid]
    if unknown:
        hints = {name: difflib.get_close_matches(name, valid, n=1) for name in unknown}
        said = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for n, h in hints.items())
        raise InputError(f"unknown BitsAndBytesConfig field {said}; valid fields: {', '.join(valid)}")
    try:
        config = BitsAndBytesConfig(**fields)
    except (ValueError, TypeError) as exc:
        raise InputError(f"invalid BitsAndBytesConfig: {one_line(exc)}") from None
    if not (config.load_in_4bit or config.load_in_8bit):
        raise InputError("BitsAndBytesConfig quantizes nothing: set load_in_4bit or load_in_8bit to true")
    for name, measured, what in BNB_NOT_MODELLED:
        if getattr(config, name) != measured:
            raise InputError(f"BitsAndBytesConfig {name}={getattr(config, name)!r} ({what}) is not modelled yet")
    import torch

    if config.load_in_4bit and config.bnb_4bit_quant_storage != torch.uint8:
        raise InputError(f"BitsAndBytesConfig bnb_4bit_quant_storage={config.bnb_4bit_quant_storage} is not "
                         "modelled yet; modelled: uint8 (the default)")
    return config


def quant_of(config) -> tuple[str, bool]:
    """llmsim's words for a BitsAndBytesConfig: ("nf4" | "fp4" | "int8", double quantization)."""
    if config.load_in_8bit:
        return "int8", False
    return config.bnb_4bit_quant_type, bool(config.bnb_4bit_use_double_quant)


def resolve_load_dtype(spec: ModelSpec, dtype: str) -> str:
    """`from_pretrained(dtype=...)` as transformers 5 resolves it: "auto" is the config's dtype, else float32."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in LOAD_DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; valid choices: {', '.join(LOAD_DTYPES)} (or fp32, bf16, fp16)")
    if dtype != "auto":
        return dtype
    import torch

    config_dtype = getattr(spec.hf_config(), "dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    name = str(config_dtype or torch.float32).removeprefix("torch.")
    if name not in LOAD_DTYPES:
        raise InputError(f"{spec.name}'s config dtype {name!r} is not modelled; pass dtype float32, bfloat16 or "
                         "float16")
    return name


def _mixed_precision(args) -> str | None:
    """The Trainer's mixed precision: "bf16" (`bf16=True`), "fp16" (`fp16=True`) or None."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else None


def _optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))  # an OptimizerNames member once TrainingArguments holds it


def _precision(load_dtype: str, args) -> Precision:
    """The (load dtype, mixed precision) pair as llmsim's single precision word, where it has one."""
    mixed = _mixed_precision(args)
    table = {("float32", None): Precision.FP32, ("float32", "bf16"): Precision.BF16_AUTOCAST,
             ("float32", "fp16"): Precision.FP16_AUTOCAST, ("bfloat16", None): Precision.BF16,
             ("float16", None): Precision.FP16, ("bfloat16", "bf16"): Precision.BF16}
    if (load_dtype, mixed) not in table:
        raise InputError(f"weights loaded in {load_dtype} with the Trainer's {mixed}=True are not modelled yet; "
                         "modelled: float32 with bf16 or fp16, bfloat16 with or without bf16, float16 without fp16")
    return table[(load_dtype, mixed)]


def trainer_setup(spec: ModelSpec, seq_len: int, fields: dict[str, Any], peft_fields: dict[str, Any] | None = None,
                  dtype: str = "auto", quantization: dict[str, Any] | None = None,
                  kbit_prep: bool = True, recipe: Recipe = Recipe.HF_TRAINER) -> TrainSetup:
    """The HF Trainer recipe's TrainSetup (recipe trl-sft: TRL's SFTTrainer, `fields` an SFTConfig's): the user's
    fields kept as given (the trace runs the Trainer on them), the loop fields llmsim reports and checks derived
    from the arguments the Trainer would hold."""
    if spec.config_json is None:
        raise InputError(f"the {recipe.value} recipe loads {spec.name} with from_pretrained: it needs an HF config "
                         "(a zoo name or a config.json), not a module factory")
    args = training_arguments(fields, recipe)
    if recipe is Recipe.TRL_SFT and fields.get("deepspeed"):
        raise InputError("TRL's SFTTrainer under DeepSpeed is not modelled yet (it changes get_peft_model's dtype "
                         "under ZeRO-3; no row measures it); modelled with --sft-config: one process, or --world-size "
                         "N ranks of DistributedDataParallel")
    if recipe is Recipe.TRL_SFT and args.fsdp:
        raise InputError("TRL's SFTTrainer with the SFTConfig's fsdp is not modelled yet (no row measures it); "
                         "modelled: the HF Trainer's FSDP (--training-args with fsdp), and with --sft-config one "
                         "process or --world-size N ranks of DistributedDataParallel")
    if recipe is Recipe.TRL_SFT and quantization is not None:
        raise InputError("a BitsAndBytesConfig base with --sft-config is not modelled yet (SFTTrainer casts the "
                         "adapters of a quantized model to bf16; no row measures it); modelled with TRL: full "
                         "fine-tuning and LoRA on a bf16 or fp32 base")
    optim = _optim_name(args)
    if optim not in TRAINER_OPTIMS:
        raise InputError(f"TrainingArguments optim {optim!r} is not modelled yet; modelled: "
                         f"{', '.join(TRAINER_OPTIMS)}")
    optimizer, fused = TRAINER_OPTIMS[optim]
    load_dtype = resolve_load_dtype(spec, dtype)
    precision = _precision(load_dtype, args)
    lora_rank = 0
    if peft_fields is not None:
        lora_rank = int(lora_config(peft_fields).r)
    quant, double_quant, threshold = None, False, LLM_INT8_THRESHOLD
    if quantization is not None:
        config = bitsandbytes_config(quantization)
        if not lora_rank:
            raise InputError("a BitsAndBytesConfig base is frozen: the Trainer trains it through peft adapters "
                             "(--peft-config)")
        quant, double_quant = quant_of(config)
        threshold = float(config.llm_int8_threshold) if quant == "int8" else LLM_INT8_THRESHOLD
    elif not kbit_prep:
        raise InputError("--no-kbit-prep names a step of a quantized model's recipe: it needs "
                         "--quantization-config")
    return TrainSetup(
        micro_batch=args.per_device_train_batch_size, seq_len=seq_len, precision=precision,
        grad_ckpt=bool(args.gradient_checkpointing), grad_accum=args.gradient_accumulation_steps,
        optimizer=optimizer, fused=fused, build_bf16=load_dtype == "bfloat16", lora_rank=lora_rank,
        recipe=recipe, training_args=json.dumps(fields, sort_keys=True),
        peft_config=json.dumps(peft_fields, sort_keys=True) if peft_fields is not None else None,
        load_dtype=load_dtype, quant=quant, double_quant=double_quant, int8_threshold=threshold,
        quantization_config=json.dumps(quantization, sort_keys=True) if quantization is not None else None,
        kbit_prep=kbit_prep if quantization is not None else False)


def recipe_facts(setup: TrainSetup, deepspeed=None) -> dict[str, Any]:
    """What is predicted, in the ecosystem's words: the recipe, the two precision axes, the optimizer, accumulation.
    `deepspeed` (the layout's DeepSpeedSetup): what steps when DeepSpeed builds or replaces the optimizer."""
    if setup.recipe.trainer:
        args = training_arguments(json.loads(setup.training_args), setup.recipe)
        sft = {}
        if setup.recipe is Recipe.TRL_SFT:  # its head and its truncation (SFTConfig.max_length), where it truncates
            sft["loss"] = f"TRL's fused LM head ({args.loss_type})"
            if args.max_length is not None and setup.seq_len > args.max_length:
                sft["max_length"] = f"{args.max_length} (rows of {setup.seq_len} tokens truncated)"
        return {"recipe": setup.recipe.value, "load_dtype": setup.load_dtype,
                "mixed_precision": _mixed_precision(args) or "no",
                "optimizer": _deepspeed_optimizer(deepspeed, _optim_name(args)),
                "grad_accum": setup.grad_accum,
                "max_grad_norm": args.max_grad_norm,
                "peft": "LoRA r=%d" % setup.lora_rank if setup.lora_rank else "none",
                "quantization": _quantization_words(setup), **sft}
    if setup.recipe is Recipe.DEEPSPEED_PIPE:  # the JSON decides: DeepSpeed casts to bf16 and clips (its defaults)
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

        config = setup.ds_pipe.config
        bf16 = config.get("bf16", {}).get("enabled")
        return {"recipe": setup.recipe.value,
                "load_dtype": "float32" + (", cast to bfloat16 by DeepSpeed's engine" if bf16 else ""),
                "mixed_precision": "no", "optimizer": _deepspeed_optimizer(deepspeed, "none"),
                "grad_accum": setup.n_microbatches,
                "max_grad_norm": config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT),
                "peft": "none", "quantization": "none"}
    build = "bfloat16" if setup.build_bf16 else "float32"  # build_bf16 holds with precision bf16 only
    mixed = {Precision.BF16_AUTOCAST: "bf16", Precision.FP16_AUTOCAST: "fp16"}.get(setup.precision, "no")
    cast = {Precision.BF16: ", then cast to bfloat16", Precision.FP16: ", then cast to float16"}.get(setup.precision, "")
    optimizer = _deepspeed_optimizer(
        deepspeed, setup.optimizer.value + (" (fused)" if setup.fused else " (foreach)" if setup.foreach else ""))
    return {"recipe": setup.recipe.value, "load_dtype": build + ("" if setup.build_bf16 else cast),
            "mixed_precision": mixed, "optimizer": optimizer, "grad_accum": setup.grad_accum, "max_grad_norm": None,
            "peft": f"LoRA r={setup.lora_rank}" if setup.lora_rank else "none",
            "quantization": _quantization_words(setup)}


def _deepspeed_optimizer(deepspeed, client: str) -> str:
    """The optimizer that steps, named: the client's, or the one DeepSpeed builds from its JSON, or DeepSpeed's CPU
    Adam that accelerate hands it in place of the client's (DeepSpeedSetup.replaces_client_optimizer)."""
    from llmsim.inputs.dsconfig import DEEPSPEED_OPTIMIZER_NAMES

    if deepspeed is None or deepspeed.optimizer_kind == "client":
        return client
    name = DEEPSPEED_OPTIMIZER_NAMES[deepspeed.optimizer_kind]
    if deepspeed.replaces_client_optimizer:
        return f"{name} (accelerate's map_pytorch_optim_to_deepspeed, in place of {client})"
    return f"{name} (the DeepSpeed JSON's \"optimizer\" section)"


def _quantization_words(setup: TrainSetup) -> str:
    """The quantized base as bitsandbytes names it, and whether peft's prepare_model_for_kbit_training ran."""
    if setup.quant is None:
        return "none"
    if setup.quant == "int8":
        words = f"bitsandbytes int8 (llm_int8_threshold {setup.int8_threshold:g})"
    else:
        words = f"bitsandbytes {setup.quant}" + (" double-quant" if setup.double_quant else "")
        compute = "bfloat16"  # the canonical build's (llmsim/model/quantized.py, quantization_config)
        if setup.quantization_config is not None:
            compute = str(bitsandbytes_config(json.loads(setup.quantization_config)).bnb_4bit_compute_dtype)
        words += f", compute {compute.removeprefix('torch.')}"
    if setup.recipe.trainer:
        words += ", prepare_model_for_kbit_training" if setup.kbit_prep else ", no prepare_model_for_kbit_training"
    return words
