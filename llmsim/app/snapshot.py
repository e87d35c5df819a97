"""`llmsim predict --snapshot FILE.pickle`: one rank's predicted step as a PyTorch memory snapshot, the dict that
`torch.cuda.memory._snapshot()` returns and https://pytorch.org/memory_viz opens ("Active Memory Timeline").

Every allocation of the rank's timeline is an `alloc` trace entry and its free a `free_requested` then
`free_completed` entry, as the caching allocator records them (torch/csrc/cuda/CUDACachingAllocator.cpp,
`TraceEntry`), with the tensor's exact size; a storage that `resize_` grows or shrinks is freed and allocated anew
at its new size. Each entry's frame names what llmsim knows of it: the tensor (or its category), the phase and the
layer, under the module that made it, at the step (as the line). Addresses are the allocation's place in a
never-reused address space: the visualizer pairs a free with its allocation by address, and the allocator model's
own placement is not exported, so the snapshot has no segments ("Active Cached Memory" stays empty).
On a GPU (`gpu`, the prediction's profile) each thread's cuBLAS and cuBLASLt workspace is an allocation too, made at
its first call (the timeline's WORKSPACE_MARKERS rows) and kept to the end, as `replay.on_gpu` counts them; sizes
stay the tensors' own, as the allocator's trace records them, so the running total reaches the predicted peak with
each block rounded up to 512 bytes, as `torch.cuda.max_memory_allocated()` counts it.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import pandas as pd

from llmsim.model.tracker import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE, NO_BLOCK, TIMELINE_COLUMNS
from llmsim.sim.allocator import MIN_BLOCK_BYTES

BLOCK_ALIGN = MIN_BLOCK_BYTES  # CUDA's caching allocator rounds every block to it (kMinBlockSize): addresses step so


def snapshot(timeline: pd.DataFrame, gpu=None) -> dict:
    """The memory snapshot of one rank's timeline, on `gpu` (a GpuProfile) with its workspaces (module docstring)."""
    workspaces = {CUBLAS_WORKSPACE: ("cuBLAS workspace", gpu.cublas_workspace_bytes),
                  CUBLASLT_WORKSPACE: ("cuBLASLt workspace", gpu.cublaslt_workspace_bytes)} if gpu is not None else {}
    events: list[dict] = []
    live: dict[int, tuple[int, int, list[dict]]] = {}  # serial -> (address, size, frames)
    next_address = 0

    def alloc(serial: int, size: int, frames: list[dict]) -> None:
        nonlocal next_address
        live[serial] = (next_address, size, frames)
        events.append(_entry("alloc", next_address, size, frames, len(events)))
        next_address += -(-size // BLOCK_ALIGN) * BLOCK_ALIGN or BLOCK_ALIGN

    def free(serial: int) -> int:
        address, size, frames = live.pop(serial)
        events.append(_entry("free_requested", address, size, frames, len(events)))
        events.append(_entry("free_completed", address, size, frames, len(events)))
        return size

    for step, phase, block, module, serial, delta, category, tensor in \
            timeline[TIMELINE_COLUMNS].itertuples(index=False):
        if serial in workspaces:  # kept to the end of the process: a key no storage has
            name, size = workspaces[serial]
            alloc(-1 - len(events), size, _frames(step, phase, block, module, category, name))
            continue
        if delta == 0 or serial < 0:
            continue  # a marker row
        if serial in live:  # the free of a live storage, or a resize_ of it
            frames = live[serial][2]
            size = free(serial) + int(delta)
            if size > 0:
                alloc(serial, size, frames)
        elif delta > 0:
            alloc(serial, int(delta), _frames(step, phase, block, module, category, tensor))
    return {"segments": [], "device_traces": [events]}


def _frames(step: int, phase: str, block: int, module: str, category: str, tensor: str) -> list[dict]:
    layer = "" if block == NO_BLOCK else f", layer {block}"
    return [{"filename": module or "llmsim", "line": int(step) + 1,
             "name": f"{tensor or category} ({category}, {phase}{layer})"}]


def _entry(action: str, address: int, size: int, frames: list[dict], time: int) -> dict:
    return {"action": action, "addr": address, "size": size, "stream": 0, "frames": frames, "time_us": time}


def write_snapshot(timeline: pd.DataFrame, path: str | Path, gpu=None) -> None:
    with open(path, "wb") as f:
        pickle.dump(snapshot(timeline, gpu), f)
