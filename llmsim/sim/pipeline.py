"""The whole pipeline, in `predict`: model -> checks -> trace -> strategy's per-rank plan -> replay -> peaks.
Each step lives in its own module: the trace and its expansion in `traced`, the strategies in `strategies/`, the
replay of each rank's timeline (peak, caching allocator, device total) in `replay`, what comes out in
`prediction`."""
from __future__ import annotations

import functools
from dataclasses import replace

import pandas as pd

from llmsim.enums import Recipe
from llmsim.errors import InputError
from llmsim.inputs.gpus import GpuProfile, on_gpu
from llmsim.inputs.spec import ModelSpec, TrainSetup, check_fits_positions, check_fused_layout, resolve_attention
from llmsim.model.losses import check_loss
from llmsim.model.pipelining import check_pipeline, layer_range, layers_prefix
from llmsim.model.quantized import check_quantized
from llmsim.model.tensor_parallel import UNEVEN_SIZES, check_expert_parallel, check_tensor_parallel, tp_rank_classes
from llmsim.sim.allocator import AllocatorConfig
from llmsim.sim.prediction import Prediction, RankPrediction, renamed_layers
from llmsim.sim.processes import collector_paused
from llmsim.sim.replay import as_rank, replay_ahead, replay_ranks
from llmsim.sim.strategies import Layout, check_supported, traced_setup
from llmsim.sim.traced import expanded, plan, stage_ranks, stage_timeline, stage_timelines

__all__ = ["Prediction", "RankPrediction", "checked", "expanded", "predict", "predict_stage"]


def predict(model: ModelSpec, setup: TrainSetup, layout: Layout = Layout(),
            gpu: GpuProfile | None = None, alloc_conf: AllocatorConfig = AllocatorConfig(),
            progress: bool = False, jobs: int = 1) -> Prediction:
    """Every rank's peak for `model` trained as `setup` says, laid out as `layout`, on `gpu` (None: the CPU).
    `progress`: a bar over a pipeline's stages (one trace each); `jobs`: local processes for the stages not yet
    traced and for ZeRO-1/2's rank replays on a GPU. Python's cyclic collector is paused meanwhile."""
    if jobs < 1:
        raise InputError(f"jobs({jobs}) must be >= 1")
    nvme = None
    with collector_paused():
        setup = checked(model, setup, layout, gpu)  # what is refused, one line each; the setup the trace runs
        if setup.recipe in (Recipe.DEEPSPEED_PIPE, Recipe.DEEPSPEED_AUTOTP):  # DeepSpeed's pipeline engine, its
            rank_timelines, graph = _ds_engine_ranks(model, setup, layout, jobs)  # AutoTP: each rank traced as it runs
        elif layout.pp > 1:  # one trace per stage, shared by the stage's TP ranks in every replica
            stages = stage_timelines(model, setup, layout, progress, jobs,
                                     planned=functools.partial(replay_ahead, gpu=gpu, alloc_conf=alloc_conf))
            rank_timelines = {rank: timeline for stage, (timeline, _) in enumerate(stages)
                              for rank in stage_ranks(layout, stage)}
            graph = stages[-1][1]
        elif layout.fsdp is not None:  # one trace per group of ranks with equal local shards
            from llmsim.sim.strategies.fsdp import rank_classes

            classes = rank_classes(model, setup, layout.world_size) if layout.tp == 1 else [list(range(
                layout.world_size))]  # FSDP2 x TP: even shards only (`checked`), every rank alike
            rank_timelines, graph = _traced_per_class(model, setup, classes, "fsdp_rank")
        elif len(classes := tp_rank_classes(model.hf_config(), setup.tp) if setup.tp > 1 else [[0]]) > 1:
            # uneven TP shards: one trace per group of ranks with equal shards
            rank_timelines, graph = _traced_per_class(model, setup, classes, "tp_rank")
        else:  # one trace, at full depth; the strategy plans each rank's timeline from it
            timeline, graph = expanded(model, setup)
            rank_timelines = plan(timeline, layout, setup)
            if layout.deepspeed is not None and (layout.deepspeed.swaps_optimizer or layout.deepspeed.swaps_params):
                from llmsim.sim.strategies.zero3 import nvme_bytes

                nvme = nvme_bytes(timeline, layout, setup)
        ranks = replay_ranks(rank_timelines, gpu, alloc_conf, jobs)  # peak, reserved and device total per rank
        if layout.pp > 1 and setup.recipe is not Recipe.DEEPSPEED_PIPE:
            ranks = _in_model_names(ranks, model, layout)
        bound = None
        if setup.ep > 1 and setup.routing != "collapsed":  # the routing's worst case beside the stated one
            worst = replace(setup, routing="collapsed")
            bound = replay_ranks(plan(expanded(model, worst)[0], layout, worst), gpu, alloc_conf, jobs)
        return Prediction(model, setup, layout, ranks, graph, gpu, alloc_conf, routing_bound=bound, nvme_bytes=nvme)


