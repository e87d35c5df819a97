"""LLMem's single-GPU setting (Kim et al., IJCAI 2024), reproduced as far as llmsim's strategies allow (issue 6).

LLMem's setting (from its repository, taehokim20/LLMem, `dp_real.py` and `size_estimator.py`): OPT-125m/350m,
BLOOM-560m, CodeGen-350M on a 16 GB Tesla V100; transformers 4.29 (eager attention: no SDPA yet); weights
cast with `model.half()`; gradient checkpointing on; sequence length 512 (only full 512-token batches);
3 steps; the largest batch whose estimate fits. What differs here:
- LLMem trains through Colossal-AI Gemini (fp16 parameters in chunks, an fp32 master copy per parameter,
  gradients reusing the fp16 chunks, HybridAdam with fp32 moments: about 14 B/parameter). llmsim has no
  Gemini strategy; the two nearest canonical steps are shown: `fp16` (model.half(), torch AdamW with fp16
  states: 8 B/parameter) and `fp16-autocast` (torch AMP: fp32 weights, gradients and states, 16 B/parameter).
- LLMem's ground truth is nvidia-smi's used memory (plus its NVML offset); llmsim's device total is the
  caching allocator's reserved bytes plus the profile's CUDA context (data/gpus/v100-16gb.json, unmeasured).
- CodeGen-350M: LLMem used the -nl checkpoint, the zoo holds -mono (same architecture and vocabulary size).
- LLMem's per-model table (Table 2: batch size, measured and estimated peak) could not be read from this
  machine (no copy of the paper's body is reachable offline); only its headline errors are known (0.4-1.6 %).
  The table below is llmsim's side; put LLMem's numbers next to it when the paper is at hand.
Run: python experiments/llmem_v100.py (about three minutes); output saved in llmem_v100.out.
"""
from __future__ import annotations

from dataclasses import replace

from llmsim.app import size
from llmsim.enums import Attention, Precision
from llmsim.inputs.gpus import load_gpu
from llmsim.sim.pipeline import predict
from llmsim.app.report import human_bytes
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout

MODELS = ("opt-125m", "opt-350m", "bloom-560m", "codegen-350m-mono")
SEQ_LEN, MAX_MICRO_BATCH = 512, 512


def largest_micro_batch(spec, precision: Precision, gpu) -> tuple[int, object]:
    """`llmsim size`'s search (double while it fits, then bisect) on one GPU: (largest micro-batch that fits,
    its rank prediction, or None when micro-batch 1 does not fit)."""
    setup = TrainSetup(1, SEQ_LEN, precision, Attention.EAGER, grad_ckpt=True)
    micro_batch, _ = size.largest_micro_batch(spec, setup, size.Candidate("single", 1, lambda mb: Layout()), gpu,
                                              MAX_MICRO_BATCH)
    if not micro_batch:
        return 0, None
    return micro_batch, predict(spec, replace(setup, micro_batch=micro_batch), gpu=gpu).ranks[0]


def main() -> None:
    gpu = load_gpu("v100-16gb")
    print(f"{gpu.device_name}: capacity {human_bytes(gpu.capacity_bytes)}, seq {SEQ_LEN}, checkpointing, eager "
          f"attention, CUDA kernels of sm{gpu.compute_capability.replace('.', '')}")
    print(f"{'model':<18} {'precision':<14} {'largest mb':>10} {'allocated':>11} {'reserved':>11} "
          f"{'device total':>12} {'headroom':>10} {'peak at':>16}")
    for name in MODELS:
        spec = load_model_spec(name)
        for precision in (Precision.FP16, Precision.FP16_AUTOCAST):
            micro_batch, rank = largest_micro_batch(spec, precision, gpu)
            if rank is None:
                print(f"{name:<18} {precision.value:<14} {'0':>10}  (micro-batch 1 does not fit)")
                continue
            print(f"{name:<18} {precision.value:<14} {micro_batch:>10} {human_bytes(rank.peak_allocated_bytes):>11} "
                  f"{human_bytes(rank.peak_reserved_bytes):>11} {human_bytes(rank.device_total_bytes):>12} "
                  f"{human_bytes(gpu.capacity_bytes - rank.device_total_bytes):>10} "
                  f"{f'step {rank.peak.step + 1} {rank.peak.phase}':>16}", flush=True)


if __name__ == "__main__":
    main()
