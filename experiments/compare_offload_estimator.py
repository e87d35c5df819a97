"""llmsim vs DeepSpeed's own estimator for ZeRO-2 with the optimizer offloaded to the CPU (ZeRO-Offload), for
Llama-2-7B/13B/70B on 8-64 GPUs, 8 GPUs a node.

Setup: `"bf16": {"enabled": true}`, `"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
"pin_memory": true}}` with DeepSpeed's other defaults, `"zero_force_ds_cpu_optimizer": false` and the client
torch.optim.AdamW, micro-batch 1, sequence 4096, full activation checkpointing, the model loaded in bf16
(`--build-dtype bf16`, as from_pretrained(dtype=torch.bfloat16) loads it).
Columns (bytes):
- llmsim_device: the most loaded rank's peak allocated over the whole step, initialize included (DeepSpeed
  flattens the bf16 model into one buffer while the parameters still exist: 2 x 2 bytes per parameter for a
  moment); llmsim_device_training: the same after the build;
- llmsim_host_rank / llmsim_host_node: the host peak of one rank, and of a node (8 ranks);
- deepspeed_gpu / deepspeed_cpu: `estimate_zero2_model_states_mem_needs(params, 8, nodes, cpu_offload=True)`:
  2 bytes per parameter on each GPU, and params x max(4 x GPUs, 16) x 1.5 bytes of CPU memory per node.
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
CONFIG = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
          "zero_force_ds_cpu_optimizer": False}


def parameter_count(name: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_model_spec(name).hf_config())
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    rows = []
    for name in MODELS:
        spec = load_model_spec(name)
        params = parameter_count(name)
        setup = TrainSetup(MICRO_BATCH, SEQ_LEN, Precision.BF16, grad_ckpt=True, build_bf16=True)
        for world in WORLD_SIZES:
            deepspeed = ds_setup(CONFIG, world, spec.hf_config().hidden_size, None, None)
            start = time.perf_counter()
            prediction = predict(spec, setup, Layout(Strategy.DEEPSPEED, world, deepspeed))
            seconds = time.perf_counter() - start
            training = max(int(r.timeline["delta_bytes"].where(r.timeline["category"] != "host_offload", 0)
                               .cumsum()[r.timeline["phase"] != "build"].max()) for r in prediction.ranks)
            cpu, gpu = estimate_zero2_model_states_mem_needs(params, GPUS_PER_NODE, world // GPUS_PER_NODE,
                                                             cpu_offload=True)
            rows.append({"model": name, "world_size": world, "params": params,
                         "llmsim_device": prediction.peak_allocated_bytes, "llmsim_device_training": training,
                         "llmsim_host_rank": prediction.peak_host_bytes,
                         "llmsim_host_node": prediction.host_per_node_bytes(GPUS_PER_NODE),
                         "deepspeed_gpu": gpu, "deepspeed_cpu": cpu, "llmsim_seconds": round(seconds, 2)})
            print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(OUT, index=False)
    gib = frame.set_index(["model", "world_size"]).drop(columns=["params", "llmsim_seconds"]) / 2**30
    print(gib.round(2).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
