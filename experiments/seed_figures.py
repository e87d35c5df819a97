"""The seeds' worked figures next to llmsim's predictions (issue 5).

Seeds (../shared/seeds): the PEFT memory guide says a 1B-parameter model in fp16 takes 1e9 x 2 B = 1.863 GiB and
full fine-tuning adds gradients (1x) and Adam states (2x) for 5.59 GiB; the LLMem article's rule of thumb says
fine-tuning X billion parameters in bf16 needs 4 * (2X) = 8X GB (Llama-7B: 56 GB).
llmsim's setup: the canonical step in pure bf16 built directly in bf16 (`--build-dtype bf16`), client AdamW,
micro-batch 1, CPU kernels. Run: python experiments/seed_figures.py (about a minute).
"""
from __future__ import annotations

from llmsim.enums import Category, Precision
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec

GIB, GB = 2**30, 10**9
SEED_1B_FP16_GIB = 1e9 * 2 / GIB  # 1.863
SEED_STATES_GIB = 3 * SEED_1B_FP16_GIB  # 5.59


def parameter_count(name: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_model_spec(name).hf_config())
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    print(f"seed: 1B params in fp16 = {SEED_1B_FP16_GIB:.3f} GiB; "
          f"gradients + Adam states (3x) = {SEED_STATES_GIB:.2f} GiB")
    print(f"{'model':<13} {'params':>6} {'seq':>5} {'ckpt':>5} {'peak GB':>8} {'at':>16} {'param GiB':>9} "
          f"{'grad GiB':>8} {'Adam GiB':>8} {'act+tmp GiB':>11} {'rule 8X GB':>10} {'rule err':>8}")
    for name in ("pythia-1b", "llama-2-7b", "mistral-7b", "llama-3.1-8b"):
        n = parameter_count(name)
        for seq, ckpt in ((512, True), (4096, True), (4096, False), (16384, True)):
            setup = TrainSetup(1, seq, Precision.BF16, grad_ckpt=ckpt, build_bf16=True)
            rank = predict(load_model_spec(name), setup).ranks[0]
            b = rank.peak.breakdown_bytes
            other = sum(v for k, v in b.items() if k not in (Category.PARAMETER.value, Category.GRADIENT.value,
                                                             Category.OPTIMIZER_STATE.value))
            rule, peak_gb = 8 * n / 1e9, rank.peak_allocated_bytes / GB
            print(f"{name:<13} {n / 1e9:>5.2f}B {seq:>5} {str(ckpt):>5} {peak_gb:>8.2f} "
                  f"{f'step {rank.peak.step + 1} {rank.peak.phase}':>16} {b.get('parameter', 0) / GIB:>9.2f} "
                  f"{b.get('gradient', 0) / GIB:>8.2f} {b.get('optimizer_state', 0) / GIB:>8.2f} {other / GIB:>11.2f} "
                  f"{rule:>10.2f} {100 * (rule - peak_gb) / peak_gb:>+7.1f}%")


if __name__ == "__main__":
    main()
