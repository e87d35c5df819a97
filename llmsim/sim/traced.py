"""Each traced process's timeline at full depth, kept for the next prediction with the same inputs (`expanded`);
a pipeline's stages, traced in local processes when several are missing (`stage_timelines`), a 1F1B middle stage
composed from another's trace (`_traced`); and the strategy's per-rank timelines planned from a traced one
(`plan`)."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import pandas as pd

from llmsim.inputs.spec import ModelSpec, TrainSetup
from llmsim.model.step import StepInfo
from llmsim.model.trace import Trace, hand, no_decay_names, recording_traces, trace
from llmsim.model.tracker import CHUNKS
from llmsim.sim.processes import as_done_in_processes
from llmsim.sim.strategies import STRATEGIES, Layout, Strategy
from llmsim.sim.strategies.events import per_timeline
from llmsim.sim.strategies.zero_common import NO_DECAY
from llmsim.sim.timeline import TRACED_STEPS, expand, repeat_last_step

if TYPE_CHECKING:  # networkx loads when a graph is first asked for
    import networkx as nx


def expanded(model: ModelSpec, setup: TrainSetup) -> tuple[pd.DataFrame, Callable[[], nx.DiGraph]]:
    """The full-depth timeline of one traced process and its layer graph (built when first asked for), kept for
    the next prediction with the same inputs (the latest `_MAX_EXPANDED`; the strategies and the replay read
    them, never change them). With pipeline stages, the graph is the last stage's."""
    key = (model, setup)
    if key in _EXPANDED:
        _EXPANDED[key] = _EXPANDED.pop(key)  # the most recently used is the last to go
        return _EXPANDED[key]
    return _remember(key, *_expand_key(key))


def _expand_key(key: tuple[ModelSpec, TrainSetup]) -> tuple[pd.DataFrame, StepInfo]:
    """Trace and expand to full depth (what `expanded` keeps). Two steps are traced and the steady second one
    repeated (`repeat_last_step`)."""
    model, setup = key
    steps = replace(setup, steps=min(setup.steps, TRACED_STEPS))
    composed = _composed_at_depth(model, steps)
    if composed is not None:
        full, info = composed
    else:
        traced = _traced(model, steps)
        full, info = expand(traced), traced.info
    timeline = repeat_last_step(full, setup.steps)
    if timeline is None:  # the last traced step is not steady: trace every step
        traced = _traced(model, setup)
        timeline = expand(traced)
    timeline.attrs.pop(CHUNKS, None)  # the stage's traced steps only
    if setup.trainer_under_deepspeed:  # the Trainer's optimizer has two param groups, which DeepSpeed keeps apart
        timeline.attrs[NO_DECAY] = no_decay_names(model, setup)
    return timeline, info


def _composed_at_depth(model: ModelSpec, setup: TrainSetup) -> tuple[pd.DataFrame, StepInfo] | None:
    """A 1F1B middle stage other than the first of its kind, composed from that one's trace expanded to full depth
    (one expansion for every stage of the kind; compose_1f1b moves whole chunk calls, which the expansion keeps
    together, `timeline._expanded_chunks`); None where it is not such a stage or the composition declines."""
    template = _template_stage(model, setup)
    if template is None:
        return None
    key = (model, replace(setup, pp_stage=template))
    if key not in _EXPANDED_TEMPLATES:
        source = _template_trace(key)
        _keep(_EXPANDED_TEMPLATES, key, (expand(source), source.info), _MAX_TEMPLATES)
    expanded_source, info = _EXPANDED_TEMPLATES[key]
    timeline = _composed(expanded_source, template, setup)
    return None if timeline is None else (timeline, info)


def _traced(model: ModelSpec, setup: TrainSetup) -> Trace:
    """`trace`, or for a 1F1B middle stage other than the first of its kind, the first one's trace composed into
    this stage's schedule (llmsim/sim/compose_1f1b.py; traced where the composition declines); a stage traced
    over many micro-batches is composed from a shallower pipeline's over fewer where it can be (`widened`)."""
    template = _template_stage(model, setup)
    if template is not None:
        source = _template_trace((model, replace(setup, pp_stage=template)))
        timeline = _composed(source.timeline, template, setup)
        if timeline is not None:
            return replace(source, timeline=timeline)
    return widened(model, setup) or trace(model, setup)


def _template_trace(key: tuple[ModelSpec, TrainSetup]) -> Trace:
    """The trace of a stage others are composed from: a worker's (`_keep_template`), or made here."""
    return _TEMPLATES.get(key) or widened(*key) or trace(*key)


