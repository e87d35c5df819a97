"""Tier 5: published GPU measurements, re-predicted. Each entry of experiments/published_gpu.yaml (its source,
quote and setup as the source states it, with the defaults read from the source's own configs) that llmsim can
model is predicted here with the setup written as the source's users wrote it; the rest are listed with the
reason they are not. The published figure is compared with the prediction's matching figure: peak allocated
(torch.cuda.max_memory_allocated) or, for NVML readings, the device total.
These are not validated rows: the runs used other library versions (transformers 4.4x, torch 2.4) and
flash_attention_2, where llmsim traces transformers 5.24's sdpa on the CUDA kernels torch picks; the errors say
how far llmsim's GPU figures are from real GPUs on fully stated setups until tier-4 rows exist.
Run: python experiments/published_gpu.py  (output in experiments/published_gpu.out; a few minutes on 2 cores)"""
from __future__ import annotations

from pathlib import Path

import yaml

import llmsim

HERE = Path(__file__).resolve().parent
GIB = 2**30
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def trainer_args(micro_batch: int, **extra) -> dict:
    # fms-hf-tuning's defaults.yaml: gradient checkpointing, no accumulation, adam_epsilon 1e-4, weight decay 0.01;
    # transformers 4.4x's default optim is adamw_torch and its checkpointing is reentrant
    return {"per_device_train_batch_size": micro_batch, "gradient_accumulation_steps": 1, "optim": "adamw_torch",
            "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True},
            "adam_epsilon": 1e-4, "weight_decay": 0.01, **extra}


def lora(rank: int, alpha: int, dropout: float, targets: list[str]) -> dict:
    return {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets, "bias": "none",
            "task_type": "CAUSAL_LM"}


NF4_BF16 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16"}

# entry id -> (llmsim.predict keywords, which published figures to compare: metric name -> GiB)
MODELLED = {
    "fms-pr14-mistral7b-fft-1gpu-fp16": dict(model="mistral-7b", seq_len=4096, gpu="a100-80gb", dtype="float16",
                                             training_args=trainer_args(4)),
    "fms-pr14-mistral7b-lora-1gpu-fp16": dict(model="mistral-7b", seq_len=4096, gpu="a100-80gb", dtype="float16",
                                              training_args=trainer_args(4), peft_config=lora(16, 16, 0.0, QKVO)),
    "fms-2025-mistral7b-fft-1gpu-bf16": dict(model="mistral-7b", seq_len=4096, gpu="a100-80gb", dtype="bfloat16",
                                             training_args=trainer_args(4)),
    "fms-2025-mistral7b-lora-1gpu-bf16-bs8": dict(model="mistral-7b", seq_len=4096, gpu="a100-80gb",
                                                  dtype="bfloat16", training_args=trainer_args(8),
                                                  peft_config=lora(16, 16, 0.1, QKVO)),
    # TRL's SFTTrainer (fms-hf-tuning) on a bitsandbytes base: prepare_model_for_kbit_training as TRL calls it
    "fms-2025-mistral7b-qlora-1gpu-bf16": dict(model="mistral-7b", seq_len=4096, gpu="a100-80gb", dtype="bfloat16",
                                               training_args=trainer_args(4, bf16=True),
                                               peft_config=lora(16, 16, 0.1, QKVO),
                                               quantization_config=NF4_BF16),
    "fms-2025-mistral7b-fft-1gpu-bf16-bs8": dict(model="mistral-7b", seq_len=4096, gpu="a100-80gb", dtype="bfloat16",
                                                 training_args=trainer_args(8)),
    # fms-acceleration's accelerated-peft-bnb plugin: the same BitsAndBytesConfig, its own prepare (freeze, input
    # grads, checkpointing; no fp32 upcast), get_peft_model, then SFTTrainer with no peft_config
    "fms-2025-mistral7b-qlora-accelpeft-1gpu-bf16": dict(model="mistral-7b", seq_len=4096, gpu="a100-80gb",
                                                         dtype="bfloat16", training_args=trainer_args(4, bf16=True),
                                                         peft_config=lora(16, 16, 0.1, [*QKVO, "c_attn"]),
                                                         quantization_config=NF4_BF16, no_kbit_prep=True),
    "fms-2025-llama2-70b-qlora-accelpeft-1gpu-bf16": dict(model="llama-2-70b", seq_len=4096, gpu="a100-80gb",
                                                          dtype="bfloat16", training_args=trainer_args(4, bf16=True),
                                                          peft_config=lora(16, 16, 0.1, [*QKVO, "c_attn"]),
                                                          quantization_config=NF4_BF16, no_kbit_prep=True),
}
# the same source's row of a setup at the other batch size (the entry's other_metrics): another point on its slope
EXTRA = {"fms-2025-mistral7b-lora-1gpu-bf16-bs4": ("fms-2025-mistral7b-lora-1gpu-bf16-bs8",
                                                   dict(training_args=trainer_args(4)), 26704571904 / GIB,
                                                   29576 / 1024),
         "fms-2025-mistral7b-qlora-1gpu-bf16-bs8": ("fms-2025-mistral7b-qlora-1gpu-bf16",
                                                    dict(training_args=trainer_args(8, bf16=True)),
                                                    37002646016 / GIB, 46050 / 1024),
         "fms-2025-mistral7b-qlora-accelpeft-1gpu-bf16-bs8": ("fms-2025-mistral7b-qlora-accelpeft-1gpu-bf16",
                                                              dict(training_args=trainer_args(8, bf16=True)),
                                                              28412178944 / GIB, 34016 / 1024)}
