"""Time `llmsim size` on Llama-2-70B (bf16, checkpointing, seq 4096) on H100-80GB, every layout family, two
processes: the cheapest layouts that fit and how long the answer took.
Run: python experiments/benchmark_size.py  (output in experiments/benchmark_size.out)"""
from __future__ import annotations

import time

from llmsim.enums import Precision
from llmsim.inputs.gpus import load_gpu
from llmsim.app.size import size
from llmsim.inputs.spec import TrainSetup, load_model_spec

spec, gpu = load_model_spec("llama-2-70b"), load_gpu("h100-80gb")
setup = TrainSetup(1, 4096, Precision.BF16, grad_ckpt=True)
for max_gpus in (8, 16):
    begin = time.perf_counter()
    frame = size(spec, setup, gpu, max_gpus=max_gpus, jobs=2)
    took = time.perf_counter() - begin
    fitting = frame[frame["fits"]]
    answer = ", ".join(f"{row.layout} on {row.gpus} (micro-batch {row.largest_micro_batch})"
                       for row in fitting.itertuples()) or "none"
    print(f"Llama-2-70B on H100-80GB, --max-gpus {max_gpus}: {len(frame)} layouts in {took:.0f} s; fit: {answer}")
