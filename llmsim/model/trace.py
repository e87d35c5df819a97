"""Stage 1: model -> traced timeline of a reduced-depth copy, run under fake tensors (no memory).

A decoder stack repeats one layer (or a short pattern of layers: `every_n_layers` checkpointing,
alternating attention types) L times. The trace runs the canonical step on a copy with `trace_depth`
layers -- one leading group, one template group and a trailing group -- so that every edge effect
(the first layer's input, the last layer's output) is seen once, and the timeline stage replicates the
template group's events to reach L. The full-depth fake run is the tier-3 oracle, never the predictor.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
from unittest import mock
from dataclasses import dataclass, replace

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from llmsim.errors import InputError, one_line
from llmsim.model import fsdp, moe
from llmsim.model.kernels import cuda_kernels
from llmsim.model.optimizer_values import answered_optimizer_values
from llmsim.enums import Device, Recipe
from llmsim.inputs.spec import ModelSpec, TrainSetup, num_experts
from llmsim.model.step import StepInfo, optimizer_class, run_canonical_step, run_pipeline_step
from llmsim.model.pipelining import cut, layer_range, layers_per_stage
from llmsim.model.replicate import replicate_model
from llmsim.model.quantized import (fake_loading, header_checkpoint, load_checkpoint_quantized, load_quantized,
                                    real_checkpoint)
from llmsim.model.tensor_parallel import (WaitReturnsInput, build_parallel, fake_process_group, parallel_mesh,
                                          parallel_on_meta)
from llmsim.model.tracker import StorageTracker
from llmsim.model.trainer_recipe import checkpoint_dtype, own_bitsandbytes_overrides
from llmsim.model.trainer_trace import run_trainer_step


@dataclass(frozen=True)
class Trace:
    timeline: pd.DataFrame  # events of the traced run, in order (see tracker.TIMELINE_COLUMNS)
    info: StepInfo
    depth: int  # decoder layers in the traced copy
    period: int  # layers repeat their behaviour with this period
    num_layers: int  # decoder layers of the real model
    lead: int = 0  # irregular leading layers (a MoE model's dense first layers), before the periodic ones


def layer_structure(spec: ModelSpec, setup: TrainSetup, start: int, end: int) -> tuple[int, int]:
    """(lead, period) of layers `start .. end-1`: the irregular leading layers traced as they are, then the period
    with which the rest repeat their behaviour (attention types, checkpointing every n layers, and in a
    mixture-of-experts model which layers are dense: llmsim/model/moe.py)."""
    if not num_experts(spec.hf_config()):
        return 0, math.lcm(setup.ckpt_period, spec.layer_period)
    signatures = moe.layer_signatures(spec.config_json)[start:end]
    return moe.lead_and_period([(signature, i % setup.ckpt_period) for i, signature in enumerate(signatures)])


def stage_layers(spec: ModelSpec, setup: TrainSetup) -> tuple[int, int]:
    """The decoder layers `start .. end-1` this trace stands for: the whole stack, or a pipeline stage's share."""
    if setup.pp > 1:
        return layer_range(setup.pp_stage, setup.pp, spec.num_layers, setup.pp_split)
    return 0, spec.num_layers


def trace_depth(num_layers: int, period: int, lead: int = 0) -> int:
    """Irregular leading layers + leading group + template group + trailing group (plus the remainder of a
    partial group)."""
    depth = lead + 3 * period + (num_layers - lead) % period
    return min(depth, num_layers)


def _over_dp(wrap, mesh, counted: bool, model):
    """`wrap(model, mesh=<the mesh's dp dimension>)`, the dimension sliced inside the wrap as the measured run slices
    it (fsdp.submesh_made_for_real)."""
    return wrap(model, mesh=fsdp.submesh_made_for_real(mesh, "dp", counted))


def fsdp_on_parallel_mesh(setup: TrainSetup) -> bool:
    """FSDP2 per layer (`--fsdp-wrap layers`) with TP or PP: fully_shard over the dp dimension of the (dp, pp, tp) mesh
    tensor and pipeline parallelism use, each stage and TP shard sharded again over its replicas."""
    return setup.fsdp is not None and setup.fsdp.wrap == "layers" and setup.tp * setup.pp > 1


