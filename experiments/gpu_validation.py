"""GPU validation kit (tier 4): the canonical step on one real GPU, measured three ways, one row per run.

    python experiments/gpu_validation.py            # on a GPU machine: runs the matrix, appends rows to
                                                    # data/measurements/tier4_gpu.csv (about 4-6 min on an H200)
    python experiments/gpu_validation.py --dry-run  # anywhere: checks every configuration resolves and prints
                                                    # llmsim's prediction for the detected/named GPU, runs nothing

Each configuration runs in its own process (a fresh CUDA context and allocator) and records
`torch.cuda.max_memory_allocated()`, `torch.cuda.max_memory_reserved()` and the device's used memory
(`torch.cuda.mem_get_info`: total - free, which includes the CUDA context) at the end of step 3, plus the
storage tracker's exact live-tensor peak. `llmsim validate` then compares allocated (2 %), reserved and device
total (5 %), see llmsim/tolerances.py. LoRA needs peft, AdamW8bit bitsandbytes' CUDA build.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

TIER4_CSV = Path(__file__).resolve().parent.parent / "data" / "measurements" / "tier4_gpu.csv"
PER_RUN_TIMEOUT_S = 120
# (zoo model, micro_batch, seq_len, precision, grad_ckpt, ckpt_every[, lora_rank[, optimizer]]): single GPU, plain
# PyTorch, AdamW (foreach, CUDA's default) unless named; LoRA through peft on a frozen base.
MATRIX = [
    ("gpt2", 8, 1024, "bf16", False, 1),
    ("opt-1.3b", 4, 1024, "bf16", True, 1),
    ("qwen2.5-0.5b", 4, 2048, "bf16", False, 1),
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1),
    ("qwen2.5-3b", 2, 2048, "bf16", True, 2),
    ("pythia-1.4b", 4, 2048, "bf16-autocast", True, 1),
    ("bloom-1b7", 2, 1024, "bf16", True, 1),
    ("llama-2-7b", 1, 2048, "bf16", True, 1),
    ("llama-3.1-8b", 1, 4096, "bf16", True, 1),
    ("mistral-7b", 1, 2048, "bf16", True, 2),
    ("llama-3.1-8b", 2, 2048, "bf16", True, 1, 16),
    ("qwen2.5-1.5b", 4, 1024, "fp16-autocast", True, 1),
    # Other optimizers (issue 5), validated on the CPU only so far (data/measurements/tier1_optim_cpu.csv):
    # torch's Adafactor (its foreach path on CUDA), transformers' Adafactor, bitsandbytes' AdamW8bit (the CUDA
    # kernel updates the 8-bit states in place and allocates nothing, like the fake op the trace runs).
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1, 0, "adafactor"),
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1, 0, "hf-adafactor"),
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1, 0, "adamw8bit"),
]


def _setup(entry):
    from llmsim.enums import Optimizer, Precision
    from llmsim.spec import TrainSetup, load_model_spec, resolve_attention

    model, mb, seq, precision, ckpt, every, *rest = entry
    lora_rank = rest[0] if rest else 0
    optimizer = rest[1] if len(rest) > 1 else "adamw"
    spec = load_model_spec(model)
    setup = TrainSetup(mb, seq, Precision(precision), None, ckpt, every, foreach=True, lora_rank=lora_rank,
                       optimizer=Optimizer(optimizer))
    return spec, resolve_attention(spec, setup)


def worker(entry) -> dict:
    """One configuration on cuda:0 (run in a child process)."""
    import torch

    from llmsim.measure import environment, setup_columns
    from llmsim.peaks import replay
    from llmsim.step import run_canonical_step
    from llmsim.trace import model_builder
    from llmsim.tracker import StorageTracker

    spec, setup = _setup(entry)
    torch.cuda.set_device(0)
    build = model_builder(spec, setup, None)
    tracker = StorageTracker()
    start = time.perf_counter()
    with torch.device("cuda"):
        run_canonical_step(build, setup, tracker, None)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"tier": 4, **setup_columns(spec, setup), "strategy": "single", "world_size": 1, "rank": 0,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "device_total_bytes": total - free,
            "tracker_peak_bytes": replay(tracker.timeline()).allocated_bytes,
            "gpu": _profile_name(torch.cuda.get_device_name(0)), "device": torch.cuda.get_device_name(0),
            **environment(),
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - start, 2)}


def _profile_name(device_name: str) -> str:
    from llmsim.gpus import gpu_names, load_gpu

    for name in gpu_names():
        if load_gpu(name).device_name == device_name:
            return name
    return ""


def dry_run(gpu_name: str) -> int:
    from llmsim.gpus import load_gpu
    from llmsim.pipeline import predict
    from llmsim.report import human_bytes

    gpu = load_gpu(gpu_name)
    for entry in MATRIX:
        spec, setup = _setup(entry)
        rank = predict(spec, setup, gpu=gpu).ranks[0]
        print(f"{entry}: predicted allocated {human_bytes(rank.peak_allocated_bytes)}, reserved "
              f"{human_bytes(rank.peak_reserved_bytes)}, device total {human_bytes(rank.device_total_bytes)}, "
              f"fits {gpu.name}: {rank.fits}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--gpu", default="h200", help="profile for --dry-run predictions")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: one configuration as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(worker(tuple(json.loads(args.one)))))
        return 0
    if args.dry_run:
        return dry_run(args.gpu)
    from llmsim.measure import append_rows

    failures = 0
    for entry in MATRIX:
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(entry)], capture_output=True,
                                  text=True, timeout=PER_RUN_TIMEOUT_S)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
            failures += 1
            print(f"FAILED {entry}", flush=True)
            continue
        append_rows([row], TIER4_CSV)
        print(entry, row["peak_allocated_bytes"], row["peak_reserved_bytes"], row["device_total_bytes"], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
