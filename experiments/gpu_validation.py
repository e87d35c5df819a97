"""GPU validation kit (tier 4): the canonical step on one real GPU, measured three ways, one row per run.

    python experiments/gpu_validation.py            # on a GPU machine: runs the matrix, appends rows to
                                                    # data/measurements/tier4_gpu.csv (about 4-6 min on an H200)
    python experiments/gpu_validation.py --dry-run  # anywhere: checks every configuration resolves and prints
                                                    # llmsim's prediction for the detected/named GPU, runs nothing

Each configuration runs in its own process (a fresh CUDA context and allocator) and records
`torch.cuda.max_memory_allocated()`, `torch.cuda.max_memory_reserved()` and the device's used memory
(`torch.cuda.mem_get_info`: total - free, which includes the CUDA context) at the end of step 3, plus the
storage tracker's exact live-tensor peak. `llmsim validate` then compares allocated (2 %), reserved and device
total (5 %), see llmsim/measure/tolerances.py. LoRA needs peft, AdamW8bit bitsandbytes' CUDA build.

Liger's fused linear cross-entropy (`--loss fused-linear-ce`): llmsim predicts it with a torch imitation of
Liger's algorithm (llmsim/model/losses.py), measured on the CPU only. Its entries here run Liger's real Triton
Function (`liger_kernel.transformers.functional.liger_fused_linear_cross_entropy`, liger-kernel 0.8.5 must be
installed) in place of the imitation, so `llmsim validate` compares the real kernel's
`max_memory_allocated` with the imitation's prediction for the GPU's branches (logits chunk written with
`torch.mm(out=)`, the weight gradient accumulated with `torch.addmm(out_dtype=float32)` from sm80 on); each
pairs with the same configuration under transformers' loss, so the saving is measured too.

On a lent machine whose files come back from one folder (`--out DIR`): rows go to DIR/tier4_gpu.csv as each run
ends, each run's tracker timeline and CUDA allocator trace (`torch.cuda.memory._record_memory_history`, no stacks)
to DIR/traces_0.tar.gz (runs 0-12) and traces_1.tar.gz, a failed run's stderr to DIR/failures.log, and the
device's own figures (capacity, the context of a bare process, the cuBLAS workspace) to DIR/device.json.
`--deadline S` starts no run after S seconds.
The command prepared for this workplace's H200 (python 3.12, torch 2.11+cu130, transformers 5.17, no deepspeed;
`bash experiments/gpu_wheels.sh` fills `.whl/site`, to carry: liger-kernel 0.8.5, peft 0.21.2 and bitsandbytes
0.50.2 with only its CUDA 13 library; every entry but AdamW8bit's ran through transformers 5.17 on this CPU, cut to
one layer, a 2,048-token vocabulary and seq 32, before any GPU):

    export PYTHONPATH=$PWD:$PWD/.whl/site PYTHONUNBUFFERED=1
    python3 experiments/gpu_validation.py --out $OUT --deadline 420 2>&1 | tee $OUT/log.txt
"""
from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import pickle
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TIER4_CSV = Path(__file__).resolve().parent.parent / "data" / "measurements" / "tier4_gpu.csv"
PER_RUN_TIMEOUT_S = 120
RUNS_PER_ARCHIVE = 13  # the matrix's 25 runs in two trace archives: a lent machine sends back 8 files at most
# (zoo model, micro_batch, seq_len, precision, grad_ckpt, ckpt_every[, lora_rank[, lever]]): single GPU,
# plain PyTorch, AdamW (foreach, CUDA's default) unless an optimizer is named; LoRA through peft on a frozen
# base; the lever is True for checkpointing with offload (transformers' save_on_cpu into pinned host memory:
# the device peak must drop by the offloaded inputs, and the host peak is checked against the tracker's host
# copies -- the CPU rows emulate this boundary, llmsim/model/offload.py), a loss or an optimizer by name, or "fused"
# (AdamW's fused kernel instead of its foreach path).
MATRIX = [
    ("gpt2", 8, 1024, "bf16", False, 1),
    ("opt-1.3b", 4, 1024, "bf16", True, 1),
    ("qwen2.5-0.5b", 4, 2048, "bf16", False, 1),
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1),
    ("qwen2.5-3b", 2, 2048, "bf16", True, 2),
    ("pythia-1.4b", 4, 2048, "bf16-autocast", True, 1),
    ("bloom-1b7", 2, 1024, "bf16", True, 1),
    ("llama-2-7b", 1, 2048, "bf16", True, 1),
    ("llama-3.1-8b", 1, 4096, "bf16", True, 1),
    ("mistral-7b", 1, 2048, "bf16", True, 2),
    ("llama-3.1-8b", 2, 2048, "bf16", True, 1, 16),
    ("qwen2.5-1.5b", 4, 1024, "fp16-autocast", True, 1),
    ("llama-3.1-8b", 1, 4096, "bf16", True, 1, 0, True),
    ("qwen2.5-1.5b", 4, 2048, "bf16-autocast", True, 2, 0, True),
    # (..., lora_rank, loss): Liger's real fused linear cross-entropy, next to the two rows above it pairs with
    ("llama-3.1-8b", 1, 4096, "bf16", True, 1, 0, "fused-linear-ce"),
    ("qwen2.5-0.5b", 4, 2048, "bf16", False, 1, 0, "fused-linear-ce"),
    # Other optimizers (issue 5), validated on the CPU only so far (data/measurements/tier1_optim_cpu.csv):
    # torch's Adafactor (its foreach path on CUDA), transformers' Adafactor, bitsandbytes' AdamW8bit (the CUDA
    # kernel updates the 8-bit states in place and allocates nothing, like the fake op the trace runs).
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1, 0, "adafactor"),
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1, 0, "hf-adafactor"),
    ("qwen2.5-1.5b", 4, 1024, "bf16", True, 1, 0, "adamw8bit"),
    # torch's fused AdamW (`fused=True`, "fused" here; validated on the CPU so far, tier1/tier2_fused_adamw_cpu.csv):
    # `_fused_adamw_` updates in place with no temporaries, and its `step` tensors live on the GPU (the foreach
    # path keeps them on the host). Each pair's foreach run peaks in the first optimizer step (its `_foreach_sqrt`
    # list, one more copy of the parameters), the fused run in the backward: predicted 9-14 % lower.
    ("qwen2.5-0.5b", 2, 512, "fp32", True, 1),
    ("qwen2.5-0.5b", 2, 512, "fp32", True, 1, 0, "fused"),
    ("qwen2.5-1.5b", 1, 512, "bf16", True, 1),
    ("qwen2.5-1.5b", 1, 512, "bf16", True, 1, 0, "fused"),
    # torch Adam/AdamW's for-loop and foreach paths make each parameter's 0-d `step` with `torch.tensor(0.0)`
    # (torch/optim/adam.py, `_init_group`): on the host in a user's script, but on the GPU under the worker's
    # `with torch.device("cuda")` (the H200 run: 4-byte blocks of the CUDA allocator, no host bytes), which the
    # kit's rows say (`cuda_default_device`). The fused rows above put it on the device either way.
    ("gpt2", 1, 128, "fp32", False, 1, 0, "adam"),
    # A mixture-of-experts model (issue 25): OLMoE-1B-7B's 64 experts per layer through transformers' grouped_mm,
    # CUTLASS's bf16 grouped GEMM on sm90 (its small workspace is not modelled; the output is, as on the CPU).
    # Predicted for an H200: 64.44 GiB allocated, 65.43 GiB device total. Run through transformers 5.17 on this CPU
    # (one layer, a 2,048-token vocabulary, seq 32): real 4,497,687,100 B, predicted the same.
    ("olmoe-1b-7b", 1, 2048, "bf16", True, 1),
]
FUSED = "fused"  # the lever that turns on the optimizer's fused kernel (AdamW's `fused=True`)


