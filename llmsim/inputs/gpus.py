"""GPU profiles (data/gpus/*.json): what decides OOM beyond live tensors (DESIGN.md stage 4)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from llmsim.enums import Device
from llmsim.errors import InputError

GPU_DIR = Path(__file__).resolve().parents[2] / "data" / "gpus"
# The verdict's margin, as a fraction of the card: a job whose predicted device total comes within it of the
# capacity is "tight", not "fits". Until GPU runs (tier 4) calibrate it, it is the error llmsim's targets allow
# its GPU figures (tolerances.DEVICE_TOTAL_TOLERANCE, 5 % of the device total); the CPU-measured error of the
# allocated bytes is far inside it (worst 0.151 % over every committed row, `llmsim validate`). `--margin` sets it.
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class GpuProfile:
    name: str
    device_name: str
    compute_capability: str
    capacity_bytes: int  # torch.cuda.get_device_properties(0).total_memory
    cuda_context_bytes: int  # driver/runtime context: outside PyTorch's allocator
    cublas_workspace_bytes: int  # allocated through the caching allocator by a thread's first matmul
    source: str
    # allocated through the caching allocator by a thread's first addmm with a bias (torch's cuBLASLt path): torch's
    # CUBLASLT_WORKSPACE_SIZE default, measured on the H200
    cublaslt_workspace_bytes: int = 1 << 20
    margin: float = DEFAULT_MARGIN  # the user's budget, not the card's: a fraction of capacity_bytes

    @property
    def margin_bytes(self) -> int:
        return round(self.margin * self.capacity_bytes)


def gpu_names() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.json"))


def load_gpu(name: str, margin: float | None = None) -> GpuProfile:
    """The profile `data/gpus/NAME.json`; `margin`: the verdict's margin as a fraction of the card (default
    DEFAULT_MARGIN)."""
    path = GPU_DIR / f"{name}.json"
    if not path.exists():
        raise InputError(f"unknown GPU {name!r}; valid choices: {', '.join(gpu_names())}")
    fields = json.loads(path.read_text())
    if "margin" in fields:  # a profile describes the card; the margin is the user's (--margin)
        raise InputError(f"GPU profile {path.name} sets 'margin': the margin is --margin's, not the card's")
    if margin is not None and not 0 <= margin < 0.5:
        raise InputError(f"margin({100 * margin:g} %) must be at least 0 % and below 50 % of the card")
    return GpuProfile(**fields, **({} if margin is None else {"margin": margin}))


def on_gpu(setup, gpu: GpuProfile):
    """The canonical step as it runs on this GPU: the kernels CUDA picks for its compute capability
    (llmsim.model.kernels) and torch's CUDA defaults (AdamW takes its foreach path for CUDA parameters, unless the
    fused kernel is asked for: `_default_to_fused_or_foreach` is not consulted when `fused=True`)."""
    return replace(setup, device=Device.CUDA, cuda_capability=gpu.compute_capability, foreach=not setup.fused)
