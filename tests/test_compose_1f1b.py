"""Under 1F1B a middle stage's timeline is composed from the first middle stage of its kind
(llmsim/sim/compose_1f1b.py): each is traced here on its own and compared, event for event, with its composition,
on the committed 1F1B rows' middle stages and on shapes that move the held output's free (M < 2W - 2), tie the
embedding, checkpoint, autocast, and alternate attention in a mixture-of-experts model; under FSDP2, with each
call's rows taken from a template call that follows the same kind."""
import functools
from dataclasses import replace

import pandas as pd
import pytest

import llmsim.sim.traced as traced
from llmsim.enums import Precision
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.validate import row_inputs
from llmsim.model.pipelining import Schedule
from llmsim.model.trace import trace
from llmsim.model.tracker import CHUNKS
from llmsim.sim import compose_1f1b
from llmsim.sim.pipeline import checked
from llmsim.sim.strategies import Layout, Strategy
from llmsim.sim.timeline import TRACED_STEPS, expand, repeat_last_step
from test_expansion import _allocation_order
from test_pipeline_stages import frees_in_serial_order

ROWS = ["data/measurements/tier2_pp_cpu.csv", "data/measurements/tier2_dp_tp_pp_cpu.csv",  # every committed PP row
        "data/measurements/tier2_fsdp_pp_cpu.csv"]
F1B = Schedule.ONE_F_ONE_B
CASES = [  # (zoo model, shrink(hidden, layers, vocab, heads), setup, layout)
    ("llama-2-7b", (64, 12, 512, 4), TrainSetup(1, 32, Precision.BF16),
     Layout(world_size=6, pp=6, schedule=F1B, n_microbatches=6)),
    ("qwen2.5-0.5b", (64, 10, 512, 4), TrainSetup(2, 16, grad_ckpt=True),
     Layout(Strategy.DDP, 10, pp=5, schedule=F1B, n_microbatches=5)),
    ("pythia-160m", (64, 6, 512, 4), TrainSetup(1, 16, Precision.BF16_AUTOCAST),
     Layout(world_size=6, pp=6, schedule=F1B, n_microbatches=7)),
    # stages deeper than their trace (6 and 5 layers, traced at 3): composed from the template's expansion
    ("llama-2-7b", (64, 24, 512, 4), TrainSetup(1, 32, Precision.BF16, grad_ckpt=True),
     Layout(world_size=4, pp=4, schedule=F1B, n_microbatches=6)),
    ("qwen2.5-0.5b", (64, 20, 512, 4), TrainSetup(1, 16, Precision.BF16_AUTOCAST),
     Layout(Strategy.DDP, 8, pp=4, schedule=F1B, n_microbatches=5)),
    # sliding and full attention alternate: stage 1 (layers 1-2) is of another kind than stages 2 and 3 (3-6, 7-10)
    ("gpt-oss-20b", (64, 12, 512, 4), TrainSetup(1, 16, Precision.BF16),
     Layout(world_size=5, pp=5, schedule=F1B, n_microbatches=6, pp_split=(1, 2, 4, 4, 1))),
]


def in_allocation_order(frame: pd.DataFrame) -> pd.DataFrame:
    """`frees_in_serial_order` with serials numbered from 0 in order of allocation (test_expansion's): a composed
    FSDP2 stage at full depth numbers its storages from its template's first, which has other temporaries."""
    return frees_in_serial_order(_allocation_order(frame))


def middle_stage_cases():
    for path in ROWS:
        rows = pd.read_csv(path)
        runs = rows[(rows["schedule"] == "1f1b") & (rows["pp"] > 2)].drop_duplicates(
            [c for c in rows.columns if c not in ("rank", "peak_allocated_bytes", "measured_at", "wall_s")])
        for index, row in runs.iterrows():
            yield pytest.param(*row_inputs(row), id=f"{path.split('/')[-1].removesuffix('.csv')}-row{index}")
    for name, shape, setup, layout in CASES:
        yield pytest.param(load_model_spec(name, shrink(name, *shape)), setup, layout, id=name)


