"""llmsim vs Megatron-LM's `theoretical_memory_usage` and Korthikanti et al.'s activation formulas, for
Llama-2-7B and Llama-2-70B under tensor and pipeline parallelism (experiments/megatron_formulas.py ports both).

Setup, the closest each side has to the other:
- llmsim: `--precision bf16-autocast` (fp32 weights, gradients and AdamW states, the forward in bf16: 16 bytes
  a parameter), on an H100's kernels (`--gpu h100-80gb`: flash SDPA, foreach AdamW), transformers' TP plan,
  torch.distributed.pipelining 1F1B with 8 micro-batches of 1 sample, sequence 4096, with and without full
  activation checkpointing. Columns: the first stage's rank (rank 0, the one both formulas describe) and the
  fullest rank, each the peak allocated over the whole step.
- Megatron: bf16 weights, fp32 main gradients and fp32 Adam (18 bytes a parameter, no distributed optimizer),
  vocabulary padded to 128 x tp, `report_theoretical_memory` (its activation term is a selective-recompute
  formula, with or without sequence parallelism) for the weights + optimizer and activations columns.
- Korthikanti: activations only, no recompute or full recompute to match llmsim's checkpointing, no sequence
  parallelism (transformers' TP plan has none), first stage with pp micro-batches in flight.
Run: python experiments/compare_tp_pp.py  (about 4 minutes on 2 cores; writes experiments/compare_tp_pp.csv)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_formulas import korthikanti_activation_bytes, megatron_args_from_hf, report_theoretical_memory  # noqa: E402

from llmsim.enums import Precision  # noqa: E402
from llmsim.inputs.gpus import load_gpu  # noqa: E402
from llmsim.sim.pipeline import predict  # noqa: E402
from llmsim.model.pipelining import Schedule  # noqa: E402
from llmsim.inputs.spec import TrainSetup, load_model_spec  # noqa: E402
from llmsim.sim.strategies import Layout  # noqa: E402

SEQ_LEN, MICRO_BATCH, MICROBATCHES = 4096, 1, 8
RUNS = {  # model -> [(tp, pp, checkpointing)]
    "llama-2-7b": [(tp, pp, ckpt) for tp, pp in ((2, 1), (8, 1), (2, 2), (2, 4)) for ckpt in (False, True)],
    "llama-2-70b": [(8, 2, True), (8, 4, True), (4, 8, True), (8, 8, True)],
}
OUT = Path(__file__).with_suffix(".csv")
GIB = 1024**3


def row(name: str, tp: int, pp: int, ckpt: bool) -> dict:
    spec = load_model_spec(name)
    setup = TrainSetup(MICRO_BATCH, SEQ_LEN, Precision.BF16_AUTOCAST, grad_ckpt=ckpt)
    layout = Layout(world_size=tp * pp, tp=tp, pp=pp, schedule=Schedule.ONE_F_ONE_B, n_microbatches=MICROBATCHES)
    start = time.perf_counter()
    prediction = predict(spec, setup, layout, load_gpu("h100-80gb"))
    seconds = time.perf_counter() - start
    config = spec.config_dict
    weights, activations, _ = report_theoretical_memory(
        megatron_args_from_hf(config, SEQ_LEN, MICRO_BATCH, tp, pp, 1, recompute="full" if ckpt else None),
        MICROBATCHES)
    korthikanti = korthikanti_activation_bytes(config, SEQ_LEN, MICRO_BATCH, tp, pp, False, "full" if ckpt else None)
    first = prediction.ranks[0]
    return {"model": name, "tp": tp, "pp": pp, "grad_ckpt": ckpt,
            "llmsim_first_stage": first.peak_allocated_bytes, "llmsim_first_stage_phase": first.peak.phase,
            "llmsim_max_rank": prediction.peak_allocated_bytes,
            "llmsim_first_stage_params_grads_states": sum(
                first.peak.breakdown_bytes.get(c, 0) for c in ("parameter", "gradient", "optimizer_state")),
            "megatron_weights_optimizer": round(weights), "megatron_activations": round(activations),
            "korthikanti_activations": korthikanti, "predict_s": round(seconds, 1)}


def main() -> int:
    rows = []
    for name, runs in RUNS.items():
        for tp, pp, ckpt in runs:
            rows.append(row(name, tp, pp, ckpt))
            shown = {k: (f"{v / GIB:.2f}" if isinstance(v, int) and v > 10**6 else v) for k, v in rows[-1].items()}
            print(shown, flush=True)
    pd.DataFrame(rows).to_csv(OUT, index=False)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
