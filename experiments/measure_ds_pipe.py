"""Tier-2 rows of DeepSpeed's pipeline engine (recipe deepspeed-pipe, llmsim/model/ds_pipe.py): real multi-process
runs on this CPU (torchrun, gloo, DeepSpeed's CPU accelerator), the storage tracker in every rank, each run as a
pipeline script writes it: a PipelineModule of the model's own pieces, `deepspeed.initialize` with the JSON below,
`engine.train_batch()` per step. Each run goes through `llmsim measure`'s own parsing (--ds-config with --pp), so the
rows say what the CLI would be given. DeepSpeed's collectives are settled (`ds_gloo_settle`: gloo's worker thread given
a moment to drop its reference to a collective's tensors, as NCCL does at the wait; the rows say `gloo_settle`):
unsettled, the last stage of the Mistral run held a 4-byte scalar past the loss's broadcast in one of two runs.

RUNS: ZeRO-0 and ZeRO-1, fp32 and bf16 (ZeRO-0 in bf16 is DeepSpeed's BF16_Optimizer), 2-4 stages over 1-2 replicas,
DeepSpeed's activation checkpointing every 1 and 2 layers, four architectures (Llama MHA, Mistral GQA, Qwen2 with
q/k/v biases; Qwen2.5-0.5B's head tied to its embedding), both partition methods, and DeepSpeed's default
reduce_bucket_size (5e8 elements: two such buckets under a pipeline, a 2 GB peak on a model of 3 MB); the others set
2e5 elements so the model's own memory decides.
Writes data/measurements/tier2_ds_pipe_cpu.csv.
Run: python experiments/measure_ds_pipe.py [--only N ...]  (about 10 minutes on 2 cores: DeepSpeed JIT-builds its
FusedAdam op in every rank, 20-60 s, on this machine)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from llmsim.app.options import build_parser, inputs
from llmsim.inputs.zoo import shrink
from llmsim.measure.launch import LaunchFailure
from llmsim.measure.runs import MEASUREMENTS_DIR, append_rows, measure_distributed

OUT = MEASUREMENTS_DIR / "tier2_ds_pipe_cpu.csv"
SHAPES = {  # zoo model -> (hidden, layers, vocab, heads), shrunk as experiments/measure_tier2_parallel.py shrinks them
    "llama-2-7b": (128, 4, 2000, 4), "llama-2-7b-deep": (128, 8, 2000, 4), "mistral-7b": (128, 3, 1500, 16),
    "qwen2.5-7b": (112, 3, 3000, 28), "qwen2.5-0.5b": (112, 4, 3000, 28),  # 0.5B: the head tied to the embedding
}
SMALL_BUCKET = 200_000  # reduce_bucket_size, elements
# (model, pp, dp, ZeRO stage, bf16, micro-batches, checkpoint every (0: off), micro-batch, seq, extra JSON, partition)
RUNS = [
    ("llama-2-7b", 2, 1, 0, False, 4, 0, 2, 64, {}, None),
    ("llama-2-7b", 2, 2, 1, False, 4, 0, 2, 64, {}, None),
    ("llama-2-7b", 2, 1, 1, True, 4, 0, 2, 64, {}, None),
    ("llama-2-7b", 2, 1, 0, True, 4, 0, 2, 64, {}, None),  # ZeRO-0 + bf16: BF16_Optimizer
    ("llama-2-7b-deep", 3, 1, 1, False, 5, 1, 2, 64, {}, None),
    ("llama-2-7b", 2, 2, 1, True, 3, 2, 2, 64, {}, None),
    ("llama-2-7b", 2, 1, 1, True, 4, 0, 2, 64, {"reduce_bucket_size": None}, None),  # DeepSpeed's default bucket
    ("mistral-7b", 2, 1, 1, True, 4, 1, 1, 96, {}, "uniform"),
    ("qwen2.5-7b", 3, 1, 0, False, 6, 0, 2, 64, {"gradient_clipping": 0.0}, None),
    ("llama-2-7b", 4, 1, 1, False, 8, 1, 1, 64, {}, "uniform"),
    # tie_word_embeddings: DeepSpeed's TiedLayerSpec on the first and last stages, ReduceTiedGrads between them
    ("qwen2.5-0.5b", 2, 1, 1, True, 4, 0, 2, 64, {}, None),
    ("qwen2.5-0.5b", 3, 2, 0, False, 3, 1, 1, 64, {}, "uniform"),
]


def ds_config(pp: int, dp: int, stage: int, bf16: bool, micro_batches: int, micro_batch: int, extra: dict) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": SMALL_BUCKET}
    if "reduce_bucket_size" in extra and extra["reduce_bucket_size"] is None:
        del zero["reduce_bucket_size"]
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
              "train_batch_size": micro_batch * micro_batches * dp,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
              "steps_per_print": 1000}
    config.update({key: value for key, value in extra.items() if key != "reduce_bucket_size"})
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def argv(run: tuple, config_path: str) -> list[str]:
    model, pp, dp, _, _, _, every, micro_batch, seq, _, partition = run
    zoo_name = model.split("-deep")[0]
    args = ["measure", "--model", zoo_name, "--seq-len", str(seq), "--ds-config", config_path, "--pp", str(pp),
            "--world-size", str(pp * dp)]
    for key, value in shrink(zoo_name, *SHAPES[model]).items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    if every:
        args += ["--grad-ckpt", "--ckpt-every", str(every)]
    if partition:
        args += ["--partition-method", partition]
    return args


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", type=int, nargs="*", help="indices into RUNS (default: all)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--timeout", type=int, default=900)
    args = parser.parse_args()
    failures = 0
    for index, run in enumerate(RUNS):
        if args.only is not None and index not in args.only:
            continue
        model, pp, dp, stage, bf16, micro_batches, _, micro_batch, _, extra, _ = run
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
            json.dump(ds_config(pp, dp, stage, bf16, micro_batches, micro_batch, extra), file)
        try:
            spec, setup, layout = inputs(build_parser().parse_args(argv(run, file.name)))
            rows = measure_distributed(spec, setup, layout, args.timeout, ds_gloo_settle=True)
        except LaunchFailure as exc:
            failures += 1
            print(f"FAILED {index} {run}: {exc}", flush=True)
            continue
        finally:  # the JSON is read when the run is parsed and again by every rank
            Path(file.name).unlink()
        append_rows(rows, args.out)
        print(index, run, [r["peak_allocated_bytes"] for r in rows], rows[0]["wall_s"], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
