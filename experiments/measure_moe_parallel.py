"""Mixture-of-experts models under every layout llmsim models: data/measurements/tier2_moe_cpu.csv.

Each run is `llmsim measure` in a fresh process on 2 ranks (torchrun, gloo, the exact tracker in every rank), the
canonical recipe through each engine's entry point: `deepspeed.initialize` for ZeRO-1/2/3 (and ZeRO-3 with the
optimizer and parameters offloaded), `fully_shard` per decoder layer then the root for FSDP2, transformers' own TP
plan on DTensor (its MoE plan: `packed_colwise` gate_up, `rowwise` down, `moe_tp_experts` on the experts module),
torch.distributed.pipelining for PP, DistributedDataParallel. Small real shapes of the zoo's MoE configs
(`llmsim.inputs.zoo.shrink`: 8 experts, top-2, each family's layout kept; 8 or 16 heads so that the kv-heads
divide by 2), transformers' default experts implementation (grouped_mm).
HELDOUT runs (`--heldout`, data/measurements/tier2_moe_heldout_cpu.csv): families, shapes and layouts none of the
runs above has, each predicted (printed first) before it is measured, with llmsim's code fixed.
Run: python experiments/measure_moe_parallel.py [--only N] [--heldout]   (about 10 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "measurements" / "tier2_moe_cpu.csv"
HELDOUT_OUT = OUT.with_name("tier2_moe_heldout_cpu.csv")
SHAPES = {"mixtral-8x7b": (128, 4, 1000, 8), "qwen3-30b-a3b": (128, 4, 1000, 16), "deepseek-v3": (128, 5, 1000, 4),
          "gpt-oss-20b": (128, 4, 1000, 8), "deepseek-v2-lite": (128, 3, 1000, 4),
          "olmoe-1b-7b": (96, 5, 1200, 4), "qwen2-57b-a14b": (112, 4, 900, 28), "qwen3-235b-a22b": (128, 6, 800, 16),
          "gpt-oss-120b": (128, 5, 700, 16)}
ZERO = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
BF16 = {"bf16": {"enabled": True}}
ZERO3_OFFLOAD = {"zero_force_ds_cpu_optimizer": False,
                 "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "offload_param": {"device": "cpu", "pin_memory": True}}}
# (model, precision, extra llmsim flags, DeepSpeed JSON or None)
RUNS = [
    ("mixtral-8x7b", "fp32", [], {**ZERO, "zero_optimization": {"stage": 3}}),
    ("mixtral-8x7b", "bf16", ["--grad-ckpt"], {**ZERO, **BF16, "zero_optimization": {"stage": 3}}),
    ("qwen3-30b-a3b", "bf16", [], {**ZERO, **BF16, "zero_optimization": {"stage": 3}}),
    ("deepseek-v3", "bf16", [], {**ZERO, **BF16, "zero_optimization": {"stage": 3}}),
    ("gpt-oss-20b", "bf16", [], {**ZERO, **BF16, "zero_optimization": {"stage": 3}}),
    ("deepseek-v2-lite", "fp32", ["--lora-rank", "8", "--lora-targets", "q_proj,kv_b_proj,o_proj"],
     {**ZERO, "zero_optimization": {"stage": 3}}),
    ("mixtral-8x7b", "bf16", [], {**ZERO, **BF16, **ZERO3_OFFLOAD}),
    ("mixtral-8x7b", "fp32", [], {**ZERO, "zero_optimization": {"stage": 2}}),
    ("qwen3-30b-a3b", "bf16", [], {**ZERO, **BF16, "zero_optimization": {"stage": 1}}),
    ("mixtral-8x7b", "fp32", ["--strategy", "fsdp", "--world-size", "2"], None),
    ("deepseek-v3", "fp32", ["--strategy", "fsdp", "--world-size", "2", "--fsdp-param-dtype", "bf16"], None),
    ("mixtral-8x7b", "fp32", ["--tp", "2"], None),
    ("qwen3-30b-a3b", "bf16", ["--tp", "2", "--grad-ckpt"], None),
    ("deepseek-v3", "fp32", ["--tp", "2"], None),
    ("mixtral-8x7b", "fp32", ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"], None),
    ("mixtral-8x7b", "fp32", ["--strategy", "ddp", "--world-size", "2"], None),
]

HELDOUT = [
    ("olmoe-1b-7b", "bf16", ["--grad-ckpt"], {**ZERO, **BF16, "zero_optimization": {"stage": 3}}),
    ("qwen2-57b-a14b", "fp32", ["--strategy", "fsdp", "--world-size", "2", "--fsdp-no-reshard"], None),
    ("gpt-oss-120b", "bf16-autocast", ["--tp", "2"], None),
    ("qwen3-235b-a22b", "bf16", ["--grad-ckpt", "--grad-accum", "2"], {**ZERO, **BF16, "gradient_accumulation_steps": 2,
                                                                     "zero_optimization": {"stage": 2}}),
    ("qwen2-57b-a14b", "bf16", [], {**ZERO, **BF16, "zero_force_ds_cpu_optimizer": False,
                                    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    # (first written as OLMoE at PP 2, which llmsim refused before the run: transformers has no PP plan for olmoe)
    ("deepseek-v2-lite", "fp32", ["--pp", "2", "--microbatches", "2"], None),
    ("gpt-oss-120b", "bf16", ["--lora-rank", "8", "--lora-targets", "q_proj,v_proj"],
     {**ZERO, **BF16, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}),
]


def _llmsim(verb: str, model: str, precision: str, flags: list[str], ds: dict | None, *extra: str):
    """`llmsim predict|measure` on the run's shape, 2 ranks of the DeepSpeed JSON `ds` when one is given."""
    from llmsim.inputs.zoo import shrink

    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "llmsim.app.cli", verb, "--model", model, "--seq-len", "64",
                   "--micro-batch", "2", "--precision", precision, *extra, *flags]
        for key, value in shrink(model, *SHAPES[model]).items():
            command += ["--set", f"{key}={json.dumps(value)}"]
        if ds is not None:
            path = Path(directory) / "ds_config.json"
            path.write_text(json.dumps(ds))
            command += ["--ds-config", str(path), "--world-size", "2"]
        return subprocess.run(command, capture_output=True, text=True)


