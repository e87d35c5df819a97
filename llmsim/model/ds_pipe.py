"""A Hugging Face causal LM trained with DeepSpeed's pipeline engine (recipe "deepspeed-pipe"): the run as a DeepSpeed
pipeline script writes it,

    module = PipelineModule(layers=layer_specs(config), loss_fn=loss, num_stages=pp,
                            partition_method=..., activation_checkpoint_interval=...)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config, model_parameters=...)
    for step in range(steps):
        engine.train_batch(data_iter)      # gradient_accumulation_steps micro-batches through the stages

and the same code run twice: measured (torchrun, gloo, the storage tracker in every rank:
llmsim/measure/dist_worker.py) and traced (one rank under a fake process group and fake tensors: llmsim/model/trace.py,
`trace_ds_pipe`, with `traced_patches`).
Everything that decides the stage's memory is DeepSpeed's own: the partition of the layers (`partition_method`,
DeepSpeed's default "parameters"), TrainSchedule's order and its `num_pipe_buffers` activation slots, the received
and sent buffers, the buffers the last stage keeps across steps, ZeRO-0's or ZeRO-1's gradient reduction and
optimizer (DeepSpeed asserts ZeRO-2 and -3 away under a pipeline), its own activation checkpointing.

The layers. Transformers has no PipelineModule of its models, and DeepSpeed's pipeline takes one tensor (or a
tuple) from stage to stage, so every pipeline script wraps the model's pieces itself. `layer_specs` is the plain
wrapping: one LayerSpec for the input embedding (token ids -> hidden states), one per decoder layer of the model's
own class (hidden states -> hidden states), one for the final norm and one for the LM head (-> logits), and the
model's own loss function (`ForCausalLMLoss`) as the pipeline's `loss_fn`. What wrappers differ in, and this one
chooses: each decoder layer computes its rotary cos/sin from its input with its own rotary module (the model computes
them once for all layers), so each layer keeps its own pair for its backward (2 x seq x head_dim in the activation
dtype: a few MiB at 4,096 tokens, against the layer's hundreds); no attention mask is passed (SDPA's causal
kernel, as transformers calls it for a batch without padding); a head tied to the embedding is DeepSpeed's
TiedLayerSpec on the first and last stages (`layer_specs`)."""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
from unittest import mock

import torch
from torch import nn

from llmsim.enums import Category, Phase
from llmsim.errors import InputError
from llmsim.model.tracker import StorageTracker

PARTITION_METHOD = "parameters"  # PipelineModule's default: the layers split so each stage holds as many parameters
# Each rank is traced whole, its own trace (a replica's ZeRO partition is its own): 7-9 s a rank for a stage of five
# Llama-2-70B layers over 16 micro-batches, so a layout of more ranks is refused rather than left running for an hour
MAX_TRACED_RANKS = 64  # DeepSpeed's AutoTP, each rank traced whole too, takes the same limit (ds_script.py)
# PipelineModule's checkpointable_layers: only the decoder layers, as the DeepSpeed pipeline models of Megatron and
# GPT-NeoX restrict it (GPTModelPipe: ParallelTransformerLayerPipe). DeepSpeed's default checkpoints every chunk with
# parameters, the input embedding too, whose reentrant checkpoint of integer ids gives an output without a gradient
# on the first stage: its backward raises ("element 0 of tensors does not require grad"), in a real run as in the trace
CHECKPOINTED = ["DecoderLayerPipe"]


@functools.lru_cache(maxsize=8)
def _parts(config_json: str):
    """The model's own decoder-layer, norm and rotary classes (from its modeling module, read off a meta build)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config_json))
    base = getattr(model, model.base_model_prefix)
    return type(base.layers[0]), type(base.norm), type(base.rotary_emb)


def hf_config(config_json: str):
    """The model's transformers config, SDPA attention (the causal kernel the layers rely on)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**json.loads(config_json))
    config._attn_implementation = "sdpa"
    return config


