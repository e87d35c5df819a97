"""Issue 7's question, for the layouts modelled so far: on this GPU, which layouts fit, and with what largest
micro-batch? Pure compute; the CLI prints the table.

A layout is a strategy and a number of GPUs: one GPU, DDP, DeepSpeed ZeRO-1/2/3 (defaults, bf16 when the setup
is bf16), tensor parallelism over all the GPUs (`tp`), a pipeline of one stage per GPU (`pp`: 1F1B over as many
micro-batches as stages, the fewest it takes), and TP x PP with TP 2, 4 or 8 (`tp2xpp`: pp = GPUs / 2), on
2, 4, 8, ... up to `max_gpus`; TP and PP only where the model has transformers' plans and its sizes divide. Asked
for by name: FSDP2, ZeRO-Offload, and the 3-D layouts, DDP x TP x PP (`ddpxtp2xpp4`, `ddpxpp8` with TP 1) on two
replicas (REPLICAS_3D: a rank holds the same with more, so each split is shown once, on the fewest GPUs) and FSDP2 x
PP (`fsdpxpp4`: every split of every GPU count, a rank's shards shrinking as the data-parallel degree grows).
For each, the largest micro-batch up to `max_micro_batch` whose every
rank fits is found by doubling then bisecting, which assumes that memory grows with the micro-batch. Live bytes
do; the caching allocator can make "fits" non-monotonic within about one segment of the capacity (a larger
micro-batch can fit where a smaller one did not). The answer is always a micro-batch that fits next to one that
does not (or the maximum), and equals trying every micro-batch whenever "fits" is monotonic (tests check both).
With `global_batch` (samples per optimizer step) each layout must make up that batch: its data-parallel replicas
(DDP's, ZeRO's and FSDP2's ranks, a 3-D layout's replicas) split it evenly (gradient accumulation is modelled for
one process only), one process may accumulate over passes, and a pipeline splits its share into micro-batches (at
least one per stage); the largest micro-batch that fits wins.
With `allow`, levers the user accepts (checkpointing, a bf16 build, LoRA, offloaded checkpoints) are switched on,
fewest first, until the layout fits; a layout that never fits says why (the bytes it needs, or what is not
modelled).
Before tracing a TP or PP layout (one trace per TP degree and per stage), a lower bound of every rank's peak
allocated bytes from the meta-device build (llmsim/sim/bound.py: its parameters, gradients and optimizer states) is
checked: a layout whose bound alone cannot fit is reported as needing "at least" that much, untraced. A pipeline
is predicted stage by stage, the likely fullest first, and a micro-batch stops at the first stage that cannot fit
it (its other stages are not traced; the "needs" then names the fullest rank of the stages predicted). Its search
predicts only the stages that have bound it so far (the first stage to begin with) and then its answer whole;
a stage that cannot fit the answer joins them and the search goes on below (`_search`). With "fits" monotonic
the answer is the same as predicting every stage at every micro-batch; in any case it is predicted whole.
A layout's GPU counts (a pipeline's aside) are evaluated in turn, fewest first, and the search on more GPUs starts
from the answer on fewer (a hint it gallops from: the same answer whenever "fits" is monotonic, in a few trials
where it moves little); layouts are evaluated in `jobs` local processes.
DeepSpeed's bf16 keeps fp32 master weights, so ZeRO layouts in bf16 carry 16 bytes of model state per parameter
where the single-process pure-bf16 step carries 8.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import pandas as pd

from llmsim.inputs.dsconfig import ds_setup
from llmsim.enums import Precision
from llmsim.sim.allocator import AllocatorConfig
from llmsim.inputs.gpus import GpuProfile
from llmsim.errors import InputError
from llmsim.sim.bound import rank_lower_bounds
from llmsim.sim.pipeline import checked, checked_stage_timeline, predict, predict_stage
from llmsim.sim.replay import predict_timeline
from llmsim.sim.timeline import on_the_line
from llmsim.sim.processes import in_processes
from llmsim.app.report import human_bytes
from llmsim.model.pipelining import Schedule, check_pipeline
from llmsim.model.tensor_parallel import check_tensor_parallel
from llmsim.inputs.spec import FsdpSetup, ModelSpec, TrainSetup, as_loaded
from llmsim.sim.strategies import ZERO_ALLOW_UNTESTED_OPTIMIZER, Layout, Strategy, deepspeed_tested


@dataclass(frozen=True)
class Candidate:
    name: str
    gpus: int
    layout_for: object  # (micro_batch) -> Layout


FAMILIES = ("single", "ddp", "zero", "offload", "fsdp", "tp", "pp", "tpxpp", "3d", "fsdpxpp")
# Asked for by name (--layouts): FSDP2 (`fsdp`, and `fsdp-offload` with CPUOffloadPolicy: both traced at 3 layers and
# expanded since 2026-12-05); ZeRO-Offload ("offload": ZeRO-1/2/3 with the optimizer on
# the host, `zero1-offload` to `zero3-offload`, `zero3-offload-all` with the parameters there too, and in bf16
# `zero3-offload-params` with the parameters alone) walks and
# replays every rank (ZeRO-1/2, zero12.plan) or every class of ranks (ZeRO-3, zero3.plan) on its own; "3d" (DDP x TP x
# PP, `ddpxtp2xpp4`...) traces a pipeline per TP x PP split again (over TP shards torch's replicate runs in the
# trace); "fsdpxpp" (FSDP2 per layer over the data-parallel ranks of each stage, `fsdpxpp4` on 16 GPUs: dp = GPUs /
# stages) is a pipeline search per split too, whose shards shrink with the data-parallel degree (every GPU count)
DEFAULT_FAMILIES = tuple(f for f in FAMILIES if f not in ("fsdp", "offload", "3d", "fsdpxpp"))
# The 3-D family's data-parallel degree: a rank of DDP x TP x PP holds the same at any number of replicas (DDP's
# buckets and replicate's all-reduce buffers are per rank; tests/test_size.py checks 2 against 4), so each TP x PP
# split is shown once, on the fewest GPUs that replicate it
REPLICAS_3D = 2


def candidates(spec: ModelSpec, setup: TrainSetup, max_gpus: int,
               families: tuple[str, ...] = FAMILIES) -> list[Candidate]:
    out = [Candidate("single", 1, lambda mb: Layout())] if "single" in families else []
    world = 2
    while world <= max_gpus:
        if "ddp" in families:
            out.append(Candidate("ddp", world, lambda mb, w=world: Layout(Strategy.DDP, w)))
        if "zero" in families and setup.precision in (Precision.FP32, Precision.BF16):
            for stage in (1, 2, 3):
                out.append(Candidate(f"zero{stage}", world,
                                     lambda mb, w=world, s=stage: _zero(spec, setup, w, s, mb)))
        if "offload" in families and _offload_refusal(spec, setup, world) is None:
            for stage in (1, 2, 3):
                out.append(Candidate(f"zero{stage}-offload", world,
                                     lambda mb, w=world, s=stage: _zero(spec, setup, w, s, mb, offload=True)))
            out.append(Candidate("zero3-offload-all", world,  # the parameters offloaded too
                                 lambda mb, w=world: _zero(spec, setup, w, 3, mb, offload=True, offload_params=True)))
            if setup.precision is Precision.BF16:  # the parameters alone (fp32 is not modelled: zero3.py)
                out.append(Candidate("zero3-offload-params", world,
                                     lambda mb, w=world: _zero(spec, setup, w, 3, mb, offload_params=True)))
        if "fsdp" in families and _fsdp_refusal(spec, setup, world) is None:  # FSDP2 as the tutorial sets it up
            out.append(Candidate("fsdp", world, lambda mb, w=world: Layout(Strategy.FSDP, w, fsdp=FsdpSetup())))
            out.append(Candidate("fsdp-offload", world,  # CPUOffloadPolicy: shards, gradients and states on the host
                                 lambda mb, w=world: Layout(Strategy.FSDP, w, fsdp=FsdpSetup(offload=True))))
        if "fsdpxpp" in families:  # FSDP2 x PP as `predict --strategy fsdp --pp N` runs it: a (dp, pp) mesh
            for pp in sorted(p for p in _divisors(world) if 2 <= p <= world // 2):
                if _fsdp_refusal(spec, setup, world, pp) is None:
                    out.append(Candidate(f"fsdpxpp{pp}", world, lambda mb, p=pp, d=world // pp, m=None:
                                         _model_parallel(1, p, m, d, FsdpSetup())))
        splits = ([(world, 1)] if "tp" in families else []) + ([(1, world)] if "pp" in families else []) + \
            ([(t, world // t) for t in (2, 4, 8) if t < world and world % t == 0] if "tpxpp" in families else [])
        for tp, pp in splits:
            if _model_parallel_refusal(spec, setup, tp, pp) is None:
                name = "tp" if pp == 1 else "pp" if tp == 1 else f"tp{tp}xpp"
                out.append(Candidate(name, world, lambda mb, t=tp, p=pp, m=None: _model_parallel(t, p, m)))
        if "3d" in families and world % REPLICAS_3D == 0:
            for tp, pp in _splits_3d(world // REPLICAS_3D):
                if _model_parallel_refusal(spec, setup, tp, pp) is None:
                    name = f"ddpxtp{tp}xpp{pp}" if tp > 1 else f"ddpxpp{pp}"
                    out.append(Candidate(name, world, lambda mb, t=tp, p=pp, m=None: _model_parallel(t, p, m,
                                                                                                   REPLICAS_3D)))
        world *= 2
    return out


def _why_none(spec: ModelSpec, setup: TrainSetup, families: tuple[str, ...], max_gpus: int) -> str:
    """Why `candidates` found no layout: the refusals of the families asked for, as `predict` words them."""
    if max_gpus < 2:
        return "every family but single needs 2 GPUs or more (--max-gpus)"
    reasons = []
    if "zero" in families and setup.precision not in (Precision.FP32, Precision.BF16):
        reasons.append(f"DeepSpeed ZeRO takes fp32 or bf16, not {setup.precision.value}")
    if {"fsdp", "fsdpxpp"} & set(families) and (reason := _fsdp_refusal(spec, setup, 2)) is not None:
        reasons.append(reason)
    if "offload" in families and (reason := _offload_refusal(spec, setup, 2)) is not None:
        reasons.append(reason)
    if {"tp", "pp", "tpxpp", "3d", "fsdpxpp"} & set(families):
        for degree in (2, 4, 8)[: max(1, max_gpus.bit_length() - 1)]:
            for tp, pp in ((degree, 1), (1, degree)):
                reason = _model_parallel_refusal(spec, setup, tp, pp)
                if reason is not None and reason not in reasons:
                    reasons.append(reason)
    return "; ".join(reasons) or "none of them is modelled for this setup"


def _offload_refusal(spec: ModelSpec, setup: TrainSetup, world: int) -> str | None:
    """Why ZeRO-2 with the optimizer offloaded over `world` ranks is not modelled for this setup, or None."""
    from llmsim.sim.strategies import check_supported

    if setup.precision not in (Precision.FP32, Precision.BF16):
        return f"DeepSpeed ZeRO takes fp32 or bf16, not {setup.precision.value}"
    try:
        check_supported(setup, _zero(spec, setup, world, 2, setup.micro_batch, offload=True))
    except InputError as error:
        return str(error)
    return None


def _fsdp_refusal(spec: ModelSpec, setup: TrainSetup, world: int, pp: int = 1) -> str | None:
    """Why FSDP2 over `world` ranks (in `pp` pipeline stages) is not modelled for this model and setup (as `predict`
    words it), or None."""
    from llmsim.sim.strategies import fsdp

    if spec.config_json is None:
        return "FSDP2 needs an HF config (its decoder layers), not a module factory"
    if pp > 1 and (reason := _model_parallel_refusal(spec, setup, 1, pp)) is not None:
        return reason
    try:
        fsdp.check_supported(setup, _model_parallel(1, pp, dp=world // pp, fsdp=FsdpSetup()) if pp > 1
                             else Layout(Strategy.FSDP, world, fsdp=FsdpSetup()))
    except InputError as error:
        return str(error)
    return None


def _model_parallel(tp: int, pp: int, n_microbatches: int | None = None, dp: int = 1,
                    fsdp: FsdpSetup | None = None) -> Layout:
    """TP `tp` x PP `pp` under 1F1B (as many micro-batches as stages unless given), in `dp` data-parallel replicas
    where dp > 1: DDP (torch's replicate over the TP shards), or with `fsdp` FSDP2 (fully_shard per layer over each
    stage's dp ranks)."""
    strategy = Strategy.FSDP if fsdp is not None else Strategy.DDP if dp > 1 else Strategy.SINGLE
    return Layout(strategy, dp * tp * pp, tp=tp, pp=pp, fsdp=fsdp, schedule=Schedule.ONE_F_ONE_B,
                  n_microbatches=n_microbatches or pp)


def _splits_3d(per_replica: int) -> list[tuple[int, int]]:
    """The (tp, pp) of the 3-D family whose replica has `per_replica` GPUs: TP 1, 2, 4 or 8 and at least 2 stages."""
    return [(tp, per_replica // tp) for tp in (1, 2, 4, 8) if per_replica % tp == 0 and per_replica // tp >= 2]


def _model_parallel_refusal(spec: ModelSpec, setup: TrainSetup, tp: int, pp: int) -> str | None:
    """Why TP `tp` x PP `pp` is not modelled for this model and setup, or None where it is."""
    if setup.lora_rank:
        return "LoRA is not modelled with tensor or pipeline parallelism"
    if spec.config_json is None:
        return "tensor and pipeline parallelism need an HF config, not a module factory"
    try:
        check_tensor_parallel(spec.hf_config(), tp)
        check_pipeline(spec.hf_config(), pp, pp, Schedule.ONE_F_ONE_B, None, setup.precision)
    except InputError as error:
        return str(error)
    return None


def _zero(spec: ModelSpec, setup: TrainSetup, world: int, stage: int, micro_batch: int,
          offload: bool = False, offload_params: bool = False) -> Layout:
    config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": setup.precision is Precision.BF16}}
    if offload:  # LLaMA-Factory's ds_z2/z3_offload_config.json with the Trainer's optimizer
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_force_ds_cpu_optimizer"] = False
    if offload_params:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if not deepspeed_tested(setup.optimizer):  # as a user running it must (llmsim.sim.strategies.check_deepspeed_optimizer)
        config[ZERO_ALLOW_UNTESTED_OPTIMIZER] = True
    deepspeed = ds_setup(config, world, int(spec.hf_config().hidden_size), micro_batch, setup.precision)
    return Layout(Strategy.DEEPSPEED, world, deepspeed)


def fits(spec: ModelSpec, setup: TrainSetup, candidate: Candidate, micro_batch: int, gpu: GpuProfile,
         alloc_conf: AllocatorConfig = AllocatorConfig()) -> tuple:
    ok, worst, _ = _worst(spec, replace(setup, micro_batch=micro_batch), candidate.layout_for(micro_batch), gpu,
                          alloc_conf)
    return ok, worst.needed_bytes


def _worst(spec: ModelSpec, setup: TrainSetup, layout: Layout, gpu: GpuProfile, alloc_conf: AllocatorConfig,
           only: list[int] | None = None):
    """(whether every rank predicted fits, the rank with the largest device total among them, how many pipeline
    stages were not predicted). A pipeline is predicted stage by stage (one trace each) and stops at the first
    stage with a rank that does not fit: then the layout does not, whatever the other stages need. The likely
    fullest go first: the first stage (the most micro-batches in flight under 1F1B), then the last (the LM head
    and loss), then the others. `only`: predict these stages alone (a screen: "fits" then means that they fit)."""
    if layout.pp == 1:
        prediction = predict(spec, setup, layout, gpu, alloc_conf)
        return all(r.fits for r in prediction.ranks), max(prediction.ranks, key=lambda r: r.needed_bytes), 0
    order = [0, layout.pp - 1] + list(range(1, layout.pp - 1)) if only is None else only
    ranks = []
    for predicted_stages, stage in enumerate(order, 1):
        predicted = predict_stage(spec, setup, layout, stage, gpu, alloc_conf)
        ranks += predicted
        if not all(r.fits for r in predicted):
            return False, max(ranks, key=lambda r: r.needed_bytes), layout.pp - predicted_stages
    return True, max(ranks, key=lambda r: r.needed_bytes), layout.pp - len(order)


def largest_micro_batch(spec, setup, candidate, gpu, max_micro_batch: int,
                        alloc_conf: AllocatorConfig = AllocatorConfig(),
                        hint: int | None = None) -> tuple[int, int | None]:
    """(largest micro-batch that fits or 0, its device total): `_search`."""
    return _search(spec, setup, candidate, gpu, max_micro_batch, alloc_conf, hint)[:2]


def _search(spec, setup, candidate, gpu, max_micro_batch: int, alloc_conf: AllocatorConfig,
            hint: int | None = None) -> tuple:
    """(largest micro-batch that fits or 0, its device total, and when it is 0: micro-batch 1's worst rank and
    how many pipeline stages it left unpredicted). Doubling from 1 until a micro-batch does not fit, then
    bisecting; with a `hint` (the answer of the same layout on fewer GPUs), galloping from it instead: up by 1, 2,
    4, ... while they fit, down by 1, 2, 4, ... while they do not, then bisecting (`_next_trial`). Without one,
    once micro-batches 1 and 2 fit, the hint is, for a pipeline, the largest micro-batch its screened stages fit
    with each event's bytes on the line through its bytes at 1 and 2 (`_lined`); otherwise, or where the
    timelines at 1 and 2 have not the same events, where the line through their device totals meets the card
    less its margin (`_extrapolated`: activations grow with the micro-batch, the model states do not). Between a
    fit and a miss whose totals are known, the next trial is where the line through those two totals meets the
    card less its margin (`_secant`) rather than the midpoint or the gallop down. A pipeline's
    trials predict only the stages that have bound it so far (the first stage, the fullest under 1F1B, to begin
    with): a trial they cannot fit does not fit (exact); the answer they find is then predicted whole, and where
    another stage cannot fit it, that stage joins them and the search goes on below, first where their events'
    lines through micro-batch 2 and that miss say. Those lines are guesses of where to try (the trials are
    predicted); the answer is always predicted whole, next to a micro-batch that does not fit (or the
    maximum)."""
    first = candidate.layout_for(1)
    screen = [0] if first.pp > 1 else None

    def trial(micro_batch: int, only: list[int] | None) -> tuple:
        return _worst(spec, replace(setup, micro_batch=micro_batch), candidate.layout_for(micro_batch), gpu,
                      alloc_conf, only)

    verified, verified_total = 0, None  # the largest micro-batch predicted whole that fits
    good, bad, failure = 0, None, None
    floor, needs = 0, {}  # floor: what fitted before the hint was tried; needs: the trials' worst device totals
    limit = gpu.capacity_bytes - gpu.margin_bytes
    slow = 0  # line steps in a row that did not halve the gap between a fit and a miss (two: bisect next)
    lined = None  # the next trial, where the stages' timelines on a line say the answer is (`_lined`)
    while True:
        # double until it stops fitting, then bisect between the last fit and the first miss
        while (good < max_micro_batch) if bad is None else (bad - good > 1):
            guess = _secant(good, bad, needs, limit) if slow < 2 and lined is None else None
            micro_batch = (lined if lined is not None else guess if guess is not None
                           else _next_trial(good, bad, hint, max_micro_batch, floor))
            lined = None
            gap = None if bad is None else bad - good
            ok, worst, unpredicted = trial(micro_batch, screen)
            needs[micro_batch] = worst.needed_bytes
            if not ok:
                bad, failure = micro_batch, (worst, unpredicted) if micro_batch == 1 else failure
            else:
                good = micro_batch
            slow = 0 if gap is None or guess is None or 2 * (bad - good) <= gap else slow + 1
            if not ok:
                continue
            if not unpredicted:
                verified, verified_total = micro_batch, worst.needed_bytes
            if hint is None and good == 2 and bad is None and 1 in needs:
                line = _lined(spec, setup, candidate, screen, gpu, alloc_conf, (1, 2), 2, max_micro_batch)
                line = (min(max(line, 3), max_micro_batch) if line is not None  # 2: the trial expected to miss
                        else _extrapolated(needs[1], needs[2], gpu, max_micro_batch))
                if line is not None and line > 2:  # gallop from there rather than doubling on
                    hint, floor = line, 2
        if good == verified:
            return verified, verified_total, failure
        ok, worst, unpredicted = trial(good, None)  # the screen's answer, predicted whole
        if ok:
            return good, worst.needed_bytes, None
        screen.append(worst.rank % (first.pp * first.tp) // first.tp)  # the stage that did not fit it
        failure = (worst, unpredicted) if good == 1 else failure
        needs[good] = worst.needed_bytes  # the stage that joins the screen: a miss there
        good, bad, hint, slow = verified, good, None, 0
        if bad > 2:  # the screen's lines through micro-batch 2 and this miss (the new stage traced at 2)
            line = _lined(spec, setup, candidate, screen, gpu, alloc_conf, (2, bad), max(good, 2), bad - 1)
            lined = line if line is not None and good < line < bad else None


def _next_trial(good: int, bad: int | None, hint: int | None, max_micro_batch: int, floor: int = 0) -> int:
    """The next micro-batch `_search` tries, knowing the largest that fits so far (`good`, 0 for none) and the
    smallest that does not (`bad`, None for none). Without a hint: 1, then doubling, then bisecting. With one:
    the hint, then galloping away from it (up: hint + 1, + 3, + 7, ... while they fit; down: hint - 1, - 3, - 7,
    ... while they do not, to `floor` + 1, `floor` being what fitted before the hint was tried), then bisecting;
    with "fits" monotonic both end at the same answer, the hint in log2(distance) trials when it is close."""
    if hint is not None:
        hint = min(max(hint, 1), max_micro_batch)
        if good == floor and bad is None:
            return hint
        if bad is None:  # every trial so far fits: up from the hint
            return min(good + (good - hint + 1), max_micro_batch)
        if good == floor and bad - good > 1:  # none fits from the hint down so far: down from the hint
            return max(bad - (hint - bad + 1), good + 1)
    if bad is None:
        return min(max(2 * good, 1), max_micro_batch)
    return (good + bad) // 2


def _secant(good: int, bad: int | None, needs: dict[int, int], limit: int) -> int | None:
    """Between the largest micro-batch that fits so far (`good`) and the smallest that does not (`bad`), where the
    line through their device totals meets `limit` (the card less its margin), kept strictly between them; None
    where one of them has no total (no fit yet, or no miss) or the line does not rise. `_search` tries it in place
    of the midpoint, and bisects after two such steps in a row that did not halve the gap (a total that is flat and
    then jumps moves each line's guess by little): where the totals of micro-batches 1 and 2 lie on another line
    than the larger ones' (the optimizer step's peak, not the activations'), the guess from them overshoots, and
    the line through the miss lands near the answer instead of galloping down to it."""
    if bad is None or good < 1 or good not in needs or bad not in needs or needs[bad] <= needs[good]:
        return None
    step = (limit - needs[good]) * (bad - good) // (needs[bad] - needs[good])
    return min(max(good + step, good + 1), bad - 1)


def _lined(spec, setup, candidate, stages: list[int] | None, gpu, alloc_conf: AllocatorConfig,
           points: tuple[int, int], low: int, top: int) -> int | None:
    """The largest micro-batch from `low` to `top` that fits a pipeline's `stages` (the search's screen) on the
    guess of `timeline.on_the_line`: each event's bytes on the line through its bytes at the two micro-batches
    `points` (the stages' timelines there: the trials', or traced for a stage new to the screen). `_search` tries
    it next: with the guess right, the search ends in two trials, that one and the next (what fits is only what
    is predicted). None where `low` does not fit on the guess, a stage's timelines at `points` have not the same
    events or not on a line, or the layout is not a pipeline or changes with the micro-batch."""
    layout = candidate.layout_for(points[0])
    if not stages or layout.pp == 1 or any(candidate.layout_for(b) != layout for b in (*points, low, top)):
        return None
    lines = []
    for stage in stages:
        line = on_the_line(*(checked_stage_timeline(spec, replace(setup, micro_batch=b), layout, stage, gpu)
                             for b in points), points)
        if line is None:
            return None
        lines.append(line)

    def fits(micro_batch: int) -> bool:  # a replay each: milliseconds
        return all(predict_timeline(line(micro_batch), gpu, alloc_conf).fits for line in lines)

    if not fits(low):
        return None
    good, bad = low, None  # doubling, then bisecting, on the guess
    while bad is None and good < top:
        trial = min(2 * good, top)
        good, bad = (trial, None) if fits(trial) else (good, trial)
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _extrapolated(need_1: int, need_2: int, gpu: GpuProfile, max_micro_batch: int) -> int | None:
    """Where micro-batches 1 and 2 both fit, the micro-batch whose device total, on the line through theirs,
    reaches the card less its margin: where `_search` gallops from (a guess: what fits is only what is
    predicted); None where the total does not grow."""
    slope = need_2 - need_1
    if slope <= 0:
        return None
    return min(max_micro_batch, 2 + (gpu.capacity_bytes - gpu.margin_bytes - need_2) // slope)


# What `--allow` may switch on to make a layout fit, tried fewest first (then in this order).
LEVERS: dict[str, dict] = {
    "ckpt": {"grad_ckpt": True},
    "bf16": {"precision": Precision.BF16, "build_bf16": True},
    "lora": {"lora_rank": 16},
    "offload": {"grad_ckpt": True, "ckpt_offload": True},
}


def lever_sets(allow: tuple[str, ...]) -> list[tuple[str, ...]]:
    """(), then each allowed lever alone, then pairs, ...: the least change to the user's setup first."""
    if unknown := [name for name in allow if name not in LEVERS]:
        raise InputError(f"unknown levers {unknown} for --allow; valid choices: {', '.join(LEVERS)}")
    return [combo for n in range(len(allow) + 1) for combo in itertools.combinations(allow, n)]


def with_levers(setup: TrainSetup, levers: tuple[str, ...]) -> TrainSetup:
    for name in levers:
        setup = as_loaded(setup, **LEVERS[name])
    return setup


def size(spec: ModelSpec, setup: TrainSetup, gpu: GpuProfile, max_gpus: int = 8,
         max_micro_batch: int = 64, alloc_conf: AllocatorConfig = AllocatorConfig(),
         families: tuple[str, ...] = DEFAULT_FAMILIES, global_batch: int | None = None,
         allow: tuple[str, ...] = (), jobs: int = 1, progress: bool = False,
         cluster: str | None = None) -> pd.DataFrame:
    """One row per layout (and GPU count): whether it fits, with which of the allowed levers (the fewest that
    make it fit), its micro-batch (the largest that fits; with `global_batch`, the one that makes up the batch),
    and why it does not fit when it does not. A layout other than a pipeline is evaluated on its GPU counts in
    turn, fewest first (`_layout_rows`: the answer on fewer GPUs starts the search on more); a pipeline on each
    GPU count apart (its traces are per stage, and on few GPUs a large model's pipelines fit nothing to start
    from). They are evaluated in `jobs` local processes (each traces what its layouts need), the pipelines first
    (they take longest), the most stages first; with `cluster` (a Dask scheduler's address) on its workers."""
    if global_batch is not None and global_batch < 1:
        raise InputError(f"global-batch must be a positive integer, got {global_batch}")
    combos = lever_sets(allow)
    keys: dict[tuple[str, int], list[tuple[str, ...]]] = {}
    for levers in combos:
        for candidate in candidates(spec, with_levers(setup, levers), max_gpus, families):
            keys.setdefault((candidate.name, candidate.gpus), []).append(levers)
    if not keys:
        raise InputError(f"no layout of the families {', '.join(families)} applies to {spec.name} on up to "
                         f"{max_gpus} GPU(s): {_why_none(spec, setup, families, max_gpus)}")
    work = functools.partial(_chains_rows, spec, setup, gpu, max_gpus, max_micro_batch, alloc_conf, families,
                             global_batch)
    # The longest first: each pipeline on its own (a trace per stage; the most GPUs, the most stages, first), then
    # the other layouts each as a chain of its GPU counts, fewest first, ZeRO-3's first (traces of its own). A
    # 3-D layout of TP 1 (`ddpxppN`, DDP around each of the `pp` layout's stages) goes with the `pp` layout of its
    # stages, after it: the same stage traces (DDP's buffers are planned, not traced), made once in one process.
    pipelines = sorted((key for key in keys if "pp" in key[0]), key=lambda key: -key[1])
    partner = {}  # ddpxppN on 2N GPUs -> pp on N
    for key in pipelines:
        pp_key = ("pp", key[1] // REPLICAS_3D)
        if key[0] == f"ddpxpp{pp_key[1]}" and pp_key in keys:
            partner[key] = pp_key
    chains: dict[str, list[tuple[tuple[str, int], list[tuple[str, ...]]]]] = {}
    for key in sorted(keys, key=lambda key: key[1]):
        if "pp" not in key[0]:
            chains.setdefault(key[0], []).append((key, keys[key]))
    grouped = {key: [[(key, keys[key])]] for key in pipelines if key not in partner}  # item: its chains
    for key, pp_key in partner.items():
        grouped[pp_key].append([(key, keys[key])])
    items = list(grouped.values()) + \
        [[chains[name]] for name in sorted(chains, key=lambda name: (name != "zero3", -len(chains[name])))]
    items_done = in_processes(work, items, jobs, progress, "layout", cluster=cluster)
    rows = {row_key: row for chains_rows in items_done for chain in chains_rows for row_key, row in chain}
    frame = pd.DataFrame([rows[key] for key in keys])
    return frame.sort_values(["fits", "gpus", "largest_micro_batch"], ascending=[False, True, False],
                             kind="stable").reset_index(drop=True)


def _chains_rows(spec: ModelSpec, setup: TrainSetup, gpu: GpuProfile, max_gpus: int, max_micro_batch: int,
                 alloc_conf: AllocatorConfig, families: tuple[str, ...], global_batch: int | None,
                 chains: list[list[tuple[tuple[str, int], list[tuple[str, ...]]]]]) -> list[list]:
    """`_layout_rows` of each chain, in turn, in one process (each chain its own search: no hint passes from one
    to the next)."""
    return [_layout_rows(spec, setup, gpu, max_gpus, max_micro_batch, alloc_conf, families, global_batch, chain)
            for chain in chains]


def _layout_rows(spec: ModelSpec, setup: TrainSetup, gpu: GpuProfile, max_gpus: int, max_micro_batch: int,
                 alloc_conf: AllocatorConfig, families: tuple[str, ...], global_batch: int | None,
                 chain: list[tuple[tuple[str, int], list[tuple[str, ...]]]]) -> list[tuple[tuple[str, int], dict]]:
    """The rows of one layout on each of its GPU counts ((name, GPUs), the lever sets to try), fewest GPUs first,
    each trying the levers in turn: a layout that never fits is shown with every lever it was allowed. The
    largest micro-batch a lever set found on fewer GPUs is where the search on more starts (`_search`'s hint):
    it moves by a few from one GPU count to the next, and the search gallops from it."""
    rows, found = [], {}
    for key, tries in chain:
        for levers in tries:
            candidate = _candidate(spec, setup, levers, key, max_gpus, families)
            row = _evaluate(spec, with_levers(setup, levers), candidate, gpu, max_micro_batch, alloc_conf,
                            global_batch, found.get(levers))
            row = {"layout": key[0], "gpus": key[1], "levers": "+".join(levers) or "-", **row}
            if row["largest_micro_batch"]:
                found[levers] = row["largest_micro_batch"]
            if row["fits"]:
                break
        rows.append((key, row))
    return rows


def _candidate(spec: ModelSpec, setup: TrainSetup, levers: tuple[str, ...], key: tuple[str, int], max_gpus: int,
               families: tuple[str, ...]) -> Candidate:
    """The candidate (name, GPUs) with these levers: rebuilt where it runs (a candidate holds a closure)."""
    return next(c for c in candidates(spec, with_levers(setup, levers), max_gpus, families) if (c.name, c.gpus) == key)


def _evaluate(spec: ModelSpec, setup: TrainSetup, candidate: Candidate, gpu: GpuProfile, max_micro_batch: int,
              alloc_conf: AllocatorConfig, global_batch: int | None, hint: int | None = None) -> dict:
    try:
        if global_batch is None:
            if why := _cannot_fit(spec, replace(setup, micro_batch=1), candidate.layout_for(1), gpu):
                return _row(0, 1, None, gpu, why)
            micro_batch, total, failure = _search(spec, setup, candidate, gpu, max_micro_batch, alloc_conf, hint)
            if not micro_batch:
                return _row(0, 1, None, gpu, _needs(1, "", failure[0], gpu, failure[1]))
            return _row(micro_batch, 1, total, gpu, "")
        return _for_global_batch(spec, setup, candidate, gpu, alloc_conf, global_batch)
    except InputError as error:  # a combination llmsim refuses (e.g. a lever not modelled with this layout)
        return _row(0, 1, None, gpu, f"not modelled: {error}")


def _for_global_batch(spec, setup, candidate, gpu, alloc_conf, global_batch: int) -> dict:
    """The global batch is micro-batch x replicas x passes: the data-parallel replicas split it (gradient
    accumulation is modelled for one process only, so each takes its share at once); one process may accumulate;
    a pipeline splits its share into micro-batches (1F1B needs at least as many as stages). The largest
    micro-batch that fits wins."""
    replicas = candidate.layout_for(1).dp  # DDP's, ZeRO's, FSDP's ranks and the 3-D layouts' replicas
    if global_batch % replicas:
        return _row(0, 1, None, gpu, f"global batch {global_batch} is not a multiple of {replicas} replicas")
    share = global_batch // replicas
    stages = _stages(candidate)
    if stages > 1:
        options = [(mb, share // mb) for mb in _divisors(share) if share // mb >= stages]
        if not options:
            return _row(0, 1, None, gpu, f"global batch {global_batch} gives fewer micro-batches than {stages} "
                        "stages (1F1B)")
    elif candidate.name == "single":
        options = [(mb, share // mb) for mb in _divisors(share)]
    else:
        options = [(share, 1)]
    for i, (micro_batch, passes) in enumerate(options):  # largest micro-batch first
        trial = replace(setup, micro_batch=micro_batch, grad_accum=passes if stages == 1 else 1)
        layout = candidate.layout_for(micro_batch, m=passes) if stages > 1 else candidate.layout_for(micro_batch)
        if i == 0 and (why := _cannot_fit(spec, trial, layout, gpu)):  # the model states alone, at any split
            return _row(0, options[-1][1], None, gpu, why)
        ok, worst, unpredicted = _worst(spec, trial, layout, gpu, alloc_conf)
        if ok:
            return _row(micro_batch, passes, worst.needed_bytes, gpu, "")
    micro_batch, passes = options[-1]
    split = f" x {passes} {'micro-batches' if stages > 1 else 'passes'}" if passes > 1 else ""
    return _row(0, passes, None, gpu, _needs(micro_batch, split, worst, gpu, unpredicted))


def _cannot_fit(spec: ModelSpec, setup: TrainSetup, layout: Layout, gpu: GpuProfile) -> str | None:
    """Why `layout` fits at no micro-batch, from a lower bound of its ranks' peak allocated bytes that needs no
    trace (llmsim/sim/bound.py: the model states alone; TP and PP layouts), or None where the bound fits or is not
    modelled. A rank fits only if its live bytes and its two cuBLAS workspaces fit in the capacity less the CUDA
    context and the verdict's margin (`replay.on_device`): the model states are all alive only from the first
    backward on, when the forward's thread and autograd's have each made theirs (tracker.WORKSPACE_MARKERS).
    Raises the InputError `predict` would raise for this layout."""
    bounds = rank_lower_bounds(spec, checked(spec, setup, layout, gpu), layout)
    if not bounds:
        return None
    rank = max(bounds, key=bounds.get)  # the lowest such rank
    workspaces = 2 * gpu.cublas_workspace_bytes
    usable = gpu.capacity_bytes - gpu.margin_bytes - gpu.cuda_context_bytes - workspaces
    if bounds[rank] <= usable:
        return None
    total = bounds[rank] + workspaces + gpu.cuda_context_bytes
    return (f"needs at least {human_bytes(total)} on rank {rank} of {human_bytes(gpu.capacity_bytes)} less its "
            f"{human_bytes(gpu.margin_bytes)} margin (its model states alone, before activations)")


def _needs(micro_batch: int, split: str, worst, gpu: GpuProfile, unpredicted: int = 0) -> str:
    other = f" (the other {unpredicted} pipeline stage{'s' * (unpredicted > 1)} not predicted)" if unpredicted else ""
    return (f"micro-batch {micro_batch}{split} needs {human_bytes(worst.needed_bytes)} on rank {worst.rank} "
            f"of {human_bytes(gpu.capacity_bytes)} ({worst.verdict}: margin {human_bytes(gpu.margin_bytes)}){other}")


def _row(micro_batch: int, passes: int, total: int | None, gpu: GpuProfile, why: str) -> dict:
    return {"largest_micro_batch": micro_batch, "passes": passes, "needed_bytes": total,
            "headroom_bytes": gpu.capacity_bytes - total if total is not None else None,
            "fits": micro_batch > 0, "why": why}


def _stages(candidate: Candidate) -> int:
    return candidate.layout_for(1).pp


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]
