"""Tier-2 rows of DeepSpeed's AutoTP training: the DeepSpeed script as a user writes it (llmsim/model/ds_script.py:
`deepspeed.initialize(model=..., optimizer=AdamW(...), config=ds_config)`, forward, `engine.backward`,
`engine.step`), its JSON's `"tensor_parallel": {"autotp_size": N}` sharding the model's linear layers inside
`deepspeed.initialize` and ZeRO-0/1/2 running over the data-parallel ranks (world / N). Real multi-process runs on
this CPU (torchrun, gloo, DeepSpeed's CPU accelerator), the storage tracker in every rank, DeepSpeed's collectives
given gloo's settle (`gloo_settle`: without it gloo's worker thread held a 4-byte scalar of rank 0 past its
all-reduce in one run, which NCCL releases at the wait). Writes data/measurements/tier2_autotp_cpu.csv.
Run: python experiments/measure_tier2_autotp.py [--only I ...]  (about 4 minutes on 2 cores)."""
from __future__ import annotations

import argparse
import sys

from llmsim.enums import Precision
from llmsim.inputs.dsconfig import ds_setup
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.launch import LaunchFailure
from llmsim.measure.runs import MEASUREMENTS_DIR, append_rows, measure_distributed
from llmsim.model.ds_script import on_autotp
from llmsim.sim.strategies import Layout, Strategy

OUT = MEASUREMENTS_DIR / "tier2_autotp_cpu.csv"
SHAPES = {  # zoo model -> (hidden, layers, vocab, heads): every size divides by 4 (kv-heads included)
    "llama-2-7b": (128, 3, 2000, 4), "mistral-7b": (128, 3, 1500, 16), "qwen2.5-7b": (112, 3, 3000, 28),
    "pythia-160m": (128, 3, 2048, 4), "llama-3.1-8b": (128, 3, 2500, 16), "qwen2.5-0.5b": (112, 3, 3000, 28),
}
ZERO2_EXAMPLE = {"overlap_comm": True, "contiguous_gradients": True, "allgather_partitions": True,
                 "allgather_bucket_size": 2e8, "reduce_scatter": True}
# (model, world, autotp_size, ZeRO stage, precision, checkpointing, micro_batch, seq_len, gradient_accumulation_steps,
#  the JSON's "optimizer" section (DeepSpeed's FusedAdam) rather than the client torch.optim.AdamW[, more
#  zero_optimization keys])
RUNS = [
    ("llama-2-7b", 2, 2, 1, "bf16", False, 2, 64, 1, False),
    ("llama-2-7b", 2, 2, 0, "fp32", False, 2, 64, 1, False),
    ("llama-2-7b", 2, 2, 2, "bf16", True, 2, 96, 1, False),
    ("llama-2-7b", 4, 2, 1, "bf16", False, 2, 64, 1, False),
    ("llama-2-7b", 4, 4, 2, "fp32", False, 1, 64, 1, False),
    ("llama-2-7b", 4, 2, 2, "bf16", True, 2, 64, 2, False),
    ("mistral-7b", 2, 2, 1, "bf16", False, 2, 64, 1, False),
    ("qwen2.5-7b", 4, 2, 2, "bf16", True, 2, 64, 1, False),
    ("qwen2.5-0.5b", 2, 2, 1, "bf16", False, 2, 64, 1, False),
    ("pythia-160m", 2, 2, 1, "fp32", False, 2, 64, 1, False),
    ("llama-3.1-8b", 4, 4, 1, "bf16", False, 1, 64, 1, True),
    ("llama-2-7b", 4, 2, 0, "bf16", False, 2, 64, 1, False),
    # transformers' example ZeRO-2 JSON (examples/ds_zero2.json: overlap_comm, contiguous gradients, a 2e8 all-gather
    # bucket) with AutoTP added
    ("llama-2-7b", 4, 2, 2, "bf16", True, 2, 64, 1, False, ZERO2_EXAMPLE),
    ("mistral-7b", 4, 2, 2, "bf16", False, 1, 64, 2, False, ZERO2_EXAMPLE),
]


def config(run: tuple) -> dict:
    """The run's DeepSpeed JSON, as a user writes one for AutoTP (the HF integration's "auto" bucket size)."""
    _, _, autotp, stage, precision, _, mb, _, accumulation, ds_optimizer = run[:10]
    json = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 1.0, "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto", **(run[10] if len(run) > 10 else {})},
            "tensor_parallel": {"autotp_size": autotp}}
    if ds_optimizer:
        json["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5}}
    return json


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", type=int, nargs="*", help="indices into RUNS (default: all)")
    parser.add_argument("--timeout", type=int, default=600)
    args = parser.parse_args()
    failures = 0
    for index, run in enumerate(RUNS):
        if args.only is not None and index not in args.only:
            continue
        model, world, _, _, precision, ckpt, mb, seq, accumulation = run[:9]
        spec = load_model_spec(model, shrink(model, *SHAPES[model]))
        deepspeed = ds_setup(config(run), world, int(spec.hf_config().hidden_size), None, None)
        layout = Layout(Strategy.DEEPSPEED, world, deepspeed)
        setup = on_autotp(TrainSetup(mb, seq, Precision(precision), None, ckpt, 1, grad_accum=accumulation), layout)
        try:
            rows = measure_distributed(spec, setup, layout, args.timeout, ds_gloo_settle=True)
        except LaunchFailure as exc:
            print(f"FAILED {run}: {exc}", flush=True)
            failures += 1
            continue
        append_rows(rows, OUT)
        print(index, run, [r["peak_allocated_bytes"] for r in rows], rows[0]["wall_s"], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
