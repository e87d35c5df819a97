"""Under 1F1B a middle stage's timeline is composed from the first middle stage of its kind
(llmsim/sim/compose_1f1b.py): each is traced here on its own and compared, event for event, with its composition,
on the committed 1F1B rows' middle stages and on shapes that move the held output's free (M < 2W - 2), tie the
embedding, checkpoint, autocast, and alternate attention in a mixture-of-experts model."""
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
from test_pipeline_stages import frees_in_serial_order

ROWS = "data/measurements/tier2_pp_cpu.csv"
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


def middle_stage_cases():
    rows = pd.read_csv(ROWS)
    runs = rows[(rows["schedule"] == "1f1b") & (rows["pp"] > 2)].drop_duplicates(
        [c for c in rows.columns if c not in ("rank", "peak_allocated_bytes", "measured_at", "wall_s")])
    for index, row in runs.iterrows():
        yield pytest.param(*row_inputs(row), id=f"row{index}")
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
        own_at_depth = frees_in_serial_order(repeat_last_step(expand(own), setup.steps))
        pd.testing.assert_frame_equal(  # and at full depth, every step
            frees_in_serial_order(repeat_last_step(expand(composed), setup.steps)), own_at_depth)
        at_depth = traced._composed_at_depth(spec, stage_setup)  # what a prediction does: compose at full depth
        assert at_depth is not None
        pd.testing.assert_frame_equal(frees_in_serial_order(repeat_last_step(at_depth[0], setup.steps)),
                                      own_at_depth)
    assert composed_stages >= 1


def test_fsdp2_middle_stages_are_traced_not_composed():
    """FSDP2 x PP: torch's PipelineStage runs FSDP2's backward of every micro-batch but the last without resharding
    or reducing, so what a chunk call leaves for the next depends on the stage's call order, which the composition's
    reordering does not follow: composed from stage 1, stage 3 would not run its own trace's events (its GPU peak
    came out 0.2 MB over). Every FSDP2 middle stage is traced (traced._template_stage)."""
    from llmsim.inputs.spec import FsdpSetup

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 12, 512, 4))
    layout = Layout(Strategy.FSDP, 12, fsdp=FsdpSetup(), pp=6, schedule=F1B, n_microbatches=6)
    setup = checked(spec, TrainSetup(1, 64, Precision.BF16, grad_ckpt=True), layout)

    def stage_setup(stage: int) -> TrainSetup:
        return replace(traced._stage_setup(setup, layout, stage), steps=min(setup.steps, TRACED_STEPS))

    assert [traced._template_stage(spec, stage_setup(stage)) for stage in range(6)] == [None] * 6
    composed = traced._composed(trace(spec, stage_setup(1)).timeline, 1, stage_setup(3))
    own = trace(spec, stage_setup(3)).timeline
    assert composed is not None and len(composed) == len(own)  # the composition runs, and goes wrong
    assert not frees_in_serial_order(composed).equals(frees_in_serial_order(own))


def test_the_call_order_is_schedule_1f1b_s():
    """Stage 1 of 4 with 6 micro-batches: 3 warm-up forwards, 3 forward-backward pairs, 2 cool-down backwards; the
    warm-up's last fired send (micro-batch 1) is held past its backward until B3 returns. Stage 1 of 6 (W = 5) has
    only one steady forward: micro-batch 3's backward comes in the cool-down, after the send is let go."""
    assert compose_1f1b.call_order(6, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4),
                                             ("B", 2), ("F", 5), ("B", 3), ("B", 4), ("B", 5)]
    assert compose_1f1b.held_output(6, 3) == 1
    assert compose_1f1b.held_output(6, 5) is None
