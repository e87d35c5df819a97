"""Measure the HF Trainer recipe through the entry points: data/measurements/trainer_cpu.csv.

Each run is `llmsim measure --training-args ... [--peft-config ...] [--dtype ...]` in a fresh process, as a
user's script starts: `from_pretrained` from a checkpoint written before the measured region, optional
`get_peft_model(LoraConfig(...))`, `Trainer(...).train()` for three steps (llmsim/model/trainer_recipe.py).
Small real shapes of four families: Llama (untied), Qwen2 (tied embeddings, biased q/k/v), GPT-2 (Conv1D, learned
positions), GPT-NeoX (Pythia). QLORA_CASES add a BitsAndBytesConfig (`--quantization-config`): from_pretrained
quantizes on load, then peft's prepare_model_for_kbit_training (unless the case skips it) and get_peft_model.
DDP_CASES run under torchrun on 2 ranks (`--world-size 2`: the Trainer wraps the model in DistributedDataParallel
over gloo), one row per rank, in data/measurements/trainer_ddp_cpu.csv.
DEEPSPEED_CASES run the Trainer with TrainingArguments(deepspeed=...) on 2 ranks (ZeRO-1/2, "auto" values), in
data/measurements/trainer_deepspeed_cpu.csv; OFFLOAD_CASES the same with the optimizer offloaded to the CPU (ZeRO-Offload), in
data/measurements/trainer_offload_cpu.csv.
MOE_CASES run the same entry points on mixture-of-experts models of seven families (small shapes of the zoo's
configs from `llmsim.inputs.zoo.shrink`: 8 experts, top-2, each family's layout kept), transformers' default experts
implementation (grouped_mm), in data/measurements/trainer_moe_cpu.csv (MOE_QLORA_CASES too); MOE_DEEPSPEED_CASES on 2 ranks with ZeRO-2,
in data/measurements/trainer_moe_deepspeed_cpu.csv. ZERO3_CASES: the Trainer under ZeRO-3 on 2 ranks, in
data/measurements/trainer_zero3_cpu.csv; NVME_CASES the same JSON with the optimizer offloaded to "nvme"
(ZeRO-Infinity's swapper), each predicted first, in data/measurements/trainer_offload_cpu.csv (NVME_PARAM_CASES:
the parameters to "nvme", `--cases nvme-params`; PARAMS_OFFLOAD_CASES: the parameters to the CPU and the optimizer
not, `--cases params-offload`). ACCELERATE_FSDP_CASES
(`--cases accelerate-fsdp`): the Trainer launched by `accelerate launch --config_file` with distributed_type FSDP,
each predicted first, in data/measurements/trainer_fsdp_cpu.csv; ACCELERATE_FSDP_RAM_CASES (`--cases
accelerate-fsdp-ram`) the same with fsdp_cpu_ram_efficient_loading on (the launch's default), into the same file;
ACCELERATE_FSDP_AC_CASES (`--cases accelerate-fsdp-ac`) with fsdp_activation_checkpointing.
LLAMA_FACTORY_CASES: LLaMA-Factory's DeepSpeed configs as it ships them, on 2
ranks, each predicted first (printed before the run), in data/measurements/trainer_llamafactory_cpu.csv.
SFT_CASES run TRL's SFTTrainer (`llmsim measure --sft-config ...`: `SFTTrainer(model, SFTConfig(...),
train_dataset=Dataset, processing_class=..., peft_config=...).train()`, TRL's defaults unless the case sets them:
checkpointing, bf16, max_length 1024), each predicted first, in data/measurements/trainer_sft_cpu.csv; SFT_DDP_CASES
the same on 2 ranks of DistributedDataParallel, in data/measurements/trainer_sft_ddp_cpu.csv (both need trl: pip
install "llmsim[trl]"; measured with trl 1.16.0). FSDP_CASES: the
Trainer's FSDP2 from its TrainingArguments (fsdp, fsdp_config) on 2 ranks, accelerate's FSDP path on as on a GPU
(llmsim/model/trainer_recipe.py, accelerate_fsdp_on_cpu), gloo's collectives settled, each predicted first, in
data/measurements/trainer_fsdp_cpu.csv (the first two cases on 3 ranks too, where shards do not divide: `--cases fsdp
--world-size 3 --models llama-2-7b,qwen2.5-0.5b --only 2`, experiments/measure_trainer_fsdp_3ranks.out).
FSDP_HOST_CASES (`--cases fsdp-host`): the same measured as on a GPU (`--fsdp-init host`: the model loaded on the
host, fully_shard copying each unit to the device), device and host peaks, each predicted first, into the same file
(experiments/measure_trainer_fsdp_host.out).
Run: python experiments/measure_trainer.py [--out CSV] [--only N] [--world-size N] [--models a,b]
     [--cases all|plain|qlora|ddp|deepspeed|offload|moe|moe-qlora|moe-deepspeed|zero3|llamafactory|sft|sft-ddp|fsdp|
      fsdp-offload|fsdp-host|nvme|nvme-params|params-offload|accelerate-fsdp|accelerate-fsdp-ram|accelerate-fsdp-ac]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "measurements" / "trainer_cpu.csv"
DDP_OUT = OUT.with_name("trainer_ddp_cpu.csv")
DDP_WORLD_SIZE = 2
SEQ_LEN = 128
MODELS = {
    "llama-2-7b": {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_hidden_layers": 4,
                   "num_key_value_heads": 4, "vocab_size": 2000},
    "qwen2.5-0.5b": {"hidden_size": 128, "intermediate_size": 320, "num_attention_heads": 4, "num_hidden_layers": 3,
                     "num_key_value_heads": 2, "vocab_size": 3000, "max_window_layers": 3},
    "gpt2": {"n_layer": 3, "n_embd": 96, "n_head": 4, "vocab_size": 1500},
    "pythia-160m": {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 3,
                    "vocab_size": 2500},
}
# Mixture-of-experts models: (zoo name, decoder layers); DeepSeek-V3 keeps its 3 dense first layers before 3 MoE ones
MOE_SHAPES = [("mixtral-8x7b", 4), ("qwen3-30b-a3b", 4), ("deepseek-v3", 6), ("gpt-oss-20b", 4), ("olmoe-1b-7b", 3),
              ("qwen2-57b-a14b", 3), ("deepseek-v2-lite", 3)]
MOE_OUT = OUT.with_name("trainer_moe_cpu.csv")
MOE_DEEPSPEED_OUT = OUT.with_name("trainer_moe_deepspeed_cpu.csv")
BASE = {"per_device_train_batch_size": 2, "learning_rate": 2e-5}
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
# (name, TrainingArguments fields over BASE, LoraConfig or None, from_pretrained dtype)
CASES = [
    ("default optim (adamw_torch_fused)", {}, None, "float32"),
    ("adamw_torch", {"optim": "adamw_torch"}, None, "float32"),
    ("sgd", {"optim": "sgd"}, None, "float32"),
    ("adafactor", {"optim": "adafactor"}, None, "float32"),
    ("adamw_8bit", {"optim": "adamw_8bit"}, None, "float32"),
    ("no clipping", {"optim": "adamw_torch", "max_grad_norm": 0.0}, None, "float32"),
    ("accumulation 4", {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 1}, None, "float32"),
    ("bf16 autocast", {"bf16": True}, None, "float32"),
    ("fp16 autocast + GradScaler", {"fp16": True}, None, "float32"),
    ("loaded in bf16", {}, None, "bfloat16"),
    ("loaded in bf16, bf16=True", {"bf16": True}, None, "bfloat16"),
    ("checkpointing, bf16", {"gradient_checkpointing": True, "bf16": True}, None, "float32"),
    ("LoRA all-linear", {}, LORA, "float32"),
    ("LoRA dropout 0.1, bf16 weights", {}, {**LORA, "lora_dropout": 0.1}, "bfloat16"),
    ("DoRA", {}, {**LORA, "use_dora": True}, "float32"),
    ("rsLoRA, bias lora_only, checkpointing", {"gradient_checkpointing": True},
     {**LORA, "use_rslora": True, "bias": "lora_only"}, "float32"),
]

# LoRA on the experts as well as on attention: peft's target_parameters wraps the 3-D expert parameters
LORA_EXPERTS = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "task_type": "CAUSAL_LM"}
MOE_CASES = [
    ("default optim (adamw_torch_fused)", {}, None, "float32"),
    ("adamw_torch, accumulation 2", {"optim": "adamw_torch", "gradient_accumulation_steps": 2,
                                     "per_device_train_batch_size": 1}, None, "float32"),
    ("bf16 autocast", {"bf16": True}, None, "float32"),
    ("fp16 autocast + GradScaler", {"fp16": True}, None, "float32"),
    ("loaded in bf16, bf16=True", {"bf16": True}, None, "bfloat16"),
    ("checkpointing, bf16", {"gradient_checkpointing": True, "bf16": True}, None, "float32"),
    ("LoRA all-linear", {}, LORA, "float32"),
    ("LoRA attention + experts, bf16 weights, bf16=True", {"bf16": True}, LORA_EXPERTS, "bfloat16"),
]

# The QLoRA recipe as peft's and TRL's docs write it, and its variations:
# (name, TrainingArguments fields over BASE, LoraConfig, from_pretrained dtype, BitsAndBytesConfig, kbit_prep)
NF4_DQ_BF16 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
               "bnb_4bit_compute_dtype": "bfloat16"}
QLORA_CASES = [
    ("QLoRA: nf4 double-quant, bf16 load, bf16=True", {"bf16": True}, LORA, "bfloat16", NF4_DQ_BF16, True),
    ("QLoRA + checkpointing (reentrant)", {"bf16": True, "gradient_checkpointing": True}, LORA, "bfloat16",
     NF4_DQ_BF16, True),
    ("QLoRA + checkpointing use_reentrant=False", {"bf16": True, "gradient_checkpointing": True,
                                                   "gradient_checkpointing_kwargs": {"use_reentrant": False}},
     LORA, "bfloat16", NF4_DQ_BF16, True),
    ("QLoRA without prepare_model_for_kbit_training", {"bf16": True}, LORA, "bfloat16", NF4_DQ_BF16, False),
    ("QLoRA, paged_adamw_32bit, dropout 0.05", {"bf16": True, "optim": "paged_adamw_32bit"},
     {**LORA, "lora_dropout": 0.05}, "bfloat16", NF4_DQ_BF16, True),
    ("nf4, compute fp32 (the default), fp32 load", {}, LORA, "float32", {"load_in_4bit": True,
                                                                          "bnb_4bit_quant_type": "nf4"}, True),
    ("fp4, bf16 compute, fp32 load, bf16=True", {"bf16": True}, LORA, "float32",
     {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "bfloat16"}, True),
    ("LLM.int8 base, fp32 load", {}, LORA, "float32", {"load_in_8bit": True}, True),
    ("QLoRA, paged_adamw_8bit", {"bf16": True, "optim": "paged_adamw_8bit"}, LORA, "bfloat16", NF4_DQ_BF16, True),
]

# The Trainer under torchrun: the plain cases DDP could change (its buckets hold the trainable gradients; under
# accumulation accelerate skips the all-reduce with no_sync until the boundary)
DDP_CASES = [case for case in CASES if case[0] in (
    "default optim (adamw_torch_fused)", "adamw_torch", "accumulation 4", "bf16 autocast", "loaded in bf16",
    "checkpointing, bf16", "LoRA all-linear")]

# The Trainer under DeepSpeed (TrainingArguments(deepspeed=...)), 2 ranks: ZeRO-2 as HF recipes write it ("auto"
# values, overlap_comm, contiguous gradients: examples/ds_zero2.json), and ZeRO-1; the Trainer's own optimizer
ZERO2 = json.loads((Path(__file__).resolve().parent.parent / "examples" / "ds_zero2.json").read_text())
ZERO1 = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 1}, "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
DEEPSPEED_OUT = OUT.with_name("trainer_deepspeed_cpu.csv")
# ZeRO-Offload as LLaMA-Factory's ds_z2_offload_config.json writes it (optimizer to the CPU, pinned, "auto" values),
# with the key DeepSpeed needs to take the Trainer's optimizer there, and without its round_robin_gradients (not
# modelled); the same for ZeRO-1
ZERO2_OFFLOAD = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                 "zero_force_ds_cpu_optimizer": False,
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "allgather_partitions": True, "allgather_bucket_size": 5e8,
                                       "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                                       "contiguous_gradients": True}}
ZERO1_OFFLOAD = {**ZERO2_OFFLOAD, "zero_optimization": {**ZERO2_OFFLOAD["zero_optimization"], "stage": 1}}
OFFLOAD_OUT = OUT.with_name("trainer_offload_cpu.csv")
OFFLOAD_CASES = [
    ("ZeRO-2 offload, bf16, default optim", {"bf16": True, "deepspeed": ZERO2_OFFLOAD}, None, "float32"),
    ("ZeRO-2 offload, bf16, adamw_torch, accumulation 2", {"bf16": True, "optim": "adamw_torch",
                                                          "gradient_accumulation_steps": 2,
                                                          "deepspeed": ZERO2_OFFLOAD}, None, "float32"),
    ("ZeRO-1 offload, fp32, checkpointing", {"gradient_checkpointing": True, "deepspeed": ZERO1_OFFLOAD}, None,
     "float32"),
]
# QLoRA on MoE models: bitsandbytes quantizes the nn.Linear layers; the 3-D experts stay in the load dtype
MOE_QLORA_CASES = [("QLoRA: nf4 double-quant, bf16 load, bf16=True, all-linear", {"bf16": True}, LORA, "bfloat16",
                    None, True)]
MOE_DEEPSPEED_CASES = [
    ("ZeRO-2, bf16, default optim", {"bf16": True, "deepspeed": ZERO2}, None, "float32"),
    ("ZeRO-2, bf16, LoRA attention + experts", {"bf16": True, "deepspeed": ZERO2}, LORA_EXPERTS, "float32"),
]
DEEPSPEED_CASES = [
    ("ZeRO-2, bf16, default optim", {"bf16": True, "deepspeed": ZERO2}, None, "float32"),
    ("ZeRO-2, bf16, adamw_torch", {"bf16": True, "optim": "adamw_torch", "deepspeed": ZERO2}, None, "float32"),
    ("ZeRO-2, fp32 (bf16 auto: off)", {"deepspeed": ZERO2}, None, "float32"),
    ("ZeRO-2, bf16, accumulation 2", {"bf16": True, "gradient_accumulation_steps": 2, "deepspeed": ZERO2}, None,
     "float32"),
    ("ZeRO-2, bf16, checkpointing", {"bf16": True, "gradient_checkpointing": True, "deepspeed": ZERO2}, None,
     "float32"),
    ("ZeRO-2, bf16, LoRA all-linear", {"bf16": True, "deepspeed": ZERO2}, LORA, "float32"),
    ("ZeRO-1, bf16, default optim", {"bf16": True, "deepspeed": ZERO1}, None, "float32"),
]


# ZeRO-3 as HF's docs write it (examples/ds_zero3.json: "auto" buckets and persistence threshold, overlap_comm);
# TrainingArguments are made before from_pretrained, so the model loads partitioned under zero.Init
# (transformers' HfDeepSpeedConfig), as the Trainer's ZeRO-3 guide requires. Without its "train_batch_size": "auto":
# on this CPU DeepSpeedConfig is first read (from_pretrained's zero.Init) before deepspeed.comm is initialised, takes
# a world size of 1 (deepspeed/runtime/config.py, "HF zero.init case") and asserts 4 != 2 * 1 * 1 on the filled
# value; without the key it derives the batch itself
ZERO3 = {k: v for k, v in json.loads((Path(__file__).resolve().parent.parent / "examples" / "ds_zero3.json")
                                     .read_text()).items() if k != "train_batch_size"}
ZERO3_OUT = OUT.with_name("trainer_zero3_cpu.csv")
ZERO3_CASES = [
    ("ZeRO-3, bf16, default optim", {"bf16": True, "deepspeed": ZERO3}, None, "float32"),
    ("ZeRO-3, fp32, adamw_torch", {"optim": "adamw_torch", "deepspeed": ZERO3}, None, "float32"),
    ("ZeRO-3, bf16, checkpointing", {"bf16": True, "gradient_checkpointing": True, "deepspeed": ZERO3}, None,
     "float32"),
    ("ZeRO-3, bf16, LoRA all-linear", {"bf16": True, "deepspeed": ZERO3}, LORA, "float32"),
    ("ZeRO-3, bf16, accumulation 2", {"bf16": True, "gradient_accumulation_steps": 2, "deepspeed": ZERO3}, None,
     "float32"),
]
# ZeRO-Infinity: the same ZeRO-3 JSON with the optimizer offloaded to "nvme" (DeepSpeed's swapper; the files go to
# a scratch folder, as nvme_path names one), as DeepSpeed's ZeRO-Infinity tutorial writes it; without
# "zero_force_ds_cpu_optimizer" accelerate hands DeepSpeed its CPU Adam, with it false the Trainer's AdamW steps.
# Every case predicted before measured, into OFFLOAD_OUT
ZERO3_NVME = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "offload_optimizer": {
    "device": "nvme", "nvme_path": "/tmp/llmsim-nvme", "pin_memory": True, "buffer_count": 4}}}
NVME_CASES = [
    ("ZeRO-3 optimizer to nvme, bf16, default optim (CPU Adam)", {"bf16": True, "deepspeed": ZERO3_NVME}, None,
     "float32"),
    ("ZeRO-3 optimizer to nvme, fp32, adamw_torch", {"optim": "adamw_torch", "deepspeed": {
        **ZERO3_NVME, "zero_force_ds_cpu_optimizer": False}}, None, "float32"),
    ("ZeRO-3 optimizer to nvme, bf16, checkpointing, accumulation 2", {
        "bf16": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2, "deepspeed": ZERO3_NVME},
     None, "float32"),
    ("ZeRO-3 optimizer to nvme, bf16, LoRA all-linear", {"bf16": True, "deepspeed": ZERO3_NVME}, LORA, "float32"),
]

# ZeRO-Infinity's parameter swapper under the Trainer: the same JSON with the optimizer offloaded to the CPU and the
# parameters to "nvme" (a pool of 5 x 1e6 elements: DeepSpeed's 1e8 would lock 2 GB a rank here). At these shapes
# every partition is under 1 MiB, so nothing is written and DeepSpeed's prefetch runs; what the cases vary is
# max_in_cpu against the Trainer's two param groups (weight decay, then none): within it (both groups' flat host
# buffers), 0 (every sub-group past it: one-element buffers, unpinned fp32 masters, the write-back buffer), and a
# value that ends within the first group's sub-groups. Every case predicted before measured, into OFFLOAD_OUT
ZERO3_NVME_PARAMS = {**ZERO3, "zero_optimization": {
    **ZERO3["zero_optimization"], "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "nvme", "nvme_path": "/tmp/llmsim-nvme", "pin_memory": True, "buffer_size": 1e6}}}


def _max_in_cpu(elements: int, **zero) -> dict:
    return {**ZERO3_NVME_PARAMS, "zero_optimization": {
        **ZERO3_NVME_PARAMS["zero_optimization"], **zero, "offload_param": {
            **ZERO3_NVME_PARAMS["zero_optimization"]["offload_param"], "max_in_cpu": elements}}}


NVME_PARAM_CASES = [
    ("ZeRO-3 parameters to nvme, bf16, default optim (CPU Adam)", {"bf16": True, "deepspeed": ZERO3_NVME_PARAMS},
     None, "float32"),
    ("parameters to nvme, max_in_cpu 0, fp32, adamw_torch", {"optim": "adamw_torch", "deepspeed": {
        **_max_in_cpu(0), "zero_force_ds_cpu_optimizer": False}}, None, "float32"),
    ("parameters to nvme, max_in_cpu 60,000 over sub-groups of 20,000, bf16, checkpointing, accumulation 2", {
        "bf16": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2,
        "deepspeed": _max_in_cpu(60_000, sub_group_size=20_000)}, None, "float32"),
]

# ZeRO-3 with the parameters offloaded and the optimizer not (no offload_optimizer): the Trainer's own optimizer steps
# the fp32 master on the device. bf16 only (llmsim refuses fp32 until a run of it is measured).
# Every case predicted before measured, into OFFLOAD_OUT (`--cases params-offload`)
ZERO3_PARAMS = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"],
                                               "offload_param": {"device": "cpu", "pin_memory": True}}}
PARAMS_OFFLOAD_CASES = [
    ("ZeRO-3 parameters to the CPU, bf16, default optim", {"bf16": True, "deepspeed": ZERO3_PARAMS}, None, "float32"),
    ("ZeRO-3 parameters to the CPU, bf16, checkpointing, accumulation 2, adamw_torch", {
        "bf16": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2, "optim": "adamw_torch",
        "deepspeed": ZERO3_PARAMS}, None, "float32"),
    ("ZeRO-3 parameters to the CPU, bf16, LoRA all-linear", {"bf16": True, "deepspeed": ZERO3_PARAMS}, LORA,
     "float32"),
]


# LLaMA-Factory's DeepSpeed configs exactly as it ships them (examples/deepspeed/, commit 1d6e8b2): ZeRO-2 with
# round_robin_gradients, the same with the optimizer offloaded and no "zero_force_ds_cpu_optimizer" (accelerate then
# swaps the Trainer's AdamW for DeepSpeed's CPU Adam), and ZeRO-3 with optimizer and parameters offloaded. The one
# change: the ZeRO-3 config without "train_batch_size": "auto", which this CPU cannot start (see ZERO3)
_LF_COMMON = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
              "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                       "hysteresis": 2, "min_loss_scale": 1},
              "bf16": {"enabled": "auto"}, "comms_config": {"verbose": False},
              "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}}}
_LF_Z2 = {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False,
          "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True, "round_robin_gradients": True}
LF_Z2 = {**_LF_COMMON, "zero_optimization": _LF_Z2}
LF_Z2_OFFLOAD = {**_LF_COMMON, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                          "pin_memory": True},
                                                     **{k: v for k, v in _LF_Z2.items() if k != "stage"}}}
LF_Z3_OFFLOAD = {**{k: v for k, v in _LF_COMMON.items() if k != "train_batch_size"}, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": False, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}
LLAMA_FACTORY_OUT = OUT.with_name("trainer_llamafactory_cpu.csv")
LLAMA_FACTORY_CASES = [
    ("LLaMA-Factory ds_z2_config, bf16, default optim", {"bf16": True, "deepspeed": LF_Z2}, None, "float32"),
    ("LLaMA-Factory ds_z2_offload_config, bf16, default optim", {"bf16": True, "deepspeed": LF_Z2_OFFLOAD}, None,
     "float32"),
    ("LLaMA-Factory ds_z2_offload_config, bf16, LoRA all-linear", {"bf16": True, "deepspeed": LF_Z2_OFFLOAD}, LORA,
     "float32"),
    ("LLaMA-Factory ds_z2_offload_config, fp32, accumulation 2, checkpointing",
     {"gradient_accumulation_steps": 2, "gradient_checkpointing": True, "deepspeed": LF_Z2_OFFLOAD}, None, "float32"),
    ("LLaMA-Factory ds_z3_offload_config, bf16, default optim", {"bf16": True, "deepspeed": LF_Z3_OFFLOAD}, None,
     "float32"),
    # held out for the Trainer's LoRA under parameter offload (its adapters stay fp32, DeepSpeed's `self.dtype`
    # being its optimizer's first parameter's), predicted before measured once that was modelled:
    # `python -c "import measure_trainer as m; m.run_case_named(m.LLAMA_FACTORY_CASES[-1])"` in experiments/
    ("LLaMA-Factory ds_z3_offload_config, bf16, LoRA all-linear", {"bf16": True, "deepspeed": LF_Z3_OFFLOAD}, LORA,
     "float32"),
]


# TRL's SFTTrainer: (name, SFTConfig fields over BASE, LoraConfig given to SFTTrainer(peft_config=...), dtype)
SFT_OUT = OUT.with_name("trainer_sft_cpu.csv")
SFT_DDP_OUT = OUT.with_name("trainer_sft_ddp_cpu.csv")
SFT_CASES = [
    ("SFTConfig defaults (checkpointing, bf16, adamw_torch_fused)", {}, None, "float32"),
    ("no checkpointing", {"gradient_checkpointing": False}, None, "float32"),
    ("bf16=False (fp32), checkpointing", {"bf16": False}, None, "float32"),
    ("loaded in bf16", {}, None, "bfloat16"),
    ("fp16 autocast + GradScaler", {"fp16": True}, None, "float32"),
    ("LoRA all-linear (peft_config)", {}, LORA, "float32"),
    ("LoRA dropout 0.05, bf16 weights, no checkpointing", {"gradient_checkpointing": False},
     {**LORA, "lora_dropout": 0.05}, "bfloat16"),
    ("DoRA", {}, {**LORA, "use_dora": True}, "float32"),
    ("max_length 64 (rows truncated)", {"max_length": 64}, None, "float32"),
    ("accumulation 2", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1}, None, "float32"),
    ("adamw_torch, no clipping", {"optim": "adamw_torch", "max_grad_norm": 0.0}, None, "float32"),
    ("loss_type dft", {"loss_type": "dft"}, None, "float32"),
    ("adafactor, reentrant checkpointing", {"optim": "adafactor",
                                            "gradient_checkpointing_kwargs": {"use_reentrant": True}}, None, "float32"),
]
FSDP_OUT = OUT.with_name("trainer_fsdp_cpu.csv")
# The Trainer's FSDP (TrainingArguments fsdp / fsdp_config -> accelerate's FSDP2 plugin), 2 ranks under torchrun
FSDP_CASES = [
    ("fsdp=True (FSDP2, reshard after forward, accelerate's wrap)", {"fsdp": True}, None, "float32"),
    ("bf16 mixed precision (MixedPrecisionPolicy bf16/bf16)", {"fsdp": True, "bf16": True}, None, "float32"),
    ("loaded in bf16, bf16=True (accelerate upcasts the trainable weights to fp32)", {"fsdp": True, "bf16": True},
     None, "bfloat16"),
    ("loaded in bf16, no mixed precision", {"fsdp": True}, None, "bfloat16"),
    ("reshard_after_forward false", {"fsdp": True, "fsdp_config": {"reshard_after_forward": False}}, None,
     "float32"),
    ("legacy fsdp='shard_grad_op auto_wrap'", {"fsdp": "shard_grad_op auto_wrap"}, None, "float32"),
    ("gradient checkpointing, bf16", {"fsdp": True, "bf16": True, "gradient_checkpointing": True}, None,
     "float32"),
    ("LoRA all-linear, bf16 weights, bf16=True", {"fsdp": True, "bf16": True}, LORA, "bfloat16"),
    ("accumulation 2", {"fsdp": True, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 1}, None,
     "float32"),
    ("adamw_torch, no clipping", {"fsdp": True, "optim": "adamw_torch", "max_grad_norm": 0.0}, None, "float32"),
]
# The Trainer under `accelerate launch --config_file FILE` with distributed_type FSDP (the plugin from the variables the
# launcher sets, the TrainingArguments without fsdp), launched by accelerate's launcher itself, 2 ranks, into
# FSDP_OUT; each predicted first (llmsim reads the file with accelerate's own launcher code:
# llmsim/inputs/accelerate_config.py `trainer_fsdp_launch`). The file as `accelerate config` writes one for FSDP2
ACCELERATE_FSDP = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
                   "num_machines": 1, "num_processes": 2, "machine_rank": 0, "main_training_function": "main",
                   "rdzv_backend": "static", "same_network": True, "use_cpu": False,
                   "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                   "fsdp_cpu_ram_efficient_loading": False, "fsdp_offload_params": False,
                                   "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                                   "fsdp_activation_checkpointing": False}}
ACCELERATE_FSDP_CASES = [  # (name, TrainingArguments fields, peft, dtype, the accelerate config)
    ("bf16 (the launch's mixed_precision), checkpointing", {"gradient_checkpointing": True}, None, "float32",
     ACCELERATE_FSDP),
    ("mixed_precision no, reshard_after_forward false", {}, None, "float32",
     {**ACCELERATE_FSDP, "mixed_precision": "no",
      "fsdp_config": {**ACCELERATE_FSDP["fsdp_config"], "fsdp_reshard_after_forward": False}}),
    ("offload_params (CPUOffloadPolicy)", {}, None, "float32",
     {**ACCELERATE_FSDP, "fsdp_config": {**ACCELERATE_FSDP["fsdp_config"], "fsdp_offload_params": True}}),
    ("LoRA all-linear, bf16 weights", {}, LORA, "bfloat16", ACCELERATE_FSDP),
]
# The same launch with `fsdp_cpu_ram_efficient_loading` on (accelerate launch's default where the file leaves the key
# out; `accelerate config` writes true): the model moved to the meta device before sharding (the other ranks before
# the upcast) and rank 0's state dict broadcast into every rank's shards (`fsdp2_load_full_state_dict`), so rank 0
# runs apart. `--cases accelerate-fsdp-ram`; the last ones measured as on a GPU (`--fsdp-init host`: rank 0's state
# dict on the host, each parameter copied to the device for its broadcast)
RAM_EFFICIENT = {**ACCELERATE_FSDP, "fsdp_config": {**ACCELERATE_FSDP["fsdp_config"],
                                                    "fsdp_cpu_ram_efficient_loading": True}}
ACCELERATE_FSDP_RAM_CASES = [  # (name, TrainingArguments fields, peft, dtype, the accelerate config, llmsim flags)
    ("ram-efficient loading left out (the launch's default: true), bf16, checkpointing",
     {"gradient_checkpointing": True}, None, "float32",
     {**ACCELERATE_FSDP, "fsdp_config": {key: value for key, value in ACCELERATE_FSDP["fsdp_config"].items()
                                         if key != "fsdp_cpu_ram_efficient_loading"}}, ()),
    ("ram-efficient, LoRA all-linear, bf16 weights", {}, LORA, "bfloat16", RAM_EFFICIENT, ()),
    ("ram-efficient, loaded in bf16, bf16 (rank 0 upcasts)", {}, None, "bfloat16", RAM_EFFICIENT, ()),
    ("ram-efficient, mixed_precision no, reshard_after_forward false", {}, None, "float32",
     {**RAM_EFFICIENT, "mixed_precision": "no",
      "fsdp_config": {**RAM_EFFICIENT["fsdp_config"], "fsdp_reshard_after_forward": False}}, ()),
    ("ram-efficient, offload_params (CPUOffloadPolicy)", {}, None, "float32",
     {**RAM_EFFICIENT, "fsdp_config": {**RAM_EFFICIENT["fsdp_config"], "fsdp_offload_params": True}}, ()),
    ("host: ram-efficient, bf16", {}, None, "float32", RAM_EFFICIENT, ("--fsdp-init", "host")),
    ("host: ram-efficient, LoRA all-linear, bf16 weights", {}, LORA, "bfloat16", RAM_EFFICIENT,
     ("--fsdp-init", "host")),
    ("host: ram-efficient, offload_params, checkpointing", {"gradient_checkpointing": True}, None, "float32",
     {**RAM_EFFICIENT, "fsdp_config": {**RAM_EFFICIENT["fsdp_config"], "fsdp_offload_params": True}},
     ("--fsdp-init", "host")),
]
# ... and with `fsdp_activation_checkpointing` (accelerate's `fsdp2_apply_ac`: torch's checkpoint_wrapper on every
# decoder layer, what transformers' Trainer recommends with FSDP over its own `gradient_checkpointing`). `--cases
# accelerate-fsdp-ac`; the last case is the same switch in the TrainingArguments' fsdp_config under torchrun
FSDP_AC = {**ACCELERATE_FSDP, "fsdp_config": {**ACCELERATE_FSDP["fsdp_config"], "fsdp_activation_checkpointing": True}}
ACCELERATE_FSDP_AC_CASES = [  # (name, TrainingArguments fields, peft, dtype, the accelerate config or None, flags)
    ("activation checkpointing, bf16", {}, None, "float32", FSDP_AC, ()),
    ("activation checkpointing, LoRA all-linear, bf16 weights", {}, LORA, "bfloat16", FSDP_AC, ()),
    ("activation checkpointing, mixed_precision no, reshard_after_forward false", {}, None, "float32",
     {**FSDP_AC, "mixed_precision": "no",
      "fsdp_config": {**FSDP_AC["fsdp_config"], "fsdp_reshard_after_forward": False}}, ()),
    ("activation checkpointing, ram-efficient loading left out (true), accumulation 2",
     {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1}, None, "float32",
     {**FSDP_AC, "fsdp_config": {key: value for key, value in FSDP_AC["fsdp_config"].items()
                                 if key != "fsdp_cpu_ram_efficient_loading"}}, ()),
    ("activation checkpointing, offload_params", {}, None, "float32",
     {**FSDP_AC, "fsdp_config": {**FSDP_AC["fsdp_config"], "fsdp_offload_params": True}}, ()),
    ("host: activation checkpointing, loaded in bf16, bf16", {}, None, "bfloat16", FSDP_AC, ("--fsdp-init", "host")),
    ("TrainingArguments fsdp_config activation_checkpointing, bf16",
     {"fsdp": True, "bf16": True, "fsdp_config": {"activation_checkpointing": True}}, None, "float32", None, ()),
]
# The Trainer's FSDP with fsdp_config cpu_offload (accelerate's CPUOffloadPolicy()), 2 ranks, into FSDP_OUT
FSDP_OFFLOAD_CASES = [
    ("cpu_offload (CPUOffloadPolicy, pinned)", {"fsdp": True, "fsdp_config": {"cpu_offload": True}}, None, "float32"),
    ("cpu_offload, loaded in bf16, bf16=True", {"fsdp": True, "bf16": True, "fsdp_config": {"cpu_offload": True}},
     None, "bfloat16"),
    ("legacy fsdp='full_shard offload auto_wrap'", {"fsdp": "full_shard offload auto_wrap"}, None, "float32"),
    ("cpu_offload, LoRA all-linear, bf16 weights, bf16=True", {"fsdp": True, "bf16": True,
                                                              "fsdp_config": {"cpu_offload": True}}, LORA, "bfloat16"),
    ("cpu_offload, checkpointing, accumulation 2", {"fsdp": True, "fsdp_config": {"cpu_offload": True},
                                                   "gradient_checkpointing": True, "gradient_accumulation_steps": 2,
                                                   "per_device_train_batch_size": 1}, None, "float32"),
]
# The Trainer's FSDP measured as on a GPU (`--fsdp-init host`: the model loaded on the host, accelerate's upcast
# there, fully_shard copying each unit to the device; llmsim/model/host_memory.py, HostMemory.active_fsdp), 2 ranks,
# into FSDP_OUT; what `--gpu` predicts of the Trainer's FSDP, here with the CPU's kernels
FSDP_HOST_CASES = [
    ("host: fsdp=True", {"fsdp": True}, None, "float32"),
    ("host: bf16 mixed precision", {"fsdp": True, "bf16": True}, None, "float32"),
    ("host: loaded in bf16, bf16=True (the upcast on the host)", {"fsdp": True, "bf16": True}, None, "bfloat16"),
    ("host: loaded in bf16, no mixed precision", {"fsdp": True}, None, "bfloat16"),
    ("host: reshard_after_forward false", {"fsdp": True, "fsdp_config": {"reshard_after_forward": False}}, None,
     "float32"),
    ("host: LoRA all-linear, bf16 weights, bf16=True", {"fsdp": True, "bf16": True}, LORA, "bfloat16"),
    ("host: checkpointing, accumulation 2, bf16", {"fsdp": True, "bf16": True, "gradient_checkpointing": True,
                                                   "gradient_accumulation_steps": 2,
                                                   "per_device_train_batch_size": 1}, None, "float32"),
    ("host: cpu_offload", {"fsdp": True, "fsdp_config": {"cpu_offload": True}}, None, "float32"),
]
# ... and one shape where it matters on the device: LoRA on a deep, narrow model with short sequences, whose whole
# model on the device (--fsdp-init full, a CPU run) is its peak (13,505,472 B predicted) and whose host-loaded run
# peaks in the forward instead (9,229,482 B predicted)
FSDP_HOST_DEEP = ("llama-2-7b", {"hidden_size": 128, "intermediate_size": 1024, "num_attention_heads": 4,
                                 "num_hidden_layers": 8, "num_key_value_heads": 4, "vocab_size": 1000}, 8,
                  ("host: LoRA all-linear, deep and narrow, seq 8, micro-batch 1",
                   {"fsdp": True, "bf16": True, "per_device_train_batch_size": 1}, LORA, "bfloat16"))
SFT_DDP_CASES = [case for case in SFT_CASES if case[0] in (
    "SFTConfig defaults (checkpointing, bf16, adamw_torch_fused)", "LoRA all-linear (peft_config)",
    "no checkpointing", "accumulation 2")]


def moe_models() -> dict[str, dict]:
    from llmsim.inputs.zoo import shrink

    return {name: shrink(name, 128, layers, 1000, 4) for name, layers in MOE_SHAPES}


def run_case(model: str, fields: dict, peft: dict | None, dtype: str, out: Path, quantization: dict | None = None,
             kbit_prep: bool = True, world_size: int = 1, overrides: dict | None = None,
             predict_first: bool = False, sft: bool = False, extra: tuple[str, ...] = (),
             seq_len: int = SEQ_LEN) -> int:
    with tempfile.TemporaryDirectory() as directory:
        args_path = Path(directory) / ("sft_config.json" if sft else "training_args.json")
        args_path.write_text(json.dumps({**BASE, **fields}))
        command = [sys.executable, "-m", "llmsim.app.cli", "measure", "--model", model, "--seq-len", str(seq_len),
                   "--sft-config" if sft else "--training-args", str(args_path), "--dtype", dtype, "--out", str(out)]
        if world_size > 1:
            command += ["--world-size", str(world_size)]
        command += list(extra)
        for key, value in (MODELS[model] if overrides is None else overrides).items():
            command += ["--set", f"{key}={json.dumps(value)}"]
        if peft is not None:
            peft_path = Path(directory) / "adapter_config.json"
            peft_path.write_text(json.dumps(peft))
            command += ["--peft-config", str(peft_path)]
        if quantization is not None:
            quant_path = Path(directory) / "bnb_config.json"
            quant_path.write_text(json.dumps(quantization))
            command += ["--quantization-config", str(quant_path)] + ([] if kbit_prep else ["--no-kbit-prep"])
        if predict_first:  # the same inputs through `llmsim predict`, printed before the run starts
            asked = [arg for arg in command if arg not in ("--out", str(out))]
            asked[asked.index("measure")] = "predict"
            predicted = subprocess.run(asked + ["--format", "json"], capture_output=True, text=True)
            print(f"{model:14} predicted:", [(r["peak_allocated_bytes"], r["peak_host_bytes"]) for r in
                                             json.loads(predicted.stdout)["ranks"]] if predicted.returncode == 0
                  else predicted.stderr.strip()[-300:], flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        last = " | ".join((done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-world_size:])
        quant = "" if quantization is None else ("int8" if quantization.get("load_in_8bit") else
                                                 quantization.get("bnb_4bit_quant_type", "fp4"))
        print(f"{model:14} {dtype:9} {json.dumps(fields)[:60]:60} {'lora' if peft else '':4} {quant:4} "
              f"{'' if kbit_prep else 'no-prep':7} -> {last}", flush=True)
        return done.returncode


def run_case_named(case: tuple, models=("llama-2-7b", "qwen2.5-0.5b", "gpt2"), out: Path = LLAMA_FACTORY_OUT) -> int:
    """One case of LLAMA_FACTORY_CASES on `models`, 2 ranks, each predicted first (as `--cases llamafactory`)."""
    name, fields, peft, dtype = case
    return sum(run_case(model, fields, peft, dtype, Path(out), None, True, DDP_WORLD_SIZE, None, predict_first=True)
               != 0 for model in models)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="default: OUT (DDP_OUT for --cases ddp)")
    parser.add_argument("--only", type=int, default=None, help="the first N cases of each model")
    parser.add_argument("--cases", choices=["all", "plain", "qlora", "ddp", "deepspeed", "offload", "moe",
                                            "moe-qlora", "moe-deepspeed", "zero3", "llamafactory", "sft", "sft-ddp",
                                            "fsdp", "fsdp-offload", "fsdp-host", "nvme", "nvme-params",
                                            "params-offload", "accelerate-fsdp",
                                            "accelerate-fsdp-ram", "accelerate-fsdp-ac"],
                        default="all",
                        help="all: plain and qlora, one process (ddp, deepspeed: those cases on 2 ranks, to --out or "
                        "DDP_OUT / DEEPSPEED_OUT)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks under torchrun (default: the cases')")
    parser.add_argument("--models", default=None, help="comma-separated zoo names (default: every model of MODELS)")
    args = parser.parse_args()
    world_size, out = {"ddp": (DDP_WORLD_SIZE, DDP_OUT), "deepspeed": (DDP_WORLD_SIZE, DEEPSPEED_OUT),
                       "offload": (DDP_WORLD_SIZE, OFFLOAD_OUT), "nvme": (DDP_WORLD_SIZE, OFFLOAD_OUT),
                       "nvme-params": (DDP_WORLD_SIZE, OFFLOAD_OUT), "params-offload": (DDP_WORLD_SIZE, OFFLOAD_OUT),
                       "moe": (1, MOE_OUT), "moe-qlora": (1, MOE_OUT),
                       "moe-deepspeed": (DDP_WORLD_SIZE, MOE_DEEPSPEED_OUT),
                       "zero3": (DDP_WORLD_SIZE, ZERO3_OUT),
                       "llamafactory": (DDP_WORLD_SIZE, LLAMA_FACTORY_OUT), "sft": (1, SFT_OUT),
                       "sft-ddp": (DDP_WORLD_SIZE, SFT_DDP_OUT),
                       "fsdp": (DDP_WORLD_SIZE, FSDP_OUT),
                       "fsdp-offload": (DDP_WORLD_SIZE, FSDP_OUT),
                       "fsdp-host": (DDP_WORLD_SIZE, FSDP_OUT),
                       "accelerate-fsdp": (DDP_WORLD_SIZE, FSDP_OUT),
                       "accelerate-fsdp-ram": (DDP_WORLD_SIZE, FSDP_OUT),
                       "accelerate-fsdp-ac": (DDP_WORLD_SIZE, FSDP_OUT)}.get(args.cases, (1, OUT))
    out = args.out or out
    world_size = args.world_size or world_size
    cases = ([(*case, None, True) for case in CASES] if args.cases in ("all", "plain") else []) + \
        (QLORA_CASES if args.cases in ("all", "qlora") else []) + \
        ([(*case, None, True) for case in DDP_CASES] if args.cases == "ddp" else []) + \
        ([(*case, None, True) for case in DEEPSPEED_CASES] if args.cases == "deepspeed" else []) + \
        ([(*case, None, True) for case in OFFLOAD_CASES] if args.cases == "offload" else []) + \
        ([(*case, None, True) for case in ZERO3_CASES] if args.cases == "zero3" else []) + \
        ([(*case, None, True) for case in NVME_CASES] if args.cases == "nvme" else []) + \
        ([(*case, None, True) for case in NVME_PARAM_CASES] if args.cases == "nvme-params" else []) + \
        ([(*case, None, True) for case in PARAMS_OFFLOAD_CASES] if args.cases == "params-offload" else []) + \
        ([(*case, None, True) for case in LLAMA_FACTORY_CASES] if args.cases == "llamafactory" else []) + \
        ([(*case, None, True) for case in SFT_CASES] if args.cases == "sft" else []) + \
        ([(*case, None, True) for case in SFT_DDP_CASES] if args.cases == "sft-ddp" else []) + \
        ([(*case, None, True) for case in FSDP_CASES] if args.cases == "fsdp" else []) + \
        ([(*case, None, True) for case in FSDP_OFFLOAD_CASES] if args.cases == "fsdp-offload" else []) + \
        ([(*case, None, True) for case in FSDP_HOST_CASES] if args.cases == "fsdp-host" else [])
    models = {model: None for model in (args.models.split(",") if args.models else MODELS)}
    if args.cases.startswith("moe"):
        models = moe_models()
        cases = {"moe": [(*case, None, True) for case in MOE_CASES],
                 "moe-qlora": [(*case[:4], NF4_DQ_BF16, case[5]) for case in MOE_QLORA_CASES],
                 "moe-deepspeed": [(*case, None, True) for case in MOE_DEEPSPEED_CASES]}[args.cases]
    failures = 0
    for model, overrides in models.items():
        for name, fields, peft, dtype, quantization, kbit_prep in cases[: args.only]:
            failures += run_case(model, fields, peft, dtype, Path(out), quantization, kbit_prep, world_size,
                                 overrides, predict_first=args.cases in ("llamafactory", "sft", "sft-ddp", "fsdp",
                                                                             "fsdp-offload", "fsdp-host", "nvme",
                                                                             "nvme-params", "params-offload"),
                                 sft=args.cases.startswith("sft"),
                                 extra=("--fsdp-init", "host") if args.cases == "fsdp-host" else ()) != 0
    if args.cases in ("accelerate-fsdp", "accelerate-fsdp-ram", "accelerate-fsdp-ac"):
        launches = {"accelerate-fsdp": [(*case, ()) for case in ACCELERATE_FSDP_CASES],
                    "accelerate-fsdp-ram": ACCELERATE_FSDP_RAM_CASES,
                    "accelerate-fsdp-ac": ACCELERATE_FSDP_AC_CASES}[args.cases]
        with tempfile.TemporaryDirectory() as directory:
            for model in models:
                for index, (name, fields, peft, dtype, config, flags) in enumerate(launches[: args.only]):
                    launch = Path(directory) / f"accelerate{index}.json"
                    launch.write_text(json.dumps(config))
                    accelerate = ("--accelerate-config", str(launch)) if config is not None else ()
                    failures += run_case(model, fields, peft, dtype, Path(out), world_size=world_size,
                                         predict_first=True, extra=(*accelerate, *flags)) != 0
    if args.cases == "accelerate-fsdp-ram" and args.only is None:  # where the build is the peak: ranks apart
        model, overrides, seq_len, (name, fields, peft, dtype) = FSDP_HOST_DEEP
        fields = {key: value for key, value in fields.items() if key not in ("fsdp", "bf16")}  # the launch's
        with tempfile.TemporaryDirectory() as directory:
            launch = Path(directory) / "accelerate.json"
            launch.write_text(json.dumps(RAM_EFFICIENT))
            for flags in ((), ("--fsdp-init", "host")):
                failures += run_case(model, fields, peft, dtype, Path(out), world_size=world_size,
                                     overrides=overrides, predict_first=True, seq_len=seq_len,
                                     extra=("--accelerate-config", str(launch), *flags)) != 0
    if args.cases == "fsdp-host" and args.only is None:
        model, overrides, seq_len, (name, fields, peft, dtype) = FSDP_HOST_DEEP
        failures += run_case(model, fields, peft, dtype, Path(out), world_size=world_size, overrides=overrides,
                             predict_first=True, extra=("--fsdp-init", "host"), seq_len=seq_len) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