def predicted(model: str, precision: str, flags: list[str], ds: dict | None) -> str:
    """llmsim's prediction per rank, before the run is measured."""
    done = _llmsim("predict", model, precision, flags, ds, "--format", "json", "--no-suggest")
    if done.returncode:
        return "refused: " + done.stderr.strip()[-300:]
    ranks = json.loads(done.stdout)["ranks"]
    return "predicted " + " | ".join(f"rank {r['rank']}: {r['peak_allocated_bytes']:,} B" +
                                     (f", host {r['peak_host_bytes']:,} B" if r.get("peak_host_bytes") else "")
                                     for r in ranks)


def run(model: str, precision: str, flags: list[str], ds: dict | None, out: Path) -> int:
    done = _llmsim("measure", model, precision, flags, ds, "--out", str(out))
    last = " | ".join((done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-2:])
    layout = json.dumps(ds["zero_optimization"]) if ds else " ".join(flags)
    print(f"{model:16} {precision:5} {layout[:70]:70} -> {last}", flush=True)
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", type=int, default=None, help="the first N runs")
    parser.add_argument("--out", default=None, help="default: OUT (HELDOUT_OUT with --heldout)")
    parser.add_argument("--heldout", action="store_true", help="the HELDOUT runs, each predicted first")
    parser.add_argument("--index", type=int, nargs="*", help="only these indices of the list")
    args = parser.parse_args()
    out = Path(args.out or (HELDOUT_OUT if args.heldout else OUT))
    failures = 0
    cases = (HELDOUT if args.heldout else RUNS)[: args.only]
    for case in [cases[i] for i in args.index] if args.index is not None else cases:
        if args.heldout:
            print(f"{case[0]:16} {case[1]:5} {predicted(*case)}", flush=True)
        failures += run(*case, out) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