class EmbeddingPipe(nn.Module):
    """Token ids -> hidden states: the model's input embedding."""

    def __init__(self, config_json: str) -> None:
        super().__init__()
        config = hf_config(config_json)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderLayerPipe(nn.Module):
    """Hidden states -> hidden states: one decoder layer of the model's own class, its rotary cos/sin computed
    here from the input's length (positions 0 .. seq-1, as the model numbers them without a cache)."""

    def __init__(self, config_json: str, index: int) -> None:
        super().__init__()
        layer_class, _, rotary_class = _parts(config_json)
        config = hf_config(config_json)
        self.layer = layer_class(config, index)
        self.rotary_emb = rotary_class(config=config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.layer(hidden, position_ids=position_ids, position_embeddings=position_embeddings)


class NormPipe(nn.Module):
    def __init__(self, config_json: str) -> None:
        super().__init__()
        config = hf_config(config_json)
        self.norm = _parts(config_json)[1](config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class HeadPipe(nn.Module):
    def __init__(self, config_json: str) -> None:
        super().__init__()
        config = hf_config(config_json)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def tied_lm_head(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head of a model whose head is its input embedding (tie_word_embeddings): the logits against the
    embedding's weight, as transformers' tied `lm_head` computes them (no bias)."""
    return nn.functional.linear(hidden, embedding.embed_tokens.weight)


def check_model(config_json: str) -> None:
    """What `layer_specs` wraps: a decoder-only model with RMS norm and rotary positions."""
    config = hf_config(config_json)
    if not hasattr(config, "rms_norm_eps") or getattr(config, "num_local_experts", None) or \
            getattr(config, "num_experts", None):
        raise InputError(f"the deepspeed-pipe recipe wraps decoder layers with RMS norm and rotary positions, "
                         f"dense; {config.model_type} is not modelled yet (modelled: llama, mistral, qwen2)")


def layer_specs(config_json: str) -> list:
    """The embedding, the decoder layers, the norm and the head. A head tied to the embedding
    (tie_word_embeddings) is DeepSpeed's TiedLayerSpec on both ends, as its pipeline models tie them: the embedding
    module itself where the first and last stages are one, else a copy on the last stage whose weight DeepSpeed
    broadcasts at initialize and whose gradient it all-reduces with the first stage's (ReduceTiedGrads)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    config = hf_config(config_json)
    layers = [LayerSpec(DecoderLayerPipe, config_json, index) for index in range(int(config.num_hidden_layers))]
    if getattr(config, "tie_word_embeddings", False):
        tied = functools.partial(TiedLayerSpec, "embed", EmbeddingPipe, config_json,
                                 tied_weight_attr=["embed_tokens.weight"])
        return [tied(), *layers, LayerSpec(NormPipe, config_json), tied(forward_fn=tied_lm_head)]
    return [LayerSpec(EmbeddingPipe, config_json), *layers, LayerSpec(NormPipe, config_json),
            LayerSpec(HeadPipe, config_json)]


def causal_lm_loss(vocab_size: int):
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size)
    return loss


def run_step(config_json: str, ds_config: dict, num_stages: int, micro_batch: int, seq_len: int, steps: int,
             ckpt_interval: int, tracker: StorageTracker, partition_method: str = PARTITION_METHOD):
    """The pipeline script above under `tracker`, in a process group of pp x dp ranks (DeepSpeed's topology: rank
    = stage x dp + data-parallel rank). Each micro-batch is a new pair of tensors (input ids, labels), as a data
    loader hands them: the first stage loads the ids, the last the labels (DeepSpeed sends neither)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from llmsim.model.step import LayerHooks

    vocab_size = int(hf_config(config_json).vocab_size)
    with tracker:
        module = PipelineModule(layers=layer_specs(config_json), loss_fn=causal_lm_loss(vocab_size),
                                num_stages=num_stages, partition_method=partition_method,
                                activation_checkpoint_interval=ckpt_interval, checkpointable_layers=CHECKPOINTED)
        hooks = LayerHooks(tracker, module, None)
        engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config,
                                               model_parameters=[p for p in module.parameters() if p.requires_grad])
        hooks.label_model()
        _phases_followed(engine, tracker)
        generator = torch.Generator().manual_seed(0)

        def batches():
            for _ in itertools.count():
                ids = torch.randint(0, vocab_size, (micro_batch, seq_len), generator=generator)
                labels = ids.clone()
                tracker.label([ids, labels], Category.INPUT)
                yield ids, labels
        data = batches()
        for step in range(steps):
            tracker.set_phase(step, Phase.FORWARD)
            engine.train_batch(data)
        tracker.finish()
    return hooks.info(vocab_size)


def _phases_followed(engine, tracker: StorageTracker) -> None:
    """The tracker's phase follows the engine's instructions: forward, backward, then the reduction and the
    optimizer step (the schedule interleaves micro-batches' forwards and backwards); after each instruction what
    DeepSpeed holds is named (`label_engine`)."""
    from deepspeed.runtime.pipe import schedule

    phases = {schedule.ForwardPass: Phase.FORWARD, schedule.BackwardPass: Phase.BACKWARD,
              schedule.ReduceGrads: Phase.OPTIMIZER, schedule.OptimizerStep: Phase.OPTIMIZER}
    instructions = dict(engine._INSTRUCTION_MAP)

    def following(kind, run):
        def instruction(self, *args, **kwargs):
            if kind in phases:
                tracker.set_phase(tracker.step, phases[kind])
            result = run(self, *args, **kwargs)
            label_engine(self, tracker)
            return result
        return instruction
    for kind in instructions:
        instructions[kind] = following(kind, instructions[kind])
    engine._INSTRUCTION_MAP = instructions  # read as self._INSTRUCTION_MAP[type(cmd)] (engine._exec_schedule)
    reduce = getattr(engine.optimizer, "reduce_ready_partitions_and_remove_grads", None)
    if reduce is not None:  # ZeRO-1's reduction under a pipeline: the bucket it appends lives inside ReduceGrads
        def bucket_named(*args, **kwargs):
            tracker.label(_buckets(engine.optimizer), Category.REDUCE_BUCKET)
            return reduce(*args, **kwargs)
        engine.optimizer.reduce_ready_partitions_and_remove_grads = bucket_named


# What DeepSpeed's optimizers hold, by attribute (runtime/zero/stage_1_and_2.py, runtime/bf16_optimizer.py): the
# breakdown's names for them. Only names: the bytes are the trace's either way.
_HELD = (("bit16_groups_flat", Category.PARAMETER), ("bf16_groups_flat", Category.PARAMETER),
         ("single_partition_of_fp32_groups", Category.MASTER_WEIGHTS),
         ("fp32_groups_flat_partition", Category.MASTER_WEIGHTS),
         ("fp32_groups_gradients_flat", Category.GRADIENT), ("grads_in_partition", Category.GRADIENT),
         ("averaged_gradients", Category.GRADIENT))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _buckets(optimizer) -> list[torch.Tensor]:
    """ZeRO-1's reduce buckets: each dtype's `ipg_buckets[dtype].buffer` (runtime/zero/stage_1_and_2.py)."""
    return [tensor for bucket in getattr(optimizer, "ipg_buckets", {}).values()
            for tensor in _tensors(getattr(bucket, "buffer", None))]


def label_engine(engine, tracker: StorageTracker) -> None:
    """Name what the engine holds now: the optimizer's flat parameters, fp32 masters, gradient buffers, reduce
    buckets and states, the parameters' gradients, the pipe buffers and receive buffers (activations at the stage's
    boundary; the labels an input)."""
    optimizer = engine.optimizer
    for attribute, category in _HELD:
        tracker.label(list(_tensors(getattr(optimizer, attribute, None))), category)
    tracker.label(_buckets(optimizer), Category.REDUCE_BUCKET)
    basic = getattr(optimizer, "optimizer", optimizer)
    tracker.label(list(_tensors(getattr(basic, "state", {}))), Category.OPTIMIZER_STATE)
    tracker.label([p.grad for p in engine.module.parameters() if p.grad is not None], Category.GRADIENT)
    buffers = getattr(engine, "pipe_buffers", {})
    tracker.label(list(_tensors([buffers.get(name) for name in ("inputs", "outputs", "output_tensors")])),
                  Category.ACTIVATION)
    tracker.label(list(_tensors(buffers.get("labels"))), Category.INPUT)
    tracker.label(list(_tensors(getattr(engine, "_grad_layer_buf", None))), Category.ACTIVATION)


@contextlib.contextmanager
def traced_patches(micro_batch: int, seq_len: int, hidden: int):
    """What a fake-tensor trace of `run_step` answers for DeepSpeed, each as the real run has it:
    - a receiving stage reads the shape of what it receives from the sender's first send (`_recv_tensor_meta`:
      `.item()` of a received int32 buffer, which a fake receive leaves without values): the 256-int32 meta
      buffer is allocated as the real one is, and the receive buffer made for the previous stage's output, one
      (micro_batch, seq_len, hidden) tensor in the module's dtype, as `_allocate_or_extend_buffers` makes it;
    - the engine's logging of the parameter counts (`.tolist()` of an all-reduced count) and the overflow check of
      the gradient norm (`bool(~isfinite(norm).any())`: no overflow) read values: answered 0 and False;
    - FusedAdam's multi-tensor kernel (`MultiTensorApply.__call__`), compiled code that updates the parameters and
      both states in place and would read a fake tensor's data pointer, does nothing (it allocates nothing), and its
      op is not built (`FusedAdamBuilder().load()`: a JIT build of 20 s in every process on this machine)."""
    import types
    from deepspeed.ops.adam.multi_tensor_apply import MultiTensorApply
    from deepspeed.runtime.pipe.engine import TENSOR_META_SIZE, PipelineEngine

    from llmsim.model.optimizer_values import _AnswerScalars

    def recv_tensor_meta(self, send_stage):
        torch.empty(TENSOR_META_SIZE, dtype=torch.int32, device=self.device)
        dtype = next(self.module.parameters()).dtype
        return self._allocate_or_extend_buffers(0, [micro_batch, seq_len, hidden], dtype)

    with mock.patch.object(PipelineEngine, "_recv_tensor_meta", recv_tensor_meta), \
            mock.patch.object(MultiTensorApply, "__call__", lambda self, *args, **kwargs: None), \
            mock.patch("deepspeed.ops.adam.fused_adam.FusedAdamBuilder",
                       lambda: types.SimpleNamespace(load=lambda: types.SimpleNamespace(multi_tensor_adam=None))), \
            _AnswerScalars(0, False):
        yield


@contextlib.contextmanager
def deepspeed_groups_kept_apart():
    """DeepSpeed keeps the process groups it made in module globals (deepspeed.utils.groups, the pipeline's p2p
    groups): each trace's fake process group is destroyed after it, so its groups are forgotten with it."""
    import copy

    from deepspeed.runtime.pipe import p2p
    from deepspeed.utils import groups

    kept = {module: {name: copy.copy(value) for name, value in vars(module).items()
                     if name.startswith("_") and not name.startswith("__") and not callable(value)
                     and not isinstance(value, (type(contextlib), str))}
            for module in (groups, p2p)}
    try:
        yield
    finally:
        for module, values in kept.items():
            for name, value in values.items():
                setattr(module, name, value)


def on_engine(setup, layout, partition_method: str):
    """`setup` as DeepSpeed's pipeline engine runs it over `layout` (strategy deepspeed, pp > 1): the deepspeed-pipe
    recipe, its micro-batches the JSON's gradient_accumulation_steps (`layout.n_microbatches`, nothing accumulated
    beside them), the traced replica 0 of dp; the CLI and `llmsim validate` both build it here."""
    from dataclasses import replace

    from llmsim.enums import Recipe
    from llmsim.inputs.spec import DsPipeSetup

    return replace(setup, recipe=Recipe.DEEPSPEED_PIPE, grad_accum=1, pp=layout.pp,
                   n_microbatches=layout.n_microbatches,
                   ds_pipe=DsPipeSetup(layout.deepspeed.config_json, layout.dp, 0, partition_method))


def ckpt_interval(setup) -> int:
    """PipelineModule's activation_checkpoint_interval: every `ckpt_every` layers with checkpointing, else 0."""
    return setup.ckpt_every if setup.grad_ckpt else 0


# The canonical step's levers this recipe does not take (the DeepSpeed JSON and the wrapping decide the run), with
# their defaults: each is refused rather than dropped
_NOT_TAKEN = (("lora_rank", 0, "--lora-rank"), ("quant", None, "--quant"), ("ckpt_offload", False, "--ckpt-offload"),
              ("build_bf16", False, "--build-dtype"), ("load_dtype", None, "--dtype"), ("foreach", False, "--foreach"),
              ("fused", False, "--fused"), ("grad_accum", 1, "--grad-accum (the pipeline's micro-batches are "
                                                                "DeepSpeed's gradient_accumulation_steps)"))


def _check_partition_method(method: str) -> None:
    """PipelineModule's partition_method: "parameters", "uniform", or "type:REGEX", which DeepSpeed searches in each
    layer's class name, case-insensitive (module.py, `_find_layer_type`): a regex that does not compile or matches
    none of the wrapper's classes fails inside DeepSpeed with a traceback, so it is refused here."""
    import re

    if method in ("parameters", "uniform"):
        return
    names = [EmbeddingPipe.__name__, DecoderLayerPipe.__name__, NormPipe.__name__, HeadPipe.__name__]
    if not method.startswith("type:"):
        raise InputError(f"partition-method {method!r}: valid choices: parameters (DeepSpeed's default), uniform, "
                         "type:REGEX (PipelineModule's partition_method)")
    try:
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
    except re.error as exc:
        raise InputError(f"partition-method {method!r}: the regex does not compile ({exc})") from None
    if not any(pattern.search(name) for name in names):
        raise InputError(f"partition-method {method!r} matches none of the pipeline's layer classes "
                         f"({', '.join(names)})")


def checked_setup(spec, setup, layout):
    """What the deepspeed-pipe recipe models, one line of InputError for the rest; the setup its traces run."""
    from dataclasses import replace

    from llmsim.enums import Attention, Loss, Optimizer, Precision
    from llmsim.inputs.spec import check_fits_positions

    if layout.deepspeed is None or layout.pp < 2 or setup.ds_pipe is None:  # a Layout has one with strategy deepspeed
        raise InputError("the deepspeed-pipe recipe is DeepSpeed's pipeline engine: a DeepSpeed config (--ds-config) "
                         f"and pp >= 2 (got strategy {layout.strategy.value}, pp({layout.pp}))")
    if layout.tp > 1:
        raise InputError(f"DeepSpeed's pipeline engine with tp({layout.tp}) is Megatron's model parallelism (an mpu), "
                         "not modelled; modelled: pp x dp")
    if layout.deepspeed.autotp_size > 1:
        raise InputError(f"DeepSpeed's pipeline engine with tensor_parallel.autotp_size({layout.deepspeed.autotp_size})"
                         " is not modelled; modelled: AutoTP without --pp, and the pipeline engine over pp x dp")
    config = setup.ds_pipe.config
    zero = config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage > 1:
        raise InputError(f"ZeRO stage {stage} with pp({layout.pp}): DeepSpeed's pipeline engine refuses it ('ZeRO-2 "
                         "and ZeRO-3 are incompatible with pipeline parallelism', runtime/pipe/engine.py); valid "
                         "stages: 0, 1")
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(key), dict) and zero[key].get("device", "none") != "none":
            raise InputError(f"DeepSpeed config zero_optimization.{key} with pp({layout.pp}) is not modelled yet "
                             "(DeepSpeed's pipeline engine without offload is)")
    checkpointing = config.get("activation_checkpointing") or {}
    if any(value for key, value in checkpointing.items() if key != "number_checkpoints"):
        raise InputError("DeepSpeed config activation_checkpointing (" + ", ".join(
            key for key, value in checkpointing.items() if value) + ") with the pipeline engine is not modelled: "
            "it acts only where the script calls deepspeed.checkpointing.configure (partitioned or CPU-held "
            "checkpoints), which the deepspeed-pipe recipe does not; modelled: PipelineModule's own checkpointing "
            "(--grad-ckpt, --ckpt-every)")
    if config.get("fp16", {}).get("enabled"):
        raise InputError("fp16 with DeepSpeed's pipeline engine is not modelled: DeepSpeed refuses fp16 on the CPU "
                         "its engine is traced on; modelled: bf16 and fp32")
    precision = Precision.BF16 if config.get("bf16", {}).get("enabled") else Precision.FP32
    if setup.precision is not precision:
        raise InputError(f"precision {setup.precision.value} contradicts the DeepSpeed config's ({precision.value}): "
                         "DeepSpeed's engine casts the model as its JSON says")
    if "optimizer" not in config:
        raise InputError("the deepspeed-pipe recipe builds its optimizer from the DeepSpeed config's \"optimizer\" "
                         "section (as pipeline scripts pass no client optimizer); add one, e.g. {\"type\": \"AdamW\", "
                         "\"params\": {\"lr\": 1e-5}}")
    if setup.n_microbatches != int(config.get("gradient_accumulation_steps", 1)):
        raise InputError(f"microbatches({setup.n_microbatches}) contradicts the DeepSpeed config's "
                         f"gradient_accumulation_steps({config.get('gradient_accumulation_steps', 1)}), which is "
                         "the number of micro-batches train_batch runs through the pipeline")
    for name, default, flag in _NOT_TAKEN:
        if getattr(setup, name) != default:
            raise InputError(f"{flag} with DeepSpeed's pipeline engine is not modelled yet (the deepspeed-pipe "
                             "recipe runs the DeepSpeed config's optimizer and precision on the whole model)")
    if setup.loss is not Loss.HF or setup.optimizer is not Optimizer.ADAMW or setup.lora_targets is not None:
        raise InputError("--loss, --optimizer and LoRA with DeepSpeed's pipeline engine are not modelled yet (the "
                         "DeepSpeed config's \"optimizer\" section sets the optimizer)")
    if setup.attention not in (None, Attention.SDPA):
        raise InputError(f"attention {setup.attention.value} with DeepSpeed's pipeline engine is not modelled: the "
                         "wrapped decoder layers pass no mask and rely on SDPA's causal kernel; valid choices: sdpa")
    check_model(spec.config_json)
    _check_partition_method(setup.ds_pipe.partition_method)
    specs = int(hf_config(spec.config_json).num_hidden_layers) + 3  # the embedding, the layers, the norm, the head
    if layout.pp > specs:
        raise InputError(f"pp({layout.pp}) is more stages than the PipelineModule's {specs} layers (the embedding, "
                         "each decoder layer, the norm and the LM head)")
    setup = replace(setup, attention=Attention.SDPA)
    check_fits_positions(spec, setup)
    return setup