# runs the source reports out of memory (no figure): the setup of the named entry with the model or batch changed
OOM = {"fms-2025 baseline-peft-bnb, Llama-2-70B, micro-batch 4": ("fms-2025-mistral7b-qlora-1gpu-bf16",
                                                                   dict(model="llama-2-70b")),
       "fms-2025 accelerated-peft-bnb, Llama-2-70B, micro-batch 8": ("fms-2025-llama2-70b-qlora-accelpeft-1gpu-bf16",
                                                                     dict(training_args=trainer_args(8, bf16=True)))}
NOT_MODELLED = {
    "fsdp": "FSDP through the Trainer (accelerate's FSDP1) is not modelled: llmsim's FSDP2 covers the canonical step "
            "only, and no quantized base",
    "qlora-trainer": "QLoRA through the Trainer (BitsAndBytesConfig) under several ranks is not modelled yet",
    "variable": "variable-length batches and evaluation inside the measured window",
    "torchtune": "torchtune's own model code, NF4 via torchao, its activation offloading and chunked loss",
    "unknown": "the metric or the GPU is not stated",
    "fp16-amp": "refused by llmsim: weights loaded in float16 with the Trainer's fp16=True are not modelled yet "
                "(llmsim.predict raises InputError)",
    "zero3-lora-70b": "ZeRO-3 with LoRA on 70B (accelerate's DeepSpeed plugin, gradient accumulation with LoRA) "
                      "is not modelled together; NVML reading off a screenshot",
}
# entries llmsim was asked for and refused (the reason its InputError gives)
REFUSED = {"fms-pr14-mistral7b-qlora-1gpu-fp16": "fp16-amp"}


def reason(entry: dict) -> str:
    if entry["id"] in REFUSED:
        return NOT_MODELLED[REFUSED[entry["id"]]]
    if entry["strategy"] == "fsdp":
        return NOT_MODELLED["fsdp"]
    if entry["id"].startswith("torchtune"):
        return NOT_MODELLED["torchtune"]
    if entry["metric"] == "unknown" or "unknown" in str(entry["gpu"]).lower():
        return NOT_MODELLED["unknown"]
    if "variable" in str(entry["seq_len"]):
        return NOT_MODELLED["variable"]
    if entry.get("quant"):
        return NOT_MODELLED["qlora-trainer"]
    return NOT_MODELLED["zero3-lora-70b"]


def main() -> None:
    entries = {entry["id"]: entry for entry in yaml.safe_load((HERE / "published_gpu.yaml").read_text())}
    rows = []
    cases = [(i, MODELLED[i], entries[i]["value_gib"], _nvml_gib(entries[i])) for i in MODELLED]
    cases += [(i, {**MODELLED[base], **change}, alloc, nvml) for i, (base, change, alloc, nvml) in EXTRA.items()]
    for name, options, allocated_gib, nvml_gib in cases:
        options = dict(options)
        model, seq_len = options.pop("model"), options.pop("seq_len")
        prediction = llmsim.predict(model, seq_len, **options)
        rank = prediction.deciding_rank
        rows.append((name, allocated_gib, rank.peak_allocated_bytes / GIB, nvml_gib, rank.device_total_bytes / GIB,
                     prediction.verdict))
    print(f"{'entry':<48} {'published alloc':>15} {'predicted':>9} {'error':>8}   {'published NVML':>14} "
          f"{'device total':>12} {'error':>8}  verdict")
    for name, alloc, predicted, nvml, total, verdict in rows:
        nvml_text = f"{nvml:>14.2f} {total:>12.2f} {100 * (total - nvml) / nvml:>+7.1f} %" if nvml else " " * 37
        print(f"{name:<48} {alloc:>15.2f} {predicted:>9.2f} {100 * (predicted - alloc) / alloc:>+7.1f} %   "
              f"{nvml_text}  {verdict}")
    print("\nruns the source reports out of memory on its A100 80GB:")
    for name, (base, change) in OOM.items():
        options = {**MODELLED[base], **change}
        model, seq_len = options.pop("model"), options.pop("seq_len")
        prediction = llmsim.predict(model, seq_len, **options)
        rank = prediction.deciding_rank
        print(f"  {name:<58} allocated {rank.peak_allocated_bytes / GIB:.2f} GiB, device total "
              f"{rank.device_total_bytes / GIB:.2f} GiB: {prediction.verdict}")
    print("\nnot re-predicted:")
    for entry in entries.values():
        if entry["id"] not in MODELLED:
            print(f"  {entry['id']}: {reason(entry)}")


def _nvml_gib(entry: dict) -> float | None:
    text = str((entry.get("other_metrics") or {}).get("nvml_used_minus_start", ""))
    return float(text.split(" MiB")[0]) / 1024 if " MiB" in text else None


if __name__ == "__main__":
    main()
