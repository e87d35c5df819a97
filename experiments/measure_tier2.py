"""Tier-2 measurement matrix: real multi-process runs on this CPU (torchrun, gloo), the storage tracker in
every rank: torch DDP and DeepSpeed ZeRO stages 0/1/2 with a client AdamW, varied knobs.

Writes data/measurements/tier2_cpu.csv (one row per rank). Run: python experiments/measure_tier2.py
(about 20 minutes on 2 cores; each run is killed after --timeout seconds and reported, never hangs).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from llmsim.dsconfig import load_ds_config
from llmsim.enums import Attention, Precision
from llmsim.launch import LaunchFailure
from llmsim.measure import TIER2_CSV, append_rows, measure_distributed
from llmsim.spec import TrainSetup, load_model_spec
from llmsim.strategies import Layout, Strategy
from llmsim.zoo import shrink

SHAPES = {  # zoo model -> (hidden, layers, vocab, heads)
    "llama-2-7b": (128, 4, 2000, 4), "gpt2": (128, 3, 1024, 4), "qwen2.5-0.5b": (112, 3, 3000, 7),
    "pythia-160m": (128, 4, 2048, 4), "opt-125m": (96, 4, 1280, 4), "bloom-560m": (64, 3, 2048, 4),
    "codegen-350m-mono": (128, 3, 1024, 4),
}
# (model, world size, precision, grad_ckpt, ckpt_every, micro_batch, seq_len, strategy, zero section or None)
RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "ddp", None),
    ("gpt2", 3, "bf16", True, 1, 2, 96, "ddp", None),
    ("qwen2.5-0.5b", 4, "fp32", False, 1, 1, 128, "ddp", None),
    ("opt-125m", 2, "bf16-autocast", True, 2, 3, 64, "ddp", None),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 0}),
    ("pythia-160m", 3, "fp32", True, 1, 2, 80, "deepspeed", {"stage": 0}),
    ("gpt2", 4, "fp32", False, 1, 1, 64, "deepspeed", {"stage": 0}),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 0}),
    ("gpt2", 3, "bf16", False, 1, 2, 96, "deepspeed", {"stage": 0}),
    ("gpt2", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 1}),
    ("llama-2-7b", 3, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 50000}),
    ("qwen2.5-0.5b", 4, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 1}),
    ("opt-125m", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 1, "overlap_comm": True}),
    ("pythia-160m", 2, "bf16", True, 2, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 200000}),
    ("codegen-350m-mono", 3, "fp32", False, 1, 1, 96, "deepspeed", {"stage": 1}),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 2}),
    ("opt-125m", 2, "bf16", False, 1, 2, 64, "deepspeed",
     {"stage": 2, "reduce_bucket_size": 100000, "overlap_comm": True}),
    ("pythia-160m", 3, "fp32", True, 2, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 100000}),
    ("gpt2", 4, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 2}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 20000}),
    ("llama-2-7b", 4, "fp32", False, 1, 4, 128, "deepspeed", {"stage": 2, "reduce_bucket_size": "auto"}),
    ("bloom-560m", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 2}),
    ("qwen2.5-0.5b", 3, "bf16", False, 1, 1, 96, "deepspeed", {"stage": 2, "overlap_comm": True}),
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=TIER2_CSV)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--only", type=int, nargs="*", help="indices into RUNS (default: all)")
    args = parser.parse_args()
    failures = 0
    for index, (model, world, precision, ckpt, every, mb, seq, strategy, zero) in enumerate(RUNS):
        if args.only is not None and index not in args.only:
            continue
        spec = load_model_spec(model, shrink(model, *SHAPES[model]))
        attention = Attention.EAGER if model == "bloom-560m" else None
        setup = TrainSetup(mb, seq, Precision(precision), attention, ckpt, every)
        deepspeed = None
        if zero is not None:
            config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
                      "zero_optimization": zero, "bf16": {"enabled": precision == "bf16"}}
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(config, f)
            deepspeed = load_ds_config(f.name, world, SHAPES[model][0], mb, Precision(precision))
        layout = Layout(Strategy(strategy), world, deepspeed)
        try:
            rows = measure_distributed(spec, setup, layout, args.timeout)
        except LaunchFailure as exc:
            failures += 1
            print(f"FAILED {model} {strategy} {zero} x{world}: {exc}", flush=True)
            continue
        append_rows(rows, args.out)
        print(model, strategy, zero, world, precision, [r["peak_allocated_bytes"] for r in rows],
              rows[0]["wall_s"], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