def _setup(entry):
    from llmsim.enums import Loss, Optimizer, Precision
    from llmsim.inputs.spec import TrainSetup, load_model_spec, resolve_attention

    model, mb, seq, precision, ckpt, every, *extra = entry
    lever = extra[1] if len(extra) > 1 else None  # True: checkpointing with offload; else a loss or an optimizer
    losses, optimizers = {m.value for m in Loss}, {m.value for m in Optimizer}
    spec = load_model_spec(model)
    setup = TrainSetup(mb, seq, Precision(precision), None, ckpt, every, foreach=lever != FUSED, fused=lever == FUSED,
                       lora_rank=extra[0] if extra else 0, ckpt_offload=lever is True,
                       loss=Loss(lever) if lever in losses else Loss.HF,
                       optimizer=Optimizer(lever) if lever in optimizers else Optimizer.ADAMW,
                       cuda_default_device=True)  # the worker runs the step under `with torch.device("cuda")`
    return spec, resolve_attention(spec, setup)


def worker(entry, trace_path: str | None = None) -> dict:
    """One configuration on cuda:0 (run in a child process); `trace_path`: pickle the tracker's timeline and the
    CUDA caching allocator's own trace (every alloc/free/segment event, no stacks) there."""
    import torch

    from llmsim.measure.runs import environment, library_versions, setup_columns
    from llmsim.model.offload import host_peak_bytes, split_host
    from llmsim.sim.peaks import replay
    from llmsim.model.step import run_canonical_step
    from llmsim.model.trace import model_builder
    from llmsim.model.tracker import StorageTracker

    spec, setup = _setup(entry)
    if setup.loss.value == "fused-linear-ce":
        _use_real_liger()
    torch.cuda.set_device(0)
    build = model_builder(spec, setup, None)
    tracker = StorageTracker()
    if trace_path:
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10**7)
        except Exception as error:  # the rows matter more than the trace
            print(f"no allocator history: {error!r}", file=sys.stderr)
    start = time.perf_counter()
    with torch.device("cuda"):
        run_canonical_step(build, setup, tracker, None)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    timeline = tracker.timeline()
    device, host = split_host(timeline)  # the pinned copies of --ckpt-offload are host memory
    if trace_path:
        _save_traces(trace_path, timeline)
    return {"tier": 4, "recipe": setup.recipe.value, **setup_columns(spec, setup), "strategy": "single",
            "world_size": 1, "rank": 0,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "device_total_bytes": total - free,
            "reserved_at_end_bytes": torch.cuda.memory_reserved(),
            "tracker_peak_bytes": replay(device).allocated_bytes, "peak_host_bytes": host_peak_bytes(host),
            "gpu": _profile_name(torch.cuda.get_device_name(0)), "device": torch.cuda.get_device_name(0),
            **environment(), **library_versions(),
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - start, 2)}


