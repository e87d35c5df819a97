"""The accuracy targets of DESIGN.md, stated once. They are never widened to make a row pass."""
from __future__ import annotations

# |predicted - measured| / measured of each rank's peak allocated bytes, by measurement tier.
PEAK_ALLOCATED_TOLERANCE = {
    1: 0.01,  # tier 1: real single-process CPU runs under the storage tracker
    2: 0.01,  # tier 2: real multi-process runs (DeepSpeed, DDP, TP, PP) on CPU/gloo
    3: 0.01,  # tier 3: the full-size step under FakeTensorMode
    4: 0.02,  # tier 4: real GPU, torch.cuda.max_memory_allocated()
}
# Tier 4 only: reserved (max_memory_reserved) and device total (NVML used).
RESERVED_TOLERANCE = 0.05
DEVICE_TOTAL_TOLERANCE = 0.05
