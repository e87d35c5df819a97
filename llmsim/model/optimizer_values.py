"""The values an optimizer reads inside its step, answered for the fake-tensor trace as a real run answers them.

A fake tensor has no values: `.item()` (aten._local_scalar_dense) and `.tolist()` raise. Three optimizers read
values; each read is answered here, by a patch that lasts for the trace only (llmsim/model/trace.py, `run_fake`):

- torch.optim.Adafactor (torch/optim/_adafactor.py, `_single_tensor_adafactor`, `_multi_tensor_adafactor`):
  `step_t.item()` (a 0-d constant the fake mode answers itself), then `param.norm(2).item()` and
  `update.norm(2).item()`: they set the step size `alpha` and the clipping `denom`, Python floats that scale
  `param.add_(update, alpha=-alpha / denom)` and allocate nothing, so any finite answer gives the real run's
  allocations. Answered 1.0.
- transformers.optimization.Adafactor (`_get_lr`, scale_parameter=True): `max(eps[1], state["RMS"])` compares
  a 0-d tensor with 1e-3. Where RMS > 1e-3 the learning rate is a 0-d tensor (`param_scale * rel_step_sz`,
  4 bytes, alive until the next parameter's replaces it), else a Python float. Answered True (RMS > 1e-3):
  true of every parameter drawn from a normal or set to ones by `_init_weights` (RMS ~ initializer_range
  = 0.02, or 1); a zero-initialised one (a bias) stays below 1e-3 for the first steps (each step moves it by
  at most lr = 1e-3 x 1e-2), so the trace holds 4 bytes more than a real run while such a parameter is
  stepped, never while the step's largest update (a weight matrix's) is alive.
- bitsandbytes' 8-bit optimizers build their quantile maps with `functional.create_dynamic_map`, which
  computes on tensors and reads them back with `.tolist()`. It depends on its arguments only: run once on
  real tensors outside every dispatch mode, its `.tolist()` results are recorded, then it runs again in the
  trace with each fake tensor's `.tolist()` answered by the real run's in turn, so the trace sees the same
  allocations (the linspace temporaries and the 256-entry float32 map) as a real run.
"""
from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from llmsim.enums import Optimizer

ADAFACTOR_NORM_ANSWER = 1.0  # torch Adafactor's norms only scale the update (see above)
HF_RMS_ABOVE_EPS = True  # transformers Adafactor: parameter RMS > eps[1] = 1e-3 (see above)


class _AnswerScalars(TorchDispatchMode):
    """Answers `_local_scalar_dense` of a fake tensor whose value the fake mode does not know."""

    def __init__(self, answer: float, boolean: bool) -> None:
        super().__init__()
        self.answer, self.boolean = answer, boolean

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _unknown(args[0]):
            return self.boolean if args[0].dtype is torch.bool else self.answer
        return func(*args, **(kwargs or {}))


def _unknown(tensor) -> bool:
    return isinstance(tensor, FakeTensor) and tensor.constant is None and tensor.item_memo is None


def _answering(fn, answer: float, boolean: bool):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _AnswerScalars(answer, boolean):
            return fn(*args, **kwargs)
    return wrapper


def _replaying_tolist(fn):
    """`fn` (a pure function of its arguments) run on real tensors first, then in the trace with each fake
    tensor's `.tolist()` (FakeTensor.tolist: `.item()` of every element) answered by the real run's, in order."""
    real_tolist = torch.Tensor.tolist

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        answers: list = []

        def recording(tensor):
            answers.append(real_tolist(tensor))
            return answers[-1]
        with _disable_current_modes(), mock.patch.object(torch.Tensor, "tolist", recording):
            fn(*args, **kwargs)
        replay = iter(answers)

        with mock.patch.object(FakeTensor, "tolist", lambda tensor: next(replay)):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def answered_optimizer_values(optimizer: Optimizer):
    """For the trace: the value reads of `optimizer`'s step answered (nothing changes for the others)."""
    with contextlib.ExitStack() as stack:
        if optimizer is Optimizer.ADAFACTOR:
            from torch.optim import _adafactor

            for name in ("_single_tensor_adafactor", "_multi_tensor_adafactor"):
                stack.enter_context(mock.patch.object(
                    _adafactor, name, _answering(getattr(_adafactor, name), ADAFACTOR_NORM_ANSWER, True)))
        elif optimizer is Optimizer.HF_ADAFACTOR:
            from transformers.optimization import Adafactor

            get_lr = _answering(Adafactor._get_lr, ADAFACTOR_NORM_ANSWER, HF_RMS_ABOVE_EPS)
            stack.enter_context(mock.patch.object(Adafactor, "_get_lr", staticmethod(get_lr)))
        elif optimizer.bitsandbytes:
            from bitsandbytes import functional

            stack.enter_context(mock.patch.object(functional, "create_dynamic_map",
                                                  _replaying_tolist(functional.create_dynamic_map)))
        yield
