"""A pipeline stage's trace replays micro-batch 1's model events (of its first step) for micro-batches 2 and later,
and for micro-batch 1 of the later steps, and micro-batch 0's for micro-batch 0 of the later steps, the gradients it
leaves set for real (llmsim/model/chunk_replay.py), while torch's schedule runs for real: each
stage of the committed pipeline rows, and of shapes that tie the embedding,
checkpoint, autocast, train in fp16, shard over TP, split unevenly and stand for a GPU, is traced both ways here and
compared event for event."""
from dataclasses import replace

import pandas as pd
import pytest

from llmsim.enums import Precision
from llmsim.inputs.gpus import load_gpu
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.validate import row_inputs
from llmsim.model import chunk_replay
from llmsim.model.pipelining import Schedule
from llmsim.model.trace import forget_traces, trace
from llmsim.model.tracker import CHUNKS
from llmsim.sim import traced
from llmsim.sim.pipeline import checked
from llmsim.sim.strategies import Layout, Strategy
from llmsim.sim.timeline import TRACED_STEPS
from test_pipeline_stages import frees_in_serial_order

ROWS = "data/measurements/tier2_pp_cpu.csv"
F1B, GPIPE = Schedule.ONE_F_ONE_B, Schedule.GPIPE
CASES = [  # (zoo model, shrink(hidden, layers, vocab, heads), setup, layout, gpu)
    ("llama-2-7b", (64, 12, 512, 4), TrainSetup(1, 32, Precision.BF16, grad_ckpt=True),
     Layout(world_size=4, pp=4, schedule=F1B, n_microbatches=6), None),
    ("qwen2.5-0.5b", (64, 6, 512, 4), TrainSetup(2, 16, Precision.BF16_AUTOCAST),  # tied embedding
     Layout(Strategy.DDP, 6, pp=3, schedule=GPIPE, n_microbatches=5), None),
    ("llama-2-7b", (64, 6, 512, 4), TrainSetup(1, 32, Precision.FP16),
     Layout(world_size=3, pp=3, schedule=F1B, n_microbatches=4, pp_split=(1, 3, 2)), None),
    ("llama-2-7b", (64, 4, 512, 4), TrainSetup(1, 32, Precision.FP32, grad_ckpt=True),
     Layout(world_size=4, tp=2, pp=2, schedule=GPIPE, n_microbatches=4), None),
    ("llama-2-7b", (64, 6, 512, 4), TrainSetup(1, 32, Precision.BF16, grad_ckpt=True),
     Layout(world_size=3, pp=3, schedule=F1B, n_microbatches=5), "h100-80gb"),
    ("llama-2-7b", (64, 6, 512, 4), TrainSetup(1, 32, Precision.BF16, grad_ckpt=True),  # DDP x TP x PP: replicate
     Layout(Strategy.DDP, 12, tp=2, pp=3, schedule=F1B, n_microbatches=4), None),
]


def fresh(spec, setup):
    """`trace` run again, not taken from its cache (which also keeps the stage `trace.stage_split` traces it as)."""
    forget_traces()
    return trace(spec, setup)


def replayed_cases():
    rows = pd.read_csv(ROWS)
    runs = rows[rows["pp"] > 1].drop_duplicates(
        [c for c in rows.columns if c not in ("rank", "peak_allocated_bytes", "measured_at", "wall_s")])
    for index, row in runs.iterrows():
        yield pytest.param(*row_inputs(row), None, id=f"row{index}")
    for name, shape, setup, layout, gpu in CASES:
        yield pytest.param(load_model_spec(name, shrink(name, *shape)), setup, layout, gpu, id=f"{name}-{gpu}")