NARROW = 5  # the depth and micro-batches of the shallower pipeline a stage is composed from (`widened`)
WIDEN_FROM = 8  # the fewest micro-batches that are worth it: a stage over fewer is traced


@functools.lru_cache(maxsize=32)
def widened(model: ModelSpec, setup: TrainSetup) -> Trace | None:
    """Under 1F1B with as many micro-batches as stages (M = pp >= WIDEN_FROM), the first stage (warm-up W = M),
    the first middle stage (W = M - 1) or the last (W = 1), composed from the same stage of a pipeline of NARROW
    stages over NARROW micro-batches whose `pp_split` gives it the same layers (`compose_1f1b.composed` over fewer
    micro-batches: each call from the template's call of its role; the receive buffers, the batch and the last
    stage's kept outputs made for M); None where it is not such a stage or the composition declines (then trace
    it). A stage's trace depends on its layers, W and M,
    not on the pipeline's depth (experiments/explore_stage_traces.py), except FSDP2's device mesh made on the CPU
    (4 bytes a rank): FSDP2 on the CPU is traced. Chunk replay spares a stage's later micro-batches their
    computation, but not under FSDP2 (70B: 348 ms a micro-batch traced, 6 ms replayed);
    `tests/test_compose_1f1b.py` compares with the stage's own trace."""
    from llmsim.enums import Device, Recipe
    from llmsim.model.pipelining import Schedule, layers_per_stage
    from llmsim.sim import compose_1f1b

    stage, m = setup.pp_stage, setup.n_microbatches
    last = stage == setup.pp - 1
    if (setup.recipe is not Recipe.CANONICAL or setup.schedule != Schedule.ONE_F_ONE_B.value
            or setup.stages_per_rank != 1 or m != setup.pp or m < WIDEN_FROM or (stage not in (0, 1) and not last)
            or (setup.fsdp is not None and setup.device is Device.CPU)):
        return None

    counts = layers_per_stage(setup.pp, model.num_layers, setup.pp_split)
    if last:  # the narrow pipeline's last stage holds its layers, the others those before them
        before = model.num_layers - counts[-1]
        if before < NARROW - 1:
            return None
        split, narrow_stage = layers_per_stage(NARROW - 1, before) + (counts[-1],), NARROW - 1
    else:  # the narrow pipeline's first stages hold the layers of this one and those before, the others the rest
        rest, others = sum(counts[stage + 1:]), NARROW - stage - 1
        if rest < others:
            return None
        split, narrow_stage = counts[:stage + 1] + layers_per_stage(others, rest), stage
    narrow = replace(setup, pp=NARROW, pp_stage=narrow_stage, n_microbatches=NARROW, pp_split=split,
                     fsdp_world=setup.fsdp_world // setup.pp * NARROW if setup.fsdp is not None else
                     setup.fsdp_world)
    source = trace(model, narrow)
    warmup = compose_1f1b.warmup
    timeline = compose_1f1b.composed(source.timeline, warmup(NARROW, NARROW, narrow_stage), warmup(m, m, stage), m,
                                     NARROW, 1 + (0 < stage < setup.pp - 1), outputs_kept=last)
    return None if timeline is None else replace(source, timeline=timeline)


def _composed(source: pd.DataFrame, template: int, setup: TrainSetup) -> pd.DataFrame | None:
    """compose_1f1b.composed: `setup`'s stage from `source`, a timeline of stage `template`."""
    from llmsim.sim import compose_1f1b

    warmup = functools.partial(compose_1f1b.warmup, setup.n_microbatches, setup.pp)
    return compose_1f1b.composed(source, warmup(template), warmup(setup.pp_stage), setup.n_microbatches)


def _template_stage(model: ModelSpec, setup: TrainSetup) -> int | None:
    """The stage whose 1F1B trace `_traced` composes `setup`'s stage from: the first middle stage of its kind,
    where that is another stage. Under FSDP2 torch's PipelineStage runs every backward without resharding or
    reducing (`set_reshard_after_backward(False)`, `set_requires_gradient_sync(False)`; `perform_reduce_grad` after
    the last), so what a chunk call does depends on the kind of the call before it, and the composition takes each
    call's rows from a template call that follows the same kind (compose_1f1b, `_sources`): reordering the
    template's own calls instead had stages 27-29 of Llama-2-70B over 32 stages (dp 2) at 53-59 GiB where traced
    they hold 18 GiB, and missed a measured six-stage run by up to 40.5 % (tests/test_compose_1f1b.py)."""
    from llmsim.model.pipelining import Schedule

    stage = setup.pp_stage
    if setup.pp < 3 or setup.schedule != Schedule.ONE_F_ONE_B.value or stage in (0, setup.pp - 1):
        return None
    layout = Layout(world_size=setup.pp, pp=setup.pp, pp_split=setup.pp_split)  # what stage_kind reads
    kind = stage_kind(model, layout, stage)
    first = next(other for other in range(1, stage + 1) if stage_kind(model, layout, other) == kind)
    return first if first != stage else None


