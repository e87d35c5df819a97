"""One rank of a measured multi-process canonical step (tier 2), launched by `llmsim.measure.launch` via torchrun.

    loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()     # DeepSpeed (every
                                                      # micro-step: the engine steps at gradient_accumulation_steps)
    loss = ddp(input_ids=x, labels=x).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    loss = model(input_ids=x, labels=x).loss; ...       # tensor parallel: the model is this rank's TP shards

The storage tracker runs in every rank from before the model is built to the end of step 3; each rank
writes its peak and its timeline to the output folder.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmsim.enums import Attention, Loss, Optimizer, Precision
from llmsim.model.ds_script import build_causal_lm, run_deepspeed as run_deepspeed_script
from llmsim.model.offload import host_peak_bytes, split_host
from llmsim.sim.peaks import replay
from llmsim.inputs.spec import ModelSpec, TrainSetup
from llmsim.model.step import run_canonical_step, run_pipeline_step
from llmsim.model.tensor_parallel import parallel_mesh
from llmsim.model.trace import model_builder, rank_builders
from llmsim.model.tracker import StorageTracker


DDP_BUCKET_CAP_MB = 25  # torch DistributedDataParallel's default
GLOO_SETTLE_S = 0.001


def _build(job: dict):
    return build_causal_lm(job["config_json"], job["attention"], bool(job.get("build_bf16")))


def run_deepspeed(job: dict, tracker: StorageTracker) -> None:
    """The DeepSpeed script with the canonical step's levers (llmsim/model/ds_script.py, `run_deepspeed`): under
    AutoTP the same code the trace runs."""
    run_deepspeed_script(job["config_json"], job["ds_config"], _setup(job), tracker,
                         settled=_deepspeed_settled(bool(job.get("ds_gloo_settle"))))


def run_deepspeed_pipe(job: dict, tracker: StorageTracker) -> None:
    """DeepSpeed's pipeline engine on the model's layers (llmsim/model/ds_pipe.py): `deepspeed.initialize` on a
    PipelineModule, then `engine.train_batch` per step."""
    from llmsim.model import ds_pipe

    with _deepspeed_settled(bool(job.get("ds_gloo_settle"))):
        ds_pipe.run_step(job["config_json"], job["ds_config"], job["pp"], job["micro_batch"], job["seq_len"],
                         job["steps"], job["ckpt_every"] if job["grad_ckpt"] else 0, tracker,
                         job.get("partition_method") or ds_pipe.PARTITION_METHOD)


def _deepspeed_settled(settle: bool):
    """With `settle`, gloo's worker thread is given GLOO_SETTLE_S after each of DeepSpeed's collectives to drop
    its reference to their tensors, as NCCL's work does at the wait: after a synchronous one returns, and inside the
    wait of an asynchronous one (ZeRO-3's all-gathers). Without it, a bucket's flattened copy (`allreduce_bucket`)
    can outlive `average_tensor` while the next gradients are copied: seen with one bucket holding every gradient
    (DeepSpeed's default reduce_bucket_size on a small model), rank 1 1.1 MB over in one run of two. DeepSpeed's
    torch backend keeps its own references to `all_gather_into_tensor` and `reduce_scatter_tensor`, taken when
    `init_distributed` made it (before this), so those are settled there too; until 2026-12-04 they were not.
    It does not remove all of gloo's lateness (experiments/measure_offload_past_max_in_cpu.out: ZeRO-3 with the
    parameter swapper and 512-wide layers, one or both ranks 1.5-2.8 MB over on the device in 4 of 6 runs before,
    3 of 3 exact after; run 99, 512-wide with LoRA, one rank 897,020 B over once after)."""
    import contextlib

    if not settle:
        return contextlib.nullcontext()
    import torch.distributed as dist
    from deepspeed.comm import comm

    from llmsim.model.gloo import settled

    stack = contextlib.ExitStack()
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"):
        stack.enter_context(mock.patch.object(dist, name, settled(getattr(dist, name), GLOO_SETTLE_S,
                                                                  at_wait=True)))
    backend = comm.cdb
    for name in ("all_gather_function", "reduce_scatter_function"):
        if getattr(backend, name, None) is not None:
            stack.enter_context(mock.patch.object(backend, name, settled(getattr(backend, name), GLOO_SETTLE_S,
                                                                         at_wait=True)))
    return stack


def _setup(job: dict) -> TrainSetup:
    return TrainSetup(job["micro_batch"], job["seq_len"], Precision(job["precision"]), Attention(job["attention"]),
                      job["grad_ckpt"], job["ckpt_every"], job["steps"], build_bf16=bool(job.get("build_bf16")),
                      tp=job.get("tp", 1), pp=job.get("pp", 1), schedule=job.get("schedule", "gpipe"),
                      n_microbatches=job.get("n_microbatches", 1), stages_per_rank=job.get("stages_per_rank", 1),
                      pp_split=tuple(job["pp_split"]) if job.get("pp_split") else None,
                      lora_rank=job.get("lora_rank", 0), lora_alpha=job.get("lora_alpha", 16),
                      lora_targets=tuple(job["lora_targets"]) if job.get("lora_targets") else None,
                      optimizer=Optimizer(job.get("optimizer", Optimizer.ADAMW.value)),
                      grad_accum=job.get("grad_accum", 1), ckpt_offload=bool(job.get("ckpt_offload")),
                      loss=Loss(job.get("loss", Loss.HF.value)), loss_chunk=job.get("loss_chunk"),
                      lora_modules_to_save=_tuple(job.get("lora_modules_to_save")),
                      trainable_tokens=_tuple(job.get("trainable_tokens")), foreach=bool(job.get("foreach")),
                      fused=bool(job.get("fused")))


def _tuple(values: list | None) -> tuple | None:
    return tuple(values) if values else None


def run_ddp(job: dict, tracker: StorageTracker) -> None:
    """The canonical step with the model wrapped in DistributedDataParallel before the optimizer is built."""
    from torch.nn.parallel import DistributedDataParallel

    bucket_cap_mb = job.get("bucket_cap_mb", DDP_BUCKET_CAP_MB)
    run_canonical_step(lambda: _build(job), _setup(job), tracker,
                       wrap=lambda model: DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb))


def run_fsdp(job: dict, tracker: StorageTracker) -> None:
    """The canonical step with PyTorch FSDP2's `fully_shard` on every decoder layer and then the root, over all
    ranks, before the optimizer is built (llmsim/model/fsdp.py); gloo's worker thread settles after each
    reduce-scatter unless the job says not to (`gloo_settle`)."""
    from llmsim.inputs.spec import FsdpSetup
    from llmsim.model.fsdp import mesh_1d, meta_build, settled_collectives, shard

    fsdp = FsdpSetup.from_json(job["fsdp_config"])
    world_size = torch.distributed.get_world_size()
    mesh = mesh_1d(world_size)
    setup = replace(_setup(job), fsdp=fsdp, fsdp_world=world_size)
    build = (lambda: _build(job)) if fsdp.init == "full" else meta_build(lambda: _build(job))
    with settled_collectives(job.get("gloo_settle", True)):
        run_canonical_step(build, setup, tracker,
                           wrap=lambda model: shard(model, fsdp, mesh))


class GlooWorkSettles(TorchDispatchMode):
    """After each collective's `wait_tensor`, give gloo's worker thread a millisecond to drop its reference to
    the collective's tensors while this thread still holds them.

    Without it, which step keeps the LM head's gathered logits (and their local shard) alive until the
    backward is a thread race: when the worker is descheduled between completing the work and destroying
    it, its reference becomes the last one, and the free then waits for the GIL, which the forward holds
    until `loss.backward()` releases it (seen on a 3-layer Llama, TP 2: +9 % in one step out of three,
    rank and step changing run to run). NCCL releases a work's tensors when it is waited on; the
    prediction keeps that order, and with this mode the measured runs agree event for event with it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            time.sleep(GLOO_SETTLE_S)
        return out


def run_model_parallel(job: dict, tracker: StorageTracker) -> None:
    """This rank's pipeline stage (llmsim.model.pipelining) and shards of transformers' TP plan
    (llmsim.model.tensor_parallel): the canonical PP step, or the canonical step when there is one stage. With
    dp > 1 the stage is wrapped in DistributedDataParallel over its data-parallel group, or where TP shards it in
    torch's replicate (llmsim/model/replicate.py: DDP takes no DTensor), or with FSDP2 sharded by fully_shard per
    layer and then the stage (llmsim/model/fsdp.py); their collectives settle as FSDP2's do."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    from llmsim.inputs.spec import FsdpSetup
    from llmsim.model.fsdp import meta_build, settled_collectives, shard
    from llmsim.model.replicate import replicate_model

    dp, tp = job.get("dp", 1), job.get("tp", 1)
    mesh = parallel_mesh(dp, job.get("pp", 1), tp)
    setup = replace(_setup(job), pp_stage=mesh.get_coordinate()[1])
    fsdp = FsdpSetup.from_json(job["fsdp_config"]) if job.get("fsdp_config") else None
    if fsdp is not None:  # FSDP2 x PP (x TP): fully_shard per layer, then the stage, over the mesh's dp
        setup = replace(setup, fsdp=fsdp, fsdp_world=torch.distributed.get_world_size())
    spec = ModelSpec(job["model"], job["config_json"])
    # several stages a rank: one model per stage this rank holds
    build, first_blocks = (rank_builders(spec, setup, mesh) if setup.stages_per_rank > 1
                           else (model_builder(spec, setup, None, mesh), None))
    wrap, settled = None, contextlib.nullcontext()
    if fsdp is not None:
        if fsdp.init == "meta":
            build = [meta_build(each) for each in build] if isinstance(build, list) else meta_build(build)
        def wrap(model):
            return shard(model, fsdp, mesh["dp"])
        settled = settled_collectives(job.get("gloo_settle", True))
    elif job.get("replicate"):
        def wrap(model):
            return replicate_model(model, mesh["dp"])
        settled = settled_collectives(job.get("gloo_settle", True))
    elif dp > 1:
        def wrap(model):
            return DistributedDataParallel(model, process_group=mesh["dp"].get_group(),
                                           bucket_cap_mb=DDP_BUCKET_CAP_MB)
    with GlooWorkSettles(), settled:
        if setup.pp > 1:
            run_pipeline_step(build, setup, tracker, mesh["pp"].get_group(), wrap, first_blocks=first_blocks)
        else:
            run_canonical_step(build, setup, tracker, wrap=wrap)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    torch.manual_seed(0)
    if job["framework"] in ("deepspeed", "deepspeed_pipe"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    tracker = StorageTracker()
    runners = {"deepspeed": run_deepspeed, "ddp": run_ddp, "model_parallel": run_model_parallel, "fsdp": run_fsdp,
               "deepspeed_pipe": run_deepspeed_pipe}
    runners[job["framework"]](job, tracker)
    timeline = tracker.timeline()
    timeline.to_csv(args.out / f"rank{rank}.timeline.csv", index=False)
    device, host = split_host(timeline)  # offloaded checkpoint inputs are host memory (llmsim/model/offload.py)
    peak = replay(device)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "peak_allocated_bytes": peak.allocated_bytes, "peak_phase": peak.phase,
         "peak_step": peak.step, "peak_layer": peak.layer, "breakdown_bytes": peak.breakdown_bytes,
         "peak_host_bytes": host_peak_bytes(host)}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
