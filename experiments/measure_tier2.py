"""Tier-2 measurement matrix: real multi-process runs on this CPU (torchrun, gloo), the storage tracker in
every rank: torch DDP and DeepSpeed ZeRO stages 0/1/2 with a client AdamW, varied knobs.

Writes data/measurements/tier2_cpu.csv (one row per rank). Run: python experiments/measure_tier2.py
(about 20 minutes on 2 cores; each run is killed after --timeout seconds and reported, never hangs).

`--zero3` runs ZERO3_RUNS instead (DeepSpeed ZeRO stage 3, zero.Init through HfDeepSpeedConfig), then
ZERO3_REPEATS a second time with the same config (run-to-run spread), and appends to
data/measurements/tier2_zero3_cpu.csv. About 10 minutes on 2 cores. These rows were measured before
`strategies/zero3.py` was written and used to develop it.

`--ds-optimizer` runs DS_OPTIMIZER_RUNS (stages 1-3 with a DeepSpeed "optimizer" section: FusedAdam, which
DeepSpeed JIT-compiles for the CPU on first use, and `torch_adam`) into data/measurements/tier2_ds_optimizer_cpu.csv.

`--zero3-heldout` runs ZERO3_HELDOUT (architectures, world sizes and knobs the development rows do not have:
GQA Mistral and Llama-3.1, OPT-350m's embedding projections, tied GPT-2 medium, BLOOM-1b1) into
data/measurements/tier2_zero3_heldout_cpu.csv: measured once the model was written, never tuned against.

`--levers-ddp` runs LEVERS_DDP_RUNS (issue 5's levers under 2-rank DDP, alone and combined: gradient accumulation,
checkpoint offload, TRL's chunked NLL, the Liger imitation, the Adafactors and bitsandbytes' optimizers, peft's
modules_to_save and trainable tokens) into data/measurements/tier2_levers_ddp_cpu.csv.

`--levers-zero` runs LEVERS_ZERO_RUNS (the loss levers and checkpoint offload under 2-rank DeepSpeed ZeRO-0/1/2,
client AdamW, fp32 and bf16, alone and combined) into data/measurements/tier2_levers_zero_cpu.csv.

`--lora` runs LORA_RUNS (peft LoRA on a frozen base under DDP and DeepSpeed ZeRO-3: get_peft_model after the
build, which under ZeRO-3 is zero.Init, then deepspeed.initialize) into data/measurements/tier2_lora_cpu.csv.

`--fused` runs FUSED_RUNS (torch.optim's fused AdamW/Adam under DDP, and as DeepSpeed's client or `torch_adam`
optimizer under ZeRO-0..3) into data/measurements/tier2_fused_adamw_cpu.csv.

`--lora-zero12` runs LORA_ZERO12_RUNS (peft LoRA under DeepSpeed ZeRO-1 and ZeRO-2: get_peft_model on the built
model, then deepspeed.initialize, which casts every parameter to bf16 and flattens the adapters alone) into
data/measurements/tier2_lora_zero12_cpu.csv.

`--zero-extras` runs ZERO_EXTRAS_RUNS (peft's modules_to_save and trainable tokens under ZeRO-0/1/2, checkpoint
offload under ZeRO-3, and the loss levers, offload and peft's extras with a DeepSpeed "optimizer" section) into
data/measurements/tier2_zero_extras_cpu.csv.

`--ga-zero` runs GA_ZERO_RUNS (gradient accumulation, 2 and 3 micro-steps, under 2-rank DeepSpeed ZeRO-0/1/2/3 with the
client AdamW, fp32 and bf16; the JSON's gradient_accumulation_steps set to it) into
data/measurements/tier2_ga_zero_cpu.csv.

`--zero0-dsopt` runs ZERO0_DSOPT_RUNS (a DeepSpeed "optimizer" section with ZeRO stage 0, LoRA with ZeRO stage 0,
and LoRA with ZeRO-1/2 and a DeepSpeed "optimizer" section) into data/measurements/tier2_zero0_dsopt_cpu.csv.

`--optim-zero` runs OPTIM_ZERO_RUNS (the client optimizers other than AdamW under DeepSpeed ZeRO-1/2/3: torch's
Adam, SGD and Adafactor, transformers' Adafactor, bitsandbytes' 8-bit and paged AdamW, stepped by DeepSpeed on its
flat fp32 partitions; the JSON sets zero_allow_untested_optimizer for those DeepSpeed has not tested) into
data/measurements/tier2_optim_zero_cpu.csv.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from llmsim.inputs.dsconfig import load_ds_config
from llmsim.enums import Attention, Loss, Optimizer, Precision
from llmsim.measure.launch import LaunchFailure
from llmsim.measure.runs import MEASUREMENTS_DIR, TIER2_CSV, append_rows, measure_distributed
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.inputs.zoo import shrink

SHAPES = {  # zoo model -> (hidden, layers, vocab, heads)
    "llama-2-7b": (128, 4, 2000, 4), "gpt2": (128, 3, 1024, 4), "qwen2.5-0.5b": (112, 3, 3000, 7),
    "pythia-160m": (128, 4, 2048, 4), "opt-125m": (96, 4, 1280, 4), "bloom-560m": (64, 3, 2048, 4),
    "codegen-350m-mono": (128, 3, 1024, 4),
    "mistral-7b": (128, 3, 1500, 4), "llama-3.1-8b": (128, 3, 2500, 4), "opt-350m": (96, 3, 1280, 4),
    "gpt2-medium": (96, 4, 1536, 4), "bloom-1b1": (96, 3, 1536, 4),
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
ZERO3_CSV = MEASUREMENTS_DIR / "tier2_zero3_cpu.csv"
ZERO3_HELDOUT_CSV = MEASUREMENTS_DIR / "tier2_zero3_heldout_cpu.csv"
DS_OPTIMIZER_CSV = MEASUREMENTS_DIR / "tier2_ds_optimizer_cpu.csv"
FUSED_ADAMW = {"type": "AdamW", "params": {"lr": 1e-4}}
TORCH_ADAMW = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}
# (model, world, precision, ckpt, every, micro_batch, seq, strategy, zero section, optimizer section)
DS_OPTIMIZER_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 50000}, FUSED_ADAMW),
    ("gpt2", 3, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 1}, FUSED_ADAMW),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 50000, "stage3_prefetch_bucket_size": 20000}, FUSED_ADAMW),
    # Its rows are in data/measurements/pending/: which ranks hold gloo's reduce-scatter clone at the peak
    # changes from run to run (see pending/README.md).
    ("opt-125m", 4, "fp32", True, 1, 1, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 40000, "sub_group_size": 40000}, FUSED_ADAMW),
    ("pythia-160m", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 3, "reduce_bucket_size": 50000},
     TORCH_ADAMW),
]
ZERO3_HELDOUT = [
    ("mistral-7b", 2, "fp32", True, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 30000, "stage3_prefetch_bucket_size": 10000,
      "stage3_param_persistence_threshold": 500}),
    ("llama-3.1-8b", 4, "bf16", False, 1, 2, 48, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 40000, "stage3_max_live_parameters": 20000,
      "stage3_max_reuse_distance": 5000}),
    ("opt-350m", 3, "fp32", True, 2, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 60000, "sub_group_size": 30000}),
    ("gpt2-medium", 2, "bf16", False, 1, 3, 40, "deepspeed",
     {"stage": 3, "contiguous_gradients": False, "reduce_bucket_size": 25000,
      "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}),
    ("bloom-1b1", 3, "bf16", True, 1, 1, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto"}),
    ("llama-2-7b", 4, "fp32", False, 1, 1, 96, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 70000, "stage3_max_reuse_distance": 100000,
      "stage3_prefetch_bucket_size": 60000, "stage3_max_live_parameters": 200000}),
]
# Same tuple as RUNS. DeepSpeed's stage-3 defaults: reduce_bucket_size 5e8 (an empty(5e8) kept all run),
# stage3_prefetch_bucket_size 5e7, stage3_max_live_parameters 1e9, stage3_param_persistence_threshold 1e5,
# stage3_max_reuse_distance 1e9, sub_group_size 1e9, overlap_comm True, contiguous_gradients True.
ZERO3_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 50000, "stage3_prefetch_bucket_size": 20000,
      "stage3_param_persistence_threshold": 1000}),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 3}),
    ("gpt2", 3, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 3}),
    ("qwen2.5-0.5b", 4, "fp32", False, 1, 1, 128, "deepspeed", {"stage": 3, "reduce_bucket_size": 50000}),
    ("opt-125m", 2, "bf16", True, 2, 3, 64, "deepspeed",
     {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}),
    ("pythia-160m", 3, "fp32", True, 1, 2, 80, "deepspeed",
     {"stage": 3, "stage3_max_live_parameters": 30000, "stage3_prefetch_bucket_size": 20000}),
    ("llama-2-7b", 3, "bf16", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 50000, "stage3_max_reuse_distance": 0}),
    ("gpt2", 4, "fp32", False, 1, 1, 64, "deepspeed",
     {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False}),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 96, "deepspeed",
     {"stage": 3, "sub_group_size": 50000, "reduce_bucket_size": 50000}),
    ("llama-2-7b", 4, "bf16", True, 1, 2, 64, "deepspeed",
     {"stage": 3, "sub_group_size": 50000, "stage3_param_persistence_threshold": 1000}),
    ("opt-125m", 3, "fp32", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "contiguous_gradients": False, "reduce_bucket_size": 50000}),
    ("pythia-160m", 2, "bf16", False, 1, 4, 64, "deepspeed",
     {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 100000, "stage3_prefetch_bucket_size": 0}),
    ("codegen-350m-mono", 3, "fp32", False, 1, 1, 96, "deepspeed",
     {"stage": 3, "stage3_max_live_parameters": 30000, "stage3_max_reuse_distance": 0,
      "stage3_prefetch_bucket_size": 50000}),
    ("bloom-560m", 2, "fp32", True, 1, 2, 64, "deepspeed",
     {"stage": 3, "stage3_param_persistence_threshold": 1000, "reduce_bucket_size": 50000}),
    ("gpt2", 2, "fp32", True, 2, 2, 128, "deepspeed",
     {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto"}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 20000, "stage3_prefetch_bucket_size": 20000,
      "stage3_max_live_parameters": 30000, "stage3_param_persistence_threshold": 0}),
    ("qwen2.5-0.5b", 3, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 3}),
    ("opt-125m", 4, "fp32", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 50000, "overlap_comm": False, "stage3_param_persistence_threshold": 0}),
    ("pythia-160m", 4, "bf16", True, 2, 1, 64, "deepspeed",
     {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 1000,
      "reduce_bucket_size": 50000}),
    ("llama-2-7b", 3, "fp32", True, 1, 2, 64, "deepspeed",
     {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
      "stage3_max_live_parameters": 30000, "stage3_max_reuse_distance": 0}),
]
ZERO3_REPEATS = [0, 5, 16]
LORA_CSV = MEASUREMENTS_DIR / "tier2_lora_cpu.csv"
QV = ("q_proj", "v_proj")
# Same tuple as DS_OPTIMIZER_RUNS (optimizer section None: the client AdamW), then (lora rank, target modules or
# None for peft's default for the model type).
LORA_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "ddp", None, None, (8, None)),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "ddp", None, None, (4, None)),
    ("qwen2.5-0.5b", 2, "fp32", True, 1, 2, 64, "ddp", None, None, (8, ("q_proj", "k_proj", "v_proj", "o_proj"))),
    ("mistral-7b", 2, "bf16", False, 1, 2, 64, "ddp", None, None, (16, ("gate_proj", "up_proj", "down_proj"))),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 50000, "stage3_prefetch_bucket_size": 20000,
      "stage3_param_persistence_threshold": 1000}, None, (8, None)),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 50000, "stage3_prefetch_bucket_size": 20000,
      "stage3_param_persistence_threshold": 1000}, None, (8, None)),
    ("gpt2", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 3, "reduce_bucket_size": 50000}, None, (4, None)),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0},
     None, (8, ("q_proj", "k_proj", "v_proj", "o_proj"))),
    ("mistral-7b", 2, "fp32", False, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 30000, "stage3_prefetch_bucket_size": 0},
     None, (16, ("gate_proj", "up_proj", "down_proj"))),
    ("opt-125m", 2, "bf16", True, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 40000, "stage3_prefetch_bucket_size": 20000}, None, (8, None)),
]
LEVERS_DDP_CSV = MEASUREMENTS_DIR / "tier2_levers_ddp_cpu.csv"
# Issue 5's levers under torch DDP, alone and combined: same tuple as LORA_RUNS, then the other TrainSetup fields.
NO_LORA = (0, None)
LEVERS_DDP_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "ddp", None, None, NO_LORA, {"grad_accum": 2}),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "ddp", None, None, NO_LORA, {"grad_accum": 3}),
    ("qwen2.5-0.5b", 2, "bf16-autocast", True, 1, 2, 64, "ddp", None, None, NO_LORA, {"ckpt_offload": True}),
    ("mistral-7b", 2, "fp32", True, 2, 4, 128, "ddp", None, None, NO_LORA, {"ckpt_offload": True}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "ddp", None, None, NO_LORA,
     {"loss": Loss.CHUNKED_NLL, "loss_chunk": 500}),
    ("qwen2.5-0.5b", 2, "fp32", False, 1, 2, 64, "ddp", None, None, NO_LORA, {"loss": Loss.FUSED_LINEAR_CE}),
    ("mistral-7b", 2, "bf16-autocast", True, 1, 4, 256, "ddp", None, None, NO_LORA,
     {"loss": Loss.FUSED_LINEAR_CE}),
    ("gpt2", 2, "fp32", False, 1, 2, 64, "ddp", None, None, NO_LORA, {"optimizer": Optimizer.ADAFACTOR}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "ddp", None, None, NO_LORA, {"optimizer": Optimizer.HF_ADAFACTOR}),
    ("qwen2.5-0.5b", 2, "fp32", True, 1, 2, 64, "ddp", None, None, NO_LORA, {"optimizer": Optimizer.ADAMW_8BIT}),
    ("opt-125m", 2, "bf16-autocast", False, 1, 2, 64, "ddp", None, None, NO_LORA,
     {"optimizer": Optimizer.PAGED_ADAMW_8BIT}),
    ("gpt2", 2, "bf16", False, 1, 2, 64, "ddp", None, None, (4, None), {"lora_modules_to_save": ("lm_head",)}),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "ddp", None, None, NO_LORA, {"trainable_tokens": (0, 1, 2)}),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 2, 64, "ddp", None, None, (8, None), {"trainable_tokens": (5, 7)}),
    # combinations
    ("llama-2-7b", 2, "bf16-autocast", True, 1, 2, 64, "ddp", None, None, NO_LORA,
     {"ckpt_offload": True, "grad_accum": 2, "loss": Loss.FUSED_LINEAR_CE, "optimizer": Optimizer.ADAMW_8BIT}),
    ("mistral-7b", 2, "bf16", False, 1, 2, 64, "ddp", None, None, (8, None),
     {"lora_modules_to_save": ("lm_head",), "loss": Loss.CHUNKED_NLL, "grad_accum": 2}),
    ("qwen2.5-0.5b", 2, "fp32", True, 2, 2, 64, "ddp", None, None, (4, QV),
     {"trainable_tokens": (1, 2, 3), "ckpt_offload": True, "optimizer": Optimizer.HF_ADAFACTOR, "grad_accum": 2}),
]

FUSED_CSV = MEASUREMENTS_DIR / "tier2_fused_adamw_cpu.csv"
# torch.optim's fused kernels (`fused=True`) under DDP, and as the client AdamW of DeepSpeed ZeRO-0..3 (or a
# `torch_adam` "optimizer" section with `"fused": true`): the states are created at the first step and updated in
# place, no temporaries. Same tuple as LEVERS_DDP_RUNS.
FUSED = {"fused": True}
def small_buckets(stage: int) -> dict:  # buckets of 20k elements: the optimizer step, not a bucket, is the peak
    return {"stage": stage, "reduce_bucket_size": 20000, "allgather_bucket_size": 20000} if stage < 3 else \
        {"stage": 3, "reduce_bucket_size": 20000, "stage3_prefetch_bucket_size": 20000,
         "stage3_param_persistence_threshold": 0}


WIDE_VOCAB = (128, 2, 16000, 4)
TORCH_FUSED_ADAMW = {"type": "AdamW", "params": {"torch_adam": True, "fused": True}}
FUSED_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "ddp", None, None, NO_LORA, FUSED),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 2, 64, "ddp", None, None, NO_LORA, {**FUSED, "optimizer": Optimizer.ADAM}),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 1}, None, NO_LORA, FUSED),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", small_buckets(1), None, NO_LORA, FUSED),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 2}, None, NO_LORA, FUSED),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 64, "deepspeed", small_buckets(2), None, NO_LORA, FUSED),
    ("mistral-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", small_buckets(2), TORCH_FUSED_ADAMW, NO_LORA),
    ("opt-125m", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 3}, None, NO_LORA, FUSED),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", small_buckets(3), None, NO_LORA, FUSED),
    ("pythia-160m", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 0}, None, NO_LORA, FUSED),
    ("llama-2-7b", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 0}, None, NO_LORA, FUSED),
    # a wide vocabulary, one short sequence and checkpointing: the optimizer step is the peak, and the fused
    # path's missing temporaries are what the prediction must get right (a 13th field: the shape)
    ("llama-2-7b", 2, "fp32", True, 1, 1, 16, "ddp", None, None, NO_LORA, FUSED, WIDE_VOCAB),
    ("llama-2-7b", 2, "bf16", True, 1, 1, 16, "deepspeed", small_buckets(1), None, NO_LORA, FUSED, WIDE_VOCAB),
    ("llama-2-7b", 2, "fp32", True, 1, 1, 16, "deepspeed", small_buckets(2), None, NO_LORA, FUSED, WIDE_VOCAB),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 1, 16, "deepspeed", small_buckets(2), None, NO_LORA, FUSED,
     (112, 2, 12000, 7)),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 1, 16, "deepspeed", small_buckets(1), TORCH_FUSED_ADAMW, NO_LORA, {},
     (112, 2, 12000, 7)),
    ("llama-2-7b", 2, "bf16", True, 1, 1, 16, "deepspeed", small_buckets(3), None, NO_LORA, FUSED, WIDE_VOCAB),
]

LORA_ZERO12_CSV = MEASUREMENTS_DIR / "tier2_lora_zero12_cpu.csv"
# LoRA under DeepSpeed ZeRO-1/2, client AdamW: the adapters alone flattened and partitioned. Reduce buckets of a
# few thousand elements (the adapters are 1-4k elements each), so that buckets flush several times a backward
# and some adapters bypass the bucket (larger than it). Same tuple as LORA_RUNS, then optionally a dict of further
# TrainSetup fields.
LORA_ZERO12_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 3000}, None,
     (8, None)),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 1000}, None,
     (8, None)),
    ("gpt2", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 5000}, None, (4, None)),
    ("gpt2", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 3000}, None, (4, None)),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 2, 64, "deepspeed",
     {"stage": 2, "reduce_bucket_size": 4000, "overlap_comm": True}, None,
     (8, ("q_proj", "k_proj", "v_proj", "o_proj"))),
    ("mistral-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 6000}, None,
     (16, ("gate_proj", "up_proj", "down_proj"))),
    ("opt-125m", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 2000}, None,
     (8, None)),
    ("qwen2.5-0.5b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 5000}, None,
     (8, None)),
    # built in bf16 (from_pretrained(dtype=bfloat16)): peft's adapters are fp32 until DeepSpeed casts them
    ("pythia-160m", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 3000}, None,
     (8, None), {"build_bf16": True}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "deepspeed",
     {"stage": 1, "reduce_bucket_size": 2000, "overlap_comm": True}, None,
     (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")), {"build_bf16": True}),
]

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ZERO0_DSOPT_CSV = MEASUREMENTS_DIR / "tier2_zero0_dsopt_cpu.csv"
# Same tuple as LORA_RUNS. Stage 0 wraps a JSON FusedAdam in bf16 in FP16_Optimizer (flat bf16 and fp32 groups) and
# a torch AdamW (`torch_adam`, or the client's) in FP16_UnfusedOptimizer; in fp32 it steps the optimizer as it is.
ZERO0_DSOPT_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 0}, FUSED_ADAMW, NO_LORA),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 0}, FUSED_ADAMW, NO_LORA),
    ("opt-125m", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 0}, FUSED_ADAMW, NO_LORA),
    ("qwen2.5-0.5b", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 0}, TORCH_ADAMW, NO_LORA),
    ("pythia-160m", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 0}, TORCH_ADAMW, NO_LORA),
    # LoRA with ZeRO stage 0: the client AdamW, then a JSON FusedAdam
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 0}, None, (8, None)),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 0}, None, (4, None)),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 0}, FUSED_ADAMW, (8, QV)),
    ("mistral-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 0}, FUSED_ADAMW, (16, None)),
    # LoRA with ZeRO-1/2 and a DeepSpeed "optimizer" section
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 3000}, FUSED_ADAMW,
     (8, None)),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 2000}, FUSED_ADAMW,
     (4, None)),
    ("opt-125m", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 4000}, TORCH_ADAMW,
     (8, None)),
    # built in bf16, short sequences and rank-64 adapters on every linear layer: the wrappers' buffers, not the
    # fp32 build or the activations, make the peak
    ("llama-2-7b", 2, "bf16", False, 1, 1, 16, "deepspeed", {"stage": 0}, FUSED_ADAMW, (64, ALL_LINEAR),
     {"build_bf16": True}),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 1, 16, "deepspeed", {"stage": 0}, None, (64, ALL_LINEAR),
     {"build_bf16": True}),
    ("mistral-7b", 2, "bf16", False, 1, 1, 16, "deepspeed", {"stage": 2, "reduce_bucket_size": 20000}, FUSED_ADAMW,
     (64, ALL_LINEAR), {"build_bf16": True}),
]


LEVERS_ZERO_CSV = MEASUREMENTS_DIR / "tier2_levers_zero_cpu.csv"
# Issue 5's levers under DeepSpeed ZeRO-0/1/2 with the client torch.optim.AdamW, alone and combined: same tuple as
# LEVERS_DDP_RUNS. Small reduce buckets, so that ZeRO-1/2 flush several times a backward and the LM head's gradient
# (made in the forward by Liger, in its own backward by TRL) bypasses the bucket or shares it.
LEVERS_ZERO_RUNS = [
    ("qwen2.5-0.5b", 2, "fp32", False, 1, 2, 128, "deepspeed", {"stage": 2, "reduce_bucket_size": 50000}, None,
     NO_LORA, {"loss": Loss.FUSED_LINEAR_CE}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 128, "deepspeed", {"stage": 2, "reduce_bucket_size": 300000}, None,
     NO_LORA, {"loss": Loss.CHUNKED_NLL, "loss_chunk": 500}),
    ("mistral-7b", 2, "fp32", True, 2, 2, 128, "deepspeed", {"stage": 2, "reduce_bucket_size": 100000}, None,
     NO_LORA, {"ckpt_offload": True}),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 128, "deepspeed", {"stage": 1, "reduce_bucket_size": 100000}, None,
     NO_LORA, {"loss": Loss.FUSED_LINEAR_CE}),
    ("qwen2.5-0.5b", 2, "fp32", False, 1, 2, 128, "deepspeed", {"stage": 1, "reduce_bucket_size": 400000}, None,
     NO_LORA, {"loss": Loss.CHUNKED_NLL, "loss_chunk": 1000}),
    ("gpt2", 2, "bf16", True, 1, 2, 128, "deepspeed", {"stage": 1, "reduce_bucket_size": 60000}, None, NO_LORA,
     {"ckpt_offload": True}),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 128, "deepspeed", {"stage": 0}, None, NO_LORA,
     {"loss": Loss.FUSED_LINEAR_CE}),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 128, "deepspeed", {"stage": 0}, None, NO_LORA,
     {"loss": Loss.CHUNKED_NLL}),
    ("mistral-7b", 2, "bf16", True, 1, 2, 128, "deepspeed", {"stage": 0}, None, NO_LORA, {"ckpt_offload": True}),
    # combinations
    ("llama-2-7b", 2, "bf16", True, 1, 2, 128, "deepspeed",
     {"stage": 2, "reduce_bucket_size": 200000, "overlap_comm": True}, None, NO_LORA,
     {"ckpt_offload": True, "loss": Loss.FUSED_LINEAR_CE}),
    ("mistral-7b", 2, "fp32", True, 1, 2, 128, "deepspeed", {"stage": 1, "reduce_bucket_size": 3000}, None,
     (8, None), {"ckpt_offload": True, "loss": Loss.CHUNKED_NLL, "loss_chunk": 700}),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 128, "deepspeed", {"stage": 0}, None, NO_LORA,
     {"ckpt_offload": True, "loss": Loss.FUSED_LINEAR_CE}),
    # Liger on an untied head at a shape whose peak is the forward/backward: its forward-made gradient is larger
    # than the bucket (reduced alone) under ZeRO-2, kept to the end of the backward under ZeRO-1
    ("llama-2-7b", 2, "fp32", False, 1, 2, 256, "deepspeed", {"stage": 2, "reduce_bucket_size": 100000}, None,
     NO_LORA, {"loss": Loss.FUSED_LINEAR_CE}),
    ("mistral-7b", 2, "fp32", False, 1, 2, 256, "deepspeed", {"stage": 1, "reduce_bucket_size": 500000}, None,
     NO_LORA, {"loss": Loss.FUSED_LINEAR_CE}),
    ("gpt2", 2, "fp32", True, 2, 2, 128, "deepspeed", {"stage": 0}, None, NO_LORA, {"ckpt_offload": True}),
]
OPTIM_ZERO_CSV = MEASUREMENTS_DIR / "tier2_optim_zero_cpu.csv"
# Same tuple as LEVERS_DDP_RUNS, DeepSpeed ZeRO-1/2/3 with the client optimizer of the levers' "optimizer". Short
# sequences and small reduce buckets, so that the optimizer step, not DeepSpeed's default 5e8-element bucket or the
# activations, makes or comes near each rank's peak.
OPT = "optimizer"
OPTIM_ZERO_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 50000}, None,
     NO_LORA, {OPT: Optimizer.ADAM}),
    ("gpt2", 2, "bf16", False, 1, 1, 32, "deepspeed", {"stage": 1, "reduce_bucket_size": 20000}, None, NO_LORA,
     {OPT: Optimizer.ADAM}),
    ("llama-2-7b", 2, "fp32", False, 1, 1, 32, "deepspeed", {"stage": 1, "reduce_bucket_size": 30000}, None, NO_LORA,
     {OPT: Optimizer.SGD}),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 40000}, None,
     NO_LORA, {OPT: Optimizer.SGD}),
    ("opt-125m", 2, "fp32", False, 1, 1, 32, "deepspeed",
     {"stage": 2, "reduce_bucket_size": 20000, "overlap_comm": True}, None, NO_LORA, {OPT: Optimizer.SGD_MOMENTUM}),
    ("pythia-160m", 2, "bf16", True, 1, 1, 32, "deepspeed", {"stage": 1, "reduce_bucket_size": 30000}, None,
     NO_LORA, {OPT: Optimizer.SGD_MOMENTUM}),
    ("gpt2", 2, "fp32", False, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 20000}, None, NO_LORA,
     {OPT: Optimizer.ADAFACTOR}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 32, "deepspeed", {"stage": 1, "reduce_bucket_size": 50000}, None,
     NO_LORA, {OPT: Optimizer.ADAFACTOR}),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 30000}, None,
     NO_LORA, {OPT: Optimizer.HF_ADAFACTOR}),
    ("mistral-7b", 2, "fp32", False, 1, 1, 32, "deepspeed", {"stage": 1, "reduce_bucket_size": 40000}, None,
     NO_LORA, {OPT: Optimizer.HF_ADAFACTOR}),
    ("llama-2-7b", 2, "bf16", False, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 30000}, None,
     NO_LORA, {OPT: Optimizer.ADAMW_8BIT}),
    ("opt-125m", 2, "fp32", True, 1, 1, 32, "deepspeed", {"stage": 1, "reduce_bucket_size": 20000}, None, NO_LORA,
     {OPT: Optimizer.ADAMW_8BIT}),
    ("gpt2", 2, "fp32", False, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 25000}, None, NO_LORA,
     {OPT: Optimizer.PAGED_ADAMW}),
    ("pythia-160m", 2, "bf16", False, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 20000}, None,
     NO_LORA, {OPT: Optimizer.PAGED_ADAMW_8BIT}),
    # LoRA: the optimizer steps the adapters' flat partition (8-bit states under min_8bit_size: 32-bit)
    ("llama-2-7b", 2, "bf16", False, 1, 1, 32, "deepspeed", {"stage": 2, "reduce_bucket_size": 3000}, None,
     (8, None), {OPT: Optimizer.HF_ADAFACTOR}),
    # ZeRO-3: one fp32 vector per sub-group
    ("llama-2-7b", 2, "fp32", False, 1, 1, 32, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 50000, "stage3_prefetch_bucket_size": 20000}, None, NO_LORA,
     {OPT: Optimizer.ADAFACTOR}),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 1, 32, "deepspeed",
     {"stage": 3, "sub_group_size": 50000, "reduce_bucket_size": 50000}, None, NO_LORA, {OPT: Optimizer.HF_ADAFACTOR}),
    ("gpt2", 2, "bf16", True, 1, 1, 32, "deepspeed", {"stage": 3, "reduce_bucket_size": 50000}, None, NO_LORA,
     {OPT: Optimizer.ADAMW_8BIT}),
    ("pythia-160m", 2, "bf16", False, 1, 1, 32, "deepspeed", {"stage": 3, "reduce_bucket_size": 50000}, None,
     NO_LORA, {OPT: Optimizer.ADAM}),
    ("llama-2-7b", 2, "fp32", False, 1, 1, 32, "deepspeed",
     {"stage": 3, "sub_group_size": 5000, "reduce_bucket_size": 50000}, None, NO_LORA,
     {OPT: Optimizer.PAGED_ADAMW_8BIT}),
    ("mistral-7b", 2, "bf16", False, 1, 1, 32, "deepspeed", {"stage": 3, "reduce_bucket_size": 30000}, None,
     NO_LORA, {OPT: Optimizer.SGD}),
    ("gpt2", 2, "fp32", False, 1, 1, 32, "deepspeed", {"stage": 3, "reduce_bucket_size": 20000}, None, NO_LORA,
     {OPT: Optimizer.PAGED_ADAMW}),
    ("qwen2.5-0.5b", 2, "fp32", False, 1, 1, 32, "deepspeed", {"stage": 3, "reduce_bucket_size": 20000}, None,
     (8, None), {OPT: Optimizer.ADAMW_8BIT}),
    ("llama-2-7b", 2, "fp32", True, 1, 1, 32, "deepspeed",
     {"stage": 3, "sub_group_size": 40000, "reduce_bucket_size": 50000}, None, NO_LORA, {OPT: Optimizer.SGD_MOMENTUM}),
    # LoRA adapters of 512-element partitions in sub-groups of 3,072: under min_8bit_size, bitsandbytes' 32-bit states
    ("llama-2-7b", 2, "bf16", False, 1, 1, 32, "deepspeed",
     {"stage": 3, "sub_group_size": 3000, "reduce_bucket_size": 50000}, None, (8, None),
     {OPT: Optimizer.PAGED_ADAMW_8BIT}),
]
# Measured twice, its rows are in data/measurements/pending/tier2_optim_zero_gloo_timing_cpu.csv: one rank holds
# gloo's reduce-scatter clone (112,512 B) at its peak, rank 0 in one run and rank 1 in the other (pending/README.md).
OPTIM_ZERO_PENDING = [
    ("opt-125m", 2, "fp32", False, 1, 1, 32, "deepspeed",
     {"stage": 3, "sub_group_size": 40000, "reduce_bucket_size": 50000}, None, NO_LORA, {OPT: Optimizer.SGD_MOMENTUM}),
]
DEEPSPEED_TESTED = (Optimizer.ADAMW, Optimizer.ADAM)  # deepspeed/runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS

GA_ZERO_CSV = MEASUREMENTS_DIR / "tier2_ga_zero_cpu.csv"
# Gradient accumulation under DeepSpeed ZeRO-0/1/2/3 with the client torch.optim.AdamW: the JSON's
# gradient_accumulation_steps = grad_accum, and the script calls forward, engine.backward and engine.step every
# micro-step (the engine steps at the boundary). Same tuple as LEVERS_DDP_RUNS. Default and small reduce buckets,
# overlap_comm (stage 1 reduces in its hooks at the boundary only), and shapes whose peak is the step or the
# backward's second grads_in_partition (stage 2).
GA2, GA3 = {"grad_accum": 2}, {"grad_accum": 3}
GA_ZERO_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 2}, None, NO_LORA, GA2),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "deepspeed", small_buckets(2), None, NO_LORA, GA3),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 1}, None, NO_LORA, GA2),
    ("opt-125m", 2, "fp32", False, 1, 2, 64, "deepspeed", {**small_buckets(1), "overlap_comm": True}, None, NO_LORA,
     GA3),
    ("mistral-7b", 2, "fp32", True, 1, 2, 64, "deepspeed", small_buckets(1), None, NO_LORA, GA2),
    ("pythia-160m", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 2, "overlap_comm": True}, None, NO_LORA,
     GA2),
    ("llama-2-7b", 2, "bf16", True, 1, 1, 16, "deepspeed", small_buckets(2), None, NO_LORA, GA3, WIDE_VOCAB),
    ("llama-2-7b", 2, "fp32", True, 1, 1, 16, "deepspeed", small_buckets(1), None, NO_LORA, GA2, WIDE_VOCAB),
    ("qwen2.5-0.5b", 2, "fp32", True, 1, 1, 16, "deepspeed", {**small_buckets(2), "overlap_comm": True}, None,
     NO_LORA, GA2, (112, 2, 12000, 7)),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 1, 16, "deepspeed", {**small_buckets(1), "overlap_comm": True}, None,
     NO_LORA, GA3, (112, 2, 12000, 7)),
    # ZeRO-0: the gradients accumulate on the parameters; the engine all-reduces at the boundary only
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 0}, None, NO_LORA, GA2),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 0}, None, NO_LORA, GA3),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 1, 16, "deepspeed", {"stage": 0}, None, NO_LORA, GA2, (112, 2, 12000, 7)),
    ("mistral-7b", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 0}, None, NO_LORA, GA3),
    # ZeRO-3: every backward reduce-scatters into the persistent grad_partitions_flat_buffer (copied at the first
    # micro-step, added into after it) and sets `.grad` to None
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", small_buckets(3), None, NO_LORA, GA2),
    ("gpt2", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 3}, None, NO_LORA, GA3),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 64, "deepspeed", small_buckets(3), None, NO_LORA, GA2),
    ("opt-125m", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 3, "reduce_bucket_size": 40000}, None, NO_LORA,
     GA3),
    # LoRA with accumulation (what most LoRA recipes run), predicted before measured
    # (experiments/measure_tier2_lora_ga.out)
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 2}, None, (8, None), GA2),
    ("gpt2", 2, "fp32", True, 1, 2, 64, "deepspeed", small_buckets(1), None, (8, None), GA3),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 0}, None, (16, None), GA2),
    ("mistral-7b", 2, "bf16", False, 1, 2, 64, "deepspeed", small_buckets(3), None, (8, None), GA2),
    ("llama-2-7b", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 3}, None, (16, None), GA3),
    ("opt-125m", 2, "bf16", False, 1, 2, 64, "deepspeed", {**small_buckets(2), "overlap_comm": True}, None, (8, None),
     GA2),
]


ZERO_EXTRAS_CSV = MEASUREMENTS_DIR / "tier2_zero_extras_cpu.csv"
LM_HEAD = {"lora_modules_to_save": ("lm_head",)}
# Issue 5's levers DeepSpeed still refused (same tuple as LEVERS_DDP_RUNS): peft's modules_to_save and trainable
# tokens under ZeRO-0/1/2 (the copy and the delta are the only trainable parameters besides LoRA's: flattened,
# bucketed and stepped alone), checkpoint offload under ZeRO-3, and the loss levers, offload and peft's extras with
# a DeepSpeed "optimizer" section (FusedAdam, `torch_adam`).
ZERO_EXTRAS_RUNS = [
    # peft's extras, client AdamW
    ("gpt2", 2, "bf16", False, 1, 2, 64, "deepspeed", small_buckets(2), None, (4, None), LM_HEAD),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", small_buckets(1), None, NO_LORA,
     {"trainable_tokens": (0, 1, 2)}),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 2, 64, "deepspeed", {"stage": 2, "reduce_bucket_size": 4000}, None,
     (8, None), {"trainable_tokens": (5, 7)}),
    ("llama-2-7b", 2, "bf16", False, 1, 2, 64, "deepspeed", {"stage": 0}, None, (8, None), LM_HEAD),
    ("gpt2", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 0}, None, NO_LORA, {"trainable_tokens": (0, 1)}),
    ("mistral-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 1, "reduce_bucket_size": 3000}, None,
     (8, None), {"lora_modules_to_save": ("input_layernorm",)}),
    ("opt-125m", 2, "bf16", False, 1, 2, 64, "deepspeed", small_buckets(1), None, NO_LORA,
     {"trainable_tokens": (3, 4, 5)}),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 64, "deepspeed",
     {"stage": 2, "reduce_bucket_size": 50000, "overlap_comm": True}, None, (8, None),
     {"lora_modules_to_save": ("embed_tokens",)}),
    # checkpoint offload under ZeRO-3
    ("llama-2-7b", 2, "fp32", True, 1, 2, 128, "deepspeed", small_buckets(3), None, NO_LORA, {"ckpt_offload": True}),
    ("qwen2.5-0.5b", 2, "bf16", True, 2, 2, 128, "deepspeed", small_buckets(3), None, NO_LORA,
     {"ckpt_offload": True}),
    ("qwen2.5-0.5b", 2, "bf16", True, 1, 2, 64, "deepspeed",
     {"stage": 3, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0}, None,
     (8, ("q_proj", "k_proj", "v_proj", "o_proj")), {"ckpt_offload": True}),
    ("gpt2", 2, "fp32", True, 1, 2, 64, "deepspeed", {"stage": 3, "reduce_bucket_size": 50000}, None, (4, None),
     {"ckpt_offload": True}),
    # a DeepSpeed "optimizer" section
    ("llama-2-7b", 2, "fp32", False, 1, 2, 128, "deepspeed", {"stage": 2, "reduce_bucket_size": 100000},
     FUSED_ADAMW, NO_LORA, {"loss": Loss.FUSED_LINEAR_CE}),
    ("qwen2.5-0.5b", 2, "bf16", False, 1, 2, 128, "deepspeed", {"stage": 1, "reduce_bucket_size": 400000},
     TORCH_ADAMW, NO_LORA, {"loss": Loss.CHUNKED_NLL, "loss_chunk": 1000}),
    ("mistral-7b", 2, "bf16", True, 1, 2, 128, "deepspeed", {"stage": 0}, FUSED_ADAMW, NO_LORA,
     {"ckpt_offload": True}),
    ("gpt2", 2, "bf16", False, 1, 2, 64, "deepspeed", small_buckets(2), FUSED_ADAMW, (4, None), LM_HEAD),
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64, "deepspeed", {"stage": 0}, TORCH_ADAMW, NO_LORA,
     {"trainable_tokens": (0, 1, 2)}),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 128, "deepspeed", {"stage": 1, "reduce_bucket_size": 100000},
     FUSED_ADAMW, NO_LORA, {"ckpt_offload": True, "loss": Loss.FUSED_LINEAR_CE}),
]

def measure(runs: list[tuple], out: Path, timeout: int, label: str = "") -> int:
    """Measure each run (failures are reported and skipped); append the rank rows to `out`; the failures."""
    failures = 0
    for run in runs:
        model, world, precision, ckpt, every, mb, seq, strategy, zero = run[:9]
        optimizer = run[9] if len(run) > 9 else None
        lora_rank, lora_targets = run[10] if len(run) > 10 else (0, None)
        levers = run[11] if len(run) > 11 else {}
        shape = run[12] if len(run) > 12 else SHAPES[model]  # (hidden, layers, vocab, heads) other than SHAPES'
        spec = load_model_spec(model, shrink(model, *shape))
        attention = Attention.EAGER if model.startswith("bloom") else None
        setup = TrainSetup(mb, seq, Precision(precision), attention, ckpt, every, lora_rank=lora_rank,
                           lora_targets=lora_targets, **levers)
        deepspeed = None
        if zero is not None:
            config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": setup.grad_accum,
                      "zero_optimization": zero, "bf16": {"enabled": precision == "bf16"}}
            if optimizer is not None:
                config["optimizer"] = optimizer
            if zero.get("stage", 0) > 0 and setup.optimizer not in DEEPSPEED_TESTED:
                config["zero_allow_untested_optimizer"] = True  # else DeepSpeed refuses it (engine.py)
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(config, f)
            deepspeed = load_ds_config(f.name, world, shape[0], mb, Precision(precision))
        layout = Layout(Strategy(strategy), world, deepspeed)
        try:
            rows = measure_distributed(spec, setup, layout, timeout)
        except LaunchFailure as exc:
            failures += 1
            print(f"FAILED{label} {model} {strategy} {zero} x{world}: {exc}", flush=True)
            continue
        append_rows(rows, out)
        print(f"{label}{model}", strategy, zero, world, precision, [r["peak_allocated_bytes"] for r in rows],
              rows[0]["wall_s"], flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None,
                        help=f"CSV to append to (default {TIER2_CSV}, with --zero3 {ZERO3_CSV})")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--only", type=int, nargs="*", help="indices into RUNS, or ZERO3_RUNS (default: all)")
    parser.add_argument("--ds-optimizer", action="store_true",
                        help=f"run DS_OPTIMIZER_RUNS (a DeepSpeed \"optimizer\" section) into {DS_OPTIMIZER_CSV}")
    parser.add_argument("--lora", action="store_true", help=f"run LORA_RUNS (LoRA under DDP, ZeRO-3) into {LORA_CSV}")
    parser.add_argument("--levers-ddp", action="store_true",
                        help=f"run LEVERS_DDP_RUNS (issue 5's levers under DDP) into {LEVERS_DDP_CSV}")
    parser.add_argument("--levers-zero", action="store_true",
                        help=f"run LEVERS_ZERO_RUNS (issue 5's levers under ZeRO-0/1/2) into {LEVERS_ZERO_CSV}")
    parser.add_argument("--lora-zero12", action="store_true",
                        help=f"run LORA_ZERO12_RUNS (LoRA under ZeRO-1/2) into {LORA_ZERO12_CSV}")
    parser.add_argument("--zero0-dsopt", action="store_true",
                        help=f"run ZERO0_DSOPT_RUNS (ZeRO-0 with a DeepSpeed optimizer, LoRA) into {ZERO0_DSOPT_CSV}")
    parser.add_argument("--fused", action="store_true",
                        help=f"run FUSED_RUNS (torch.optim fused=True under DDP and ZeRO) into {FUSED_CSV}")
    parser.add_argument("--optim-zero", action="store_true",
                        help=f"run OPTIM_ZERO_RUNS (other client optimizers under ZeRO-1/2/3) into {OPTIM_ZERO_CSV}")
    parser.add_argument("--zero-extras", action="store_true",
                        help=f"run ZERO_EXTRAS_RUNS (peft's extras, ZeRO-3 offload, levers with a DeepSpeed "
                             f"optimizer) into {ZERO_EXTRAS_CSV}")
    parser.add_argument("--ga-zero", action="store_true",
                        help=f"run GA_ZERO_RUNS (gradient accumulation under ZeRO-0/1/2/3) into {GA_ZERO_CSV}")
    parser.add_argument("--zero3-heldout", action="store_true", help=f"run ZERO3_HELDOUT into {ZERO3_HELDOUT_CSV}")
    parser.add_argument("--zero3", action="store_true",
                        help="run ZERO3_RUNS and then ZERO3_REPEATS again (DeepSpeed ZeRO stage 3) instead of RUNS")
    args = parser.parse_args()
    runs, default_out = ((LORA_RUNS, LORA_CSV) if args.lora
                         else (LEVERS_DDP_RUNS, LEVERS_DDP_CSV) if args.levers_ddp
                         else (LORA_ZERO12_RUNS, LORA_ZERO12_CSV) if args.lora_zero12
                         else (LEVERS_ZERO_RUNS, LEVERS_ZERO_CSV) if args.levers_zero
                         else (OPTIM_ZERO_RUNS, OPTIM_ZERO_CSV) if args.optim_zero
                         else (DS_OPTIMIZER_RUNS, DS_OPTIMIZER_CSV) if args.ds_optimizer
                         else (ZERO0_DSOPT_RUNS, ZERO0_DSOPT_CSV) if args.zero0_dsopt
                         else (FUSED_RUNS, FUSED_CSV) if args.fused
                         else (ZERO_EXTRAS_RUNS, ZERO_EXTRAS_CSV) if args.zero_extras
                         else (GA_ZERO_RUNS, GA_ZERO_CSV) if args.ga_zero
                         else (ZERO3_HELDOUT, ZERO3_HELDOUT_CSV) if args.zero3_heldout
                         else (ZERO3_RUNS, ZERO3_CSV) if args.zero3 else (RUNS, TIER2_CSV))
    out = args.out or default_out
    chosen = [i for i in range(len(runs)) if args.only is None or i in args.only]
    failures = measure([runs[i] for i in chosen], out, args.timeout)
    if args.zero3:
        failures += measure([runs[i] for i in ZERO3_REPEATS if i in chosen], out, args.timeout, "repeat ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