def _expand_keeping_template(key: tuple[ModelSpec, TrainSetup]):
    """`_expand_key` in a worker process, with the trace itself where another stage is composed from it, and the
    traces it made (for `trace.hand`: a split tried later traces none of them again)."""
    with recording_traces() as made:
        timeline, info = _expand_key(key)
        model, setup = key
        steps = replace(setup, steps=min(setup.steps, TRACED_STEPS))
        template = _template_trace((model, steps)) if _is_template(model, setup) else None
    return timeline, info, template, made


def _is_template(model: ModelSpec, setup: TrainSetup) -> bool:
    return any(_template_stage(model, replace(setup, pp_stage=other)) == setup.pp_stage
               for other in range(setup.pp_stage + 1, setup.pp - 1))


def _remember(key: tuple[ModelSpec, TrainSetup], timeline: pd.DataFrame,
              info: StepInfo) -> tuple[pd.DataFrame, Callable[[], nx.DiGraph]]:
    return _keep(_EXPANDED, key, (timeline, functools.cache(functools.partial(_layer_graph, timeline, info))),
                 _MAX_EXPANDED)


def _keep(cache: dict, key, value, limit: int):
    """Put `value` in `cache`, the oldest entry dropped to keep at most `limit`; returns `value`."""
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def _layer_graph(timeline: pd.DataFrame, info: StepInfo) -> nx.DiGraph:
    from llmsim.sim.graph import layer_graph

    return layer_graph(timeline, info)


_MAX_EXPANDED = 16
_EXPANDED: dict[tuple[ModelSpec, TrainSetup], tuple[pd.DataFrame, Callable[[], nx.DiGraph]]] = {}
_TEMPLATES: dict[tuple[ModelSpec, TrainSetup], Trace] = {}  # traced in a worker, for `_traced` (the latest few)
# the same at full depth, its chunk calls kept: for `_composed_at_depth`
_EXPANDED_TEMPLATES: dict[tuple[ModelSpec, TrainSetup], tuple[pd.DataFrame, StepInfo]] = {}
_MAX_TEMPLATES = 4


def stage_ranks(layout: Layout, stage: int) -> list[int]:
    """The global ranks of pipeline stage `stage`: its TP ranks in every data-parallel replica."""
    per_replica = layout.pp * layout.tp
    return [replica * per_replica + stage * layout.tp + t for replica in range(layout.dp) for t in range(layout.tp)]


def stage_timeline(model: ModelSpec, setup: TrainSetup, layout: Layout,
                    stage: int) -> tuple[pd.DataFrame, Callable[[], nx.DiGraph]]:
    return _stage_planned(expanded(model, _stage_setup(setup, layout, traced_stage(model, layout, stage))),
                          layout, setup)


def traced_stage(model: ModelSpec, layout: Layout, stage: int) -> int:
    """The stage whose trace stands for `stage`'s: itself, or under GPipe the first stage of its kind. ScheduleGPipe
    runs the same actions on every stage (each micro-batch's receive, forward and send, then each one's receive,
    backward and send), so two stages that hold equal layers and neither the first stage's embedding and missing
    receives nor the last stage's head, loss and missing sends run the same events (the fake process group's rank
    names no event); `tests/test_pipeline_stages.py` traces both and compares. Under 1F1B a stage's warm-up
    (`num_stages - stage_index` forwards) sets its own order: each stage is its own, and `_traced` composes a
    middle one from the trace of the first of its kind."""
    from llmsim.model.pipelining import Schedule

    if layout.schedule is not Schedule.GPIPE or stage in (0, layout.pp - 1):
        return stage
    kind = stage_kind(model, layout, stage)
    return next(other for other in range(1, stage + 1) if stage_kind(model, layout, other) == kind)


def stage_kind(model: ModelSpec, layout: Layout, stage: int) -> tuple:
    """What a middle stage's events depend on: its layers, one description each (the attention type, and in a
    mixture-of-experts model the layer's modules and shapes: moe.layer_signatures), as `layer_structure` tells
    layers apart for the reduced-depth trace."""
    from llmsim.inputs.spec import num_experts
    from llmsim.model import moe
    from llmsim.model.pipelining import layer_range

    start, end = layer_range(stage, layout.pp, model.num_layers, layout.pp_split)
    if num_experts(model.hf_config()):
        return moe.layer_signatures(model.config_json)[start:end]
    types = getattr(model.hf_config(), "layer_types", None)
    return tuple(types[start:end]) if types else (end - start,)