def model_builder(spec: ModelSpec, setup: TrainSetup, num_layers: int | None, mesh=None, fake: bool = False):
    """How the canonical step builds the model: fp32 (the cast to bf16 is part of the step), or directly in bf16;
    with tp or pp > 1, this rank's stage and shards over `mesh` (llmsim.model.tensor_parallel.parallel_mesh)."""
    if spec.factory is not None:
        if setup.tp > 1:
            raise InputError(f"tp({setup.tp}) needs an HF config with a TP plan; {spec.name} is a module factory")
        return spec.factory_callable()
    config = spec.hf_config(num_layers if setup.pp == 1 else None)  # a stage is cut from the full stack
    if setup.quant is not None and setup.recipe.trainer:  # the hub checkpoint, quantized on load
        if not fake:
            raise InputError("the hf-trainer recipe is measured by llmsim/model/trainer_recipe.py, not built here")
        directory = header_checkpoint(spec.config_json, num_layers, checkpoint_dtype(config))
        return functools.partial(load_checkpoint_quantized, directory, setup)
    if setup.quant is not None:  # loaded from a checkpoint: a real one, or for a fake run its header alone
        directory = header_checkpoint(spec.config_json, num_layers) if fake else real_checkpoint(config)
        return functools.partial(load_quantized, directory, setup)
    build = hf_builder(spec, setup, config)
    if setup.fsdp is not None and setup.tp > 1 and not fsdp_on_parallel_mesh(setup):  # transformers' FSDP2 x TP:
        return functools.partial(parallel_on_meta, build, spec.name, mesh["tp"])  # the TP plan on the meta device
    if fsdp_on_parallel_mesh(setup) and setup.fsdp.init == "meta":  # FSDP2 x TP / PP: the stage (and its TP plan)
        # on the meta device, fully_shard next, then `to_empty` (llmsim/model/fsdp.py, `shard`)
        return functools.partial(parallel_on_meta, build, spec.name, mesh["tp"] if setup.tp > 1 else None,
                                 functools.partial(cut, stage=setup.pp_stage, num_stages=setup.pp, keep=num_layers,
                                                   split=setup.pp_split) if setup.pp > 1 else None)
    if setup.tp > 1 or setup.pp > 1:
        return functools.partial(
            build_parallel, build, spec.name, mesh["tp"] if setup.tp > 1 else None,
            functools.partial(cut, stage=setup.pp_stage, num_stages=setup.pp, keep=num_layers,
                              split=setup.pp_split) if setup.pp > 1
            else None, setup.ep)
    return build


def rank_builders(spec: ModelSpec, setup: TrainSetup, mesh=None, fake: bool = False) -> tuple[list, list[int]]:
    """Under a schedule of several stages a rank, `model_builder` for each stage pipeline rank `pp_stage` holds (stage
    s of pp x stages_per_rank, cut whole; `pipelining.rank_stages`), and the model's number of each one's first
    layer."""
    from llmsim.model.pipelining import Schedule, layer_range, rank_stages

    stages = setup.pp * setup.stages_per_rank
    held = rank_stages(setup.pp_stage, setup.pp, setup.stages_per_rank, Schedule(setup.schedule))
    builds = [model_builder(spec, replace(setup, pp=stages, pp_stage=stage, stages_per_rank=1), None, mesh, fake)
              for stage in held]
    return builds, [layer_range(stage, stages, spec.num_layers)[0] for stage in held]


def _build_dtype(setup: TrainSetup) -> torch.dtype:
    """fp32 (the canonical build), bf16 (`build_bf16`), or the dtype a recipe's `from_pretrained` loads in."""
    if setup.load_dtype is not None:
        return getattr(torch, setup.load_dtype)
    return torch.bfloat16 if setup.build_bf16 else torch.float32


def hf_builder(spec: ModelSpec, setup: TrainSetup, config):
    """`AutoModelForCausalLM.from_config` as the canonical step calls it: fp32, or bf16 with `build_bf16`."""
    def build():
        from transformers import AutoModelForCausalLM

        try:
            return AutoModelForCausalLM.from_config(config, dtype=_build_dtype(setup),
                                                    attn_implementation=setup.attention.value)
        except (ValueError, TypeError, RuntimeError, AssertionError) as exc:  # what transformers raises
            raise InputError(f"transformers cannot build {spec.name}: {one_line(exc)}") from exc
    return build


