"""PyTorch FSDP2: `torch.distributed.fsdp.fully_shard` on every decoder layer, then on the root.

That is the order accelerate's FSDP2 path (`fsdp2_prepare_model` with TRANSFORMER_BASED_WRAP) and torchtitan apply
it in, each call with the same mesh, `reshard_after_forward` and `MixedPrecisionPolicy(param_dtype, reduce_dtype)`.
It wraps the model where DistributedDataParallel would (the canonical step's `wrap`: after the precision cast,
peft and checkpointing, before the optimizer), so AdamW is built on the sharded DTensor parameters.

Predicted by running FSDP2 itself: the trace calls the same `fully_shard` under FakeTensorMode, as one rank of a
fake process group of the layout's world size (llmsim/model/tensor_parallel.py, `fake_process_group`): each
collective allocates what the real one allocates (FSDP2 allocates its own all-gather and reduce-scatter buffers;
the collective writes into them) and moves no data. The sharding, the padded shards, the all-gather buffers, the
unsharded parameters' `resize_`, the reshard after the forward (never for the root), the backward prefetch, the
reduce-scatter buffers and the sharded gradients are FSDP2's own code. Two things differ between backends:
- gloo (a CPU run) copies the whole reduce-scatter input into a buffer of its own inside the collective
  (`reduce_scatter_single`: an input-sized temporary, seen by the storage tracker and freed by the time the
  call returns); NCCL reduces in place. The CPU trace adds that copy (`gloo_reduce_scatter_copy`), a `--gpu`
  trace does not.
- gloo's worker thread may drop its reference to that copy after the call has returned: then the copy lives
  on into the next layer's backward (seen on a 4-layer Llama, 2 ranks: +2.7 % on the peak, in every step).
  NCCL's work holds no such copy; the measurement gives gloo's thread a moment after each reduce-scatter
  (`settled_collectives`), so measured rows are what the prediction models: the copy freed within the call.
Where a parameter's dim 0 does not divide by the world size, FSDP2 pads every rank's shard to ceil(dim 0 / W)
rows, but the last ranks' local shards are shorter (or empty), and so are their gradients' views and AdamW's
states: ranks differ. The ranks fall into a few classes of equal local shards (`rank_classes`), and one rank of
each class is traced.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

from llmsim.inputs.spec import FsdpSetup

GLOO_SETTLE_S = 0.002  # what the measured runs give gloo's worker thread after each reduce-scatter


def mixed_precision(fsdp: FsdpSetup):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, fsdp.param_dtype) if fsdp.param_dtype else None,
        reduce_dtype=getattr(torch, fsdp.reduce_dtype) if fsdp.reduce_dtype else None)


def offload_policy():
    """`CPUOffloadPolicy()`, torch's default: the host shards pinned (`pin_memory=True`: each shard's `.cpu()` copy
    copied again into page-locked memory, which host_memory.py follows as a host copy on a CPU that cannot pin)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy()


