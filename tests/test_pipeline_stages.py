"""Under GPipe the middle stages that hold equal layers share one trace (`llmsim.sim.traced.traced_stage`): each
is traced here on its own and compared, event for event, with the stage whose trace stands for it."""
import numpy as np
import pandas as pd
import pytest

import llmsim.sim.traced as traced
from llmsim.enums import Precision
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.model.pipelining import Schedule
from llmsim.sim.pipeline import checked, predict
from llmsim.sim.strategies import Layout, Strategy

CASES = [  # (zoo model, shrink(hidden, layers, vocab, heads), setup, layout)
    ("llama-2-7b", (64, 8, 512, 4), TrainSetup(1, 32, Precision.BF16), Layout(world_size=4, pp=4, n_microbatches=3)),
    ("qwen2.5-0.5b", (64, 10, 512, 4), TrainSetup(2, 16, grad_ckpt=True), Layout(Strategy.DDP, 10, pp=5, n_microbatches=2)),
    ("pythia-160m", (64, 6, 512, 4), TrainSetup(1, 16, Precision.BF16_AUTOCAST),
     Layout(world_size=6, pp=6, n_microbatches=4)),
    ("gpt-oss-20b", (64, 8, 512, 4), TrainSetup(1, 16, Precision.BF16), Layout(world_size=4, pp=4, n_microbatches=2)),
    ("llama-2-7b", (64, 9, 512, 4), TrainSetup(1, 16), Layout(world_size=5, pp=5, n_microbatches=2,
                                                                pp_split=(1, 2, 2, 3, 1))),
]


@pytest.mark.parametrize("name,shape,setup,layout", CASES, ids=["llama", "qwen-tied-ddp-ckpt", "pythia-autocast",
                                                                  "gpt-oss-moe-sliding", "llama-split"])
def test_a_gpipe_stage_runs_the_events_of_the_stage_that_stands_for_it(name, shape, setup, layout):
    spec = load_model_spec(name, shrink(name, *shape))
    setup = checked(spec, setup, layout)
    middle = range(1, layout.pp - 1)
    stands_for = {stage: traced.traced_stage(spec, layout, stage) for stage in middle}
    assert any(stage != other for stage, other in stands_for.items())  # some stage is not traced
    for stage, other in stands_for.items():
        own = traced.expanded(spec, traced._stage_setup(setup, layout, stage))[0]
        shared = traced.expanded(spec, traced._stage_setup(setup, layout, other))[0]
        pd.testing.assert_frame_equal(frees_in_serial_order(own), frees_in_serial_order(shared))


def frees_in_serial_order(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with each run of consecutive frees in serial order. Where nothing is allocated between them, the
    order of frees varies from one trace of a stage to the next (under autocast: torch's cast cache freed as it is
    cleared), with the same peaks."""
    frees = (frame["delta_bytes"] < 0).to_numpy()
    run = np.cumsum(np.concatenate(([True], frees[1:] != frees[:-1])))
    key = np.where(frees, frame["serial"].to_numpy(), np.arange(len(frame)))
    order = np.lexsort((key, run))
    return frame.iloc[order].reset_index(drop=True)


def test_stages_of_other_layers_or_another_schedule_are_traced_apart():
    """Equal layer counts are not enough: gpt-oss alternates sliding and full attention, so stages of three
    layers starting at an odd and an even layer differ; under 1F1B every stage is its own."""
    spec = load_model_spec("gpt-oss-20b", shrink("gpt-oss-20b", 64, 12, 512, 4))
    layout = Layout(world_size=4, pp=4, n_microbatches=4)
    assert [traced.traced_stage(spec, layout, stage) for stage in range(4)] == [0, 1, 2, 3]
    even = Layout(world_size=5, pp=5, n_microbatches=4, pp_split=(1, 2, 4, 4, 1))
    assert [traced.traced_stage(spec, even, stage) for stage in range(5)] == [0, 1, 2, 2, 4]
    llama = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 8, 512, 4))
    assert [traced.traced_stage(llama, Layout(world_size=4, pp=4, n_microbatches=4), s) for s in range(4)] == \
        [0, 1, 1, 3]
    one_f_one_b = Layout(world_size=4, pp=4, schedule=Schedule.ONE_F_ONE_B, n_microbatches=4)
    assert [traced.traced_stage(llama, one_f_one_b, stage) for stage in range(4)] == [0, 1, 2, 3]


def test_predict_traces_a_gpipe_kind_once(monkeypatch):
    from llmsim.model import trace as trace_module

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 12, 512, 4))
    layout = Layout(Strategy.DDP, 12, pp=6, n_microbatches=2)
    traced._EXPANDED.clear()
    trace_module.forget_traces()
    runs = []
    run = trace_module._run_replaying_chunks
    monkeypatch.setattr(trace_module, "_run_replaying_chunks",
                        lambda *args: runs.append(args[1].pp_stage) or run(*args))
    ranks = predict(spec, TrainSetup(1, 16), layout).ranks
    assert sorted(runs) == [0, 1, 5]  # the first stage, one of the four middle ones, the last
    assert len({rank.peak_allocated_bytes for rank in ranks}) == 3
    assert len(ranks) == 12


def test_a_stage_names_its_layers_as_the_model_does():
    """A stage's model keeps its slice of the layers as a new ModuleList, so its trace counts them from 0; each
    rank's peak and timeline name them as the whole model does (the user-given split: layers 1-2 on stage 1,
    3-4 on stage 2, 5-7 on stage 3)."""
    name, shape, setup, layout = CASES[-1]
    spec = load_model_spec(name, shrink(name, *shape))
    prediction = predict(spec, setup, layout)
    for rank, layers in zip(prediction.ranks[1:4], ({1, 2}, {3, 4}, {5, 6, 7})):
        timeline = rank.timeline
        named = {int(m.split(".")[2]) for m in timeline["module"].dropna().unique() if m.startswith("model.layers.")}
        assert named == layers
        assert set(timeline.loc[timeline["block"] >= 0, "block"]) == layers
        assert int(rank.peak.layer.split(".")[2]) in layers