@contextlib.contextmanager
def decide_like_a_real_run():
    """transformers counts a FakeTensor as "tracing" and then skips value-dependent shortcuts, so a fake
    run would materialise a causal mask that a real run leaves to SDPA's `is_causal=True`
    (masking_utils.sdpa_mask). Two questions decide it; the canonical step answers both without values:
    - `find_packed_sequence_indices(position_ids)`: its position ids are `arange(seq_len)` for every row,
      one sequence per row, so a real run computes the packing mask and returns None;
    - `_ignore_causal_mask_sdpa(..., q_offset)`: it has no KV cache, so the offset a real run reads is 0.
    """
    from transformers import masking_utils

    find_packed = masking_utils.find_packed_sequence_indices
    ignore_mask = masking_utils._ignore_causal_mask_sdpa

    def find_packed_sequence_indices(position_ids):
        result = find_packed(position_ids)  # the same intermediates a real run allocates
        return None if isinstance(position_ids, FakeTensor) else result

    def ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, *args, **kwargs):
        if isinstance(q_offset, FakeTensor):
            q_offset = 0
        return ignore_mask(padding_mask, q_length, kv_length, q_offset, *args, **kwargs)

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", find_packed_sequence_indices), \
            mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa", ignore_causal_mask_sdpa):
        yield


def _apply_as_on_cpu(self, fn, recurse=True):
    """`Module._apply` as it runs for real CPU parameters: `param.data = fn(param)` where the kinds match (the old storage is freed
    at once), buffers replaced. For fake parameters torch forces `swap_tensors` instead, which fails because
    FakeTensorMode holds weakrefs to them (torch/nn/modules/module.py, `Module._apply`); `model.to(bf16)` and
    peft's adapter placement go through here."""
    if recurse:
        for module in self.children():
            module._apply(fn)
    with torch.no_grad():
        for key, param in self._parameters.items():
            if param is None:
                continue
            if is_traceable_wrapper_subclass(param):  # a DTensor: torch swaps it for real parameters too
                torch.utils.swap_tensors(param, torch.nn.Parameter(fn(param), requires_grad=param.requires_grad))
                continue
            applied = fn(param)
            if torch._has_compatible_shallow_copy_type(param, applied):
                param.data = applied
            else:  # another device's kind (peft moving adapters to a meta-built base): a new Parameter, as torch makes
                self._parameters[key] = torch.nn.Parameter(applied, requires_grad=param.requires_grad)
        for key, buffer in self._buffers.items():
            if buffer is not None:
                self._buffers[key] = fn(buffer)
    return self


def _deepcopy_as_on_cpu(self, memo):
    """`copy.deepcopy` of a fake tensor as it runs for a real CPU one: a Parameter's `__deepcopy__` is
    `Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)` (torch/nn/parameter.py);
    a plain tensor's copies its storage, then makes `self.new_empty([])` and sets the copy as its storage
    (torch/_tensor.py). Under FakeTensorMode a parameter is a FakeTensor whose inherited
    `Tensor.__deepcopy__` would copy the storage into another fake mode; peft's ModulesToSaveWrapper deepcopies
    the module it trains (peft/utils/other.py, `ModulesToSaveWrapper.update`)."""
    if id(self) in memo:
        return memo[id(self)]
    with torch.no_grad():
        copied = self.data.clone(memory_format=torch.preserve_format)
    if isinstance(self, torch.nn.Parameter):
        copied = torch.nn.Parameter(copied, self.requires_grad)
    else:  # the plain tensor's `new_empty([])` (a 0-d tensor of its dtype), whose storage `set_` then replaces
        transient = copied.new_empty([])
        del transient
    memo[id(self)] = copied
    return copied


def _step_without_overflow(self, optimizer, optimizer_state, *args, **kwargs):
    """`GradScaler._maybe_opt_step` as a real run without overflow takes it: it reads the found-inf flags
    (`.item()`, which a fake tensor cannot answer) and steps when they are all zero (torch/amp/grad_scaler.py)."""
    return optimizer.step(*args, **kwargs)