def _ds_engine_ranks(model: ModelSpec, setup: TrainSetup, layout: Layout, jobs: int = 1):
    """Every rank of DeepSpeed's pipeline engine, numbered as DeepSpeed's topology numbers them (stage x dp +
    data-parallel rank), or of DeepSpeed's AutoTP (by global rank), each its own trace (in `jobs` local processes):
    the engine, ZeRO's partitions, the stage's buffers and AutoTP's shards are DeepSpeed's code run under fake
    tensors (llmsim/model/ds_pipe.py, llmsim/model/ds_script.py), no strategy plans them. A stage's replicas differ
    where ZeRO-1 (and bf16's optimizer under ZeRO-0) partition the flat parameters over them, and AutoTP's ranks by
    their shards and partitions too, so each is traced: at most MAX_TRACED_RANKS ranks."""
    from llmsim.model.ds_pipe import MAX_TRACED_RANKS
    from llmsim.sim.processes import as_done_in_processes
    from llmsim.sim.traced import _EXPANDED, _expand_key, _remember

    if setup.recipe is Recipe.DEEPSPEED_AUTOTP:  # its own limit, checked with the rest (ds_script.checked_setup)
        keys = [(model, replace(setup, ds_autotp=replace(setup.ds_autotp, rank=rank)))
                for rank in range(layout.world_size)]
    else:
        if layout.world_size > MAX_TRACED_RANKS:
            raise InputError(f"DeepSpeed's pipeline engine is traced rank by rank (each replica's ZeRO partition is "
                             f"its own): pp({layout.pp}) x dp({layout.dp}) = {layout.world_size} ranks is more than "
                             f"the {MAX_TRACED_RANKS} llmsim traces")
        keys = [(model, replace(setup, pp_stage=stage, ds_pipe=replace(setup.ds_pipe, dp_rank=dp_rank)))
                for stage in range(layout.pp) for dp_rank in range(layout.dp)]
    found = {index: _EXPANDED[key] for index, key in enumerate(keys) if key in _EXPANDED}
    missing = [index for index in range(len(keys)) if index not in found]
    work = as_done_in_processes(_expand_key, [keys[index] for index in missing], min(jobs, len(missing))) \
        if jobs > 1 and len(missing) > 1 else ((position, _expand_key(keys[index]))
                                               for position, index in enumerate(missing))
    for position, (timeline, info) in work:
        found[missing[position]] = _remember(keys[missing[position]], timeline, info)
    return {rank: found[rank][0] for rank in range(len(keys))}, found[len(keys) - 1][1]


def _traced_per_class(model: ModelSpec, setup: TrainSetup, classes: list[list[int]], rank_field: str):
    """One trace per group of ranks with equal shards, as the group's first rank (`rank_field` of the setup), given
    to every rank of the group; and the last trace's layer graph."""
    rank_timelines, graph = {}, None
    for ranks in classes:
        timeline, graph = expanded(model, replace(setup, **{rank_field: ranks[0]}))
        rank_timelines.update(dict.fromkeys(ranks, timeline))
    return rank_timelines, graph


