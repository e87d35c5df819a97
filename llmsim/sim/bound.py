"""A lower bound of each rank's peak allocated bytes, without tracing: what `llmsim size` checks before it
traces a tensor- or pipeline-parallel layout (one fake-tensor trace per TP degree and per stage, seconds each at
70B), so that a layout whose model states alone cannot fit is reported without one.

Right after the first `optimizer.step()` of the canonical step (llmsim/model/step.py, `run_canonical_step` and
`run_pipeline_step`) and before its `zero_grad`, a rank holds at once:
- its parameters: its pipeline stage's share (`pipelining.cut`), its TP shards (transformers' plan,
  `tensor_parallel.parallel_on_meta`), in the dtype of the step (the build's, or the precision's cast);
- every parameter's gradient, in the parameter's dtype (autograd's AccumulateGrad keeps it so), where every
  parameter takes part in the forward (EVERY_PARAMETER_TRAINED);
- the optimizer's per-parameter states, created at that first step for every parameter with a gradient
  (STATE_COPIES).
The parameters' shapes come from the same meta-device build as the trace's, so nothing is allocated. Everything
else (activations, temporaries, the 0-d `step`, the allocator's rounding) only adds to the peak, so the sum is a
lower bound of the predicted peak allocated bytes of every rank (tests/test_bound.py checks it against
`pipeline.predict`).
"""
from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch import nn

from llmsim.enums import Attention, Optimizer, Precision
from llmsim.model.pipelining import cut
from llmsim.inputs.spec import ModelSpec, TrainSetup
from llmsim.sim.strategies import Layout, Strategy
from llmsim.model.tensor_parallel import fake_process_group, parallel_mesh, parallel_on_meta
from llmsim.model.trace import hf_builder

# Per-parameter states, each of the parameter's shape and dtype, that torch.optim creates at the first step for
# every parameter with a gradient: Adam/AdamW `exp_avg` and `exp_avg_sq` (`torch.zeros_like(p,
# memory_format=torch.preserve_format)`, torch/optim/adam.py `_init_group`; amsgrad off by default), SGD with
# momentum `momentum_buffer` (`torch.clone(grad).detach()`, torch/optim/sgd.py). Other optimizers count none here
# (their states are factored or quantized): a smaller bound is still a bound.
STATE_COPIES = {Optimizer.ADAMW: 2, Optimizer.ADAM: 2, Optimizer.SGD_MOMENTUM: 1}

# Model types whose every parameter, in every pipeline stage and TP shard, takes part in the forward and so gets
# a gradient and optimizer states at the first step (checked by tests/test_bound.py against the trace). For
# other model types only the parameters count: an unused parameter would have neither.
EVERY_PARAMETER_TRAINED = ("llama", "mistral", "qwen2")


def rank_lower_bounds(model: ModelSpec, setup: TrainSetup, layout: Layout) -> dict[int, int]:
    """Rank -> a lower bound of its peak allocated bytes, for a tensor- and/or pipeline-parallel layout of
    `setup` as `pipeline.checked` returns it (every check `predict` makes already passed). Empty where no bound
    is modelled: other layouts, a module factory, a quantized base, peft."""
    if (layout.tp * layout.pp == 1 or layout.strategy is not Strategy.SINGLE or model.config_json is None
            or setup.quant is not None or setup.lora_rank or setup.trainable_tokens):
        return {}
    per_stage = [_stage_bytes(model, setup, layout, stage) for stage in range(layout.pp)]
    return {replica * layout.pp * layout.tp + stage * layout.tp + t: per_stage[stage]
            for replica in range(layout.dp) for stage in range(layout.pp) for t in range(layout.tp)}


def _stage_bytes(model: ModelSpec, setup: TrainSetup, layout: Layout, stage: int) -> int:
    """The model-state bytes of one rank of `stage` (TP rank 0 of the stage's group, whose trace `predict` gives
    all of the group's ranks)."""
    whole = _sharded_on_meta(model, setup.build_bf16, setup.attention, layout.tp)
    params = _stage_parameters(whole, stage, layout.pp, layout.pp_split)
    param_bytes = sum(_local_numel(p) * _itemsize(p, setup) for p in params)
    trained = model.hf_config().model_type in EVERY_PARAMETER_TRAINED and all(p.requires_grad for p in params)
    copies = 1 + STATE_COPIES.get(setup.optimizer, 0) if trained else 0  # the gradient, then the states
    return param_bytes * (1 + copies)


@functools.lru_cache(maxsize=4)  # one per TP degree of a sizing run; meta tensors hold no memory
def _sharded_on_meta(model: ModelSpec, build_bf16: bool, attention: Attention, tp: int) -> nn.Module:
    """The whole model as the canonical TP build makes it, on the meta device: transformers' plan over a TP
    group of `tp` ranks (this process is rank 0 of a fake process group). The plan shards each module on its
    own, so a stage's shards are the whole model's (`build_parallel` only drops the plan's entries for modules
    the cut removed)."""
    build_setup = TrainSetup(1, 1, Precision.BF16 if build_bf16 else Precision.FP32, attention, build_bf16=build_bf16)
    with fake_process_group(tp) if tp > 1 else contextlib.nullcontext():
        mesh = parallel_mesh(1, 1, tp)
        return parallel_on_meta(hf_builder(model, build_setup, model.hf_config()), model.name,
                                mesh["tp"] if mesh is not None else None)


def _stage_parameters(model: nn.Module, stage: int, num_stages: int, split) -> list[torch.Tensor]:
    """The parameters `pipelining.cut` keeps on `stage`, cut from a shallow copy of the model: `cut` replaces
    modules of the model and of its base model and edits the base model's config, and touches nothing deeper."""
    if num_stages == 1:
        return list(model.parameters())
    clone = _shallow(model)
    prefix = model.base_model_prefix
    base = _shallow(getattr(model, prefix))
    base.config = copy.copy(base.config)
    clone._modules[prefix] = base
    cut(clone, stage, num_stages, split=split)
    return list(clone.parameters())  # a tied weight once, as it is one storage


def _shallow(module: nn.Module) -> nn.Module:
    clone = copy.copy(module)
    for name in ("_modules", "_parameters", "_buffers"):
        object.__setattr__(clone, name, dict(getattr(module, name)))
    return clone


def _local_numel(param: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def _itemsize(param: torch.Tensor, setup: TrainSetup) -> int:
    """Bytes per element in the step: `model.to(dtype)` casts floating parameters to the precision's dtype."""
    cast = setup.precision.cast_dtype
    return cast.itemsize if cast is not None and param.is_floating_point() else param.element_size()
