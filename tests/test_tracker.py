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


def test_trackers_left_in_another_order_keep_seeing_resizes_then_unpatch():
    """Two threads of one process (a Dask worker's) enter and leave trackers in any order: the one still entered
    sees its resizes, and `resize_` is torch's own again once none is."""
    original = torch.UntypedStorage.resize_
    first, second = StorageTracker(), StorageTracker()
    first.__enter__()
    second.__enter__()
    t = torch.empty(1000, dtype=torch.uint8)
    first.__exit__(None, None, None)  # left first, as the thread that entered first may finish first
    t.untyped_storage().resize_(0)
    second.__exit__(None, None, None)
    assert list(second.timeline()["delta_bytes"]) == [1000, -1000]
    assert torch.UntypedStorage.resize_ is original


def test_meta_tensors_hold_no_memory():
    tracker = StorageTracker()
    with tracker:
        real = torch.empty(10)
        torch.zeros_like(real, device="meta")
    assert list(tracker.timeline()["delta_bytes"]) == [40]


def test_a_loaded_checkpoint_tensor_counts_as_the_copy_a_gpu_holds():
    """On the CPU a TP shard that from_pretrained loads is a slice of the whole checkpoint tensor, still in the
    safetensors mapping; on a GPU it is the `.to(device)` copy of the slice. Inside `loading_checkpoint` a view
    of memory the run did not allocate is no allocation; `adopt_loaded` counts the shard's own bytes, and the
    storage's size (the whole tensor's) never reads as a resize."""
    checkpoint = torch.empty(100, 64)  # 25,600 B: "the file", made before the run
    tracker = StorageTracker()
    with tracker:
        with tracker.loading_checkpoint():
            shard = checkpoint[:50]  # rank 0's rows: a view, 12,800 B of the 25,600
            made = torch.ones(8)  # a real allocation while loading still counts: 32 B
        tracker.adopt_loaded([shard, made])
        shard.view(-1)  # a later op on the shard sees the whole storage: no resize
        (shard * 2).sum()
    deltas = list(tracker.timeline()["delta_bytes"])
    assert deltas[:2] == [32, 50 * 64 * 4]
    assert 100 * 64 * 4 not in deltas  # the shard, the product and its 4-byte sum, never the whole tensor
    assert replay(tracker.timeline()).allocated_bytes == 32 + 12_800 + 12_800 + 4


def test_an_excluded_tensor_is_never_counted():
    forced = torch.zeros(16, 2, dtype=torch.long)  # the measurement's own input (a forced routing)
    tracker = StorageTracker()
    tracker.exclude([forced])
    with tracker:
        forced[:8].view(-1)
        torch.ones(4)
    assert list(tracker.timeline()["delta_bytes"]) == [16, -16]  # the ones alone


def test_the_timeline_names_phases_whatever_pandas_infers_for_strings():
    """pandas 3 with pyarrow (datasets pulls it in) stores a str-subclass Enum as a plain str: the phase column is
    built from the tracker's own Phase members, so every trace works with and without pandas' string inference."""
    import pandas as pd

    for infer in (False, True):
        with pd.option_context("future.infer_string", infer):
            tracker = StorageTracker()
            with tracker:
                torch.empty(10)
            assert set(tracker.timeline()["phase"]) == {"build"}
