"""Tier (a): bytes computed by hand on tiny modules."""
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from llmsim.enums import Category
from llmsim.sim.peaks import replay
from llmsim.model.tracker import StorageTracker


def _adamw_step(fake: bool):
    tracker = StorageTracker()
    mode = FakeTensorMode() if fake else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with mode, tracker:
        layer = nn.Linear(256, 128, bias=False)  # 32,768 params, 131,072 B
        tracker.label([layer.weight], Category.PARAMETER)
        opt = torch.optim.AdamW(layer.parameters())
        x = torch.ones(4, 256)  # 4,096 B
        layer(x).sum().backward()
        tracker.label([layer.weight.grad], Category.GRADIENT)
        opt.step()
        tracker.label(opt.state[layer.weight].values(), Category.OPTIMIZER_STATE)
        opt.zero_grad(set_to_none=True)
    return tracker.timeline()


def test_parameter_gradient_and_adamw_state_bytes():
    timeline = _adamw_step(fake=False)
    allocated = timeline[timeline["delta_bytes"] > 0]
    by_category = allocated.groupby("category")["delta_bytes"].sum()
    weight_bytes = 256 * 128 * 4
    assert by_category[Category.PARAMETER.value] == weight_bytes
    # exp_avg + exp_avg_sq (fp32, like the parameter) + the fp32 scalar `step` on CPU (torch/optim/adamw.py)
    assert by_category[Category.OPTIMIZER_STATE.value] == 2 * weight_bytes + 4
    # The gradient is freed by zero_grad(set_to_none=True): its allocation and free cancel.
    grads = timeline[timeline["category"] == Category.GRADIENT.value]["delta_bytes"]
    assert grads.max() == weight_bytes and grads.sum() == 0


def test_fake_run_counts_the_same_bytes_as_the_real_run():
    real, fake = _adamw_step(fake=False), _adamw_step(fake=True)
    assert replay(real).allocated_bytes == replay(fake).allocated_bytes
    assert sorted(real["delta_bytes"]) == sorted(fake["delta_bytes"])


def test_resize_is_recorded():
    tracker = StorageTracker()
    with tracker:
        t = torch.empty(1000, dtype=torch.uint8)
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(300)
    assert list(tracker.timeline()["delta_bytes"]) == [1000, -1000, 300]


def test_meta_tensors_hold_no_memory():
    tracker = StorageTracker()
    with tracker:
        real = torch.empty(10)
        torch.zeros_like(real, device="meta")
    assert list(tracker.timeline()["delta_bytes"]) == [40]
