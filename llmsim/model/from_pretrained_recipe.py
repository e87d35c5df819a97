"""Tensor and expert parallelism as a user runs them, measured: `from_pretrained` with transformers' own
parallelism, then a plain PyTorch loop.

    model = AutoModelForCausalLM.from_pretrained(dir, dtype=...,
                                                 distributed_config=DistributedConfig(tp_size=N))   # TP, plan "auto"
    model = AutoModelForCausalLM.from_pretrained(dir, dtype=..., distributed_config=DistributedConfig(
        tp_size=N, ep_size=N))                                                              # TP + EP (MoE)
(`from_pretrained(tp_plan="auto")` is the deprecated spelling of the first: transformers turns it into the same
DistributedConfig.)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for step in range(3):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)

This is transformers' own TP example (examples/3D_parallel.py, without its data loader): the HF Trainer refuses
a TP model on the CPU (accelerate's ParallelismConfig wants GPUs), so the loop is the user's. Nothing of the
predictor is imported: the tracker (the instrument) and the phase names only.

On the CPU a loaded tensor stays a view of the safetensors file mapping -- a TP shard is a slice of the whole
checkpoint tensor -- where a GPU holds the copy `.to(device)` makes of the shard: the tracker counts that copy
(`StorageTracker.loading_checkpoint`, `adopt_loaded`). The checkpoint is written before the tracker starts.

`routing` (MoE rows only) forces the experts' `top_k_index` on every layer, as experiments/moe_routing.py does:
"balanced" (every expert the same number of (token, slot) pairs), "collapsed" (every token onto the first
experts, all on EP rank 0) or None (the router's own choice). The tensor is made before the tracker starts.

Run under torchrun: `python -m torch.distributed.run --nproc_per_node N -m llmsim.model.from_pretrained_recipe
JOB OUT`; each rank writes its timeline under OUT.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from llmsim.enums import Phase
from llmsim.model.gloo import FSDP2_COLLECTIVES, SETTLE_S, settled_collectives
from llmsim.model.tracker import StorageTracker

def forced_routing(routing: str, tokens: int, top_k: int, experts: int):
    """`top_k_index` of `tokens` rows: balanced (pair i to expert i mod experts, so the k slots of a row are
    distinct experts), or collapsed (every row onto experts 0..k-1)."""
    import torch

    if routing == "balanced":
        pairs = torch.arange(tokens * top_k) % experts
        return pairs.view(tokens, top_k)
    if routing == "collapsed":
        return torch.arange(top_k).repeat(tokens, 1)
    raise ValueError(f"routing {routing!r}: balanced | collapsed | None (the router's)")


def _settled_waits():
    """gloo's worker thread can hold a collective's buffers past the wait; NCCL drops them there. Each wait of a
    functional collective (DTensor's, `all_to_all_single_autograd`) and each synchronous c10d collective is given
    SETTLE_S; FSDP2's asynchronous all-gathers and reduce-scatters are waited for as they are issued, then given
    it (FSDP2 keeps its own references until its own wait). An OLMoE FSDP2 run on 2 ranks came out 218,688 B over
    on one rank in 2 of 4 runs with a 2 ms sleep alone (the first held-out run among them), in 2 of 5 with the
    reduce-scatters waited for, in none of 5 with the all-gathers waited for too; a 4-rank run on 2 cores was still
    256,288 B over on one rank until the sleep was 10 ms. So the rows are what a GPU run holds."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    wait = torch.ops._c10d_functional.wait_tensor.default

    class SettledWaits(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is wait:
                time.sleep(SETTLE_S)
            return out

    from transformers.distributed import expert_parallel

    # FSDP2's collectives as the Trainer's FSDP rows settle them, and the synchronous ones expert and tensor
    # parallelism add (transformers' EP imports its collectives by name)
    stack = settled_collectives((("all_to_all_single", False), ("broadcast", False), *FSDP2_COLLECTIVES),
                                also_in=(expert_parallel,))
    stack.enter_context(SettledWaits())
    return stack


def run(job: dict) -> dict:
    """One rank: `job` has checkpoint, config (the HF config dict), load_dtype, distributed (DistributedConfig's
    fields), micro_batch, seq_len, steps, routing, gloo_settle (default true: each wait settled)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    directory = Path(job["checkpoint"])
    config = job["config"]
    routing = job.get("routing")
    forced = None
    if routing:
        top_k = config.get("num_experts_per_tok")
        experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
        forced = forced_routing(routing, job["micro_batch"] * job["seq_len"], top_k, experts)
    tracker = StorageTracker()
    if forced is not None:
        tracker.exclude([forced])
    with tracker, (_settled_waits() if job.get("gloo_settle", True) else contextlib.nullcontext()):
        with tracker.loading_checkpoint():
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=getattr(torch, job["load_dtype"]),
                distributed_config=DistributedConfig(**job["distributed"]))
        tracker.adopt_loaded([*model.parameters(), *model.buffers()])
        if forced is not None:
            hooked = [m.register_forward_pre_hook(lambda module, args: (args[0], forced, *args[2:]))
                      for name, m in model.named_modules() if name.endswith("mlp.experts")]
            if not hooked:
                raise RuntimeError("routing given, but the model has no mlp.experts module")
        model.train()
        torch.manual_seed(0)
        batch = torch.randint(0, config["vocab_size"], (job["micro_batch"], job["seq_len"]))  # the data loader's
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for step in range(job["steps"]):
            tracker.set_phase(step, Phase.FORWARD)
            loss = model(input_ids=batch, labels=batch).loss
            tracker.set_phase(step, Phase.BACKWARD)
            loss.backward()
            tracker.set_phase(step, Phase.OPTIMIZER)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
        tracker.finish()
    loaded = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
    return {"timeline": tracker.timeline(), "loaded_dtype": loaded, "rank": dist.get_rank()}


def main() -> int:
    import torch.distributed as dist

    job, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        result = run(job)
    finally:
        dist.destroy_process_group()
    rank = result["rank"]
    result["timeline"].to_pickle(out / f"rank{rank}.timeline.pkl")
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "loaded_dtype": result["loaded_dtype"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