def local_rows(rows: int, world_size: int, rank: int) -> int:
    """Rank `rank`'s rows of a dim 0 of `rows` split as FSDP2 splits it (`_chunk_with_empty`: torch.chunk's
    chunks of ceil(rows / W), the last ranks' shorter or empty)."""
    chunk = -(-rows // world_size)
    return min(chunk, max(0, rows - rank * chunk))


def rank_classes(dim0_sizes: frozenset[int], world_size: int) -> list[list[int]]:
    """The ranks grouped by their local shards (every rank of a group holds shards of the same sizes), in rank
    order; one group when every dim 0 divides by the world size."""
    uneven = sorted(rows for rows in dim0_sizes if rows % world_size)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        groups.setdefault(tuple(local_rows(rows, world_size, rank) for rows in uneven), []).append(rank)
    return list(groups.values())


def meta_build(build, untied: bool = False):
    """The model built on the meta device (FsdpSetup.init "meta"): no storage until `shard` materialises the shards.
    `untied`: as from_pretrained builds it (`init.no_tie_weights`), tied by `shard` after the load."""
    def built():
        from transformers import initialization

        with torch.device("meta"), initialization.no_tie_weights() if untied else contextlib.nullcontext():
            return build()
    return built


def shard(model: nn.Module, fsdp: FsdpSetup, mesh) -> nn.Module:
    """`fully_shard` on each decoder layer, then on the whole model (the root); returns the model. Built on the meta
    device, it is then materialised as PyTorch's FSDP2 tutorial does: `to_empty` allocates each rank's shards and
    buffers, and transformers' `_init_weights` initialises them (on the sharded DTensors)."""
    from torch.distributed.fsdp import fully_shard

    from llmsim.model.step import find_blocks

    if fsdp.wrap == "transformers":
        _shard_as_transformers(model, fsdp, mesh)
    else:
        kwargs = {"mesh": mesh, "reshard_after_forward": fsdp.reshard_after_forward, "mp_policy": mixed_precision(fsdp)}
        if fsdp.offload:
            kwargs["offload_policy"] = offload_policy()
        _, blocks = find_blocks(model, None)
        for layer in blocks:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    if fsdp.init == "meta" and fsdp.offload:
        # CPUOffloadPolicy wants the shards materialised on the host (FSDPParamGroup._validate_cpu_offload_params:
        # `to_empty(device="cpu")`) and the buffers where the compute is, as torchtitan's `init_weights(
        # buffer_device=...)` puts them
        from llmsim.model.host_memory import HOST

        with _layers_in_their_blocks(model):  # each layer's shards made, and pinned, as that layer's
            model.to_empty(device=HOST)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to("cpu")  # the device: a copy across (host_memory._Place)
        model.apply(model._init_weights)
    elif fsdp.init == "meta":
        model.to_empty(device="cpu")
        model.apply(model._init_weights)
    if fsdp.wrap == "transformers":  # from_pretrained's `_finalize_model_loading`: a tied head tied after the load
        model.tie_weights()
    return model


@contextlib.contextmanager
def _layers_in_their_blocks(model: nn.Module):
    """`Module._apply` (`to_empty`) of each decoder layer as the tracker's layer: CPUOffloadPolicy re-pins each
    layer's new shards as the layer's `_apply` returns (FSDPParam.reset_sharded_param), a new page-locked storage
    per parameter and the pageable one freed, all of it made from the root where no layer runs; as each layer's own
    events, a reduced-depth trace expands to the full one (llmsim/sim/timeline.py). Nothing where no tracker runs."""
    from llmsim.model.step import find_blocks
    from llmsim.model.tracker import StorageTracker

    tracker = StorageTracker.active()
    if tracker is None:
        yield
        return
    prefix, blocks = find_blocks(model, None)

    def in_its_block(index: int, layer: nn.Module):
        apply = layer._apply

        def _apply(*args, **kwargs):
            with tracker.in_layer(index, f"{prefix}.{index}"):
                return apply(*args, **kwargs)
        return _apply

    for index, layer in enumerate(blocks):
        layer._apply = in_its_block(index, layer)
    try:
        yield
    finally:
        for layer in blocks:
            del layer._apply


class _Meshes:
    """transformers' TransformersDeviceMesh over this trace's mesh: 1-D (data parallel), or 2-D ("fsdp", "tp")."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh

    def get_mesh(self, dims):
        return self.mesh if self.mesh.ndim == 1 else self.mesh[dims]


def _shard_as_transformers(model: nn.Module, fsdp: FsdpSetup, mesh) -> None:
    """The model's own FSDP plan applied as `from_pretrained(distributed_config=DistributedConfig(fsdp_size=N,
    fsdp_mixed_precision=...))` applies it (transformers/distributed/mixin.py `_resolve_parallel_plans`, then
    fsdp.py `apply_fully_sharded_data_parallelism`): transformers' own code, on this rank's mesh."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism

    tp = 1 if mesh.ndim == 1 else mesh["tp"].size()  # TP applied before (tensor_parallel.parallel_on_meta)
    config = DistributedConfig(fsdp_size=mesh.size() // tp, tp_size=tp,
                               fsdp_mixed_precision=fsdp.param_dtype is not None)
    model.config.distributed_config = config
    _, _, plan = model._resolve_parallel_plans(config)
    with meshes_made_for_real():
        apply_fully_sharded_data_parallelism(model, _Meshes(mesh), plan, {})


@contextlib.contextmanager
def meshes_made_for_real(counted: bool = False):
    """With TP, fully_shard (and replicate) joins the data-parallel and the TP mesh (`DeviceMesh._concatenate`), whose
    rank tensor is computed by tensor ops: outside FakeTensorMode (a fake tensor cannot be a mesh's ranks). `counted`
    (a CPU trace): under the storage tracker still, as a CPU run counts the int32 tensors the concatenation makes (one
    of world-size ranks kept by FSDP2: 4 bytes a rank); else outside every dispatch mode (on a GPU the mesh lives on
    the host, not in the device's memory)."""
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def concatenated(meshes):
        with _for_real(counted):
            return concatenate(meshes)

    with mock.patch.object(DeviceMesh, "_concatenate", staticmethod(concatenated)):
        yield


def submesh_made_for_real(mesh, name: str, counted: bool):
    """`mesh[name]`, sliced in the trace where the measured run slices it (inside the wrap, under the storage tracker:
    the slice's rank tensor, 8 bytes a rank, stays alive with it), outside FakeTensorMode as `meshes_made_for_real`
    makes meshes (`counted`: under the tracker still, on a CPU trace)."""
    with _for_real(counted):
        return mesh[name]


def _for_real(counted: bool):
    """Real tensors inside a trace: FakeTensorMode off and the storage tracker still on (`counted`: what a CPU run
    holds), or every dispatch mode off (what the traced device does not hold)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    return unset_fake_temporarily() if counted else _disable_current_modes()


@contextlib.contextmanager
def accelerate_on_fake_ranks(world_size: int, rank: int, mesh):
    """The HF Trainer's FSDP (FsdpSetup wrap "accelerate") traced as rank `rank` of `world_size`: the environment
    torchrun gives each rank (which TrainingArguments and accelerate's PartialState read; the fake process group is
    already initialised, so accelerate joins it), accelerate's FSDP turned on as on a GPU (the measured recipe's own
    `accelerate_fsdp_on_cpu`), and `fully_shard`'s default mesh (accelerate passes none) the one built before the
    fake mode. accelerate matches the optimizer's parameters to the sharded ones by data pointer
    (`_get_parameter_id`), which a fake tensor does not have (every one reads 0, and all would map to one
    parameter): the trace keys them by their storage and offset, which is what a real pointer tells apart.
    accelerate names a rank's CPU `cpu:<index>`, which a CPU tensor does not report (it says `cpu`), so a real
    CPU run's `.to(cpu:0)` copies each batch once more (experiments/explain_trainer_fsdp_residual.out) and a fake
    tensor would be a device apart: the trace's ranks take `cpu`, as a GPU run's batch is already on its device.
    accelerate's process-wide state is made afresh for the trace and dropped after it."""
    import os

    from accelerate import accelerator
    from accelerate.state import AcceleratorState, PartialState
    from torch.distributed.fsdp._fully_shard import _fully_shard

    from llmsim.model.trainer_recipe import accelerate_fsdp_on_cpu

    ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
             "LOCAL_WORLD_SIZE": str(world_size),
             # torchrun sets it for each rank; unset, accelerate would set this process's torch threads itself
             "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))}
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with mock.patch.dict(os.environ, ranks), accelerate_fsdp_on_cpu(), \
                mock.patch.object(_fully_shard, "_init_default_mesh", lambda *args, **kwargs: mesh), \
                mock.patch.object(PartialState, "set_device", _the_cpu(PartialState.set_device)), \
                mock.patch.object(accelerator, "_get_parameter_id", _parameter_key(accelerator._get_parameter_id)):
            yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _parameter_key(get_parameter_id):
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    def key(param):
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, FakeTensor) and not param.is_meta:  # the pointer a real run reads: storage + offset
            return local.untyped_storage()._cdata, local.storage_offset() * local.element_size()
        return get_parameter_id(param)
    return key


def _the_cpu(set_device):
    def on_the_cpu(state):
        set_device(state)
        if state.device.type == "cpu":
            state.device = torch.device("cpu")
    return on_the_cpu


@contextlib.contextmanager
def storages_told_apart():
    """The trace: `FSDPParam.reset_sharded_param`, which FSDP2's lazy init calls on every parameter at the first
    forward, re-pads a rank's local shard unless it already is the padded shard's storage, which it tells only for
    a plain tensor (`type(...) is torch.Tensor`) by its storage's data pointer: in a trace every shard is a fake
    tensor, so a rank with shorter local shards re-padded every one of them (a new padded copy each, the old one
    freed: 32 KB over on a host peak) where a real run keeps them. Here a fake shard that is that storage (the same
    `_cdata`, not empty) is kept as the real run keeps it: the call made with the padded size set to the local
    one (no re-pad), the padded shard restored after it."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    real_reset = FSDPParam.reset_sharded_param

    def reset_sharded_param(self):
        info = self._module_info
        local = getattr(info.module, info.param_name)._local_tensor
        data = self._sharded_param_data
        storage = data.untyped_storage() if isinstance(data, FakeTensor) else None
        if storage is None or storage.nbytes() == 0 or storage._cdata != local.untyped_storage()._cdata:
            return real_reset(self)
        padded = self.padded_sharded_param_size
        self.padded_sharded_param_size = local.size()
        try:
            return real_reset(self)
        finally:
            self.padded_sharded_param_size, self._sharded_param_data = padded, data

    with mock.patch.object(FSDPParam, "reset_sharded_param", reset_sharded_param):
        yield


def mesh_2d(fsdp_size: int, tp: int):
    """FSDP2 x TP's mesh as transformers lays it out (`initialize_distributed_mesh`: TP innermost), outside any
    FakeTensorMode."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (fsdp_size, tp), mesh_dim_names=("fsdp", "tp"))


def mesh_1d(world_size: int):
    """The data-parallel mesh FSDP2 shards over (built outside any FakeTensorMode: it reads its rank map)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


@contextlib.contextmanager
def gloo_reduce_scatter_copy():
    """A fake process group's `reduce_scatter_single` with gloo's copy of the input made and dropped inside it."""
    import torch.distributed as dist

    real = dist.reduce_scatter_single

    def reduce_scatter_single(output, input, *args, **kwargs):
        copy = torch.empty_like(input)  # noqa: F841  (ProcessGroupGloo's own buffer, freed at the wait)
        work = real(output, input, *args, **kwargs)
        del copy
        return work

    with mock.patch.object(dist, "reduce_scatter_single", reduce_scatter_single):
        yield


def settled_collectives(settle: bool = True):
    """Measured runs: each of FSDP2's collectives waited for and held until gloo's worker thread has let its tensors
    go (llmsim/model/gloo.py: the reduce-scatter's copy of the input, the all-gather's buffer), then GLOO_SETTLE_S,
    as NCCL would hold none of them past the wait (see the module's docstring). `settle=False` measures gloo's own
    timing."""
    from llmsim.model.gloo import FSDP2_COLLECTIVES, settled_collectives as settled

    return settled(FSDP2_COLLECTIVES, GLOO_SETTLE_S) if settle else contextlib.nullcontext()
