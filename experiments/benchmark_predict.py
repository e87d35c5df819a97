"""Time `llmsim predict` (issue 7's targets: 70B on 1,024 GPUs < 1 s cold and < 50 ms warm; 10,000 configurations
< 60 s), and the ratio against the tier-3 oracle (the whole step at full size under fake tensors).
- cold: the first prediction of a model and shape in the process (it traces);
- warm, new layout: the trace is cached, the layout (strategy, world size) was never predicted in the process;
- warm, repeat: the same prediction again.
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

from llmsim.sim.allocator import compiled  # noqa: E402
from llmsim.inputs.dsconfig import load_ds_config  # noqa: E402
from llmsim.enums import Precision  # noqa: E402
from llmsim.inputs.gpus import load_gpu  # noqa: E402
from llmsim.measure.runs import measure_single  # noqa: E402
from llmsim.sim import replay, traced  # noqa: E402
from llmsim.model.trace import forget_traces  # noqa: E402
from llmsim.sim.pipeline import predict  # noqa: E402
from llmsim.model.pipelining import Schedule  # noqa: E402
from llmsim.inputs.spec import TrainSetup, load_model_spec  # noqa: E402
from llmsim.sim.strategies import Layout, Strategy  # noqa: E402
from llmsim.app.sweep import sweep  # noqa: E402

llmsim_import_s = time.perf_counter() - start - imports_s


def timed(model: str, setup: TrainSetup, layout: Layout = Layout(), gpu=None, jobs: int = 1) -> tuple[float, int]:
    begin = time.perf_counter()
    prediction = predict(load_model_spec(model), setup, layout, gpu, jobs=jobs)
    return time.perf_counter() - begin, prediction.peak_allocated_bytes


def ms(seconds: float) -> str:
    """Milliseconds, with a decimal below 10 ms."""
    return f"{1000 * seconds:,.1f}" if seconds < 0.01 else f"{1000 * seconds:,.0f}"


def zero(stage: int, world: int, micro_batch: int) -> Layout:
    config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": True}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    return Layout(Strategy.DEEPSPEED, world, load_ds_config(f.name, world, 8192, micro_batch, Precision.BF16))


print(f"import torch + transformers: {imports_s:.2f} s; import llmsim: {llmsim_import_s:.2f} s; allocator model: "
      f"{'compiled' if compiled() else 'Python'}")
seven = TrainSetup(1, 2048)
cold_s, peak = timed("llama-2-7b", seven)
warm = sorted(timed("llama-2-7b", seven)[0] for _ in range(5))
other_s, _ = timed("llama-2-7b", TrainSetup(2, 2048))  # a new shape: traced again
print(f"Llama-2-7B, one process, CPU kernels, seq 2048: cold {cold_s:.2f} s (peak {peak:,} B), "
      f"warm {ms(warm[2])} ms (median of 5), new micro-batch {other_s:.2f} s")
oracle_start = time.perf_counter()
oracle = measure_single(load_model_spec("llama-2-7b"), seven, fake=True)["peak_allocated_bytes"]
oracle_s = time.perf_counter() - oracle_start
print(f"  tier-3 oracle (full 32 layers under fake tensors): {oracle_s:.1f} s, peak {oracle:,} B: "
      f"{oracle_s / cold_s:.0f}x the cold prediction, {oracle_s / warm[2]:.0f}x the warm one")

h100 = load_gpu("h100-80gb")
seventy = TrainSetup(1, 4096, Precision.BF16, grad_ckpt=True)
print("Llama-2-70B, bf16, checkpointing, seq 4096, H100s (worst rank's peak):")
for name, layout_of in (("DDP", lambda w: Layout(Strategy.DDP, w)), ("ZeRO-3", lambda w: zero(3, w, 1)),
                        ("ZeRO-1", lambda w: zero(1, w, 1)), ("ZeRO-2", lambda w: zero(2, w, 1))):
    if name in ("DDP", "ZeRO-3"):  # the first prediction of its trace (ZeRO-3 traces with its module hooks)
        cold_s, _ = timed("llama-2-70b", seventy, layout_of(512), h100)
        cold = f"cold (512 GPUs) {cold_s:.2f} s, "
    # ZeRO-1/2 share DDP's trace: their warm new layout comes first, their cold (trace cleared) after
    new_s, peak = timed("llama-2-70b", seventy, layout_of(1024), h100)
    if name in ("ZeRO-1", "ZeRO-2"):  # again, a fresh process's state: the ranks in two forked processes
        replay._REPLAYED_PLAN[0] = lambda: None  # another layout's, as far as predict knows: replayed anew
        two_s, _ = timed("llama-2-70b", seventy, zero(int(name[-1]), 1024, 1), h100, jobs=2)
        new_s = f"{ms(new_s)} ms, with 2 processes (jobs=2) {ms(two_s)}"
    else:
        new_s = ms(new_s)
    again = sorted(timed("llama-2-70b", seventy, layout_of(1024), h100)[0] for _ in range(3))
    repeat = f", warm repeat {ms(again[1])} ms (median of 3)"
    if name in ("ZeRO-1", "ZeRO-2"):  # every rank differs (its partition): its events from one template walk
        traced._EXPANDED.clear()  # cold as the others: the first prediction of its trace, here at 1,024
        forget_traces()
        replay._REPLAYED_PLAN[0] = lambda: None
        cold_s, _ = timed("llama-2-70b", seventy, layout_of(1024), h100, jobs=2)
        cold = f"cold (1,024 GPUs, 2 processes) {cold_s:.2f} s, "
        timed("llama-2-70b", seventy, Layout(Strategy.DDP, 8))  # no GPU (CPU kernels: another trace), traced first
        cpu_s, _ = timed("llama-2-70b", seventy, layout_of(1024))  # no GPU: live bytes, no allocator model
        repeat += f" (every rank's own events and allocator replay; without the allocator model {ms(cpu_s)} ms)"
    print(f"  {name} on 1,024: {cold}warm new layout {new_s} ms{repeat}, peak {peak:,} B")

# A pipeline: 16 stages (1F1B, 16 micro-batches), DDP over the replicas; one trace per stage, in 2 processes.
pipe = [Layout(Strategy.DDP, w, pp=16, schedule=Schedule.ONE_F_ONE_B, n_microbatches=16) for w in (512, 1024)]
cold_s, _ = timed("llama-2-70b", seventy, pipe[0], h100, jobs=2)
new_s, peak = timed("llama-2-70b", seventy, pipe[1], h100)
again = sorted(timed("llama-2-70b", seventy, pipe[1], h100)[0] for _ in range(3))
print(f"  PP 16 x DDP on 1,024: cold (512 GPUs, 16 stage traces in 2 processes) {cold_s:.1f} s, warm new layout "
      f"{ms(new_s)} ms, warm repeat {ms(again[1])} ms (median of 3), peak {peak:,} B")

# A sweep of 10,240 DDP configurations (llmsim sweep's own function, both cores): Llama-2-7B, bf16, checkpointing,
# 128 world sizes (8 to 1,024) x 5 GPUs x 2 micro-batches x 2 sequence lengths x 4 allocator settings.
gpus = ["a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4"]
configs = [dict(model="llama-2-7b", seq_len=seq, micro_batch=mb, precision="bf16", grad_ckpt=True, strategy="ddp",
                world_size=w, gpu=g, alloc_conf=a)
           for seq in (2048, 4096) for mb in (1, 2) for g in gpus for a in
           (None, "expandable_segments:True", "max_split_size_mb:128", "max_split_size_mb:512")
           for w in range(8, 1025, 8)]
begin = time.perf_counter()
frame = sweep(configs, jobs=2, progress=False)
sweep_s = time.perf_counter() - begin
print(f"sweep of {len(configs):,} DDP configurations (12 traces per process), 2 processes: {sweep_s:.0f} s "
      f"({1000 * sweep_s / len(configs):.1f} ms per configuration), {int((frame['error'] != '').sum())} rejected")
