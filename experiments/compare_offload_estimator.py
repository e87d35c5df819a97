"""llmsim vs DeepSpeed's own estimators for ZeRO-Offload: ZeRO-2 with the optimizer offloaded to the CPU, ZeRO-3
with the optimizer offloaded, and ZeRO-3 with the parameters offloaded too, for Llama-2-7B/13B/70B on 8-64 GPUs,
8 GPUs a node.

Setup: `"bf16": {"enabled": true}`, `"offload_optimizer": {"device": "cpu", "pin_memory": true}` (and for the last
layout `"offload_param": {"device": "cpu", "pin_memory": true}`, LLaMA-Factory's ds_z3_offload_config.json) with
DeepSpeed's other defaults, `"zero_force_ds_cpu_optimizer": false` and the client torch.optim.AdamW, micro-batch 1,
sequence 4096, full activation checkpointing, predicted for H100s (`gpu=h100-80gb`: CUDA's kernels, and DeepSpeed's
GPU-side copies: pinned buffers, staging through the host); ZeRO-2 with the model loaded in bf16 (`--build-dtype
bf16`, as from_pretrained(dtype=torch.bfloat16) loads it), ZeRO-3 built under zero.Init.
Columns (bytes):
- llmsim_device: the most loaded rank's peak allocated over the whole step, initialize included (ZeRO-2 flattens
  the bf16 model into one buffer while the parameters still exist: 2 x 2 bytes per parameter for a moment);
  llmsim_device_training: the same after the build;
- llmsim_host_rank / llmsim_host_node: the host peak of one rank, and of a node (8 ranks);
- deepspeed_gpu / deepspeed_cpu: `estimate_zero2_model_states_mem_needs(params, 8, nodes, cpu_offload=True)`
  (2 bytes per parameter on each GPU, params x max(4 x GPUs, 16) x 1.5 bytes of CPU memory per node) and
  `estimate_zero3_model_states_mem_needs(params, largest_layer, 8, nodes, cpu_offload=True,
  cpu_offload_params=..., zero_init=True)` (the largest layer's 4 bytes a parameter on each GPU, plus 2 bytes a
  parameter over all GPUs without parameter offload; 16 or 18 bytes a parameter x 1.5 per node over the nodes).
Run: python experiments/compare_offload_estimator.py  (writes experiments/compare_offload_estimator.csv;
experiments/compare_offload_estimator.out is its last output)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd

from llmsim.enums import Precision
from llmsim.inputs.dsconfig import ds_setup
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy

MODELS = ["llama-2-7b", "llama-2-13b", "llama-2-70b"]
WORLD_SIZES = [8, 16, 32, 64]
GPUS_PER_NODE = 8
MICRO_BATCH, SEQ_LEN = 1, 4096
OUT = Path(__file__).with_suffix(".csv")
OFFLOAD = {"device": "cpu", "pin_memory": True}
LAYOUTS = {  # name -> zero_optimization
    "zero2-offload": {"stage": 2, "offload_optimizer": OFFLOAD},
    "zero3-offload-optimizer": {"stage": 3, "offload_optimizer": OFFLOAD},
    "zero3-offload-all": {"stage": 3, "offload_optimizer": OFFLOAD, "offload_param": OFFLOAD},
}


def config(zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "bf16": {"enabled": True}, "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False}


def parameter_counts(name: str) -> tuple[int, int]:
    """The model's parameters, and its largest module's own (what DeepSpeed's ZeRO-3 estimator calls the largest
    layer: `model_to_params`' max over modules of their direct parameters)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_model_spec(name).hf_config())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(p.numel() for p in model.parameters()), largest


def estimate(layout: str, params: int, largest: int, world: int) -> tuple[int, int]:
    """DeepSpeed's (cpu, gpu) bytes for `layout`."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes = world // GPUS_PER_NODE
    if layout == "zero2-offload":
        return estimate_zero2_model_states_mem_needs(params, GPUS_PER_NODE, nodes, cpu_offload=True)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest, GPUS_PER_NODE, nodes, cpu_offload=True,
                                                        cpu_offload_params=layout == "zero3-offload-all",
                                                        zero_init=True)
    return cpu, gpu


def main() -> int:
    from llmsim.inputs.gpus import load_gpu

    gpu = load_gpu("h100-80gb")
    rows = []
    for name in MODELS:
        spec = load_model_spec(name)
        params, largest = parameter_counts(name)
        for layout_name, zero in LAYOUTS.items():
            setup = TrainSetup(MICRO_BATCH, SEQ_LEN, Precision.BF16, grad_ckpt=True,
                               build_bf16=zero["stage"] != 3)  # ZeRO-3 builds under zero.Init, in bf16
            for world in WORLD_SIZES:
                deepspeed = ds_setup(config(zero), world, spec.hf_config().hidden_size, None, None)
                start = time.perf_counter()
                prediction = predict(spec, setup, Layout(Strategy.DEEPSPEED, world, deepspeed), gpu=gpu)
                seconds = time.perf_counter() - start
                training = max(int(r.timeline["delta_bytes"].where(r.timeline["category"] != "host_offload", 0)
                                   .cumsum()[r.timeline["phase"] != "build"].max()) for r in prediction.ranks)
                cpu, gpu_bytes = estimate(layout_name, params, largest, world)
                rows.append({"model": name, "layout": layout_name, "world_size": world, "params": params,
                             "largest_layer": largest, "llmsim_device": prediction.peak_allocated_bytes,
                             "llmsim_device_training": training, "llmsim_host_rank": prediction.peak_host_bytes,
                             "llmsim_host_node": prediction.host_per_node_bytes(GPUS_PER_NODE),
                             "deepspeed_gpu": gpu_bytes, "deepspeed_cpu": cpu, "llmsim_seconds": round(seconds, 2)})
                print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(OUT, index=False)
    gib = (frame.set_index(["model", "layout", "world_size"])
           .drop(columns=["params", "largest_layer", "llmsim_seconds"]) / 2**30)
    print(gib.round(2).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
