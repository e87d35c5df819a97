"""Time `llmsim predict`: imports, cold (first prediction in a fresh process) and warm (the same prediction again,
in-process), for Llama-2-7B on one process and for Llama-2-70B on 1,024 GPUs (issue 7's target: < 1 s cold,
< 50 ms warm), and the ratio against the tier-3 oracle (the whole step at full size under fake tensors).
Run: python experiments/benchmark_predict.py  (output in experiments/benchmark_predict.out)"""
from __future__ import annotations

import json
import tempfile
import time

start = time.perf_counter()
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import AutoModelForCausalLM  # noqa: E402,F401

imports_s = time.perf_counter() - start

from llmsim.dsconfig import load_ds_config  # noqa: E402
from llmsim.enums import Precision  # noqa: E402
from llmsim.gpus import load_gpu  # noqa: E402
from llmsim.measure import measure_single  # noqa: E402
from llmsim.pipeline import predict  # noqa: E402
from llmsim.spec import TrainSetup, load_model_spec  # noqa: E402
from llmsim.strategies import Layout, Strategy  # noqa: E402

llmsim_import_s = time.perf_counter() - start - imports_s


def timed(model: str, setup: TrainSetup, layout: Layout = Layout(), gpu=None) -> tuple[float, int]:
    begin = time.perf_counter()
    prediction = predict(load_model_spec(model), setup, layout, gpu)
    return time.perf_counter() - begin, prediction.peak_allocated_bytes


def zero3(world: int, micro_batch: int) -> Layout:
    config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": True}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    return Layout(Strategy.DEEPSPEED, world, load_ds_config(f.name, world, 8192, micro_batch, Precision.BF16))


print(f"import torch + transformers: {imports_s:.2f} s; import llmsim: {llmsim_import_s:.2f} s")
seven = TrainSetup(1, 2048)
cold_s, peak = timed("llama-2-7b", seven)
warm = sorted(timed("llama-2-7b", seven)[0] for _ in range(5))
other_s, _ = timed("llama-2-7b", TrainSetup(2, 2048))  # a new shape: traced again
print(f"Llama-2-7B, one process, CPU kernels, seq 2048: cold {cold_s:.2f} s (peak {peak:,} B), "
      f"warm {1000 * warm[2]:.0f} ms (median of 5), new micro-batch {other_s:.2f} s")
oracle_start = time.perf_counter()
oracle = measure_single(load_model_spec("llama-2-7b"), seven, fake=True)["peak_allocated_bytes"]
oracle_s = time.perf_counter() - oracle_start
print(f"  tier-3 oracle (full 32 layers under fake tensors): {oracle_s:.1f} s, peak {oracle:,} B: "
      f"{oracle_s / cold_s:.0f}x the cold prediction, {oracle_s / warm[2]:.0f}x the warm one")

h100 = load_gpu("h100-80gb")
seventy = TrainSetup(1, 4096, Precision.BF16, grad_ckpt=True)
for name, layout in (("DDP", Layout(Strategy.DDP, 1024)), ("ZeRO-3", zero3(1024, 1))):
    cold_s, peak = timed("llama-2-70b", seventy, layout, h100)
    warm = sorted(timed("llama-2-70b", seventy, layout, h100)[0] for _ in range(5))
    print(f"Llama-2-70B, {name} on 1,024 H100s, bf16, checkpointing, seq 4096: cold {cold_s:.2f} s, "
          f"warm {1000 * warm[2]:.0f} ms (median of 5), peak {peak:,} B")
