"""llmsim vs the estimators people use, for Llama-2-7B/13B/70B under DeepSpeed ZeRO on 8-64 GPUs.

Setup: bf16 mixed precision (DeepSpeed `"bf16": {"enabled": true}`, fp32 master weights), client AdamW,
micro-batch 1, sequence 4096, full activation checkpointing, DeepSpeed's default knobs.
Columns (bytes, per GPU):
- llmsim: the most loaded rank's peak allocated. ZeRO-2: over the whole canonical step and after the build (on
  a GPU the fp32 model is built and cast on the host). ZeRO-3: the whole step, whose build is `zero.Init`'s
  (each parameter built on the device and partitioned at once, as transformers does under HfDeepSpeedConfig);
- deepspeed_estimate: DeepSpeed's own `estimate_zero2_model_states_mem_needs` /
  `estimate_zero3_model_states_mem_needs` (no offload): model states only, 2 + 18/N bytes per parameter
  (+ 4 x largest layer for ZeRO-3);
- eleuther: the EleutherAI "Transformer Math 101" model states (ZeRO-2: 2P + (2 + 12)P/N; ZeRO-3:
  (2 + 2 + 12)P/N) plus activations with full recomputation, 2 * s * b * h * L (the checkpointed layer inputs);
- megatron: Megatron-LM `theoretical_memory_usage.py` with its distributed optimizer (ZeRO-1 analogue:
  (6 + 12/N) bytes per parameter) plus Korthikanti et al.'s full-recompute activations (2 * s * b * h per
  layer) and the embedding/LM head activations it adds (4 * s * b * h + 4 * s * b * V for the logits, fp32).
Run: python experiments/compare_estimators.py  (a few minutes; writes experiments/compare_estimators.csv)
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from llmsim.inputs.dsconfig import load_ds_config
from llmsim.enums import Precision
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy

MODELS = ["llama-2-7b", "llama-2-13b", "llama-2-70b"]
WORLD_SIZES = [8, 16, 32, 64]
MICRO_BATCH, SEQ_LEN = 1, 4096
OUT = Path(__file__).with_suffix(".csv")


def model_numbers(name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    config = load_model_spec(name).hf_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return {"params": sum(p.numel() for p in model.parameters()), "largest_layer": largest,
            "hidden": config.hidden_size, "layers": config.num_hidden_layers, "vocab": config.vocab_size}


def llmsim_zero(name: str, world: int, stage: int) -> tuple[int, int, float]:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    spec = load_model_spec(name)
    deepspeed = load_ds_config(f.name, world, spec.hf_config().hidden_size, None, None)
    start = time.perf_counter()
    prediction = predict(spec, TrainSetup(MICRO_BATCH, SEQ_LEN, Precision.BF16, grad_ckpt=True),
                         Layout(Strategy.DEEPSPEED, world, deepspeed))
    seconds = time.perf_counter() - start
    training = max(_training_peak(r.timeline) for r in prediction.ranks)
    return prediction.peak_allocated_bytes, training, seconds


def _training_peak(timeline: pd.DataFrame) -> int:
    """The peak after the build: on a GPU the model is built and cast on the host before
    deepspeed.initialize moves it, so the fp32 model (4 bytes/param) never sits on the device."""
    live = timeline["delta_bytes"].cumsum()
    return int(live[timeline["phase"] != "build"].max())


def main() -> int:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    rows = []
    for name in MODELS:
        m = model_numbers(name)
        p, s, b, h, layers, vocab = m["params"], SEQ_LEN, MICRO_BATCH, m["hidden"], m["layers"], m["vocab"]
        recompute_activations = 2 * s * b * h * layers
        for world in WORLD_SIZES:
            peak, training, seconds = llmsim_zero(name, world, 2)
            peak3, _, seconds3 = llmsim_zero(name, world, 3)
            _, ds2 = estimate_zero2_model_states_mem_needs(p, world, 1, cpu_offload=False)
            _, ds3, _ = estimate_zero3_model_states_mem_needs(p, m["largest_layer"], world, 1, cpu_offload=False)
            rows.append({"model": name, "world_size": world, "params": p,
                         "llmsim_zero2": peak, "llmsim_zero2_after_build": training,
                         "llmsim_zero3": peak3, "llmsim_seconds": round(seconds, 2),
                         "llmsim_zero3_seconds": round(seconds3, 2),
                         "deepspeed_estimate_zero2": ds2, "deepspeed_estimate_zero3": ds3,
                         "eleuther_zero2": int(2 * p + 14 * p / world) + recompute_activations,
                         "eleuther_zero3": int(16 * p / world) + recompute_activations,
                         "megatron_distopt": int((6 + 12 / world) * p) + recompute_activations
                         + 4 * s * b * h + 4 * s * b * vocab})
            print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(OUT, index=False)
    timings = ["params", "llmsim_seconds", "llmsim_zero3_seconds"]
    gib = frame.set_index(["model", "world_size"]).drop(columns=timings) / 2**30
    print(gib.round(2).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