@pytest.mark.parametrize("spec,setup,layout", list(middle_stage_cases()))
def test_a_composed_1f1b_stage_runs_the_events_of_its_own_trace(spec, setup, layout):
    setup = checked(spec, setup, layout)
    composed_stages = 0
    for stage in range(1, layout.pp - 1):
        stage_setup = replace(traced._stage_setup(setup, layout, stage), steps=min(setup.steps, TRACED_STEPS))
        template = traced._template_stage(spec, stage_setup)
        kind = traced.stage_kind(spec, layout, stage)
        first = next(other for other in range(1, stage + 1) if traced.stage_kind(spec, layout, other) == kind)
        assert template == (first if first != stage else None)
        if template is None:
            continue
        composed_stages += 1
        own = trace(spec, stage_setup)
        composed = traced._traced(spec, stage_setup)
        assert composed is not own and composed.timeline.attrs[CHUNKS] == own.timeline.attrs[CHUNKS]
        pd.testing.assert_frame_equal(frees_in_serial_order(composed.timeline), frees_in_serial_order(own.timeline))
        own_at_depth = in_allocation_order(repeat_last_step(expand(own), setup.steps))
        pd.testing.assert_frame_equal(  # and at full depth, every step
            in_allocation_order(repeat_last_step(expand(composed), setup.steps)), own_at_depth)
        at_depth = traced._composed_at_depth(spec, stage_setup)  # what a prediction does: compose at full depth
        assert at_depth is not None
        pd.testing.assert_frame_equal(in_allocation_order(repeat_last_step(at_depth[0], setup.steps)),
                                      own_at_depth)
    assert composed_stages >= 1


FSDP2_CASES = [  # (shrink(hidden, layers, vocab, heads), setup, pp, micro-batches, tp, reshard_after_forward)
    ((64, 12, 512, 4), TrainSetup(1, 64, Precision.BF16, grad_ckpt=True), 6, 6, 1, True),  # the measured 6-stage run
    pytest.param((64, 12, 512, 4), TrainSetup(2, 32), 6, 8, 1, False, marks=pytest.mark.slow),
    ((64, 12, 512, 4), TrainSetup(1, 32, Precision.BF16, grad_ckpt=True), 6, 6, 2, True),  # FSDP2 x TP x PP
    pytest.param((64, 24, 512, 4), TrainSetup(1, 32, Precision.BF16_AUTOCAST), 4, 5, 1, True,  # 6 layers a stage,
                 marks=pytest.mark.slow),  # traced at 3
]


@pytest.mark.parametrize("shape,setup,pp,microbatches,tp,reshard", FSDP2_CASES)
def test_fsdp2_middle_stages_composed_by_the_previous_call_run_their_own_events(shape, setup, pp, microbatches, tp,
                                                                              reshard, monkeypatch):
    """FSDP2 x PP: torch's PipelineStage runs every backward without resharding, so a chunk call all-gathers or not
    as the call before it was a forward or a backward. Each middle stage is composed from stage 1 with every call
    taken from a template call that follows the same kind (compose_1f1b, `_sources`) and runs its own trace's
    events, traced at reduced depth and at full depth; each call running its own template call's rows instead (as
    before 435ff17) does not, where FSDP2 reshards after the forward."""
    from llmsim.inputs.spec import FsdpSetup

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", *shape))
    layout = Layout(Strategy.FSDP, 2 * pp * tp, fsdp=FsdpSetup(reshard_after_forward=reshard), tp=tp, pp=pp,
                    schedule=F1B, n_microbatches=microbatches)
    setup = checked(spec, setup, layout)

    def stage_setup(stage: int) -> TrainSetup:
        return replace(traced._stage_setup(setup, layout, stage), steps=min(setup.steps, TRACED_STEPS))

    template = trace(spec, stage_setup(1))
    warmup = functools.partial(compose_1f1b.warmup, microbatches, pp)
    reordered_differs = []
    for stage in range(2, pp - 1):
        assert traced._template_stage(spec, stage_setup(stage)) == 1
        own = trace(spec, stage_setup(stage))
        composed = traced._traced(spec, stage_setup(stage))
        assert composed is not own and composed.timeline.attrs[CHUNKS] == own.timeline.attrs[CHUNKS]
        pd.testing.assert_frame_equal(frees_in_serial_order(composed.timeline), frees_in_serial_order(own.timeline))
        at_depth = traced._composed_at_depth(spec, stage_setup(stage))
        assert at_depth is not None
        pd.testing.assert_frame_equal(in_allocation_order(repeat_last_step(at_depth[0], setup.steps)),
                                      in_allocation_order(repeat_last_step(expand(own), setup.steps)))
        with monkeypatch.context() as patched:  # every call from its own template call: a reordering alone
            patched.setattr(compose_1f1b, "_sources", lambda m, *_: {("F", mb): ("F", mb) for mb in range(m)}
                            | {("B", mb): ("B", mb) for mb in range(m)})
            reordered = compose_1f1b.composed(template.timeline, warmup(1), warmup(stage), microbatches)
        reordered_differs.append(not frees_in_serial_order(reordered).equals(frees_in_serial_order(own.timeline)))
    assert any(reordered_differs) == reshard