def _save_traces(path: str, timeline) -> None:
    """The tracker's timeline (its numeric columns, phase and category) and the allocator's events (action,
    address, size), as numpy arrays, for offline comparison with the prediction."""
    columns = {name: timeline[name].to_numpy() for name in ("step", "block", "serial", "delta_bytes")}
    columns.update({name: timeline[name].astype(str).to_numpy() for name in ("phase", "category")})
    with open(path, "wb") as handle:
        pickle.dump({"timeline": columns, "allocator": allocator_events()}, handle)


def allocator_events() -> dict:
    """The CUDA caching allocator's recorded events (action, address, size) and its segments at the end, as numpy
    arrays; recording stops. Where the snapshot fails, the error (the rows matter more than the trace)."""
    import numpy as np
    import torch

    try:
        snapshot = torch.cuda.memory._snapshot()
        trace = [e for device_trace in snapshot["device_traces"] for e in device_trace]
        actions = sorted({e["action"] for e in trace})
        return {"actions": actions, "action": np.array([actions.index(e["action"]) for e in trace], np.int8),
                "addr": np.array([e["addr"] for e in trace], np.int64),
                "size": np.array([e["size"] for e in trace], np.int64),
                "segments_at_end": [(s["address"], s["total_size"]) for s in snapshot["segments"]]}
    except Exception as error:
        return {"error": repr(error)}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def device_figures() -> dict:
    """The GPU's own numbers for its profile (data/gpus/*.json): capacity, a bare process's device memory outside
    the caching allocator once CUDA is up (the context before kernel modules load), the same after one bf16
    matmul, and what that matmul allocated through the caching allocator beyond its output (cuBLAS workspace)."""
    import torch

    torch.cuda.set_device(0)
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    bare, before = total - free - torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    b = a @ a
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - before - b.untyped_storage().nbytes()
    free, _ = torch.cuda.mem_get_info()
    return {"device": torch.cuda.get_device_name(0), "capability": "%d.%d" % torch.cuda.get_device_capability(0),
            "capacity_bytes": torch.cuda.get_device_properties(0).total_memory, "mem_get_info_total": total,
            "bare_context_bytes": bare, "context_after_matmul_bytes": total - free - torch.cuda.memory_reserved(),
            "first_matmul_workspace_bytes": workspace, "torch": torch.__version__, "cuda": torch.version.cuda}


class _RealLiger:
    """Liger's Triton fused linear cross-entropy where llmsim.model.losses calls its imitation (`LigerForCausalLMLoss`
    passes reduction "mean", no bias, accum_dtype None: the imitation's own arguments)."""

    @staticmethod
    def apply(hidden_states, weight, target, paths):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(hidden_states, weight, target, reduction="mean")