def _warmup_p2p_static(self, stages, has_backward, p2p_done):
    """`_PipelineSchedule._warmup_p2p` as a real run of the canonical PP step decides it: every stage is
    given its input and output shapes, so every stage votes STATIC and the vote's product is 1. The votes
    are still sent (their 4-byte tensors are real allocations); only their value, which a fake tensor cannot
    answer (`.item()`), is taken from the stage's own `needs_dynamic`."""
    from torch.distributed.pipelining._utils import InferenceMode

    acc = None
    for stage in stages:
        acc = stage._warmup_forward_vote(has_backward, received_acc=acc)
    result = acc
    for stage in reversed(stages):
        result = stage._warmup_backward_result(received_result=result)
        stage._inference_mode = (InferenceMode.DYNAMIC if InferenceMode.needs_dynamic(stage._user_meta, has_backward)
                                 else InferenceMode.STATIC)


class _SendingWork:
    """A fake process group's Work that, like a real one, keeps the tensors it sends alive until it is dropped."""

    def __init__(self, work, tensors: list[torch.Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def __getattr__(self, name):
        return getattr(self._work, name)


def _holding_sends(real_batch_p2p):
    """torch.distributed.pipelining's `_batch_p2p` with the sent tensors held by the returned works: a real
    (gloo or NCCL) send work references its tensor until the schedule has waited on it and let it go, so an
    input gradient sent back stays allocated until the schedule waits on its sends."""
    import torch.distributed as dist

    def batch_p2p(p2p_ops, desc=None):
        works = real_batch_p2p(p2p_ops, desc)
        sent = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return [_SendingWork(work, sent) for work in works] if sent else works
    return batch_p2p


def _cache_layers_of_the_real_model(spec: ModelSpec, setup: TrainSetup, depth: int | None):
    """A `DynamicCache(config=...)` (the forward's, where `use_cache` stays on) makes one cache layer per decoder
    layer of the config it is given, and a sliding-window layer allocates its window as a tensor there
    (cache_utils.DynamicSlidingWindowLayer), before any layer runs: in the traced copy, one per layer of the
    real model (or stage), with the real layers' types, not the copy's."""
    from transformers import cache_utils

    original = cache_utils.get_layer_types_and_kwargs
    start, end = stage_layers(spec, setup)
    real_types = getattr(spec.hf_config(), "layer_types", None)

    def get_layer_types_and_kwargs(config):
        types, kwargs = original(config)
        if depth is None or len(types) != depth or depth >= end - start:
            return types, kwargs
        real = list(real_types[start:end]) if real_types else [types[0]] * (end - start)
        of_type = dict(zip(types, kwargs))
        return real, [of_type[layer_type] for layer_type in real]

    return mock.patch.object(cache_utils, "get_layer_types_and_kwargs", get_layer_types_and_kwargs)


@contextlib.contextmanager
def _older_objects_frozen():
    """Every object alive before the trace kept out of the collections run inside it (`gc.freeze`): a library's
    own `gc.collect()` (the Trainer calls accelerate's `free_memory` at the start of `train()`) then walks only what
    the trace made, as in the measured process, instead of every frame and trace this process keeps (0.3 s a
    call in `llmsim validate`). Nothing the trace allocates is older than the trace, so what it frees is the same."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_fake(spec: ModelSpec, setup: TrainSetup, num_layers: int | None,
             replay_chunks: bool = False) -> tuple[pd.DataFrame, StepInfo]:
    """The canonical step under FakeTensorMode: exact bytes, no memory. `replay_chunks`: a pipeline stage's
    later micro-batches replay micro-batch 1's model events (llmsim/model/chunk_replay.py)."""
    tracker = StorageTracker()
    moe.grouped_mm_as_aten()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_older_objects_frozen())
        stack.enter_context(own_bitsandbytes_overrides())  # no earlier trace's 8-bit overrides in this one
        mesh, wrap = None, None
        if setup.fsdp is not None and not fsdp_on_parallel_mesh(setup):  # one rank of FSDP2's mesh (model/fsdp.py)
            stack.enter_context(fake_process_group(setup.fsdp_world, rank=setup.fsdp_rank))
            mesh = (fsdp.mesh_1d(setup.fsdp_world) if setup.tp == 1 else  # FSDP2 x TP: a 2-D mesh, TP innermost
                    fsdp.mesh_2d(setup.fsdp_world // setup.tp, setup.tp))
            if setup.fsdp.wrap == "accelerate":  # the Trainer's: accelerate shards the model in the trace
                stack.enter_context(fsdp.accelerate_on_fake_ranks(setup.fsdp_world, setup.fsdp_rank, mesh))
            else:
                wrap = functools.partial(fsdp.shard, fsdp=setup.fsdp, mesh=mesh)
            stack.enter_context(fsdp.storages_told_apart())
            if setup.device is Device.CPU:
                stack.enter_context(fsdp.gloo_reduce_scatter_copy())
        elif setup.tp * setup.pp > 1:  # TP rank `tp_rank` (0 but for uneven shards) of the stage's group in
            # data-parallel replica 0; the mesh is built before the fake mode
            dp = max(setup.replicate_dp, 1) if setup.fsdp is None else setup.fsdp_world // (setup.tp * setup.pp)
            stack.enter_context(fake_process_group(dp * setup.tp * setup.pp,
                                                   rank=setup.pp_stage * setup.tp + setup.tp_rank))
            mesh = parallel_mesh(dp, setup.pp, setup.tp)
            if setup.replicate_dp or setup.fsdp is not None:
                # DDP x TP: torch's replicate over the replicas (llmsim/model/replicate.py); FSDP2 x TP / PP: each
                # stage (TP shard) sharded again over them
                if setup.replicate_dp:
                    importlib.import_module("torch.distributed._composable.replicate_with_fsdp")  # for real
                over = replicate_model if setup.replicate_dp else functools.partial(fsdp.shard, fsdp=setup.fsdp)
                wrap = functools.partial(_over_dp, over, mesh, setup.device is Device.CPU)
                stack.enter_context(fsdp.storages_told_apart())
                stack.enter_context(fsdp.meshes_made_for_real(counted=setup.device is Device.CPU))
                if setup.fsdp is not None and setup.device is Device.CPU:
                    stack.enter_context(fsdp.gloo_reduce_scatter_copy())
        # a checkpoint is written for real; several stages a rank: one model per stage the rank holds
        build, first_blocks = (rank_builders(spec, setup, mesh, fake=True) if setup.stages_per_rank > 1
                               else (model_builder(spec, setup, num_layers, mesh, fake=True), None))
        if setup.fsdp is not None and setup.fsdp.init == "meta":
            untied = setup.fsdp.wrap == "transformers"
            build = ([fsdp.meta_build(each, untied=untied) for each in build] if isinstance(build, list)
                     else fsdp.meta_build(build, untied=untied))
        optimizer_class(setup.optimizer)  # imported for real: a module imported under the fake mode keeps fakes
        if setup.recipe.trainer:
            import transformers.trainer  # noqa: F401  (and accelerate with it)
        if setup.recipe is Recipe.TRL_SFT:
            import trl.trainer.sft_trainer  # noqa: F401  (datasets too)
        stack.enter_context(FakeTensorMode())
        if setup.tp > 1:  # functional collectives (DTensor): only with TP; a pipeline sends and receives
            stack.enter_context(WaitReturnsInput())
        if setup.quant is not None:
            stack.enter_context(fake_loading())
        if setup.ep > 1:  # the all-to-all's split sizes, which the routing decides (llmsim/model/moe.py)
            stack.enter_context(moe.stated_routing(setup.routing))
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.schedules import _PipelineSchedule

        for patch in (decide_like_a_real_run(), mock.patch.object(torch.nn.Module, "_apply", _apply_as_on_cpu),
                      mock.patch.object(FakeTensor, "__deepcopy__", _deepcopy_as_on_cpu, create=True),
                      mock.patch.object(_PipelineSchedule, "_warmup_p2p", _warmup_p2p_static),
                      mock.patch.object(schedules, "_batch_p2p", _holding_sends(schedules._batch_p2p)),
                      mock.patch.object(torch.amp.GradScaler, "_maybe_opt_step", _step_without_overflow),
                      _cache_layers_of_the_real_model(spec, setup, num_layers), cuda_kernels(setup), answered_optimizer_values(setup.optimizer)):
            stack.enter_context(patch)
        if setup.pp > 1:
            info = run_pipeline_step(build, setup, tracker, mesh["pp"].get_group(), wrap, replay_chunks=replay_chunks,
                                     first_blocks=first_blocks)
        elif setup.recipe.trainer:
            info = run_trainer_step(build, setup, tracker, num_layers)
        else:
            info = run_canonical_step(build, setup, tracker, num_layers, wrap=wrap)
    return tracker.timeline(), info


_HANDED: dict[tuple[ModelSpec, TrainSetup], Trace] = {}  # traces another process made and handed back (`hand`)
_MAX_HANDED = 64
_MADE: list[list] = []  # while `recording_traces`: the traces made meanwhile, (key, trace), innermost list last


@functools.lru_cache(maxsize=128)  # a sizing sweep reuses a model's traces across GPUs of one architecture
def trace(spec: ModelSpec, setup: TrainSetup) -> Trace:
    """The trace of `setup`'s step (a pipeline stage's: its stage), at reduced depth where layers repeat; kept
    here, or taken from those a worker process handed back (`hand`)."""
    key = (spec, setup)
    if key in _HANDED:
        return _HANDED.pop(key)
    traced = _trace(spec, setup)
    for made in _MADE:
        made.append((key, traced))
    return traced


@contextlib.contextmanager
def recording_traces():
    """The traces `trace` makes meanwhile, as (key, trace) pairs, for a worker process to hand back with its
    result: the process that handed the work out keeps them as if it had traced them (`hand`)."""
    made: list = []
    _MADE.append(made)
    try:
        yield made
    finally:
        _MADE.remove(made)


def hand(made: list) -> None:
    """Keep traces another process made (`recording_traces`) for `trace` to return when asked for them: a stage
    traced once under its canonical split serves every split tried later in this process (`stage_split`). The
    latest `_MAX_HANDED` are kept until asked for."""
    for key, traced in made:
        if len(_HANDED) >= _MAX_HANDED:
            _HANDED.pop(next(iter(_HANDED)))
        _HANDED[key] = traced


def forget_traces() -> None:
    """Drop every trace kept in this process, made here (`trace`'s cache) or handed back (`hand`): the next
    `trace` of any setup traces."""
    trace.cache_clear()
    _HANDED.clear()


def _trace(spec: ModelSpec, setup: TrainSetup) -> Trace:
    if setup.recipe is Recipe.DEEPSPEED_PIPE:  # DeepSpeed's own pipeline engine, the stage traced whole
        timeline, info = trace_ds_pipe(spec, setup)
        return Trace(timeline, info, 1, 1, 1)
    if setup.recipe is Recipe.DEEPSPEED_AUTOTP:  # DeepSpeed's AutoTP and ZeRO, the rank traced whole
        timeline, info = trace_ds_autotp(spec, setup)
        return Trace(timeline, info, 1, 1, 1)
    if spec.factory is not None:  # an arbitrary nn.Module cannot be cut to fewer layers: trace it whole
        timeline, info = run_fake(spec, setup, None)
        return Trace(timeline, info, info.num_blocks, 1, info.num_blocks)
    if setup.stages_per_rank > 1:  # several stages a rank: traced whole, their layers numbered as
        timeline, info = _run_replaying_chunks(spec, setup, None)  # the model numbers them (expand leaves a whole
        # trace as it is)
        return Trace(timeline, info, info.num_blocks, 1, info.num_blocks)
    start, end = stage_layers(spec, setup)  # a pipeline stage: traced at reduced depth like a model
    num_layers = end - start
    lead, period = layer_structure(spec, setup, start, end)
    depth = trace_depth(num_layers, period, lead)
    whole = setup.fsdp is not None and (setup.fsdp_rank != 0 or setup.fsdp.init == "host" or
                                        setup.fsdp.cpu_ram_efficient_loading or setup.fsdp.activation_checkpointing)
    if whole:
        # A rank with shorter FSDP2 shards than rank 0 (llmsim.sim.strategies.fsdp.rank_classes): traced whole. It
        # was for the trace's re-padding of every shard at the root's lazy init (an artefact since mended:
        # fsdp.storages_told_apart); its reduced-depth trace still expands short of the full one by build events
        # outside any layer (102 on a 6-layer LoRA Llama, rank 2 of 3, the same peaks), not traced down. (On a GPU
        # the expansion follows each layer's unsharded parameters, resized up and back to 0 several times a step, to
        # its own storage since 2026-12-05: timeline._pair_serials revives a storage resized to 0; until then
        # every FSDP2 GPU trace was whole.) The Trainer's build on the host (init "host"), not shown equal.
        # (CPUOffloadPolicy was traced whole until 2026-12-05: a meta build's `to_empty` on the host, and FSDP2's
        # re-pinning of each new shard, ran from the root where no layer runs; fsdp._layers_in_their_blocks makes
        # them each layer's.) With accelerate's cpu_ram_efficient_loading the state dict is loaded parameter by
        # parameter once every layer is sharded, outside any layer: the same. With its activation checkpointing every
        # layer is a checkpoint_wrapper around the layer: traced whole, its reduced-depth expansion not shown equal.
        depth = num_layers
    if getattr(spec.hf_config(), "output_router_logits", False):
        # The MoE load-balancing loss walks every layer's router logits after the decoder stack, at the model's
        # level (load_balancing_loss_func): per-layer events outside any layer, which replicating the template
        # layer would not make. Traced whole (Mixtral's 32 layers: seconds).
        depth = num_layers
    elif setup.pp > 1 and not whole and (lead, period) == (0, 1) and not num_experts(spec.hf_config()):
        split = stage_split(spec, setup, depth)
        if setup.pp_split != split:  # the trace of the stage of `depth` layers under `split`, kept once for both
            return replace(trace(spec, replace(setup, pp_split=split)), num_layers=num_layers)
    timeline, info = _run_replaying_chunks(spec, setup, depth)
    return Trace(timeline, info, depth, period, num_layers, lead)


def stage_split(spec: ModelSpec, setup: TrainSetup, depth: int) -> tuple[int, ...]:
    """The split a stage of layers that all behave alike is traced under: `depth` layers on the stage (those it
    traces), the others' spread as evenly as they go. A stage's trace runs the layers it keeps, numbered from 0, its
    warm-up and micro-batches (experiments/explore_stage_traces.py: equal event for event across pipelines of other
    depths), so stages of 5 and of 10 layers (Llama-2-70B over 16 and 8 stages), or of the splits `--suggest` tries,
    share one trace; `tests/test_expansion.py` traces both ways and compares."""
    spread = layers_per_stage(setup.pp - 1, spec.num_layers - depth)
    return (*spread[:setup.pp_stage], depth, *spread[setup.pp_stage:])


def trace_ds_pipe(spec: ModelSpec, setup: TrainSetup) -> tuple[pd.DataFrame, StepInfo]:
    """The deepspeed-pipe recipe (llmsim/model/ds_pipe.py, `run_step`) as the rank of `setup` (stage `pp_stage`,
    replica `ds_pipe.dp_rank`) runs it, under fake tensors and a fake process group of pp x dp ranks, with the
    kernels of `setup`'s target: the tracker's timeline and the step's StepInfo, no memory used. Every stage is
    traced whole (no reduced depth)."""
    from llmsim.model import ds_pipe

    pipe = setup.ds_pipe
    tracker = StorageTracker()
    ds_pipe._parts(spec.config_json)  # the modeling module imported and read off a meta build, outside the fake mode
    with _deepspeed_traced(setup, setup.pp * pipe.dp, setup.pp_stage * pipe.dp + pipe.dp_rank,
                           int(ds_pipe.hf_config(spec.config_json).hidden_size)):
        info = ds_pipe.run_step(spec.config_json, pipe.config, setup.pp, setup.micro_batch, setup.seq_len,
                                setup.steps, ds_pipe.ckpt_interval(setup), tracker, pipe.partition_method)
    return tracker.timeline(), info


def trace_ds_autotp(spec: ModelSpec, setup: TrainSetup) -> tuple[pd.DataFrame, StepInfo]:
    """The deepspeed-autotp recipe (llmsim/model/ds_script.py, `run_deepspeed`: the DeepSpeed script the measured
    runs execute, its JSON's tensor_parallel.autotp_size sharding the model inside `deepspeed.initialize`) as rank
    `ds_autotp.rank` of `ds_autotp.world_size` runs it, under fake tensors and a fake process group, with the kernels
    of `setup`'s target. Traced whole: DeepSpeed's engine, AutoTP's layers and ZeRO's partitions run as they are."""
    from llmsim.model import ds_script

    autotp = setup.ds_autotp
    tracker = StorageTracker()
    with _deepspeed_traced(setup, autotp.world_size, autotp.rank, int(spec.hf_config().hidden_size)), \
            ds_script.autotp_patches(), decide_like_a_real_run():  # the whole model: transformers' mask decisions
        info = ds_script.run_deepspeed(spec.config_json, autotp.config, replace(setup, tp=1), tracker)
    return tracker.timeline(), info


@contextlib.contextmanager
def _deepspeed_traced(setup: TrainSetup, world: int, rank: int, hidden: int):
    """DeepSpeed's own code as rank `rank` of `world` runs it, under a fake process group and fake tensors, with the
    kernels of `setup`'s target (ds_pipe.traced_patches answers what DeepSpeed reads off values)."""
    import io
    import os

    import deepspeed

    from llmsim.model import ds_pipe

    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_process_group(world, rank=rank))
        stack.enter_context(ds_pipe.deepspeed_groups_kept_apart())
        # DeepSpeed reads its local rank (the device index it builds on) from the launcher's environment
        stack.enter_context(mock.patch.dict(os.environ, {"LOCAL_RANK": "0", "RANK": str(rank),
                                                         "WORLD_SIZE": str(world)}))
        # DeepSpeed's comm over the fake group made above, without its CPU shared-memory kernel: a JIT-built op (20 s
        # on this machine, rebuilt by every process) that only `inference_all_reduce` calls (deepspeed/comm/torch.py)
        with mock.patch("deepspeed.comm.torch.build_shm_op", lambda: None):
            deepspeed.init_distributed(dist_backend="gloo")
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))  # DeepSpeed prints the partition, the topology
        # and the engine sets its logger's level from the JSON's log_level (default info): kept as llmsim set it
        stack.enter_context(mock.patch("deepspeed.runtime.engine.set_log_level_from_string", lambda level: None))
        stack.enter_context(FakeTensorMode())
        stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", _apply_as_on_cpu))
        stack.enter_context(mock.patch.object(FakeTensor, "__deepcopy__", _deepcopy_as_on_cpu, create=True))
        stack.enter_context(cuda_kernels(setup))
        stack.enter_context(ds_pipe.traced_patches(setup.micro_batch, setup.seq_len, hidden))
        yield


