"""Tier-2 measurement matrix for tensor parallelism: real multi-process runs on this CPU (torchrun, gloo),
the storage tracker in every rank.

TP_RUNS: transformers' own TP plan on DTensor (llmsim/tensor_parallel.py), TP 2 and 4, four architectures
(Llama MHA, Mistral GQA, Qwen2 GQA with q/k/v biases, GPT-NeoX fused QKV), fp32/bf16,
checkpointing on and off. Writes data/measurements/tier2_tp_cpu.csv (one row per rank).
Run: python experiments/measure_tier2_parallel.py (about 5 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmsim.enums import Precision
from llmsim.launch import LaunchFailure
from llmsim.measure import MEASUREMENTS_DIR, append_rows, measure_distributed
from llmsim.spec import TrainSetup, load_model_spec
from llmsim.strategies import Layout
from llmsim.zoo import shrink

TP_CSV = MEASUREMENTS_DIR / "tier2_tp_cpu.csv"
SHAPES = {  # zoo model -> (hidden, layers, vocab, heads): every size divides by 4 (kv-heads included)
    "llama-2-7b": (128, 4, 2000, 4), "mistral-7b": (128, 3, 1500, 16), "qwen2.5-7b": (112, 3, 3000, 28),
    "pythia-160m": (128, 3, 2048, 4), "llama-3.1-8b": (128, 5, 2500, 16),
}
# (model, tp, precision, grad_ckpt, ckpt_every, micro_batch, seq_len)
TP_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64),
    ("llama-2-7b", 4, "fp32", False, 1, 2, 64),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 96),
    ("llama-2-7b", 4, "bf16", True, 2, 1, 128),
    ("mistral-7b", 2, "fp32", True, 1, 2, 64),
    ("mistral-7b", 4, "fp32", False, 1, 3, 64),
    ("mistral-7b", 2, "bf16", False, 1, 1, 128),
    ("qwen2.5-7b", 2, "fp32", False, 1, 2, 64),
    ("qwen2.5-7b", 4, "bf16", True, 1, 2, 64),
    ("pythia-160m", 2, "fp32", False, 1, 2, 64),
    ("pythia-160m", 4, "fp32", True, 1, 1, 96),
    ("llama-3.1-8b", 2, "bf16-autocast", False, 1, 2, 64),
    ("llama-3.1-8b", 4, "fp32", True, 1, 2, 64),
]


def measure(runs: list[tuple], out: Path, timeout: int) -> int:
    """Measure each run (failures are reported and skipped); append the rank rows to `out`; the failures."""
    failures = 0
    for model, tp, precision, ckpt, every, mb, seq in runs:
        spec = load_model_spec(model, shrink(model, *SHAPES[model]))
        setup = TrainSetup(mb, seq, Precision(precision), None, ckpt, every)
        try:
            rows = measure_distributed(spec, setup, Layout(world_size=tp, tp=tp), timeout)
        except LaunchFailure as exc:
            failures += 1
            print(f"FAILED {model} tp {tp}: {exc}", flush=True)
            continue
        append_rows(rows, out)
        print(model, "tp", tp, precision, ckpt, [r["peak_allocated_bytes"] for r in rows], rows[0]["wall_s"],
              flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=TP_CSV)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--only", type=int, nargs="*", help="indices into TP_RUNS (default: all)")
    args = parser.parse_args()
    chosen = [run for i, run in enumerate(TP_RUNS) if args.only is None or i in args.only]
    return 1 if measure(chosen, args.out, args.timeout) else 0


if __name__ == "__main__":
    sys.exit(main())
