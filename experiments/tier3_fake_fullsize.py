"""Tier 3: full-size zoo models, the whole canonical step under FakeTensorMode at full depth.

The predictor traces 3 layers and replicates them; this runs every layer. Rows go to
data/measurements/tier3_fake_fullsize.csv and `llmsim validate` compares them (tolerance 1 %).
Run: python experiments/tier3_fake_fullsize.py [--moe: the MoE cases alone]   (a few minutes on 2 cores)
"""
from __future__ import annotations

import sys

from llmsim.enums import Attention, Precision
from llmsim.measure.runs import TIER3_CSV, append_rows, measure_single
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec

CASES = [
    # DESIGN.md's measured fact: 108,863,260,304 B
    ("llama-2-7b", TrainSetup(1, 2048, Precision.FP32)),
    # DESIGN.md's second measured fact (bf16, checkpointing, micro-batch 4, seq 1024)
    ("qwen2.5-1.5b", TrainSetup(4, 1024, Precision.BF16, grad_ckpt=True)),
    ("llama-3.1-8b", TrainSetup(2, 4096, Precision.BF16, grad_ckpt=True, ckpt_every=2)),
    ("mistral-7b", TrainSetup(1, 2048, Precision.BF16_AUTOCAST, grad_ckpt=True)),
    ("opt-1.3b", TrainSetup(8, 512, Precision.BF16, Attention.EAGER)),
    ("pythia-1.4b", TrainSetup(4, 2048, Precision.BF16_AUTOCAST)),
    ("bloom-1b7", TrainSetup(2, 1024, Precision.BF16, grad_ckpt=True)),
    ("gpt2-xl", TrainSetup(4, 1024, Precision.FP32, grad_ckpt=True, ckpt_every=3)),
]
# Mixture-of-experts models at full size (issue 25), transformers' grouped_mm experts: DeepSeek's dense first
# layers are traced apart from the periodic MoE ones, gpt-oss alternates sliding and full attention
MOE_CASES = [
    ("qwen3-30b-a3b", TrainSetup(1, 4096, Precision.BF16, grad_ckpt=True)),
    ("mixtral-8x7b", TrainSetup(1, 2048, Precision.BF16, grad_ckpt=True)),
    ("deepseek-v2-lite", TrainSetup(2, 2048, Precision.BF16_AUTOCAST, grad_ckpt=True, ckpt_every=2)),
    ("gpt-oss-20b", TrainSetup(1, 2048, Precision.BF16)),
    ("olmoe-1b-7b", TrainSetup(4, 2048, Precision.FP32, grad_ckpt=True)),
    ("deepseek-v3", TrainSetup(1, 1024, Precision.BF16, grad_ckpt=True)),
]


def main(argv: list[str]) -> int:
    cases = MOE_CASES if "--moe" in argv else CASES + MOE_CASES
    for name, setup in cases:
        spec = load_model_spec(name)
        row = measure_single(spec, setup, fake=True)
        append_rows([row], TIER3_CSV)
        predicted = predict(spec, setup).peak_allocated_bytes
        error = (predicted - row["peak_allocated_bytes"]) / row["peak_allocated_bytes"]
        print(f"{name:<14} full-depth fake {row['peak_allocated_bytes']:>16,} B in {row['wall_s']:>6.1f} s   "
              f"predicted {predicted:>16,} B   error {100 * error:+.4f} %", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
