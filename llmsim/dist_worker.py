"""One rank of a measured multi-process canonical step (tier 2), launched by `llmsim.launch` via torchrun.

    loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()     # DeepSpeed
    loss = ddp(input_ids=x, labels=x).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

The storage tracker runs in every rank from before the model is built to the end of step 3; each rank
writes its peak and its timeline to the output folder.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from llmsim.enums import Attention, Category, Phase, Precision
from llmsim.peaks import replay
from llmsim.spec import TrainSetup
from llmsim.step import LayerHooks, run_canonical_step
from llmsim.tracker import StorageTracker


DDP_BUCKET_CAP_MB = 25  # torch DistributedDataParallel's default


def _build(job: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(job["config_json"]))
    dtype = torch.bfloat16 if job.get("build_bf16") else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=job["attention"])


def run_deepspeed(job: dict, tracker: StorageTracker) -> None:
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = job["ds_config"]
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    with tracker:
        keep_alive = HfDeepSpeedConfig(ds_config) if stage == 3 else None  # zero.Init inside from_config
        model = _build(job)
        hooks = LayerHooks(tracker, model, None)
        model.train()
        if job["grad_ckpt"]:
            model.activation_checkpointing_enable(every_n_layers=job["ckpt_every"])
        optimizer = None if "optimizer" in ds_config else torch.optim.AdamW(model.parameters())
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        hooks.label_model()
        vocab_size = model.get_input_embeddings().num_embeddings
        batch = torch.randint(0, vocab_size, (job["micro_batch"], job["seq_len"]))
        tracker.label([batch], Category.INPUT)
        for step in range(job["steps"]):
            tracker.set_phase(step, Phase.FORWARD)
            loss = engine(input_ids=batch, labels=batch).loss
            tracker.set_phase(step, Phase.BACKWARD)
            hooks.enter_backward()
            engine.backward(loss)
            tracker.set_phase(step, Phase.OPTIMIZER)
            engine.step()
        tracker.finish()
    del keep_alive


def run_ddp(job: dict, tracker: StorageTracker) -> None:
    """The canonical step with the model wrapped in DistributedDataParallel before the optimizer is built."""
    from torch.nn.parallel import DistributedDataParallel

    setup = TrainSetup(job["micro_batch"], job["seq_len"], Precision(job["precision"]), Attention(job["attention"]),
                       job["grad_ckpt"], job["ckpt_every"], job["steps"], build_bf16=bool(job.get("build_bf16")))
    bucket_cap_mb = job.get("bucket_cap_mb", DDP_BUCKET_CAP_MB)
    run_canonical_step(lambda: _build(job), setup, tracker,
                       wrap=lambda model: DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    torch.manual_seed(0)
    if job["framework"] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    tracker = StorageTracker()
    (run_deepspeed if job["framework"] == "deepspeed" else run_ddp)(job, tracker)
    timeline = tracker.timeline()
    timeline.to_csv(args.out / f"rank{rank}.timeline.csv", index=False)
    peak = replay(timeline)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "peak_allocated_bytes": peak.allocated_bytes, "peak_phase": peak.phase,
         "peak_step": peak.step, "peak_layer": peak.layer, "breakdown_bytes": peak.breakdown_bytes}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
