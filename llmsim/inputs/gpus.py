"""GPU profiles (data/gpus/*.json): what decides OOM beyond live tensors (DESIGN.md stage 4)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from llmsim.enums import Device
from llmsim.errors import InputError

GPU_DIR = Path(__file__).resolve().parents[2] / "data" / "gpus"


@dataclass(frozen=True)
class GpuProfile:
    name: str
    device_name: str
    compute_capability: str
    capacity_bytes: int  # torch.cuda.get_device_properties(0).total_memory
    cuda_context_bytes: int  # driver/runtime context: outside PyTorch's allocator
    cublas_workspace_bytes: int  # allocated through the caching allocator at the first matmul
    source: str


def gpu_names() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.json"))


def load_gpu(name: str) -> GpuProfile:
    path = GPU_DIR / f"{name}.json"
    if not path.exists():
        raise InputError(f"unknown GPU {name!r}; valid choices: {', '.join(gpu_names())}")
    return GpuProfile(**json.loads(path.read_text()))


def on_gpu(setup, gpu: GpuProfile):
    """The canonical step as it runs on this GPU: the kernels CUDA picks for its compute capability
    (llmsim.model.kernels) and torch's CUDA defaults (AdamW takes its foreach path for CUDA parameters, unless the
    fused kernel is asked for: `_default_to_fused_or_foreach` is not consulted when `fused=True`)."""
    return replace(setup, device=Device.CUDA, cuda_capability=gpu.compute_capability, foreach=not setup.fused)
