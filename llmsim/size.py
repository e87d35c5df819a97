"""Issue 7's question, for the layouts modelled so far: on this GPU, which layouts fit, and with what largest
micro-batch? Pure compute; the CLI prints the table.

A layout is a strategy and a number of GPUs: one GPU, DDP, DeepSpeed ZeRO-1/2/3 (defaults, bf16 when the setup
is bf16), tensor parallelism over all the GPUs (`tp`), a pipeline of one stage per GPU (`pp`: 1F1B over as many
micro-batches as stages, the fewest it takes), and TP x PP with TP 2, 4 or 8 (`tp2xpp`: pp = GPUs / 2), on
2, 4, 8, ... up to `max_gpus`; TP and PP only where the model has transformers' plans and its sizes divide.
For each, the largest micro-batch up to `max_micro_batch` whose every
rank fits is found by doubling then bisecting, which assumes that memory grows with the micro-batch. Live bytes
do; the caching allocator can make "fits" non-monotonic within about one segment of the capacity (a larger
micro-batch can fit where a smaller one did not). The answer is always a micro-batch that fits next to one that
does not (or the maximum), and equals trying every micro-batch whenever "fits" is monotonic (tests check both).
DeepSpeed's bf16 keeps fp32 master weights, so ZeRO layouts in bf16 carry 16 bytes of model state per parameter
where the single-process pure-bf16 step carries 8.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace

import pandas as pd

from llmsim.dsconfig import load_ds_config
from llmsim.enums import Precision
from llmsim.allocator import AllocatorConfig
from llmsim.gpus import GpuProfile
from llmsim.errors import InputError
from llmsim.pipeline import predict
from llmsim.pipelining import Schedule, check_pipeline
from llmsim.tensor_parallel import check_tensor_parallel
from llmsim.spec import ModelSpec, TrainSetup
from llmsim.strategies import Layout, Strategy


@dataclass(frozen=True)
class Candidate:
    name: str
    gpus: int
    layout_for: object  # (micro_batch) -> Layout


FAMILIES = ("single", "ddp", "zero", "tp", "pp", "tpxpp")


def candidates(spec: ModelSpec, setup: TrainSetup, max_gpus: int,
               families: tuple[str, ...] = FAMILIES) -> list[Candidate]:
    out = [Candidate("single", 1, lambda mb: Layout())] if "single" in families else []
    world = 2
    while world <= max_gpus:
        if "ddp" in families:
            out.append(Candidate("ddp", world, lambda mb, w=world: Layout(Strategy.DDP, w)))
        if "zero" in families and not setup.lora_rank and setup.precision in (Precision.FP32, Precision.BF16):
            for stage in (1, 2, 3):
                out.append(Candidate(f"zero{stage}", world,
                                     lambda mb, w=world, s=stage: _zero(spec, setup, w, s, mb)))
        splits = ([(world, 1)] if "tp" in families else []) + ([(1, world)] if "pp" in families else []) + \
            ([(t, world // t) for t in (2, 4, 8) if t < world and world % t == 0] if "tpxpp" in families else [])
        for tp, pp in splits:
            if _model_parallel_ok(spec, setup, tp, pp):
                name = "tp" if pp == 1 else "pp" if tp == 1 else f"tp{tp}xpp"
                out.append(Candidate(name, world, lambda mb, t=tp, p=pp: _model_parallel(t, p)))
        world *= 2
    return out


def _model_parallel(tp: int, pp: int) -> Layout:
    return Layout(world_size=tp * pp, tp=tp, pp=pp, schedule=Schedule.ONE_F_ONE_B, n_microbatches=pp)


def _model_parallel_ok(spec: ModelSpec, setup: TrainSetup, tp: int, pp: int) -> bool:
    if setup.lora_rank or spec.config_json is None:
        return False
    try:
        check_tensor_parallel(spec.hf_config(), tp)
        check_pipeline(spec.hf_config(), pp, pp, Schedule.ONE_F_ONE_B, None, setup.precision)
    except InputError:
        return False
    return True


def _zero(spec: ModelSpec, setup: TrainSetup, world: int, stage: int, micro_batch: int) -> Layout:
    config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": setup.precision is Precision.BF16}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    deepspeed = load_ds_config(f.name, world, int(spec.hf_config().hidden_size), micro_batch, setup.precision)
    return Layout(Strategy.DEEPSPEED, world, deepspeed)


def fits(spec: ModelSpec, setup: TrainSetup, candidate: Candidate, micro_batch: int, gpu: GpuProfile,
         alloc_conf: AllocatorConfig = AllocatorConfig()) -> tuple:
    prediction = predict(spec, replace(setup, micro_batch=micro_batch), candidate.layout_for(micro_batch), gpu,
                         alloc_conf)
    worst = max(prediction.ranks, key=lambda r: r.device_total_bytes)
    return all(r.fits for r in prediction.ranks), worst.device_total_bytes


def largest_micro_batch(spec, setup, candidate, gpu, max_micro_batch: int,
                        alloc_conf: AllocatorConfig = AllocatorConfig()) -> tuple[int, int | None]:
    """(largest micro-batch that fits or 0, its device total)."""
    ok, total = fits(spec, setup, candidate, 1, gpu, alloc_conf)
    if not ok:
        return 0, None
    good, good_total, bad = 1, total, None
    while bad is None and good < max_micro_batch:  # double until it stops fitting
        trial = min(2 * good, max_micro_batch)
        ok, total = fits(spec, setup, candidate, trial, gpu, alloc_conf)
        if ok:
            good, good_total = trial, total
        else:
            bad = trial
    while bad is not None and bad - good > 1:  # bisect between the last fit and the first miss
        trial = (good + bad) // 2
        ok, total = fits(spec, setup, candidate, trial, gpu, alloc_conf)
        if ok:
            good, good_total = trial, total
        else:
            bad = trial
    return good, good_total


def size(spec: ModelSpec, setup: TrainSetup, gpu: GpuProfile, max_gpus: int = 8,
         max_micro_batch: int = 64, alloc_conf: AllocatorConfig = AllocatorConfig(),
         families: tuple[str, ...] = FAMILIES) -> pd.DataFrame:
    rows = []
    for candidate in candidates(spec, setup, max_gpus, families):
        micro_batch, total = largest_micro_batch(spec, setup, candidate, gpu, max_micro_batch, alloc_conf)
        rows.append({"layout": candidate.name, "gpus": candidate.gpus, "largest_micro_batch": micro_batch,
                     "device_total_bytes": total,
                     "headroom_bytes": gpu.capacity_bytes - total if total is not None else None,
                     "fits": micro_batch > 0})
    frame = pd.DataFrame(rows)
    return frame.sort_values(["fits", "gpus", "largest_micro_batch"], ascending=[False, True, False],
                             kind="stable").reset_index(drop=True)
