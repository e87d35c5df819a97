"""Feasibility study: DeepSpeed ZeRO-Infinity (`offload_optimizer`/`offload_param` with `"device": "nvme"`) run for
real on this CPU (CPU accelerator, gloo, DeepSpeed's async_io op JIT-built against libaio), with llmsim's storage
tracker and HostMemory in every rank, beside the same run with `"device": "cpu"`.

Run: python experiments/explore_nvme_offload.py [VARIANT ...] [--world N]  (a launcher: torchrun per variant)
     (worker: python -m torch.distributed.run --nproc_per_node N experiments/explore_nvme_offload.py --worker V)
Findings: docs/nvme-offload.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AIO = {"block_size": 262144, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True, "use_gds": False}
OPT_BUF = 4  # optimizer swapper buffer_count (Adam: param, grad, exp_avg, exp_avg_sq)
PARAM_BUF = (5, 100_000)  # offload_param buffer_count, buffer_size (elements); DeepSpeed's defaults: 5, 1e8


def config(variant: str, path: str) -> dict:
    """variant: '<stage>-<opt device>[-<param device>][-ds][-bf16][-pipe][-sg|-sg3][-bigv][-nopf]'."""
    parts = variant.split("-")
    stage, opt_dev = int(parts[0]), parts[1]
    param_dev = parts[2] if len(parts) > 2 and parts[2] in ("cpu", "nvme") else None
    offload_opt = {"device": opt_dev, "pin_memory": True}
    if opt_dev == "nvme":
        offload_opt.update(nvme_path=path, buffer_count=OPT_BUF, pipeline_read="pipe" in parts,
                           pipeline_write="pipe" in parts)
    zero = {"stage": stage, "offload_optimizer": offload_opt, "reduce_bucket_size": 300_000}
    if "sg" in parts:  # several sub-groups: the swap buffers are sized by the largest
        zero["sub_group_size"] = 100_000  # (each sub-group under 1 MiB: kept in memory, not swapped)
    if "nopf" in parts:  # no prefetch (the coordinator's nvme prefetch asserted in a forward)
        zero["stage3_prefetch_bucket_size"] = 0
    if "sg3" in parts:  # two sub-groups over 1 MiB (fp32): both swapped
        zero["sub_group_size"] = 300_000
    if param_dev:
        zero["offload_param"] = {"device": param_dev, "pin_memory": True}
        if param_dev == "nvme":
            size = 300_000 if "bigv" in parts else PARAM_BUF[1]  # >= the largest swappable partition (asserted)
            zero["offload_param"].update(nvme_path=path, buffer_count=PARAM_BUF[0], buffer_size=size,
                                         max_in_cpu=0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": zero, "aio": AIO}
    if "ds" in parts:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
    else:
        cfg["zero_force_ds_cpu_optimizer"] = False
    if "bf16" in parts:
        cfg["bf16"] = {"enabled": True}
    return cfg


def worker(variant: str, tracked: bool) -> None:
    import contextlib

    import torch
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from llmsim.enums import Phase
    from llmsim.measure.dist_worker import _deepspeed_settled
    from llmsim.model.host_memory import optimizer_offload
    from llmsim.model.offload import host_peak_bytes, split_host
    from llmsim.model.tracker import StorageTracker
    from llmsim.sim.peaks import replay

    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    path = os.environ["NVME_DIR"]
    cfg = config(variant, path)
    tracker = StorageTracker()
    stage = cfg["zero_optimization"]["stage"]
    t0 = time.time()
    ctx = (contextlib.ExitStack() if not tracked else contextlib.ExitStack())
    with ctx:
        if tracked:
            ctx.enter_context(tracker)
            ctx.enter_context(optimizer_offload(tracker, cfg))
            ctx.enter_context(_deepspeed_settled(True))
        keep = HfDeepSpeedConfig(cfg) if stage == 3 else None
        vocab = 4608 if "bigv" in variant.split("-") else 1000  # bigv: embedding partitions over 1 MiB at 2 ranks
        mcfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                                    max_position_embeddings=128)
        model = AutoModelForCausalLM.from_config(mcfg, attn_implementation="sdpa")
        model.train()
        optimizer = None if "optimizer" in cfg else torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        batch = torch.randint(0, vocab, (2, 64))
        losses = []
        for step in range(3):
            if tracked:
                tracker.set_phase(step, Phase.FORWARD)
            loss = engine(input_ids=batch, labels=batch).loss
            if tracked:
                tracker.set_phase(step, Phase.BACKWARD)
            engine.backward(loss)
            if tracked:
                tracker.set_phase(step, Phase.OPTIMIZER)
            engine.step()
            losses.append(round(loss.item(), 4))
        if tracked:
            tracker.finish()
    wall = time.time() - t0
    opt = engine.optimizer
    info = {"rank": rank, "variant": variant, "losses": losses, "wall_s": round(wall, 1),
            "optimizer": type(opt).__name__, "inner": type(getattr(opt, "optimizer", None)).__name__,
            "swap_optimizer": getattr(opt, "swap_optimizer", None),
            "params_in_nvme": getattr(opt, "params_in_nvme_and_cpu", None)}
    # the swap buffers: the optimizer swapper's pool, the parameter swapper's pool
    buffers = {}
    swapper = getattr(opt, "optimizer_swapper", None)
    if swapper is not None:
        info["opt_swapper"] = type(swapper).__name__
        info["opt_largest_numel"] = swapper.largest_numel
        buffers["opt_swap"] = swapper.swap_buffer_manager.all_buffers
        info["opt_min_aio_bytes"] = swapper.min_aio_bytes
    fp16_groups = getattr(opt, "fp16_groups", None)
    pswap = getattr(fp16_groups[0][0], "nvme_swapper", None) if fp16_groups else None
    if pswap is not None:
        info["param_swapper"] = type(pswap).__name__
        info["param_buffer"] = [pswap.param_buffer_count, pswap.elements_per_buffer, str(pswap.dtype)]
        buffers["param_swap"] = [pswap.buffers] + ([pswap.partitioned_swap_buffer]
                                              if pswap.partitioned_swap_buffer is not None else [])
        info["param_nvme_status"] = sorted({str(p.ds_tensor.status) for g in fp16_groups for p in g})
        info["param_ds_tensor_numel_on_host"] = sum(p.ds_tensor.numel() for g in fp16_groups for p in g
                                                     if p.ds_tensor.numel() > 0)
    info["buffers"] = {k: [(b.numel(), str(b.dtype), b.untyped_storage().nbytes()) for b in v]
                       for k, v in buffers.items()}
    info["files"] = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = Path(dirpath, f)
            info["files"][str(p.relative_to(path))] = p.stat().st_size
    info["files_total_bytes"] = sum(info["files"].values())
    if tracked:
        timeline = tracker.timeline()
        aio = {tracker._live[b.untyped_storage()._cdata].serial for v in buffers.values() for b in v
               if b.untyped_storage()._cdata in tracker._live}
        info["aio_serials_tracked"] = sorted(aio)
        device, host = split_host(timeline)
        peak = replay(device)
        info["device_peak"] = peak.allocated_bytes
        info["device_peak_where"] = (peak.step, peak.phase, peak.breakdown_bytes)
        info["host_peak"] = host_peak_bytes(host)
        is_aio = device["serial"].isin(aio)
        info["aio_bytes_in_device_side"] = int(device.loc[is_aio, "delta_bytes"].clip(lower=0).sum())
        if aio:
            dev2 = device[~is_aio].reset_index(drop=True)
            host2 = timeline[timeline["category"].isin(["host_offload"]) | timeline["serial"].isin(aio)]
            info["device_peak_without_aio"] = replay(dev2).allocated_bytes
            info["host_peak_with_aio"] = host_peak_bytes(host2.reset_index(drop=True))
        info["all_peak"] = int(timeline["delta_bytes"].cumsum().max())
        timeline.to_csv(Path(os.environ["OUT_DIR"]) / f"{variant}.w{torch.distributed.get_world_size()}.rank{rank}.csv",
                            index=False)
    print("RESULT", json.dumps(info, default=str), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def launch(variant: str, world: int, tracked: bool, timeout: int) -> int:
    out = Path(__file__).with_name("explore_nvme_offload_runs")
    out.mkdir(exist_ok=True)
    nvme = tempfile.mkdtemp(prefix="llmsim-nvme-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NVME_DIR": nvme, "OUT_DIR": str(out),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    import socket
    with socket.socket() as sock:  # (--master_port=0 hung the first try)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}",
           __file__, "--worker", variant] + ([] if tracked else ["--untracked"])
    print(f"== {variant} world={world} tracked={tracked}: {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        output += "\nTIMEOUT"
    lines = output.splitlines()
    for line in lines:
        if "RESULT" in line:
            print(line[line.index("RESULT"):], flush=True)
    if proc.returncode:
        keep = [l for l in lines if "Error" in l or "assert" in l.lower() or "raise" in l or "File " in l]
        print("FAILED rc", proc.returncode, "\n" + "\n".join((keep or lines)[-25:]), flush=True)
    print(f"   exit {proc.returncode} in {time.time() - start:.0f} s", flush=True)
    shutil.rmtree(nvme, ignore_errors=True)
    return proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="*")
    parser.add_argument("--worker")
    parser.add_argument("--untracked", action="store_true")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=240)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, not args.untracked)
        return 0
    return max([launch(v, args.world, not args.untracked, args.timeout) for v in args.variants] or [0])


if __name__ == "__main__":
    raise SystemExit(main())