def test_a_call_takes_the_rows_of_a_template_call_after_the_same_kind():
    """Stage 3 of 6 (warm-up 3) from stage 1 (warm-up 5), 6 micro-batches: stage 1 runs F0-F4, B0, F5, B1, then
    B2-B5 after backwards; stage 3's steady forwards F3 and F4 follow a backward (stage 1's F5 does), its B2 and B3
    a forward (stage 1's B1 does)."""
    sources = compose_1f1b._sources(6, 5, 3)
    assert {call: source for call, source in sources.items() if call != source} == {
        ("F", 3): ("F", 5), ("F", 4): ("F", 5), ("B", 2): ("B", 1), ("B", 3): ("B", 1)}
    assert compose_1f1b._sources(6, 6, 3) is None  # a template without steady calls has no forward after a backward


def test_the_call_order_is_schedule_1f1b_s():
    """Stage 1 of 4 with 6 micro-batches: 3 warm-up forwards, 3 forward-backward pairs, 2 cool-down backwards; the
    warm-up's last fired send (micro-batch 1) is held past its backward until B3 returns. Stage 1 of 6 (W = 5) has
    only one steady forward: micro-batch 3's backward comes in the cool-down, after the send is let go."""
    assert compose_1f1b.call_order(6, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4),
                                             ("B", 2), ("F", 5), ("B", 3), ("B", 4), ("B", 5)]
    assert compose_1f1b.held_output(6, 3) == 1
    assert compose_1f1b.held_output(6, 5) is None


WIDEN_CASES = [  # (zoo model, shrink(hidden, layers, vocab, heads), setup, strategy, pp = micro-batches, GPU, tp)
    ("llama-2-7b", (64, 24, 512, 4), TrainSetup(2, 32, Precision.BF16, grad_ckpt=True), Strategy.SINGLE, 8, None, 1),
    ("llama-2-7b", (64, 48, 512, 4), TrainSetup(1, 32, Precision.BF16, grad_ckpt=True), Strategy.DDP, 8,
     "h100-80gb", 1),  # six layers a stage, traced at three: composed, then expanded
    pytest.param("llama-2-7b", (64, 24, 512, 4), TrainSetup(2, 32, Precision.BF16, grad_ckpt=True), Strategy.FSDP,
                 8, "h100-80gb", 1, marks=pytest.mark.slow),  # every micro-batch computed: what it spares most
    pytest.param("qwen2.5-0.5b", (64, 20, 512, 4), TrainSetup(1, 16, Precision.BF16_AUTOCAST), Strategy.SINGLE, 8,
                 None, 1, marks=pytest.mark.slow),  # autocast's cast cache
    pytest.param("llama-2-7b", (64, 24, 512, 4), TrainSetup(1, 32, Precision.BF16, grad_ckpt=True), Strategy.DDP, 8,
                 "h100-80gb", 2, marks=pytest.mark.slow),  # torch's replicate x TP x PP (the 3-D layout)
    pytest.param("gpt-oss-20b", (64, 24, 512, 4), TrainSetup(1, 16, Precision.BF16), Strategy.SINGLE, 8, None, 1,
                 marks=pytest.mark.slow),  # sliding and full attention alternate: the layers kept where they are
]