def checked(model: ModelSpec, setup: TrainSetup, layout: Layout, gpu: GpuProfile | None = None) -> TrainSetup:
    """What `predict` checks before any trace (one line of InputError for what is refused), and the setup it
    traces: on this GPU, transformers' attention resolved, the strategy's tracing flags, the TP degree."""
    if setup.recipe is Recipe.DEEPSPEED_PIPE:  # checked as the user gave it (on_gpu sets the CUDA optimizer defaults)
        from llmsim.model.ds_pipe import checked_setup

        setup = checked_setup(model, setup, layout)
        return setup if gpu is None else on_gpu(setup, gpu)
    if setup.recipe is Recipe.DEEPSPEED_AUTOTP:  # DeepSpeed's AutoTP: the same, the script's own checks
        from llmsim.model import ds_script

        setup = ds_script.checked_setup(model, setup, layout)
        return setup if gpu is None else on_gpu(setup, gpu)
    if gpu is not None:
        setup = on_gpu(setup, gpu)
    setup = resolve_attention(model, setup)
    check_supported(setup, layout)
    check_quantized(model, setup)
    check_loss(model, setup)
    if layout.deepspeed is not None and layout.deepspeed.stage == 3:
        setup = replace(setup, zero3_hooks=True)
    setup = traced_setup(setup, layout)
    if layout.tp > 1:
        check_tensor_parallel(model.hf_config(), layout.tp)
        check_expert_parallel(model.hf_config(), layout.tp, layout.ep)
        if layout.pp > 1 and getattr(model.hf_config(), "tie_word_embeddings", False):
            raise InputError(f"tp({layout.tp}) x pp({layout.pp}) with tied embeddings (tie_word_embeddings) is not "
                             "modelled yet: TP alone and PP alone are")
        if (layout.pp > 1 or layout.ep > 1) and len(tp_rank_classes(model.hf_config(), layout.tp)) > 1:
            raise InputError(f"tp({layout.tp}) shards {' and '.join(UNEVEN_SIZES)} unevenly; with pp or ep that is "
                             "not modelled yet (TP alone is)")
        setup = replace(setup, tp=layout.tp, ep=layout.ep)
    if layout.fsdp is not None and layout.tp * layout.pp > 1:  # FSDP2 over TP shards or a stage: even shards only
        from llmsim.sim.strategies.fsdp import rank_classes

        split = layout.dp * layout.tp  # the ranks one stage's parameters are split over (the world without pp)
        if len(rank_classes(model, setup, split)) > 1 or len(tp_rank_classes(model.hf_config(), layout.tp)) > 1:
            if layout.pp == 1:
                raise InputError(f"fsdp x tp({layout.tp}) with shards that do not divide evenly over the {split} ranks "
                                 "is not modelled yet (each alone is)")
            raise InputError(f"fsdp x pp({layout.pp}) with shards that do not divide evenly over dp({layout.dp}) x "
                             f"tp({layout.tp}) is not modelled yet; modelled: every parameter's dim 0 a multiple of "
                             f"{split}")
    check_pipeline(model.hf_config(), layout.pp, layout.n_microbatches, layout.schedule, layout.pp_split,
                   setup.precision, layout.stages_per_rank)
    if setup.fused:  # each stage's own setup refuses it too (traced._stage_setup), but after `checked`, which
        # `--suggest` asks of each change it lists
        check_fused_layout(layout.tp, layout.pp)
    check_fits_positions(model, setup)
    return setup


def predict_stage(model: ModelSpec, setup: TrainSetup, layout: Layout, stage: int, gpu: GpuProfile | None = None,
                  alloc_conf: AllocatorConfig = AllocatorConfig()) -> list[RankPrediction]:
    """The ranks of one pipeline stage (`layout.pp > 1`), as `predict` gives them: one trace, shared by the stage's
    TP ranks in every replica. `size` asks stage by stage, so that a micro-batch one stage cannot fit costs no
    other stage's trace."""
    with collector_paused():
        timeline = checked_stage_timeline(model, setup, layout, stage, gpu)
        return _in_model_names(replay_ranks(dict.fromkeys(stage_ranks(layout, stage), timeline), gpu, alloc_conf),
                               model, layout)


def checked_stage_timeline(model: ModelSpec, setup: TrainSetup, layout: Layout, stage: int,
                           gpu: GpuProfile | None = None) -> pd.DataFrame:
    """The timeline `predict_stage` replays for `stage`: the setup `checked` for this GPU, the stage traced (or
    composed) and planned (`traced.stage_timeline`)."""
    return stage_timeline(model, checked(model, setup, layout, gpu), layout, stage)[0]


def _in_model_names(ranks: list[RankPrediction], model: ModelSpec, layout: Layout) -> list[RankPrediction]:
    """Pipeline ranks with their stage's layers named as the model names them (a stage's trace counts them from 0:
    `renamed_layers`); the ranks of one stage (its TP ranks, every replica) share one renamed prediction."""
    if layout.stages_per_rank > 1:  # each stage's layers numbered as the model numbers them (LayerHooks)
        return ranks
    config = model.hf_config()
    prefix = layers_prefix(config)
    renamed: dict[tuple[int, int], RankPrediction] = {}
    out = []
    for rank in ranks:
        stage = rank.rank // layout.tp % layout.pp  # stage_ranks: replica * pp * tp + stage * tp + tp rank
        start = layer_range(stage, layout.pp, int(config.num_hidden_layers), layout.pp_split)[0]
        key = (id(rank.peak), stage)
        if key not in renamed:
            renamed[key] = renamed_layers(rank, prefix, start)
        out.append(as_rank(renamed[key], rank.rank))
    return out
