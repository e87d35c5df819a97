"""PyTorch FSDP2 measured on this CPU: torchrun, gloo, `fully_shard` on every decoder layer and then the root
(llmsim/model/fsdp.py), the storage tracker in every rank, the canonical step around it.

Writes data/measurements/tier2_fsdp_cpu.csv (one row per rank; every row with gloo settled after each
reduce-scatter, `gloo_settle` True, which is what NCCL does and what llmsim predicts). Then, with `--both-ways`,
re-runs UNSETTLED without the settle and prints the peaks side by side (the rows are not kept: gloo's timing is
a race, see llmsim/model/fsdp.py). Run: python experiments/measure_fsdp.py [--both-ways] (about 8 minutes on
2 cores); experiments/measure_fsdp.out is its last output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmsim.enums import Attention, Precision
from llmsim.inputs.spec import FsdpSetup, TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.launch import LaunchFailure
from llmsim.measure.runs import MEASUREMENTS_DIR, append_rows, measure_distributed
from llmsim.sim.strategies import Layout, Strategy

FSDP_CSV = MEASUREMENTS_DIR / "tier2_fsdp_cpu.csv"
SHAPES = {  # (hidden, layers, vocab, heads)
    "llama-2-7b": (128, 4, 2000, 4), "gpt2": (128, 3, 1024, 4), "mistral-7b": (128, 3, 1500, 4),
    "llama-3.1-8b": (96, 3, 1536, 4), "pythia-160m": (96, 3, 1536, 4), "qwen2.5-0.5b": (112, 3, 3000, 7),
}
BF16, FP32 = "bfloat16", "float32"
# (model, world size, precision, grad_ckpt, micro_batch, seq_len, reshard_after_forward, param_dtype, reduce_dtype,
# init). The first 14 build the whole model on every rank ("full"); the rest build on the meta device ("meta",
# the default), measured after the first 14 had been modelled; an 11th item holds TrainSetup fields (LoRA).
RUNS = [
    ("llama-2-7b", 2, "fp32", False, 2, 64, True, None, None, "full"),
    ("llama-2-7b", 2, "fp32", True, 2, 64, False, None, None, "full"),
    ("llama-2-7b", 4, "bf16", False, 2, 64, True, None, None, "full"),
    ("llama-2-7b", 2, "fp32", False, 2, 64, True, BF16, FP32, "full"),
    ("gpt2", 2, "fp32", True, 2, 96, True, None, None, "full"),  # tied: the root group holds the one weight
    ("gpt2", 4, "bf16-autocast", False, 1, 64, True, None, None, "full"),
    ("gpt2", 2, "fp32", False, 2, 64, False, BF16, BF16, "full"),
    ("mistral-7b", 2, "bf16", True, 2, 64, False, None, None, "full"),
    ("mistral-7b", 4, "fp32", False, 2, 64, True, BF16, FP32, "full"),
    ("llama-3.1-8b", 3, "fp32", False, 2, 48, True, BF16, None, "full"),
    ("llama-3.1-8b", 4, "fp32", True, 1, 64, False, BF16, FP32, "full"),
    ("pythia-160m", 3, "bf16", True, 2, 64, True, None, None, "full"),
    ("pythia-160m", 2, "bf16-autocast", True, 2, 64, True, BF16, None, "full"),
    ("qwen2.5-0.5b", 2, "fp32", False, 2, 64, True, None, None, "full"),  # tied embeddings, q/k/v biases
    ("llama-2-7b", 2, "fp32", False, 2, 64, True, None, None, "meta"),
    ("llama-2-7b", 4, "bf16", True, 2, 64, True, None, None, "meta"),
    ("gpt2", 2, "fp32", False, 2, 64, True, BF16, FP32, "meta"),
    ("mistral-7b", 2, "fp32", True, 2, 64, False, BF16, FP32, "meta"),
    ("llama-3.1-8b", 4, "bf16-autocast", False, 2, 48, True, None, None, "meta"),
    ("pythia-160m", 3, "fp32", False, 2, 64, False, None, None, "meta"),
    ("qwen2.5-0.5b", 2, "bf16", True, 2, 64, True, None, None, "meta"),
    ("llama-3.1-8b", 3, "fp32", True, 1, 64, True, BF16, None, "meta"),
    # LoRA: get_peft_model before fully_shard (the frozen base sharded and gathered like any parameter)
    ("llama-2-7b", 2, "bf16", True, 2, 64, True, None, None, "meta", {"lora_rank": 8}),
    ("mistral-7b", 4, "fp32", False, 2, 64, True, BF16, FP32, "meta", {"lora_rank": 16}),
    ("gpt2", 2, "bf16", False, 2, 64, False, None, None, "full", {"lora_rank": 8}),
    ("qwen2.5-0.5b", 2, "fp32", True, 2, 64, True, None, None, "meta",
     {"lora_rank": 4, "lora_targets": ("q_proj", "v_proj", "down_proj")}),
    # uneven shards (a dim 0 that does not divide by the world size: the last ranks' local shards are shorter)
    ("llama-2-7b", 3, "fp32", False, 2, 64, True, None, None, "meta"),
    ("gpt2", 3, "bf16", True, 2, 64, True, None, None, "meta", {"lora_rank": 8}),
    ("mistral-7b", 3, "fp32", True, 2, 64, False, BF16, FP32, "full"),
    ("qwen2.5-0.5b", 4, "fp32", False, 2, 64, True, None, None, "meta", {"lora_rank": 6}),  # rank 3: no LoRA A rows
    # gradient accumulation: every micro-step's backward reduce-scatters into the sharded gradients
    ("llama-2-7b", 2, "fp32", False, 2, 64, True, None, None, "meta", {"grad_accum": 2}),
    ("mistral-7b", 4, "bf16", True, 2, 64, False, None, None, "meta", {"grad_accum": 3}),
    ("gpt2", 2, "fp32", True, 2, 64, True, BF16, FP32, "meta", {"grad_accum": 2}),
]
UNSETTLED = [0, 4, 9, 14]  # indices into RUNS measured again with gloo's own timing (--both-ways)


def inputs(run: tuple):
    model, world, precision, ckpt, mb, seq, reshard, param_dtype, reduce_dtype, init = run[:10]
    spec = load_model_spec(model, shrink(model, *SHAPES[model]))
    setup = TrainSetup(mb, seq, Precision(precision), Attention.SDPA, ckpt, **(run[10] if len(run) > 10 else {}))
    layout = Layout(Strategy.FSDP, world, fsdp=FsdpSetup(reshard, param_dtype, reduce_dtype, init))
    return spec, setup, layout


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=FSDP_CSV)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--only", type=int, nargs="*", help="indices into RUNS (default: all)")
    parser.add_argument("--both-ways", action="store_true", help="then measure UNSETTLED without gloo's settle")
    args = parser.parse_args()
    failures, settled = 0, {}
    for index in (args.only if args.only is not None else range(len(RUNS))):
        spec, setup, layout = inputs(RUNS[index])
        try:
            rows = measure_distributed(spec, setup, layout, args.timeout)
        except LaunchFailure as exc:
            failures += 1
            print(f"FAILED {RUNS[index]}: {exc}", flush=True)
            continue
        append_rows(rows, args.out)
        settled[index] = [r["peak_allocated_bytes"] for r in rows]
        print(index, RUNS[index], settled[index], rows[0]["wall_s"], flush=True)
    if args.both_ways:
        print("gloo's own timing (no settle) against the settled rows, per rank:")
        for index in UNSETTLED:
            spec, setup, layout = inputs(RUNS[index])
            rows = measure_distributed(spec, setup, layout, args.timeout, gloo_settle=False)
            unsettled = [r["peak_allocated_bytes"] for r in rows]
            print(index, RUNS[index], "settled", settled.get(index), "unsettled", unsettled, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
