"""Tier-2 measurement matrix for tensor and pipeline parallelism: real multi-process runs on this CPU
(torchrun, gloo), the storage tracker in every rank.

TP_RUNS: transformers' own TP plan on DTensor (llmsim/model/tensor_parallel.py), TP 2 and 4, five architectures
(Llama MHA, Mistral GQA, Qwen2 GQA with q/k/v biases, GPT-NeoX fused QKV, Llama-3.1), fp32/bf16/autocast,
checkpointing on and off. Writes data/measurements/tier2_tp_cpu.csv (one row per rank).
PP_RUNS: torch.distributed.pipelining (llmsim/model/pipelining.py), PP 2 and 4, GPipe and 1F1B, 1-8 micro-batches,
two hybrids: TP x PP (pp 2 x tp 2) and DP x PP (DistributedDataParallel around each of 2 stages, dp 2), and
user-given layer splits.
Writes data/measurements/tier2_pp_cpu.csv.
DP_TP_RUNS: DDP x TP and DDP x TP x PP, the replicas in torch's replicate (8-16 ranks). Writes
data/measurements/tier2_dp_tp_pp_cpu.csv.
FSDP_PP_RUNS: FSDP2 x PP and FSDP2 x TP x PP, fully_shard per layer then the stage over the dp ranks (4-16 ranks;
12 in the six-stage runs).
Writes data/measurements/tier2_fsdp_pp_cpu.csv.
INTERLEAVED_RUNS: interleaved 1F1B (torch's ScheduleInterleaved1F1B), 2-3 stages per rank over pp 2-4, alone, with
DistributedDataParallel around each stage, TP x PP, DDP x TP x PP (replicate), FSDP2 x PP and FSDP2 x TP x PP; and
LOOPED_BFS_RUNS, torch's ScheduleLoopedBFS over the same stages (--looped-bfs); ZERO_BUBBLE_RUNS, its
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV (--zero-bubble). Writes data/measurements/tier2_interleaved_cpu.csv.
Run: python experiments/measure_tier2_parallel.py [--pp | --dp-tp | --fsdp-pp | --interleaved | --looped-bfs |
--zero-bubble] (about 5 minutes each on 2 cores).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmsim.enums import Precision
from llmsim.measure.launch import LaunchFailure
from llmsim.measure.runs import MEASUREMENTS_DIR, append_rows, measure_distributed
from llmsim.model.pipelining import Schedule
from llmsim.inputs.spec import FsdpSetup, TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.inputs.zoo import shrink

TP_CSV = MEASUREMENTS_DIR / "tier2_tp_cpu.csv"
PP_CSV = MEASUREMENTS_DIR / "tier2_pp_cpu.csv"
DP_TP_CSV = MEASUREMENTS_DIR / "tier2_dp_tp_pp_cpu.csv"
FSDP_PP_CSV = MEASUREMENTS_DIR / "tier2_fsdp_pp_cpu.csv"
INTERLEAVED_CSV = MEASUREMENTS_DIR / "tier2_interleaved_cpu.csv"
SHAPES = {  # zoo model -> (hidden, layers, vocab, heads): every size divides by 4 (kv-heads included)
    "llama-2-7b": (128, 4, 2000, 4), "mistral-7b": (128, 3, 1500, 16), "qwen2.5-7b": (112, 3, 3000, 28),
    "pythia-160m": (128, 3, 2048, 4), "llama-3.1-8b": (128, 5, 2500, 16),
    "qwen2.5-0.5b": (112, 4, 3000, 28),
    "llama-2-7b-deep": (128, 8, 2000, 4), "mistral-7b-deep": (128, 6, 1500, 16), "qwen2.5-7b-deep": (112, 5, 3000, 28),
    "llama-2-7b-deep12": (128, 12, 2000, 4),  # six stages of two layers
    "pythia-160m-deep": (128, 4, 2048, 4), "qwen2.5-0.5b-deep": (112, 6, 3000, 28),
}
# (model, tp, precision, grad_ckpt, ckpt_every, micro_batch, seq_len)
TP_RUNS = [
    ("llama-2-7b", 2, "fp32", False, 1, 2, 64),
    ("llama-2-7b", 4, "fp32", False, 1, 2, 64),
    ("llama-2-7b", 2, "bf16", True, 1, 2, 96),
    ("llama-2-7b", 4, "bf16", True, 2, 1, 128),
    ("mistral-7b", 2, "fp32", True, 1, 2, 64),
    ("mistral-7b", 4, "fp32", False, 1, 3, 64),
    ("mistral-7b", 2, "bf16", False, 1, 1, 128),
    ("qwen2.5-7b", 2, "fp32", False, 1, 2, 64),
    ("qwen2.5-7b", 4, "bf16", True, 1, 2, 64),
    ("pythia-160m", 2, "fp32", False, 1, 2, 64),
    ("pythia-160m", 4, "fp32", True, 1, 1, 96),
    ("llama-3.1-8b", 2, "bf16-autocast", False, 1, 2, 64),
    ("llama-3.1-8b", 4, "fp32", True, 1, 2, 64),
]
# (model[-deep], pp, tp, schedule, n_microbatches, precision, grad_ckpt, ckpt_every, micro_batch, seq_len
#  [, dp[, layers per stage]])
PP_RUNS = [
    ("llama-2-7b", 2, 1, "gpipe", 4, "fp32", False, 1, 2, 64),
    ("llama-2-7b", 2, 1, "1f1b", 4, "fp32", False, 1, 2, 64),
    ("llama-2-7b-deep", 4, 1, "gpipe", 8, "bf16", False, 1, 1, 64),
    ("llama-2-7b-deep", 4, 1, "1f1b", 8, "bf16", True, 1, 1, 64),
    ("mistral-7b", 2, 1, "1f1b", 2, "fp32", True, 1, 2, 64),
    ("mistral-7b-deep", 4, 1, "gpipe", 1, "fp32", False, 1, 2, 96),
    ("qwen2.5-7b", 2, 1, "gpipe", 3, "bf16", False, 1, 1, 64),
    ("qwen2.5-7b-deep", 4, 1, "1f1b", 6, "fp32", False, 1, 1, 64),
    ("pythia-160m", 2, 1, "1f1b", 4, "fp32", False, 1, 2, 64),
    ("llama-3.1-8b", 2, 1, "gpipe", 2, "fp32", True, 2, 2, 64),
    ("llama-2-7b", 2, 2, "gpipe", 4, "fp32", False, 1, 2, 64),
    ("mistral-7b", 2, 2, "1f1b", 4, "bf16", False, 1, 1, 96),
    ("qwen2.5-7b", 2, 2, "1f1b", 2, "fp32", True, 1, 2, 64),
    ("llama-2-7b", 2, 1, "gpipe", 2, "fp32", False, 1, 2, 64, 2),  # + dp: DDP around each stage
    ("mistral-7b", 2, 1, "1f1b", 2, "bf16", True, 1, 1, 96, 2),
    ("llama-2-7b-deep", 2, 1, "1f1b", 2, "fp32", False, 1, 2, 64, 1, (3, 5)),  # + a user-given split
    ("mistral-7b-deep", 4, 1, "gpipe", 3, "bf16", True, 1, 1, 64, 1, (2, 1, 2, 1)),
    ("llama-2-7b", 2, 1, "1f1b", 2, "bf16-autocast", False, 1, 2, 64),  # autocast around the schedule
    ("qwen2.5-7b", 2, 2, "gpipe", 2, "bf16-autocast", True, 1, 1, 64),
    ("qwen2.5-0.5b", 2, 1, "1f1b", 2, "fp32", False, 1, 2, 64),  # tied embeddings: the last stage keeps it
]
# DDP x TP (x PP): the data-parallel replicas of TP-sharded stages in torch's replicate (llmsim/model/replicate.py;
# DistributedDataParallel takes no DTensor), each decoder layer and then the stage; the PP_RUNS tuple, dp given
DP_TP_RUNS = [
    ("llama-2-7b", 2, 2, "1f1b", 2, "fp32", False, 1, 2, 64, 2),
    ("mistral-7b", 2, 2, "gpipe", 4, "bf16", True, 1, 1, 96, 2),
    ("qwen2.5-7b", 2, 2, "1f1b", 4, "bf16-autocast", False, 1, 1, 64, 2),
    ("llama-2-7b", 1, 2, "gpipe", 1, "bf16", True, 1, 2, 64, 2),  # no pipeline: DDP x TP
    ("pythia-160m", 1, 4, "gpipe", 1, "fp32", False, 1, 2, 64, 2),
    ("llama-2-7b-deep", 4, 2, "1f1b", 4, "bf16", True, 1, 1, 64, 2),
    ("llama-2-7b-deep", 2, 2, "1f1b", 3, "bf16", True, 1, 1, 64, 2),  # 4 layers a stage: traced at 3, expanded
]
# FSDP2 x PP (x TP), and FSDP2 x TP: each stage (or TP shard) sharded by fully_shard per layer, then the stage, over
# the dp ranks of the (dp, pp, tp) mesh (torchtitan's 3-D layout); the PP_RUNS tuple, dp given, then FsdpSetup's
# init and reshard_after_forward
FSDP_PP_RUNS = [
    ("llama-2-7b", 2, 1, "1f1b", 2, "fp32", False, 1, 2, 64, 2, None, "meta", True),
    ("mistral-7b", 2, 1, "gpipe", 4, "bf16", True, 1, 1, 96, 2, None, "full", False),
    ("qwen2.5-7b", 2, 2, "1f1b", 4, "bf16-autocast", False, 1, 1, 64, 2, None, "meta", True),
    ("pythia-160m", 2, 2, "gpipe", 2, "fp32", True, 1, 2, 64, 2, None, "full", True),
    ("llama-2-7b-deep", 4, 2, "1f1b", 4, "bf16", True, 1, 1, 64, 2, None, "meta", False),
    ("mistral-7b", 1, 2, "gpipe", 1, "bf16", True, 1, 2, 64, 2, None, "full", False),  # no pipeline: FSDP2 x TP
    ("qwen2.5-7b", 1, 4, "gpipe", 1, "bf16-autocast", False, 1, 1, 64, 2, None, "meta", True),
    ("llama-2-7b-deep", 2, 1, "1f1b", 3, "fp32", True, 1, 2, 64, 2, None, "meta", True),  # expanded from 3 of 4
    ("llama-2-7b-deep", 2, 2, "gpipe", 2, "bf16", False, 1, 1, 64, 2, None, "full", False),
    # six 1F1B stages over 2 replicas (12 ranks): four middle stages, each with its own warm-up, whose order of
    # chunk calls decides what FSDP2 leaves unsharded from one call to the next (llmsim/sim/traced.py,
    # _template_stage); with and without resharding after the forward
    ("llama-2-7b-deep12", 6, 1, "1f1b", 6, "bf16", True, 1, 1, 64, 2, None, "meta", True),
    ("llama-2-7b-deep12", 6, 1, "1f1b", 8, "fp32", False, 1, 1, 64, 2, None, "meta", False),
]

# Interleaved 1F1B: (model[-deep], pp, stages per rank, n_microbatches, precision, grad_ckpt, ckpt_every, micro_batch,
# seq_len[, dp[, tp[, FsdpSetup's init and reshard_after_forward]]]); torch runs micro-batches in rounds of about pp
# (max(1, n // pp) rounds, which must divide them)
INTERLEAVED_RUNS = [
    ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64),
    ("llama-2-7b-deep", 4, 2, 8, "bf16", True, 1, 1, 64),  # one layer a stage
    ("llama-2-7b-deep12", 2, 3, 6, "fp32", True, 1, 2, 64),
    ("llama-2-7b-deep12", 3, 2, 3, "fp32", False, 1, 1, 64),  # one round
    ("mistral-7b-deep", 3, 2, 6, "bf16", True, 1, 1, 96),
    ("qwen2.5-7b-deep", 2, 2, 4, "fp32", False, 1, 1, 64),  # 5 layers over 4 stages: 2, 1, 1, 1
    ("qwen2.5-0.5b-deep", 2, 3, 2, "fp32", False, 1, 2, 64),  # tied embeddings: the last stage keeps it
    ("pythia-160m-deep", 2, 2, 4, "bf16-autocast", False, 1, 2, 64),
    ("llama-2-7b-deep", 4, 2, 10, "fp32", False, 1, 1, 64),  # 10 micro-batches on 4 ranks: 2 rounds of 5
    ("llama-3.1-8b", 2, 2, 3, "bf16", True, 2, 1, 64),
    ("llama-2-7b-deep", 2, 2, 4, "fp32", False, 1, 2, 64, 2),  # + dp: DDP around each stage
    ("mistral-7b-deep", 2, 3, 2, "bf16", True, 1, 1, 96, 2),
    ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64, 1, 2),  # TP x PP
    ("mistral-7b-deep", 2, 3, 4, "fp32", True, 1, 1, 64, 1, 2),
    ("llama-2-7b-deep", 2, 2, 4, "bf16", True, 1, 1, 64, 2, 2),  # DDP x TP x PP: torch's replicate per stage
    ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64, 2, 1, ("meta", True)),  # FSDP2 x PP, torchtitan's
    ("qwen2.5-7b-deep", 2, 2, 4, "bf16-autocast", False, 1, 1, 64, 2, 1, ("full", False)),
    ("llama-2-7b-deep", 2, 2, 2, "bf16", True, 1, 1, 64, 2, 2, ("meta", True)),  # FSDP2 x TP x PP
]

# torch's ScheduleLoopedBFS over the same stages per rank (the INTERLEAVED_RUNS tuple)
LOOPED_BFS_RUNS = [
    ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64),
    ("mistral-7b-deep", 3, 2, 5, "fp32", True, 1, 1, 64),
    ("llama-2-7b-deep", 2, 2, 3, "bf16", True, 1, 1, 64, 2, 2),  # DDP x TP x PP
]

# torch's zero-bubble schedules (each backward split into the input's gradient and the weights'): the INTERLEAVED_RUNS
# tuple per schedule; ZBV and DualPipeV place 2 stages a rank in a V (rank 0: the first and the last)
ZERO_BUBBLE_RUNS = {
    "interleaved-zero-bubble": [
        ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64),
        ("mistral-7b-deep", 3, 2, 6, "fp32", True, 1, 1, 64),
        ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64, 2),  # DDP around each stage
    ],
    "zbv-zero-bubble": [
        ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64),
        ("llama-2-7b-deep12", 3, 2, 6, "fp32", True, 1, 2, 64),
        ("qwen2.5-0.5b-deep", 2, 2, 4, "fp32", False, 1, 1, 64),  # tied: rank 0 holds the embedding and the head
        ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64, 2, 1, ("meta", True)),  # FSDP2 x PP
    ],
    "dualpipev": [
        ("llama-2-7b-deep", 2, 2, 4, "bf16", False, 1, 1, 64),
        ("mistral-7b-deep", 3, 2, 6, "bf16-autocast", True, 1, 1, 64),
        ("llama-2-7b-deep", 2, 2, 4, "bf16", True, 1, 1, 64, 1, 2),  # TP x PP
    ],
}


def _measured(run: tuple, spec, setup: TrainSetup, layout: Layout, out: Path, timeout: int) -> bool:
    """Measure `run` (as `spec`, `setup`, `layout`) and append its rank rows to `out`; False where it failed (reported,
    not raised)."""
    try:
        rows = measure_distributed(spec, setup, layout, timeout)
    except LaunchFailure as exc:
        print(f"FAILED {run}: {exc}", flush=True)
        return False
    append_rows(rows, out)
    print(run, [r["peak_allocated_bytes"] for r in rows], rows[0]["wall_s"], flush=True)
    return True


def measure_interleaved(runs: list[tuple], out: Path, timeout: int, schedule: Schedule) -> int:
    """`measure` for INTERLEAVED_RUNS, LOOPED_BFS_RUNS and ZERO_BUBBLE_RUNS, under `schedule`."""
    failures = 0
    for run in runs:
        model, pp, stages_per_rank, n_microbatches, precision, ckpt, every, mb, seq = run[:9]
        dp, tp = (run[9] if len(run) > 9 else 1), (run[10] if len(run) > 10 else 1)
        fsdp = FsdpSetup(init=run[11][0], reshard_after_forward=run[11][1]) if len(run) > 11 else None
        zoo_name = model.split("-deep")[0]
        spec = load_model_spec(zoo_name, shrink(zoo_name, *SHAPES[model]))
        strategy = Strategy.FSDP if fsdp else Strategy.DDP if dp > 1 else Strategy.SINGLE
        layout = Layout(strategy, dp * pp * tp, fsdp=fsdp, tp=tp, pp=pp, schedule=schedule,
                        n_microbatches=n_microbatches, stages_per_rank=stages_per_rank)
        setup = TrainSetup(mb, seq, Precision(precision), None, ckpt, every)
        failures += not _measured(run, spec, setup, layout, out, timeout)
    return failures


def measure(runs: list[tuple], out: Path, timeout: int) -> int:
    """Measure each run (failures are reported and skipped); append the rank rows to `out`; the failures."""
    failures = 0
    for run in runs:
        dp, split, fsdp = 1, None, None
        if len(run) == 7:  # a TP run
            model, tp, precision, ckpt, every, mb, seq = run
            pp, schedule, n_microbatches = 1, "gpipe", 1
        else:
            model, pp, tp, schedule, n_microbatches, precision, ckpt, every, mb, seq = run[:10]
            dp = run[10] if len(run) > 10 else 1
            split = run[11] if len(run) > 11 else None
            fsdp = FsdpSetup(init=run[12], reshard_after_forward=run[13]) if len(run) > 12 else None
        zoo_name = model.split("-deep")[0]
        spec = load_model_spec(zoo_name, shrink(zoo_name, *SHAPES[model]))
        setup = TrainSetup(mb, seq, Precision(precision), None, ckpt, every)
        strategy = Strategy.FSDP if fsdp else Strategy.DDP if dp > 1 else Strategy.SINGLE
        layout = Layout(strategy, dp * pp * tp, fsdp=fsdp, tp=tp, pp=pp, schedule=Schedule(schedule),
                        n_microbatches=n_microbatches, pp_split=split)
        failures += not _measured(run, spec, setup, layout, out, timeout)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", action="store_true", help=f"run PP_RUNS into {PP_CSV} instead of TP_RUNS")
    parser.add_argument("--dp-tp", action="store_true", help=f"run DP_TP_RUNS into {DP_TP_CSV}")
    parser.add_argument("--fsdp-pp", action="store_true", help=f"run FSDP_PP_RUNS into {FSDP_PP_CSV}")
    parser.add_argument("--interleaved", action="store_true", help=f"run INTERLEAVED_RUNS into {INTERLEAVED_CSV}")
    parser.add_argument("--looped-bfs", action="store_true", help=f"run LOOPED_BFS_RUNS into {INTERLEAVED_CSV}")
    parser.add_argument("--zero-bubble", action="store_true", help=f"run ZERO_BUBBLE_RUNS into {INTERLEAVED_CSV}")
    parser.add_argument("--out", type=Path, default=None, help=f"default {TP_CSV}, with --pp {PP_CSV}")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--only", type=int, nargs="*", help="indices into the runs (default: all)")
    args = parser.parse_args()
    if args.zero_bubble:
        failures = sum(measure_interleaved(runs, args.out or INTERLEAVED_CSV, args.timeout, Schedule(schedule))
                       for schedule, runs in ZERO_BUBBLE_RUNS.items())
        return 1 if failures else 0
    if args.interleaved or args.looped_bfs:
        runs = LOOPED_BFS_RUNS if args.looped_bfs else INTERLEAVED_RUNS
        chosen = [run for i, run in enumerate(runs) if args.only is None or i in args.only]
        schedule = Schedule.LOOPED_BFS if args.looped_bfs else Schedule.INTERLEAVED_1F1B
        return 1 if measure_interleaved(chosen, args.out or INTERLEAVED_CSV, args.timeout, schedule) else 0
    runs, out = ((DP_TP_RUNS, DP_TP_CSV) if args.dp_tp else (FSDP_PP_RUNS, FSDP_PP_CSV) if args.fsdp_pp
                 else (PP_RUNS, PP_CSV) if args.pp else (TP_RUNS, TP_CSV))
    chosen = [run for i, run in enumerate(runs) if args.only is None or i in args.only]
    return 1 if measure(chosen, args.out or out, args.timeout) else 0


if __name__ == "__main__":
    sys.exit(main())
