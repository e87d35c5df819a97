"""Tier-1 measurement matrix: real canonical steps of shrunken zoo models on this CPU.

Writes data/measurements/tier1_cpu.csv (one row per run). Run: python experiments/measure_tier1.py
Each row re-predicts with `llmsim validate`; tests/test_validate.py asserts every row is within 1 %.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from llmsim.enums import Attention, Loss, Optimizer, Precision
from llmsim.measure.runs import MEASUREMENTS_DIR, TIER1_CSV, append_rows, measure_single
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink

# (zoo model, hidden, layers, vocab, heads): architectures of every family in the zoo, small enough for 2 cores.
MODELS = [
    ("llama-2-7b", 128, 4, 2000, 4),
    ("llama-3.1-8b", 96, 5, 1024, 6),
    ("mistral-7b", 128, 4, 1536, 8),
    ("qwen2.5-0.5b", 112, 3, 3000, 7),
    ("gpt2", 128, 3, 1024, 4),
    ("pythia-160m", 128, 4, 2048, 4),
    ("opt-125m", 96, 4, 1280, 4),
    ("bloom-560m", 64, 3, 2048, 4),
    ("codegen-350m-mono", 128, 3, 1024, 4),
]
# (micro_batch, seq_len, precision, attention, grad_ckpt, ckpt_every), each run on every model.
SETUPS = [
    (1, 32, "fp32", "sdpa", False, 1),
    (4, 256, "bf16", "sdpa", True, 1),
    (2, 512, "bf16-autocast", "eager", True, 2),
    (8, 128, "fp32", "eager", True, 1),
    (2, 1024, "bf16", "sdpa", False, 1),
    (3, 200, "fp32", "sdpa", True, 2),
]


# LoRA (peft) on a frozen base, with and without checkpointing, fp32 and bf16 (also built directly in bf16):
# (zoo model, micro_batch, seq_len, precision, attention, grad_ckpt, ckpt_every, lora_rank, targets, build_bf16)
LORA_RUNS = [
    ("llama-2-7b", 2, 128, "fp32", "sdpa", False, 1, 8, None, False),
    ("llama-3.1-8b", 4, 96, "bf16", "sdpa", True, 1, 16, None, True),
    ("mistral-7b", 1, 256, "bf16", "eager", True, 2, 4, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    ("qwen2.5-0.5b", 2, 200, "bf16-autocast", "sdpa", False, 1, 8, None, False),
    ("gpt2", 3, 64, "fp32", "eager", True, 1, 8, None, False),
    ("pythia-160m", 2, 128, "bf16", "sdpa", False, 1, 32, None, True),
    ("opt-125m", 8, 64, "fp32", "sdpa", False, 1, 8, ("q_proj", "v_proj", "fc1"), False),
    ("bloom-560m", 2, 96, "bf16", "eager", True, 1, 8, None, False),
    ("codegen-350m-mono", 2, 64, "fp32", "sdpa", True, 1, 4, None, False),
]


# Other client optimizers (torch.optim, defaults; SGD at lr 1e-3): (zoo model, optimizer, precision, grad_ckpt)
OPTIMIZER_RUNS = [
    ("llama-2-7b", "sgd", "fp32", False), ("gpt2", "sgd-momentum", "bf16", True),
    ("qwen2.5-0.5b", "adam", "bf16-autocast", False), ("pythia-160m", "sgd-momentum", "fp32", True),
    ("opt-125m", "sgd", "bf16", False), ("mistral-7b", "adam", "fp32", True),
]


# Adafactor (torch.optim, transformers) and bitsandbytes' 8-bit and paged AdamW, with their defaults; written to
# data/measurements/tier1_optim_cpu.csv: (zoo model, optimizer, precision, grad_ckpt, micro_batch, seq_len)
MORE_OPTIMIZER_RUNS = [
    ("llama-2-7b", "adafactor", "fp32", False, 2, 128), ("gpt2", "adafactor", "bf16", True, 1, 32),
    ("qwen2.5-0.5b", "adafactor", "bf16-autocast", True, 2, 96), ("opt-125m", "adafactor", "fp32", True, 1, 32),
    ("bloom-560m", "adafactor", "bf16", False, 2, 64), ("opt-125m", "adafactor", "fp16-autocast", False, 2, 64),
    ("mistral-7b", "hf-adafactor", "fp32", False, 2, 128), ("gpt2", "hf-adafactor", "bf16", False, 1, 32),
    ("pythia-160m", "hf-adafactor", "bf16-autocast", True, 2, 64),
    ("llama-3.1-8b", "hf-adafactor", "bf16", True, 1, 32), ("codegen-350m-mono", "hf-adafactor", "fp32", True, 2, 64),
    ("llama-2-7b", "adamw8bit", "bf16", True, 1, 32), ("opt-125m", "adamw8bit", "bf16-autocast", False, 2, 128),
    ("qwen2.5-0.5b", "adamw8bit", "fp32", True, 2, 64), ("bloom-560m", "adamw8bit", "fp32", False, 1, 64),
    ("llama-2-7b", "adamw8bit", "fp16-autocast", True, 2, 64),
    ("mistral-7b", "paged-adamw", "bf16", True, 1, 32), ("gpt2", "paged-adamw", "bf16-autocast", False, 2, 64),
    ("llama-3.1-8b", "paged-adamw", "fp32", False, 2, 64),
    ("pythia-160m", "paged-adamw8bit", "bf16", False, 2, 128),
    ("codegen-350m-mono", "paged-adamw8bit", "bf16-autocast", True, 1, 64),
    ("llama-2-7b", "paged-adamw8bit", "fp32", True, 2, 96),
]
TIER1_OPTIM_CSV = TIER1_CSV.parent / "tier1_optim_cpu.csv"


def more_optimizer_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, optimizer, precision, ckpt, mb, seq in MORE_OPTIMIZER_RUNS:
        yield model, shapes[model], TrainSetup(mb, seq, Precision(precision), None, ckpt,
                                               optimizer=Optimizer(optimizer))


# float16, cast (`model.half()`) and torch AMP (autocast + GradScaler), the precision of GPUs without bf16 (V100):
# (zoo model, micro_batch, seq_len, precision, attention, grad_ckpt)
FP16_RUNS = [
    ("llama-2-7b", 2, 128, "fp16", "sdpa", False), ("llama-2-7b", 2, 128, "fp16-autocast", "sdpa", True),
    ("opt-125m", 4, 256, "fp16-autocast", "eager", True), ("opt-125m", 2, 64, "fp16", "sdpa", True),
    ("bloom-560m", 2, 128, "fp16-autocast", "eager", False), ("codegen-350m-mono", 3, 96, "fp16", "eager", True),
    ("codegen-350m-mono", 2, 128, "fp16-autocast", "sdpa", False), ("qwen2.5-0.5b", 1, 200, "fp16", "sdpa", False),
    ("gpt2", 2, 64, "fp16-autocast", "sdpa", True), ("mistral-7b", 2, 96, "fp16-autocast", "eager", False),
]


# Gradient accumulation (`loss / n; loss.backward()` n times per optimizer step):
# (zoo model, micro_batch, seq_len, precision, grad_ckpt, grad_accum)
GRAD_ACCUM_RUNS = [
    ("llama-2-7b", 2, 128, "fp32", False, 2), ("gpt2", 4, 64, "bf16", True, 4),
    ("mistral-7b", 1, 256, "bf16-autocast", True, 3), ("opt-125m", 2, 128, "fp16-autocast", False, 2),
    ("qwen2.5-0.5b", 3, 96, "bf16", False, 2), ("pythia-160m", 1, 128, "fp32", True, 8),
]


def grad_accum_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, mb, seq, precision, ckpt, accum in GRAD_ACCUM_RUNS:
        yield model, shapes[model], TrainSetup(mb, seq, Precision(precision), None, ckpt, grad_accum=accum)


# QLoRA: a bitsandbytes 4-bit base loaded from a checkpoint, prepare_model_for_kbit_training, LoRA:
# (zoo model, micro_batch, seq_len, precision, grad_ckpt, quant, double_quant, lora_rank)
QLORA_RUNS = [
    ("llama-2-7b", 2, 128, "fp32", False, "nf4", True, 8),
    ("llama-2-7b", 2, 128, "bf16-autocast", True, "nf4", False, 16),
    ("mistral-7b", 1, 256, "fp32", True, "fp4", True, 8),
    ("qwen2.5-0.5b", 2, 96, "bf16-autocast", False, "nf4", True, 4),
    ("opt-125m", 4, 64, "fp32", False, "fp4", False, 8),
    ("llama-3.1-8b", 2, 64, "bf16-autocast", True, "nf4", True, 32),
]


# An 8-bit (LLM.int8) base: BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold), prepare_model_for_kbit_training,
# LoRA; to data/measurements/tier1_int8_cpu.csv. The threshold varied (6.0: bitsandbytes' default; 0.0: no outlier
# split) and two runs differ by it alone: a CPU training step runs MatMul8bitFp, which never reads it.
# (zoo model, micro_batch, seq_len, precision, grad_ckpt, lora_rank, llm_int8_threshold)
INT8_CSV = TIER1_CSV.parent / "tier1_int8_cpu.csv"
INT8_RUNS = [
    ("llama-2-7b", 2, 128, "fp32", False, 8, 6.0), ("llama-2-7b", 2, 128, "fp32", False, 8, 0.0),
    ("llama-2-7b", 2, 128, "bf16-autocast", True, 16, 0.0), ("mistral-7b", 1, 256, "fp32", True, 8, 6.0),
    ("qwen2.5-0.5b", 2, 96, "bf16-autocast", False, 8, 6.0), ("gpt2", 3, 64, "fp32", True, 16, 0.0),
    ("opt-125m", 4, 64, "fp32", False, 8, 6.0), ("pythia-160m", 2, 128, "bf16-autocast", True, 8, 6.0),
    ("llama-3.1-8b", 2, 64, "bf16-autocast", True, 16, 6.0), ("bloom-560m", 2, 96, "fp32", False, 8, 0.0),
    ("codegen-350m-mono", 2, 64, "fp32", True, 16, 6.0), ("gpt2", 2, 128, "bf16-autocast", False, 8, 6.0),
]


def int8_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, mb, seq, precision, ckpt, rank, threshold in INT8_RUNS:
        yield model, shapes[model], TrainSetup(mb, seq, Precision(precision), None, ckpt, lora_rank=rank,
                                               quant="int8", int8_threshold=threshold)


# Checkpointing with offload (`activation_checkpointing_enable(every_n_layers, offload=True)`, llmsim/model/offload.py):
# device and host peaks, to data/measurements/tier1_offload_cpu.csv.
# (zoo model, micro_batch, seq_len, precision, attention, ckpt_every, lora_rank)
OFFLOAD_CSV = TIER1_CSV.parent / "tier1_offload_cpu.csv"
OFFLOAD_RUNS = [
    ("llama-2-7b", 2, 128, "fp32", "sdpa", 1, 0), ("llama-2-7b", 4, 256, "bf16", "sdpa", 2, 0),
    ("llama-3.1-8b", 2, 200, "bf16-autocast", "sdpa", 1, 0), ("mistral-7b", 1, 256, "bf16-autocast", "eager", 2, 0),
    ("qwen2.5-0.5b", 3, 96, "bf16", "sdpa", 1, 0), ("gpt2", 2, 128, "fp32", "eager", 1, 0),
    ("gpt2", 4, 64, "bf16-autocast", "sdpa", 2, 0), ("pythia-160m", 2, 256, "bf16", "sdpa", 1, 0),
    ("opt-125m", 8, 64, "fp32", "eager", 2, 0), ("bloom-560m", 2, 128, "bf16-autocast", "eager", 1, 0),
    ("codegen-350m-mono", 3, 128, "fp32", "sdpa", 2, 0), ("llama-2-7b", 1, 512, "fp16-autocast", "sdpa", 1, 0),
    ("qwen2.5-0.5b", 2, 128, "bf16", "sdpa", 1, 8),
]
# Deeper than the trace (3 layers or groups), so the replicated layers are checked against a real run:
# (zoo model, (hidden, layers, vocab, heads), micro_batch, seq_len, precision, attention, ckpt_every)
OFFLOAD_DEEP_RUNS = [
    ("llama-2-7b", (64, 10, 256, 4), 2, 64, "bf16", "sdpa", 2),
    ("gpt2", (64, 9, 256, 4), 2, 64, "bf16-autocast", "eager", 1),
]


def offload_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, mb, seq, precision, attn, every, rank in OFFLOAD_RUNS:
        yield model, shapes[model], TrainSetup(mb, seq, Precision(precision), Attention(attn), True, every,
                                               lora_rank=rank, ckpt_offload=True)
    for model, shape, mb, seq, precision, attn, every in OFFLOAD_DEEP_RUNS:
        yield model, shape, TrainSetup(mb, seq, Precision(precision), Attention(attn), True, every, ckpt_offload=True)


# The loss levers (llmsim/model/losses.py): TRL's chunked NLL (vocabulary tiles; None = TRL's 32768) and the imitation
# of Liger's fused linear cross-entropy (its own token-chunk rule), next to transformers' loss for the savings:
# (zoo model, micro_batch, seq_len, precision, grad_ckpt, loss, loss_chunk, extra TrainSetup fields)
LOSS_CSV = MEASUREMENTS_DIR / "tier1_loss_cpu.csv"
LOSS_RUNS = [
    ("llama-2-7b", 2, 128, "fp32", False, "hf", None, {}),
    ("llama-2-7b", 2, 128, "fp32", False, "fused-linear-ce", None, {}),
    ("llama-2-7b", 2, 128, "fp32", False, "chunked-nll", 512, {}),
    ("mistral-7b", 2, 256, "bf16-autocast", True, "hf", None, {}),
    ("mistral-7b", 2, 256, "bf16-autocast", True, "fused-linear-ce", None, {}),
    ("mistral-7b", 2, 256, "bf16-autocast", True, "chunked-nll", 700, {}),
    ("qwen2.5-0.5b", 3, 200, "bf16", True, "fused-linear-ce", None, {}),
    ("qwen2.5-0.5b", 3, 200, "bf16-autocast", False, "chunked-nll", 1000, {}),
    ("qwen2.5-0.5b", 2, 96, "fp32", True, "chunked-nll", None, {}),
    ("qwen2.5-0.5b", 2, 96, "fp32", True, "fused-linear-ce", None, {}),
    ("mistral-7b", 1, 256, "bf16", False, "chunked-nll", 700, {}),
    ("llama-3.1-8b", 4, 96, "bf16", True, "fused-linear-ce", None, {}),
    ("llama-3.1-8b", 3, 64, "bf16-autocast", False, "fused-linear-ce", None, {"grad_accum": 2}),
    ("gpt2", 4, 64, "fp32", True, "chunked-nll", 300, {}),
    ("gpt2", 2, 128, "bf16-autocast", False, "chunked-nll", None, {}),
    ("pythia-160m", 2, 128, "bf16", True, "chunked-nll", 1000, {}),
    ("opt-125m", 2, 64, "fp32", False, "chunked-nll", 333, {}),
    ("llama-2-7b", 2, 128, "bf16", False, "fused-linear-ce", None, {"lora_rank": 8}),
]


# peft's extras next to (or instead of) LoRA adapters: LoraConfig(modules_to_save=...) trains a deepcopy of each
# module, trainable tokens (LoraConfig's trainable_token_indices, or TrainableTokensConfig alone) some embedding
# rows; tied-embedding models (qwen2.5, gpt2, opt, bloom) included. Written to tier1_peft_cpu.csv:
# (zoo model, shape or None for MODELS', micro_batch, seq_len, precision, grad_ckpt, ckpt_every, lora_rank,
#  modules_to_save, trainable tokens, build_bf16)
PEFT_CSV = MEASUREMENTS_DIR / "tier1_peft_cpu.csv"
PEFT_RUNS = [
    ("llama-2-7b", None, 2, 128, "fp32", False, 1, 8, ("lm_head",), None, False),
    ("llama-2-7b", None, 2, 96, "bf16", True, 1, 8, ("input_layernorm", "embed_tokens"), None, False),
    ("llama-2-7b", None, 2, 128, "bf16-autocast", True, 1, 0, None, (0, 1, 2, 1999), False),
    ("qwen2.5-0.5b", None, 2, 96, "bf16-autocast", False, 1, 8, ("lm_head",), None, False),
    ("qwen2.5-0.5b", None, 2, 96, "fp32", True, 1, 8, ("embed_tokens",), None, False),
    ("qwen2.5-0.5b", None, 3, 64, "bf16", False, 1, 0, None, (5, 7, 11), False),
    ("qwen2.5-0.5b", None, 2, 64, "bf16", True, 1, 8, None, (0, 2999), True),
    ("gpt2", None, 2, 64, "bf16", True, 1, 0, None, (0, 1, 2, 50), False),
    ("gpt2", None, 2, 128, "fp32", False, 1, 8, None, (3, 4), False),
    ("gpt2", None, 4, 64, "bf16-autocast", True, 1, 8, ("ln_f",), (9,), False),
    ("mistral-7b", None, 1, 128, "bf16-autocast", True, 2, 4, ("lm_head",), (1, 2, 3), False),
    ("llama-3.1-8b", None, 2, 64, "bf16", True, 1, 16, ("norm", "lm_head"), None, True),
    ("pythia-160m", None, 2, 128, "fp32", True, 1, 0, None, (10, 20, 30), False),
    ("opt-125m", None, 2, 64, "bf16-autocast", False, 1, 8, ("lm_head",), None, False),
    ("bloom-560m", None, 2, 64, "fp32", False, 1, 8, None, (0, 1), False),
    ("codegen-350m-mono", None, 2, 64, "bf16", False, 1, 8, ("lm_head", "ln_f"), (7,), False),
    # deeper than the trace (3 layers or groups): the per-layer copies of input_layernorm replicated
    ("llama-2-7b", (64, 10, 256, 4), 2, 64, "bf16", True, 2, 8, ("input_layernorm", "lm_head"), (0, 255), False),
    ("gpt2", (64, 9, 256, 4), 2, 64, "fp32", False, 1, 4, ("ln_1",), None, False),
]


def peft_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, shape, mb, seq, precision, ckpt, every, rank, to_save, tokens, build_bf16 in PEFT_RUNS:
        yield model, shape or shapes[model], TrainSetup(mb, seq, Precision(precision), None, ckpt, every,
                                                        build_bf16=build_bf16, lora_rank=rank,
                                                        lora_modules_to_save=to_save, trainable_tokens=tokens)


def loss_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, mb, seq, precision, ckpt, loss, chunk, extra in LOSS_RUNS:
        yield model, shapes[model], TrainSetup(mb, seq, Precision(precision), None, ckpt, loss=Loss(loss),
                                               loss_chunk=chunk, **extra)


def qlora_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, mb, seq, precision, ckpt, quant, double_quant, rank in QLORA_RUNS:
        yield model, shapes[model], TrainSetup(mb, seq, Precision(precision), None, ckpt, lora_rank=rank,
                                               quant=quant, double_quant=double_quant)


def fp16_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, mb, seq, precision, attn, ckpt in FP16_RUNS:
        yield model, shapes[model], TrainSetup(mb, seq, Precision(precision), Attention(attn), ckpt)


# The optimizers' foreach path (torch's default for CUDA parameters, and so for every --gpu prediction): one list
# over all parameters, the embedding's, the final norm's and the LM head's among the layers'. Deeper than the
# trace, so the expansion replicates the layers' foreach temporaries; the peak falls in the optimizer step in fp32.
# (zoo model, (hidden, layers, vocab, heads), micro_batch, seq_len, precision, grad_ckpt, optimizer)
FOREACH_CSV = TIER1_CSV.parent / "tier1_foreach_cpu.csv"
FOREACH_RUNS = [
    ("llama-2-7b", (128, 6, 2000, 4), 2, 64, "fp32", False, "adamw"),
    ("llama-2-7b", (128, 4, 2000, 4), 2, 64, "bf16-autocast", True, "adamw"),
    ("mistral-7b", (128, 5, 1536, 8), 1, 128, "fp32", True, "adam"),
    ("qwen2.5-0.5b", (112, 5, 3000, 7), 2, 64, "bf16", False, "adamw"),
    ("gpt2", (128, 5, 1024, 4), 2, 64, "fp32", True, "sgd-momentum"),
    ("pythia-160m", (128, 6, 2048, 4), 2, 64, "fp16-autocast", False, "adamw"),
    ("opt-125m", (96, 5, 1280, 4), 2, 64, "fp32", False, "adamw"),
    ("llama-3.1-8b", (96, 5, 1024, 6), 2, 64, "bf16-autocast", False, "adafactor"),
]


def foreach_matrix():
    for model, shape, mb, seq, precision, ckpt, optimizer in FOREACH_RUNS:
        yield model, shape, TrainSetup(mb, seq, Precision(precision), None, ckpt, foreach=True,
                                       optimizer=Optimizer(optimizer))


# torch.optim's fused kernels (`fused=True`: `_fused_adamw_`, `_fused_adam_`, `_fused_sgd_`, which run on the CPU
# too): states created at the first step (AdamW's `step` a 0-dim fp32 tensor on the parameters' device), updated
# in place with no temporaries; under fp16-autocast the GradScaler hands the kernel `grad_scale` and `found_inf`
# instead of unscaling first. 1-3 steps, so the peak falls before, in and after the states' creation.
# (zoo model, (hidden, layers, vocab, heads), micro_batch, seq_len, precision, grad_ckpt, optimizer, steps)
FUSED_CSV = TIER1_CSV.parent / "tier1_fused_adamw_cpu.csv"
FUSED_RUNS = [
    ("llama-2-7b", (128, 6, 2000, 4), 2, 64, "fp32", False, "adamw", 3),
    ("llama-2-7b", (128, 4, 2000, 4), 2, 64, "bf16-autocast", True, "adamw", 3),
    ("qwen2.5-0.5b", (112, 5, 3000, 7), 2, 64, "bf16", False, "adamw", 3),
    ("llama-3.1-8b", (96, 5, 1024, 6), 2, 64, "fp32", False, "adamw", 1),
    ("mistral-7b", (128, 5, 1536, 8), 1, 128, "fp32", True, "adam", 3),
    ("opt-125m", (96, 5, 1280, 4), 2, 64, "bf16", True, "adam", 2),
    ("pythia-160m", (128, 6, 2048, 4), 2, 64, "fp16-autocast", False, "adamw", 3),
    ("bloom-560m", (64, 4, 2048, 4), 2, 64, "bf16-autocast", False, "adamw", 2),
    ("codegen-350m-mono", (128, 4, 1024, 4), 2, 64, "fp16", False, "adamw", 3),
    ("gpt2", (128, 5, 1024, 4), 2, 64, "fp32", True, "sgd-momentum", 3),
    ("gpt2", (128, 4, 1024, 4), 2, 64, "bf16", False, "sgd", 2),
]


def fused_matrix():
    for model, shape, mb, seq, precision, ckpt, optimizer, steps in FUSED_RUNS:
        attention = Attention.EAGER if model.startswith("bloom") else None  # BLOOM has no SDPA path
        yield model, shape, TrainSetup(mb, seq, Precision(precision), attention, ckpt, steps=steps, fused=True,
                                       optimizer=Optimizer(optimizer))


def optimizer_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, optimizer, precision, ckpt in OPTIMIZER_RUNS:
        yield model, shapes[model], TrainSetup(2, 128, Precision(precision), None, ckpt,
                                               optimizer=Optimizer(optimizer))


def lora_matrix():
    shapes = {name: shape for name, *shape in MODELS}
    for model, mb, seq, precision, attn, ckpt, every, rank, targets, build_bf16 in LORA_RUNS:
        setup = TrainSetup(mb, seq, Precision(precision), Attention(attn), ckpt, every, build_bf16=build_bf16,
                           lora_rank=rank, lora_targets=targets)
        yield model, shapes[model], setup


def matrix():
    for (model, *shape), setup in itertools.product(MODELS, SETUPS):
        yield model, shape, setup
    for model, *shape in MODELS[:6]:  # a second pass with other setups per model
        yield model, shape, (6, 64, "bf16-autocast", "sdpa", False, 1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--lora", action="store_true", help="only the LoRA runs")
    parser.add_argument("--optimizers", action="store_true", help="only the runs with other optimizers")
    parser.add_argument("--more-optimizers", action="store_true", help="only the Adafactor and bitsandbytes runs "
                        "(default --out: data/measurements/tier1_optim_cpu.csv)")
    parser.add_argument("--fp16", action="store_true", help="only the float16 runs")
    parser.add_argument("--grad-accum", action="store_true", help="only the gradient-accumulation runs")
    parser.add_argument("--qlora", action="store_true", help="only the QLoRA (4-bit base) runs")
    parser.add_argument("--int8", action="store_true", help="only the 8-bit (LLM.int8) base runs (to "
                        "tier1_int8_cpu.csv unless --out is given)")
    parser.add_argument("--ckpt-offload", action="store_true", help="only the checkpointing-with-offload runs "
                        "(to tier1_offload_cpu.csv unless --out is given)")
    parser.add_argument("--loss", action="store_true", help="only the loss-lever runs (TRL chunked NLL, Liger "
                        "fused linear CE), written to tier1_loss_cpu.csv unless --out is given")
    parser.add_argument("--peft-extras", action="store_true", help="only the runs with peft's modules_to_save and "
                        "trainable tokens, written to tier1_peft_cpu.csv unless --out is given")
    parser.add_argument("--foreach", action="store_true", help="only the optimizers' foreach runs (to "
                        "tier1_foreach_cpu.csv unless --out is given)")
    parser.add_argument("--fused", action="store_true", help="only the optimizers' fused runs (to "
                        "tier1_fused_adamw_cpu.csv unless --out is given)")
    args = parser.parse_args()
    args.out = args.out or (TIER1_OPTIM_CSV if args.more_optimizers else FOREACH_CSV if args.foreach
                            else FUSED_CSV if args.fused else INT8_CSV if args.int8
                            else OFFLOAD_CSV if args.ckpt_offload
                            else LOSS_CSV if args.loss else PEFT_CSV if args.peft_extras else TIER1_CSV)
    extra = (lora_matrix() if args.lora else optimizer_matrix() if args.optimizers
             else more_optimizer_matrix() if args.more_optimizers else foreach_matrix() if args.foreach
             else fused_matrix() if args.fused
             else fp16_matrix() if args.fp16 else grad_accum_matrix() if args.grad_accum
             else qlora_matrix() if args.qlora else int8_matrix() if args.int8
             else offload_matrix() if args.ckpt_offload
             else loss_matrix() if args.loss else peft_matrix() if args.peft_extras else None)
    if extra is not None:
        for model, shape, setup in extra:
            row = measure_single(load_model_spec(model, shrink(model, *shape)), setup)
            append_rows([row], args.out)
            print(model, setup, row["peak_allocated_bytes"], row["peak_host_bytes"], row["wall_s"], flush=True)
        return 0
    for model, (hidden, layers, vocab, heads), (mb, seq, precision, attn, ckpt, every) in matrix():
        spec = load_model_spec(model, shrink(model, hidden, layers, vocab, heads))
        if attn == "sdpa" and spec.config_dict["model_type"] == "bloom":
            attn = "eager"  # BLOOM has no SDPA path in transformers
        setup = TrainSetup(mb, seq, Precision(precision), Attention(attn), ckpt, every)
        row = measure_single(spec, setup)
        append_rows([row], args.out)
        print(model, mb, seq, precision, attn, ckpt, every, row["peak_allocated_bytes"], row["wall_s"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