@pytest.mark.parametrize("name,shape,setup,strategy,pp,gpu,tp", WIDEN_CASES)
def test_a_stage_over_many_micro_batches_runs_the_events_of_its_own_trace(name, shape, setup, strategy, pp, gpu, tp):
    """Under 1F1B with M = pp micro-batches, the first stage (W = M), the first middle stage (W = M - 1) and the last
    stage (W = 1, every micro-batch's output and loss kept to the step's end) are composed from the same stage of a
    5-stage pipeline over 5 micro-batches that holds its layers (traced.widened): each call from the template's call
    of its role, the receive buffers, the batch, the kept outputs' frees and their merge made for M. Each is traced
    here over its own M and compared, event for event, at reduced depth and at full depth; and a middle stage
    composed from the widened template at full depth (what a prediction does) runs its own trace's events."""
    from llmsim.inputs.gpus import load_gpu
    from llmsim.inputs.spec import FsdpSetup

    spec = load_model_spec(name, shrink(name, *shape))
    layout = Layout(strategy, 2 * pp * tp if strategy is not Strategy.SINGLE else pp * tp, tp=tp, pp=pp,
                    schedule=F1B, n_microbatches=pp, fsdp=FsdpSetup() if strategy is Strategy.FSDP else None)
    setup = checked(spec, setup, layout, None if gpu is None else load_gpu(gpu))

    def stage_setup(stage: int) -> TrainSetup:
        return replace(traced._stage_setup(setup, layout, stage), steps=min(setup.steps, TRACED_STEPS))

    for stage in (0, 1, pp - 1):
        widened = traced.widened(spec, stage_setup(stage))
        assert widened is not None
        assert traced._traced(spec, stage_setup(stage)) is widened
        own = trace(spec, stage_setup(stage))
        assert widened.timeline.attrs[CHUNKS] == own.timeline.attrs[CHUNKS]
        pd.testing.assert_frame_equal(in_allocation_order(widened.timeline), in_allocation_order(own.timeline))
        pd.testing.assert_frame_equal(in_allocation_order(repeat_last_step(expand(widened), setup.steps)),
                                      in_allocation_order(repeat_last_step(expand(own), setup.steps)))
    at_depth = traced._composed_at_depth(spec, stage_setup(3))  # from stage 1's widened trace
    assert at_depth is not None
    pd.testing.assert_frame_equal(in_allocation_order(repeat_last_step(at_depth[0], setup.steps)),
                                  in_allocation_order(repeat_last_step(expand(trace(spec, stage_setup(3))),
                                                                       setup.steps)))


def test_a_stage_is_widened_only_where_its_trace_is_the_shallower_pipelines():
    """Traced as before: FSDP2 on the CPU (its device mesh, made for real and counted there, has 4 bytes a rank),
    GPipe, fewer micro-batches than WIDEN_FROM, more micro-batches than stages (another warm-up shape); the other
    middle stages are composed from stage 1."""
    from llmsim.inputs.spec import FsdpSetup

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 24, 512, 4))
    setup = TrainSetup(1, 32, Precision.BF16)

    def widened(layout: Layout, stage: int):
        checked_setup = checked(spec, setup, layout)
        return traced.widened(spec, replace(traced._stage_setup(checked_setup, layout, stage), steps=TRACED_STEPS))

    assert widened(Layout(Strategy.FSDP, 16, pp=8, schedule=F1B, n_microbatches=8, fsdp=FsdpSetup()), 0) is None
    assert widened(Layout(world_size=8, pp=8, schedule=Schedule.GPIPE, n_microbatches=8), 0) is None
    assert widened(Layout(world_size=6, pp=6, schedule=F1B, n_microbatches=6), 0) is None
    assert widened(Layout(world_size=8, pp=8, schedule=F1B, n_microbatches=12), 0) is None
    assert widened(Layout(world_size=8, pp=8, schedule=F1B, n_microbatches=8), 2) is None
