"""Activation checkpointing with offload: `model.activation_checkpointing_enable(every_n_layers=n, offload=True)`.

What transformers 5.24 does (modeling_utils.py, `_activation_checkpointing_enable`): every checkpointed layer's
`torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)` runs inside
`torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=<current accelerator>)`. What that moves:
- Inside the checkpoint the layer's own saved tensors never reach save_on_cpu: the non-reentrant checkpoint's
  `_checkpoint_hook` is the innermost saved-tensors hook and packs each of them into an empty `_Holder`
  (torch/utils/checkpoint.py). They are recomputed in the backward, as without offload.
- What save_on_cpu does pack is the checkpoint's inputs: `_CheckpointFrame.save_inputs` makes a SavedVariable
  of every *positional* tensor argument of the layer (`_make_saved_tensor`), under save_on_cpu's hooks. The
  layer's keyword arguments (masks, rotary tables, position ids) stay referenced by the recompute closure, on
  the device. transformers' decoder loops pass `hidden_states` positionally, GPT-2 also its causal mask.
- Pack (torch/autograd/graph.py, `save_on_cpu.pack_to_cpu`, pin_memory=True): `torch.empty(size, dtype,
  layout, pin_memory=True)` then `copy_` -- a contiguous host copy of numel x itemsize bytes. The device
  tensor is freed as soon as nothing else holds it (the decoder loop rebinds `hidden_states` after the next
  layer; a following layer that is not checkpointed may save it and keep it).
- Unpack, at the first backward use of one of the layer's holders (the recompute, `frame.get_inputs()`):
  `packed.to(device, non_blocking=True)` -- a new device copy, alive while the recomputed layer's saved
  tensors reference it. The host copy lives as long as the checkpoint frame: until the layer's backward ends.

Measuring it on this CPU. On a machine without an accelerator transformers asks save_on_cpu for
`device_type="cpu"`; `torch.cpu.is_available()` is True, so the pack asks for pinned memory and fails
("pin_memory=True requires a CUDA or other accelerator backend"). The canonical step therefore replaces the
`save_on_cpu` that transformers calls with `host_offload` below: the same pack and unpack, with two
differences that make a CPU run allocate what a GPU run allocates -- memory is pinned only where an
accelerator exists (pinning changes where the bytes live, not how many), and an unpack whose `.to(device)`
returns the host tensor itself (the CPU emulating the device) clones it, as the real `.to(cuda)` allocates a
device copy. Every packed storage is labelled `Category.OFFLOADED`: host memory, which the predictor and the
measurement both report apart from the device peak (`split_host`). The same replacement runs under
FakeTensorMode, where every tensor is on the (fake) CPU, so a prediction -- CPU kernels or `--gpu` -- always
models the accelerator's device/host boundary, and the CPU measurement checks exactly that.

Not modelled: on a GPU the pinned copies go through CUDA's CachingHostAllocator, which rounds each request up
to a power of two and caches freed blocks until the copies recorded on them complete
(ATen/core/CachingHostAllocator.h); llmsim reports the host's live tensor bytes, not the pinned pool.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pandas as pd
import torch

from llmsim.enums import Category
from llmsim.model.tracker import StorageTracker

# timeline categories that live in host memory: offloaded checkpoint inputs, AdamW's host `step` counters on a GPU,
# and what DeepSpeed's optimizer offload keeps on the host
HOST_CATEGORIES = frozenset({Category.OFFLOADED.value, Category.HOST_OPTIMIZER_STATE.value,
                             Category.HOST_OFFLOAD.value})


def host_offload(tracker: StorageTracker, pin_memory: bool = False, device_type: str = "cuda"):
    """`torch.autograd.graph.save_on_cpu(pin_memory, device_type)`, packing as on an accelerator (see above)."""
    device_module = getattr(torch, device_type, torch.cuda)

    def pack_to_cpu(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        # torch's pinned path (transformers always pins); pinned only where an accelerator can pin
        is_pinnable = (pin_memory and device_module.is_available() and torch.accelerator.is_available()
                       and not tensor.is_sparse)
        # device="cpu": torch leaves it to the default device, which is the host in a training script (the GPU kit
        # runs the step under `torch.device("cuda")`, where the default would put the copy on the GPU)
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu",
                             pin_memory=is_pinnable)
        packed.copy_(tensor, non_blocking=is_pinnable)
        tracker.label([packed], Category.OFFLOADED)
        return tensor.device, packed

    def unpack_from_cpu(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        restored = tensor.to(device, non_blocking=pin_memory)
        if restored is tensor:  # the CPU standing in for the device: `.to(cuda)` would allocate a device copy
            restored = tensor.clone()
        return restored

    return torch.autograd.graph.saved_tensors_hooks(pack_to_cpu, unpack_from_cpu)


def offloading(tracker: StorageTracker, enabled: bool):
    """While the step runs, transformers' checkpoint function enters `host_offload` instead of save_on_cpu."""
    if not enabled:
        return contextlib.nullcontext()
    from transformers import modeling_utils

    return mock.patch.object(modeling_utils, "save_on_cpu",
                             lambda pin_memory=False, device_type="cuda": host_offload(tracker, pin_memory,
                                                                                       device_type))


def split_host(timeline: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(device events, host events) of one process's timeline."""
    on_host = host_rows(timeline)
    if not on_host.any():
        return timeline, timeline.iloc[:0]
    return timeline[~on_host].reset_index(drop=True), timeline[on_host].reset_index(drop=True)


def host_rows(timeline: pd.DataFrame) -> np.ndarray:
    """Which of a timeline's events are the host's (`split_host` without taking the frames apart: a pipeline
    stage's 85k events copied, its string columns most of it, took 22 ms, for a few dozen host rows)."""
    return timeline["category"].isin(HOST_CATEGORIES).to_numpy()


def host_peak_bytes(host: pd.DataFrame) -> int:
    """The most host bytes the step holds at once: offloaded checkpoint inputs and, on a GPU, AdamW's host `step`
    counters (0 without either)."""
    return int(host["delta_bytes"].cumsum().max()) if len(host) else 0
