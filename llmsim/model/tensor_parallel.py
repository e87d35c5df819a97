"""Tensor parallelism as transformers runs it: the model's own TP plan on DTensor, one rank per shard.

The canonical TP build (what `--tp N` predicts and what a measured TP rank runs):

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=...)          # no memory
    plan = model._resolve_parallel_plans(DistributedConfig(tp_size=N))[0]    # base_model_tp_plan + _tp_plan
    apply_tensor_parallelism(model, mesh, plan)       # colwise / rowwise DTensor placeholders, forward hooks
    every parameter and buffer -> torch.empty_like(..., device="cpu")        # this rank's shards only
    model.init_weights()

This is `from_pretrained(..., tp_plan="auto")` (transformers/distributed/mixin.py, `maybe_distribute_model`)
with the checkpoint read replaced by `init_weights`: the same placeholders, filled in place. For Llama-style
models the plan shards q/k/v, gate and up by columns and o and down by rows (an all-reduce of their output
in the forward); the LM head is `colwise_gather_output`, so every rank all-gathers the full logits.

The predictor runs this under FakeTensorMode on a fake process group (torch's "fake" backend) of N ranks:
the collectives allocate their outputs as the real ones do, with no communication. Two facts make the fake
run byte-exact with a real gloo run (checked event by event on a 3-layer Llama, TP 2):
- `_c10d_functional.wait_tensor` returns its input tensor itself; its fake kernel allocates a new one
  (`WaitReturnsInput` below restores the real behaviour);
- the device mesh holds a real tensor of ranks, so it is created before entering FakeTensorMode.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from llmsim.errors import InputError, one_line


# Sizes transformers' TP may shard unevenly: DTensor's Shard(d) splits a dimension as torch.chunk does (the first ranks
# get ceil(n / tp) rows, the rest what is left), and the MLP and the LM head run on whatever width they hold. The
# attention heads are not among them: each rank's attention reshapes its columns into whole heads.
UNEVEN_SIZES = ("intermediate_size", "vocab_size")


def check_tensor_parallel(config, tp: int) -> None:
    """The model has a TP plan, and every rank holds whole attention heads: heads and kv-heads divide by tp (the
    MLP width and the vocabulary may not: `tp_rank_classes`; a mixture-of-experts model's must)."""
    if tp == 1:
        return
    if not getattr(config, "base_model_tp_plan", None):
        raise InputError(f"model type {config.model_type!r} has no tensor-parallel plan in transformers "
                         "(base_model_tp_plan); tp must be 1")
    from llmsim.inputs.spec import num_experts

    sizes = {"num_attention_heads": getattr(config, "num_attention_heads", None),
             "num_key_value_heads": getattr(config, "num_key_value_heads", None),
             "intermediate_size": getattr(config, "intermediate_size", None),
             "vocab_size": getattr(config, "vocab_size", None)}
    even = [name for name in sizes if name not in UNEVEN_SIZES or num_experts(config)]
    for name in even:
        size = sizes[name]
        if isinstance(size, int) and size % tp:
            valid = _common_divisors([sizes[n] for n in even])
            raise InputError(f"tp({tp}) must divide {name}({size}); valid tp degrees: "
                             f"{', '.join(str(d) for d in valid)}")


def tp_rank_classes(config, tp: int) -> list[list[int]]:
    """The TP ranks in groups of equal local shards (one group where every sharded size divides by tp): a rank
    of each group is traced (`TrainSetup.tp_rank`). DTensor's Shard splits as FSDP2's shards do (`local_rows`)."""
    from llmsim.model.fsdp import local_rows

    sizes = [getattr(config, name, None) for name in UNEVEN_SIZES]
    classes: dict[tuple, list[int]] = {}
    for rank in range(tp):
        key = tuple(local_rows(size, tp, rank) for size in sizes if isinstance(size, int))
        classes.setdefault(key, []).append(rank)
    return list(classes.values())


def check_expert_parallel(config, tp: int, ep: int) -> None:
    """Expert parallelism as transformers applies it here: over the TP group (`DistributedConfig(tp_size=N,
    ep_size=N)`; with no FSDP, transformers needs ep to be a multiple of tp that divides tp), on a model with an
    EP plan whose routed experts divide by ep."""
    if ep == 1:
        return
    from llmsim.inputs.spec import num_experts

    if ep != tp:
        raise InputError(f"ep({ep}) must equal tp({tp}): transformers shards the experts over the TP group "
                         "(DistributedConfig ep_size a multiple of tp_size dividing fsdp_size x tp_size, and "
                         "fsdp_size is 1 here)")
    experts = num_experts(config)
    if not experts or not getattr(config, "base_model_ep_plan", None):
        raise InputError(f"model type {config.model_type!r} has no expert-parallel plan in transformers "
                         "(base_model_ep_plan: mixture-of-experts models only); ep must be 1")
    if experts % ep:
        raise InputError(f"ep({ep}) must divide the {experts} routed experts; valid ep degrees: "
                         f"{', '.join(str(d) for d in range(2, experts + 1) if experts % d == 0)}")


def _common_divisors(sizes) -> list[int]:
    sizes = [s for s in sizes if isinstance(s, int)]
    return [d for d in range(1, min(sizes) + 1) if all(s % d == 0 for s in sizes)][:12]


def build_parallel(build_on_meta: Callable[[], nn.Module], name: str, mesh=None,
                   cut: Callable[[nn.Module], None] | None = None, ep: int = 1) -> nn.Module:
    """The canonical build of one rank (module docstring): on the meta device, cut to a pipeline stage
    (`cut`), transformers' TP plan over `mesh` (when given) and with `ep` > 1 its expert-parallel plan, then this
    rank's shards only, initialised."""
    model = parallel_on_meta(build_on_meta, name, mesh, cut, ep)
    untied = mesh is not None and cut is None
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                module._parameters[key] = nn.Parameter(torch.empty_like(param, device="cpu"),
                                                       requires_grad=param.requires_grad)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = torch.empty_like(buffer, device="cpu")
    with warnings.catch_warnings():  # DTensor's RNG tracker has no CPU support: each rank draws its own values
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights()
    if untied:  # from_pretrained's `_finalize_model_loading`: a tied LM head, materialised as a missing key, then
        model.tie_weights()  # tied to the embedding (its own shard dropped); a no-op for an untied model
    return model


def parallel_on_meta(build_on_meta: Callable[[], nn.Module], name: str, mesh=None,
                     cut: Callable[[nn.Module], None] | None = None, ep: int = 1) -> nn.Module:
    """The canonical build of one rank up to its allocation: the model on the meta device, cut to a pipeline
    stage (`cut`), transformers' TP plan applied over `mesh` (when given; parameters become DTensors whose local
    tensors are this rank's shards), and with `ep` > 1 (= the TP degree) its expert-parallel plan, as
    `maybe_distribute_model` applies them (transformers/distributed/mixin.py): TP on the dense modules, then each
    rank whole experts (`grouped_gemm`: Shard(0) of the stacked expert weights), reached by all-to-all
    (`ep_dispatch_experts`, AutoEP: AllToAllEP in training). No memory: llmsim/sim/bound.py reads the shards'
    shapes from it."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from torch._guards import active_fake_mode
    from transformers import initialization

    untied = mesh is not None and cut is None  # TP as from_pretrained builds it: tied after the load (below)
    fake_mode = active_fake_mode()  # a trace's (None outside one)
    with torch.device("meta"), initialization.no_tie_weights() if untied else contextlib.nullcontext(), \
            _disable_current_modes() if fake_mode is not None else contextlib.nullcontext():
        model = build_on_meta()
    if cut is not None:
        cut(model)
    if fake_mode is not None:
        _as_fakes(model, fake_mode)
    if mesh is not None:  # check_tensor_parallel has made sure the model has a plan
        try:
            config = DistributedConfig(tp_size=mesh.size(), ep_size=ep)
            plan, ep_plan, _ = model._resolve_parallel_plans(config)
            modules = dict(model.named_modules())  # a pipeline stage has no LM head to shard: it was cut away
            plan = {key: style for key, style in plan.items() if not isinstance(modules.get(key), nn.Identity)}
            apply_tensor_parallelism(model, mesh, plan)
            if ep > 1:  # the EP group is the TP group (ep_size == tp_size): one mesh of the same ranks
                apply_expert_parallelism(model, mesh, mesh, ep_plan, ep_implementation=config.ep_implementation)
        except (KeyError, ValueError) as exc:  # e.g. a tied LM head, which the plan names but the model shares
            raise InputError(f"transformers cannot apply its TP plan to {name}: {one_line(exc)}") from exc
    return model


def _as_fakes(model: nn.Module, fake_mode) -> None:
    """A model built on the meta device outside the trace's modes, its parameters and buffers made the fake mode's
    (meta tensors hold no memory: no row either way). Under the modes, building the whole stack a stage is cut
    from dispatched every layer's construction through them: 0.15 s of a 1.2 s stage trace of Llama-2-70B."""
    made: dict[int, torch.Tensor] = {}  # a tied parameter (a tied embedding kept on the last stage) stays one object
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(fake_mode.from_tensor(param), requires_grad=param.requires_grad)
                module._parameters[key] = made[id(param)]
        for key, buffer in module._buffers.items():
            if buffer is not None:
                if id(buffer) not in made:
                    made[id(buffer)] = fake_mode.from_tensor(buffer)
                module._buffers[key] = made[id(buffer)]


def parallel_mesh(dp: int, pp: int, tp: int):
    """The ranks as (dp, pp, tp), TP innermost (neighbouring ranks share a TP group), created outside any fake
    mode (the mesh holds a real tensor of ranks); None for one rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp * pp * tp == 1:
        return None
    return init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


class WaitReturnsInput(TorchDispatchMode):
    """Under FakeTensorMode: `wait_tensor` returns the tensor it waited on, as its C++ kernel does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """torch's fake backend: collectives that allocate like the real ones and never communicate."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding decisions by op schema, device mesh included, and an equal mesh of the next
    process group would find the old one's groups there (their names are reused): drop them."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own copy
