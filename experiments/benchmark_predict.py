"""Time `llmsim predict` for Llama-2-7B at seq 2048: imports, cold (first prediction in a fresh process)
and warm (the same prediction again, in-process). Run: python experiments/benchmark_predict.py"""
from __future__ import annotations

import time

start = time.perf_counter()
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import AutoModelForCausalLM  # noqa: E402,F401

imports_s = time.perf_counter() - start

from llmsim.pipeline import predict  # noqa: E402
from llmsim.spec import TrainSetup, load_model_spec  # noqa: E402

llmsim_import_s = time.perf_counter() - start - imports_s


def timed(setup: TrainSetup) -> tuple[float, int]:
    begin = time.perf_counter()
    prediction = predict(load_model_spec("llama-2-7b"), setup)
    return time.perf_counter() - begin, prediction.peak_allocated_bytes


cold_s, peak = timed(TrainSetup(1, 2048))
warm = sorted(timed(TrainSetup(1, 2048))[0] for _ in range(5))
other_s, _ = timed(TrainSetup(2, 2048))  # a new shape: traced again, nothing else cached
print(f"import torch + transformers: {imports_s:.2f} s; import llmsim: {llmsim_import_s:.2f} s")
print(f"cold predict (first in process): {cold_s:.2f} s   peak {peak:,} B")
print(f"warm predict (same inputs, median of 5): {1000 * warm[2]:.0f} ms")
print(f"new micro-batch in a warm process (new trace): {other_s:.2f} s")