def _use_real_liger() -> None:
    from llmsim.model import losses

    losses.FUSED_LINEAR_CROSS_ENTROPY = _RealLiger


def _profile_name(device_name: str) -> str:
    from llmsim.inputs.gpus import gpu_names, load_gpu

    for name in gpu_names():
        if load_gpu(name).device_name == device_name:
            return name
    return ""


def dry_run(gpu_name: str) -> int:
    from llmsim.inputs.gpus import load_gpu
    from llmsim.sim.pipeline import predict
    from llmsim.app.report import human_bytes

    gpu = load_gpu(gpu_name)
    for entry in MATRIX:
        spec, setup = _setup(entry)
        rank = predict(spec, setup, gpu=gpu).ranks[0]
        print(f"{entry}: predicted allocated {human_bytes(rank.peak_allocated_bytes)}, reserved "
              f"{human_bytes(rank.peak_reserved_bytes)}, device total {human_bytes(rank.device_total_bytes)}, "
              f"host {human_bytes(rank.peak_host_bytes)}, "
              f"fits {gpu.name}: {rank.fits}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--gpu", default="h200", help="profile for --dry-run predictions")
    parser.add_argument("--out", type=Path, help="write rows, traces, failures and device figures here")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="start no run after this many seconds")
    parser.add_argument("--skip", type=int, default=0, help="start at this entry of MATRIX (a second call's rest)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: one configuration as JSON
    parser.add_argument("--trace", help=argparse.SUPPRESS)  # child process: pickle its traces here
    parser.add_argument("--device-figures", action="store_true", help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(worker(tuple(json.loads(args.one)), args.trace)))
        return 0
    if args.device_figures:
        print(json.dumps(device_figures()))
        return 0
    if args.dry_run:
        return dry_run(args.gpu)
    from llmsim.measure.runs import append_rows

    csv = args.out / "tier4_gpu.csv" if args.out else TIER4_CSV
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, __file__, "--device-figures"], capture_output=True, text=True,
                              timeout=PER_RUN_TIMEOUT_S)
        (args.out / "device.json").write_text(proc.stdout)
        if proc.stderr:  # appended: experiments/gpu_trainer.py's failures may be there already
            with open(args.out / "failures.log", "a") as log:
                log.write(f"=== device figures\n{proc.stderr}\n")
        print(proc.stdout, proc.stderr[-3000:], flush=True)
    start, failures, done = time.perf_counter(), 0, 0
    for index, entry in enumerate(MATRIX):
        if index < args.skip:
            continue
        if time.perf_counter() - start > args.deadline:
            print(f"deadline: {len(MATRIX) - index} entries not run", flush=True)
            break
        trace = str(args.out / f"trace_{index:02d}.pkl") if args.out else None
        command = [sys.executable, __file__, "--one", json.dumps(entry)] + (["--trace", trace] if trace else [])
        began, proc = time.perf_counter(), None
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=PER_RUN_TIMEOUT_S)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as error:
            failures += 1
            stderr = proc.stderr if proc is not None else error.stderr
            if isinstance(stderr, bytes):
                stderr = stderr.decode(errors="replace")
            print(f"FAILED {entry} after {time.perf_counter() - began:.0f} s: {type(error).__name__}\n"
                  f"{(stderr or '')[-1500:]}", flush=True)
            if args.out:
                with open(args.out / "failures.log", "a") as log:
                    log.write(f"=== {entry} {type(error).__name__}\n{stderr or ''}\n")
            if failures == 2 and done == 0:  # the environment, not one configuration: stop, save device time
                print("the first two runs failed: stopping", flush=True)
                break
            continue
        finally:
            _bundle(args.out, index // RUNS_PER_ARCHIVE)
        done += 1
        append_rows([row], csv)
        print(entry, row["peak_allocated_bytes"], row["peak_reserved_bytes"], row["device_total_bytes"],
              f"{time.perf_counter() - began:.0f} s", flush=True)
    return 1 if failures else 0


def _bundle(out: Path | None, part: int) -> None:
    """Move the run's trace pickle into DIR/traces_<part>.tar.gz (few files back, whatever the count of runs)."""
    if out is None:
        return
    pickles = sorted(out.glob("trace_*.pkl"))
    if not pickles:
        return
    archive = out / f"traces_{part}.tar.gz"
    members = {}
    if archive.exists():
        with tarfile.open(archive) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    for path in pickles:
        members[path.name] = path.read_bytes()
        path.unlink()
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    sys.exit(main())
