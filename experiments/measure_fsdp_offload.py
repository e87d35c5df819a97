"""FSDP2 with `CPUOffloadPolicy` measured on this CPU: torchrun, gloo, `fully_shard(..., offload_policy=
CPUOffloadPolicy())` on every decoder layer and then the root (llmsim/model/fsdp.py), the storage tracker in every
rank, the canonical step around it, and the CPU standing in for both memories (llmsim/model/host_memory.py,
`HostMemory.active_fsdp`: each shard, gradient and AdamW state the host's, each all-gather input copied to the
device, each `pin_memory()` a host copy known as pinned, as this CPU cannot pin).

Every run is predicted first (the line `predicted`), then measured (`measured`), device and host peak per rank.
Writes data/measurements/tier2_fsdp_offload_cpu.csv (one row per rank, gloo settled after each reduce-scatter as
NCCL frees at the wait). Run: python experiments/measure_fsdp_offload.py [--only I ...] (about 10 minutes on
2 cores); experiments/measure_fsdp_offload.out is its last output.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from llmsim.measure.launch import LaunchFailure
from llmsim.measure.runs import MEASUREMENTS_DIR, append_rows, measure_distributed
from llmsim.sim.pipeline import predict

from measure_fsdp import BF16, FP32, inputs as fsdp_inputs  # the same shapes and run tuple (this folder)

OFFLOAD_CSV = MEASUREMENTS_DIR / "tier2_fsdp_offload_cpu.csv"
# (model, world size, precision, grad_ckpt, micro_batch, seq_len, reshard_after_forward, param_dtype, reduce_dtype,
# init[, TrainSetup fields])
RUNS = [
    ("llama-2-7b", 2, "fp32", False, 2, 64, True, None, None, "meta"),
    ("llama-2-7b", 2, "fp32", True, 2, 64, True, None, None, "full"),
    ("llama-2-7b", 4, "bf16", True, 2, 64, True, None, None, "meta"),
    ("gpt2", 2, "fp32", False, 2, 64, True, BF16, FP32, "meta"),  # tied: the root group holds the one weight
    ("mistral-7b", 2, "bf16", True, 2, 64, False, None, None, "meta"),
    ("qwen2.5-0.5b", 3, "fp32", False, 2, 64, True, None, None, "meta"),  # uneven shards, q/k/v biases, tied
    ("pythia-160m", 2, "bf16-autocast", True, 2, 64, True, None, None, "full"),
    ("llama-3.1-8b", 3, "fp32", True, 1, 64, True, BF16, None, "meta"),
    ("mistral-7b", 4, "fp32", False, 2, 64, False, BF16, FP32, "full"),
    # LoRA: the frozen base sharded on the host and gathered like any parameter; the adapters' states on the host
    ("llama-2-7b", 2, "bf16", True, 2, 64, True, None, None, "meta", {"lora_rank": 8}),
    ("gpt2", 3, "bf16", True, 2, 64, True, None, None, "full", {"lora_rank": 8}),
    ("qwen2.5-0.5b", 2, "fp32", True, 2, 64, True, None, None, "meta",
     {"lora_rank": 4, "lora_targets": ("q_proj", "v_proj", "down_proj")}),
    # gradient accumulation: each micro-step's gradient copied to the host and added to the host gradient there
    ("llama-2-7b", 2, "fp32", False, 2, 64, True, None, None, "meta", {"grad_accum": 2}),
    ("mistral-7b", 4, "bf16", True, 2, 64, False, None, None, "full", {"grad_accum": 3}),
    ("gpt2", 2, "fp32", True, 2, 64, True, BF16, FP32, "meta", {"grad_accum": 2}),
    ("pythia-160m", 3, "fp32", False, 2, 64, False, None, None, "meta", {"lora_rank": 8, "grad_accum": 2}),
    # measured after run 10's miss was mended (llmsim/model/fsdp.py, storages_told_apart), each predicted first;
    # shorter local shards on the last ranks in three of them
    ("llama-3.1-8b", 4, "bf16", False, 2, 48, True, None, None, "full", {"lora_rank": 16}),
    ("qwen2.5-0.5b", 3, "bf16", True, 2, 64, False, None, None, "meta", {"grad_accum": 2}),
    ("gpt2", 3, "fp32", False, 2, 64, True, BF16, BF16, "meta"),
    ("mistral-7b", 3, "bf16-autocast", True, 1, 64, True, None, None, "meta", {"lora_rank": 8}),
]


def inputs(run: tuple):
    """experiments/measure_fsdp.py's run tuple, with `offload_policy=CPUOffloadPolicy()`."""
    spec, setup, layout = fsdp_inputs(run)
    return spec, setup, replace(layout, fsdp=replace(layout.fsdp, offload=True))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=OFFLOAD_CSV)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--only", type=int, nargs="*", help="indices into RUNS (default: all)")
    args = parser.parse_args()
    failures = 0
    for index in (args.only if args.only is not None else range(len(RUNS))):
        spec, setup, layout = inputs(RUNS[index])
        prediction = predict(spec, setup, layout)
        print(index, RUNS[index], "predicted device", [r.peak.allocated_bytes for r in prediction.ranks],
              "host", [r.peak_host_bytes for r in prediction.ranks], flush=True)
        try:
            rows = measure_distributed(spec, setup, layout, args.timeout)
        except LaunchFailure as exc:
            failures += 1
            print(f"FAILED {RUNS[index]}: {exc}", flush=True)
            continue
        append_rows(rows, args.out)
        print(index, "measured device", [r["peak_allocated_bytes"] for r in rows],
              "host", [r["peak_host_bytes"] for r in rows], rows[0]["wall_s"], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
