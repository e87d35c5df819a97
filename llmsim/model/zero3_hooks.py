"""Where DeepSpeed ZeRO-3's module hooks run, recorded in the traced step as zero-byte marker rows.

ZeRO-3 gathers a module's parameters before it runs and releases them after, in the forward, in a
checkpointed recompute and in the backward. It does so from hooks on every module
(deepspeed/runtime/zero/parameter_offload.py, `_register_deepspeed_module`, DeepSpeed 0.19):
- forward pre-hooks: fetch (`pre_sub_module_forward_function`), then each positional input tensor is passed
  through `PostBackwardFunctionModule`, whose backward, once all of them ran, releases the module after its
  backward (`post_sub_module_backward_function`);
- forward hooks: release (`post_sub_module_forward_function`), then each output tensor is passed through
  `PreBackwardFunctionForModule`, whose backward fetches the module before its backward.
`zero.Init` also replaces `torch.nn.functional.linear` with `zero3_linear_wrap` for the rest of the process
(partition_parameters.py, `_enable_mem_efficient_linear`): every `nn.Linear` then runs
`LinearFunctionForZeroStage3`, which saves the weight itself (not a transposed view) and has its own backward;
`linear_as_zero3` puts DeepSpeed's own function in place for the trace.
The same identity autograd functions are installed here (they return `detach()`ed aliases: no memory), so the
traced graph is the one a ZeRO-3 run executes and the markers sit where DeepSpeed's hooks run. The strategy
(`strategies/zero3.py`) replays the parameter coordinator over them.
"""
from __future__ import annotations

import contextlib
from typing import Callable
from unittest import mock

import torch
from torch import nn

from llmsim.model.tracker import BACKWARD_POST, BACKWARD_PRE, FORWARD_POST, FORWARD_PRE, StorageTracker


def _apply_to_tensors(function: Callable, value):
    """deepspeed/runtime/zero/utils.py, `apply_to_tensors_only`: tuples and lists rebuilt, dicts (HF model
    outputs) changed in place."""
    if isinstance(value, (tuple, list)):
        touched = [_apply_to_tensors(function, item) for item in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return value.__class__(*touched)
        return value.__class__(touched)
    if isinstance(value, dict):
        for key in value.keys():
            value[key] = _apply_to_tensors(function, value[key])
        return value
    if isinstance(value, torch.Tensor):
        return function(value)
    return value


class _ModuleState:
    def __init__(self) -> None:
        self.pre_backward_count = 0  # DeepSpeed's `applied_pre_backward_ref_cnt`
        self.grads_remaining = 0  # DeepSpeed's `ds_grads_remaining`


def install(model: nn.Module, tracker: StorageTracker, name_of: Callable[[str], str],
            block_of: Callable[[str], int]) -> None:
    """Register the four hooks on every module of `model`, after the tracker's own hooks, and record which
    parameter FQNs are aliases of another (tied weights). `name_of` maps an FQN of `model` to the name the
    trace gives it (a peft model's FQNs to its base model's)."""
    for fqn, module in model.named_modules():
        _register(module, name_of(fqn), block_of(name_of(fqn)), tracker)
    first: dict[int, str] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        fqn = name_of(fqn)
        if id(param) in first:  # tied: a module fetches the parameter another one owns
            tracker.mark_tied(fqn, first[id(param)], block_of(fqn))
        first.setdefault(id(param), fqn)


def _register(module: nn.Module, name: str, block: int, tracker: StorageTracker) -> None:
    state = _ModuleState()

    class PreBackward(torch.autograd.Function):
        @staticmethod
        def forward(output):
            return output.detach()

        @staticmethod
        def setup_context(ctx, inputs, output):
            state.pre_backward_count += 1

        @staticmethod
        def backward(ctx, *grads):
            if state.pre_backward_count > 0:
                tracker.mark_module(BACKWARD_PRE, name, block)
                state.pre_backward_count -= 1
            return grads

    class PostBackward(torch.autograd.Function):
        @staticmethod
        def forward(output):
            return output.detach()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.counted = inputs[0].requires_grad
            if ctx.counted:
                state.grads_remaining += 1

        @staticmethod
        def backward(ctx, *grads):
            state.grads_remaining -= 1
            if state.grads_remaining == 0:
                tracker.mark_module(BACKWARD_POST, name, block)
            return grads

    def pre_forward(module, args):
        tracker.mark_module(FORWARD_PRE, name, block)
        state.grads_remaining = 0
        return _apply_to_tensors(PostBackward.apply, args)

    def post_forward(module, args, output):
        tracker.mark_module(FORWARD_POST, name, block)
        return _apply_to_tensors(PreBackward.apply, output)

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)


@contextlib.contextmanager
def linear_as_zero3():
    """`torch.nn.functional.linear` as a ZeRO-3 run has it: DeepSpeed's `zero3_linear_wrap`."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    with mock.patch.object(torch.nn.functional, "linear", zero3_linear_wrap):
        yield
