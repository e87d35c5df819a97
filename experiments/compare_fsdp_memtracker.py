"""llmsim's FSDP2 prediction against torch's own FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker) at
full size: Llama-2-7B, 13B and 70B on 8 to 64 ranks, each run whole (every layer, full width) under FakeTensorMode
as rank 0 of a fake process group.

Both run the same job -- the model built on the meta device, checkpointing on every decoder layer, `fully_shard`
on each layer then the root (llmsim/model/fsdp.py, `shard`), `to_empty` and transformers' `_init_weights`,
torch.optim.AdamW, three steps of `model(input_ids=x, labels=x).loss.backward(); opt.step();
opt.zero_grad()` -- on the CPU's kernels (FSDPMemTracker does not choose CUDA's). FSDPMemTracker counts the
storages it sees (parameters, gradients, optimizer states, FSDP's all-gather and reduce-scatter buffers,
activations, temporaries) per device; llmsim counts every storage its own dispatch mode sees, traced at reduced
depth and expanded to the full stack. The table gives both peaks and their difference. Run:
python experiments/compare_fsdp_memtracker.py (several minutes on 2 cores); the output is
experiments/compare_fsdp_memtracker.out.
"""
from __future__ import annotations

import contextlib
import sys
import time
from unittest import mock

import torch

from llmsim.enums import Attention, Precision
from llmsim.inputs.spec import FsdpSetup, TrainSetup, load_model_spec
from llmsim.model import fsdp
from llmsim.model.step import enable_checkpointing
from llmsim.model.tensor_parallel import fake_process_group
from llmsim.model.trace import _apply_as_on_cpu, decide_like_a_real_run
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy

CASES = [("llama-2-7b", 8), ("llama-2-13b", 16), ("llama-2-70b", 64)]
SEQ_LEN, MICRO_BATCH, STEPS = 2048, 1, 3


def memtracker_peak(model_name: str, world: int) -> int:
    """FSDPMemTracker's peak (all categories, the CPU device) of rank 0 over three steps."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoModelForCausalLM

    spec = load_model_spec(model_name)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_process_group(world))
        mesh = fsdp.mesh_1d(world)
        stack.enter_context(FakeTensorMode())
        stack.enter_context(decide_like_a_real_run())
        stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", _apply_as_on_cpu))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32,
                                                     attn_implementation="sdpa")
        model.to(torch.bfloat16)
        model.train()
        enable_checkpointing(model, 1, False)
        fsdp.shard(model, FsdpSetup(), mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randint(0, spec.hf_config().vocab_size, (MICRO_BATCH, SEQ_LEN))
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch,))
        with tracker:
            for _ in range(STEPS):
                model(input_ids=batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()  # its per-module stats take one iteration; the peak is kept
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def llmsim_peak(model_name: str, world: int) -> int:
    setup = TrainSetup(MICRO_BATCH, SEQ_LEN, Precision.BF16, Attention.SDPA, grad_ckpt=True)
    prediction = predict(load_model_spec(model_name), setup, Layout(Strategy.FSDP, world, fsdp=FsdpSetup()))
    return prediction.ranks[0].peak.allocated_bytes


def main() -> int:
    print(f"seq {SEQ_LEN}, micro-batch {MICRO_BATCH}, bf16 (model.to), checkpointing, FSDP2 reshard, meta init, "
          "AdamW, CPU kernels; peaks of rank 0 in bytes")
    print(f"{'model':<12} {'ranks':>5} {'FSDPMemTracker B':>17} {'llmsim B':>15} {'difference':>11} "
          f"{'tracker s':>10} {'llmsim s':>9}")
    for model_name, world in CASES:
        start = time.perf_counter()
        theirs = memtracker_peak(model_name, world)
        middle = time.perf_counter()
        ours = llmsim_peak(model_name, world)
        end = time.perf_counter()
        print(f"{model_name:<12} {world:>5} {theirs:>17,} {ours:>15,} {(ours - theirs) / theirs:>+10.3%} "
              f"{middle - start:>10.1f} {end - middle:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