@pytest.mark.parametrize("spec,setup,layout,gpu", list(replayed_cases()))
def test_a_stage_replaying_later_micro_batches_makes_the_events_of_computing_them(spec, setup, layout, gpu,
                                                                                  monkeypatch):
    setup = checked(spec, setup, layout, load_gpu(gpu) if gpu else None)
    for stage in range(layout.pp):
        stage_setup = replace(traced._stage_setup(setup, layout, stage), steps=min(setup.steps, TRACED_STEPS))
        monkeypatch.setattr(chunk_replay, "ENABLED", False)
        computed = fresh(spec, stage_setup)
        monkeypatch.setattr(chunk_replay, "ENABLED", True)
        before, before_first = chunk_replay.ChunkReplay.calls, chunk_replay.ChunkReplay.first_calls
        replayed = fresh(spec, stage_setup)
        # every micro-batch from the third on, in each traced step, and the second after the first step
        assert chunk_replay.ChunkReplay.calls - before == stage_setup.steps * max(
            0, layout.n_microbatches - chunk_replay.FIRST_REPLAYED) + (stage_setup.steps - 1) * (
            layout.n_microbatches > 1)
        # and the first after the first step (under replicate, DDP x TP, with its per-layer groups' unshards)
        assert chunk_replay.ChunkReplay.first_calls - before_first == stage_setup.steps - 1
        assert replayed.timeline.attrs[CHUNKS] == computed.timeline.attrs[CHUNKS]
        pd.testing.assert_frame_equal(frees_in_serial_order(replayed.timeline),
                                      frees_in_serial_order(computed.timeline))


def test_a_model_whose_later_micro_batches_touch_micro_batch_1s_storages_is_computed(monkeypatch):
    """Where micro-batch 1's model events act on a storage that is not their own (here, as if its forward freed a
    storage allocated before it), the replay refuses and the stage is traced with every micro-batch computed."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 6, 512, 4))
    layout = Layout(world_size=3, pp=3, schedule=GPIPE, n_microbatches=4)
    setup = replace(traced._stage_setup(checked(spec, TrainSetup(1, 16, Precision.BF16), layout), layout, 1),
                    steps=2)
    check = chunk_replay._Forward.check

    def foreign(self):
        check(self)
        self.rows = [*self.rows, (*self.rows[0][:4], 0, -1)]  # a row on storage 0, made in the build
        check(self)
    monkeypatch.setattr(chunk_replay._Forward, "check", foreign)
    before = chunk_replay.ChunkReplay.calls
    traced_anyway = fresh(spec, setup)
    assert chunk_replay.ChunkReplay.calls == before
    monkeypatch.setattr(chunk_replay, "ENABLED", False)
    pd.testing.assert_frame_equal(traced_anyway.timeline, fresh(spec, setup).timeline)


def test_a_micro_batch_0_whose_backward_leaves_more_alive_is_computed_in_both_steps(monkeypatch):
    """Where micro-batch 0's backward leaves a storage alive that is not a gradient found in `.grad` (here, as if one
    parameter's gradient were not found), micro-batch 0 is computed in the second step too, the later micro-batches
    still replayed, and the stage's events are those of computing every micro-batch."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 6, 512, 4))
    layout = Layout(world_size=3, pp=3, schedule=F1B, n_microbatches=4)
    setup = replace(traced._stage_setup(checked(spec, TrainSetup(1, 16, Precision.BF16), layout), layout, 1),
                    steps=2)
    found = chunk_replay.ChunkReplay._gradients_made
    monkeypatch.setattr(chunk_replay.ChunkReplay, "_gradients_made", lambda self: found(self)[1:])
    before, before_first = chunk_replay.ChunkReplay.calls, chunk_replay.ChunkReplay.first_calls
    replayed = fresh(spec, setup)
    assert chunk_replay.ChunkReplay.first_calls == before_first
    assert chunk_replay.ChunkReplay.calls - before == 2 * (4 - chunk_replay.FIRST_REPLAYED) + 1
    monkeypatch.setattr(chunk_replay, "ENABLED", False)
    pd.testing.assert_frame_equal(frees_in_serial_order(replayed.timeline),
                                  frees_in_serial_order(fresh(spec, setup).timeline))


def test_the_replay_stays_within_the_two_traced_steps():
    """`chunk_replay.REPLAYED_STEPS` is the expansion's TRACED_STEPS: a setup traced over more steps (its second is
    not steady) computes every micro-batch from the third step on."""
    from llmsim.sim.timeline import TRACED_STEPS

    assert chunk_replay.REPLAYED_STEPS == TRACED_STEPS