def stage_timelines(model: ModelSpec, setup: TrainSetup, layout: Layout, progress: bool = False, jobs: int = 1,
                    planned: Callable[[pd.DataFrame], None] | None = None,
                    ) -> list[tuple[pd.DataFrame, Callable[[], nx.DiGraph]]]:
    """Every stage's `stage_timeline`; with `jobs` > 1 the stages not cached are traced in that many processes
    (the traces are independent), then cached here as if traced here. Meanwhile this process plans each stage
    whose timeline is back, and composes the 1F1B middle stages once their template's trace is (the template is
    handed out first), and calls `planned` with each stage's timeline as it is planned (the caller replays it):
    with three traces on two processes, that work fills the core the last trace leaves idle."""
    from tqdm import tqdm

    keys = [(model, _stage_setup(setup, layout, traced_stage(model, layout, stage))) for stage in range(layout.pp)]
    found = {key: _EXPANDED[key] for key in keys if key in _EXPANDED}
    missing = list(dict.fromkeys(key for key in keys if key not in found))  # a GPipe kind's stages share one
    # a 1F1B stage composed from another's trace is composed here, once that trace is back
    traced_apart = [key for key in missing if _template_stage(*key) is None]
    stages: list = [None] * layout.pp
    with tqdm(total=layout.pp, disable=not progress, unit="stage", leave=False) as bar:  # cleared at the end
        def plan_ready(ready: Callable[[tuple], bool]) -> None:
            for index, key in enumerate(keys):
                if stages[index] is None and ready(key):
                    stages[index] = _stage_planned(found[key] if key in found else expanded(*key), layout, setup)
                    if planned is not None:
                        planned(stages[index][0])
                    bar.update()

        if jobs > 1 and len(traced_apart) > 1:
            traced_apart.sort(key=lambda key: not _is_template(*key))  # templates first: the most work waits on them
            for index, (timeline, info, template, made) in as_done_in_processes(
                    _expand_keeping_template, traced_apart, min(jobs, len(traced_apart))):
                key = traced_apart[index]
                hand(made)
                found[key] = _remember(key, timeline, info)
                if template is not None:
                    _keep_template(key, template)
                plan_ready(lambda other: other in found or _template_kept(*other))
        plan_ready(lambda other: True)
    return stages


def _template_kept(model: ModelSpec, setup: TrainSetup) -> bool:
    """Whether the trace a 1F1B middle stage is composed from is here (a worker's, or expanded already)."""
    template = _template_stage(model, setup)
    if template is None:
        return False
    key = (model, replace(setup, steps=min(setup.steps, TRACED_STEPS), pp_stage=template))
    return key in _TEMPLATES or key in _EXPANDED_TEMPLATES


def _keep_template(key: tuple[ModelSpec, TrainSetup], template: Trace) -> None:
    model, setup = key
    _keep(_TEMPLATES, (model, replace(setup, steps=min(setup.steps, TRACED_STEPS))), template, _MAX_TEMPLATES)


def _stage_setup(setup: TrainSetup, layout: Layout, stage: int) -> TrainSetup:
    return replace(setup, pp=layout.pp, pp_stage=stage, schedule=layout.schedule.value,
                   n_microbatches=layout.n_microbatches, pp_split=layout.pp_split,
                   stages_per_rank=layout.stages_per_rank)


def _stage_planned(traced: tuple[pd.DataFrame, Callable[[], nx.DiGraph]], layout: Layout, setup: TrainSetup):
    timeline, graph = traced
    if layout.strategy is not Strategy.SINGLE:  # the stage's DDP buffers, the same in every replica
        timeline = plan(timeline, layout, setup)[0]
    return timeline, graph


@per_timeline(maxsize=32)
def plan(timeline: pd.DataFrame, layout: Layout, setup: TrainSetup):
    """The strategy's per-rank timelines, kept for the next prediction of the same layout on the same traced
    timeline (another GPU or allocator setting of a sweep, `size` trying GPUs): a ZeRO-3 plan walks every event
    of the step. The last few are kept (as many as a 32-stage pipeline's stages, each with its DDP buffers); a
    ZeRO-1/2 plan keeps one template walk (about 9 MiB at 70B)."""
    return STRATEGIES[layout.strategy](timeline, layout, setup)