def _run_replaying_chunks(spec: ModelSpec, setup: TrainSetup, depth: int) -> tuple[pd.DataFrame, StepInfo]:
    """`run_fake`, a pipeline stage's later micro-batches (and those of the second step) replayed where chunk_replay
    allows it (a dense model: a mixture of experts routes each micro-batch on its own), every micro-batch computed
    where it refuses."""
    from llmsim.model import chunk_replay

    from llmsim.model.pipelining import Schedule

    if not (chunk_replay.ENABLED and setup.pp > 1
            and not num_experts(spec.hf_config()) and not Schedule(setup.schedule).splits_backward):
        # (a zero-bubble schedule's weight backward runs on the graph of the micro-batch's own forward)
        return run_fake(spec, setup, depth)
    try:
        with _schedule_errors_unlogged():
            return run_fake(spec, setup, depth, replay_chunks=True)
    except Exception as error:  # the refusal can come back through torch's schedule and autograd engine
        if not chunk_replay.refused(error):
            raise
    return run_fake(spec, setup, depth)


@contextlib.contextmanager
def _schedule_errors_unlogged():
    """torch's multi-stage schedules (`_PipelineScheduleRuntime`: several stages a rank) log an exception raised in an
    action, with the whole schedule, before re-raising it: a replay's refusal (under FSDP2) is not an error of the
    user's job, and an error is raised all the same."""
    import logging

    schedules = logging.getLogger("torch.distributed.pipelining.schedules")
    disabled, schedules.disabled = schedules.disabled, True
    try:
        yield
    finally:
        schedules.disabled = disabled


def no_decay_names(spec, setup: TrainSetup) -> frozenset[str]:
    """The trainable parameters the Trainer's optimizer puts in its second param group, without weight decay
    (`Trainer.create_optimizer`: those not in `get_decay_parameter_names`, i.e. biases, norms and nn.LayerNorm's
    parameters), named as the trace names them (peft's prefix dropped). transformers' own rule, run on the model
    built on the meta device as the trace builds it (peft's adapters too): no memory."""
    from transformers import Trainer

    from llmsim.inputs.hf import lora_config
    from llmsim.model.step import base_fqn
    from llmsim.model.trainer_trace import _peft_model

    with torch.device("meta"):
        model = hf_builder(spec, setup, spec.hf_config())()
        if setup.peft_config:
            model = _peft_model(model, lora_config(json.loads(setup.peft_config)))
    decay = set(Trainer.get_decay_parameter_names(None, model))
    return frozenset(base_fqn(name) for name, param in model.named_parameters()
                     if param.requires_grad and name not in decay)
