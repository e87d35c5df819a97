"""Client optimizers other than AdamW under DeepSpeed ZeRO-1/2/3: stepped on flat fp32 vectors (hand-computed
bytes), DeepSpeed's refusal of an untested optimizer, and the measured rows."""
import json
import math

import pandas as pd
import pytest

from llmsim.inputs.dsconfig import DeepSpeedSetup
from llmsim.enums import Category, Optimizer, Phase, Precision
from llmsim.errors import InputError
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy, check_deepspeed_optimizer
from llmsim.sim.strategies.flat_optimizer import recorded_steps
from llmsim.sim.strategies.zero_common import EventWriter, adamw
from llmsim.inputs.zoo import shrink

OPTIM_ZERO_CSV = MEASUREMENTS_DIR / "tier2_optim_zero_cpu.csv"
UNTESTED = {"zero_allow_untested_optimizer": True}


def _deepspeed(stage: int, world: int = 2, precision: Precision = Precision.FP32, **extra) -> DeepSpeedSetup:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": precision is Precision.BF16}, **extra}
    return DeepSpeedSetup(json.dumps(config), world)


def test_recorded_adamw_is_the_hand_model():
    """The recording of torch's AdamW on one vector makes the events `zero_common.adamw` writes by hand (its
    0-d `step` included), step after step: the recorder runs what the hand model restates."""
    numel = 1000
    writer = EventWriter(0)
    recorded = recorded_steps(Optimizer.ADAMW, (numel,), 3, False)
    for step in range(3):
        start = len(writer.rows)
        adamw(writer, [numel], step == 0, False)
        hand = [(row[5], row[6]) for row in writer.rows[start:]]
        assert [(delta, category) for _, delta, category in recorded[step][0]] == hand


@pytest.mark.parametrize("optimizer,state_bytes", [
    (Optimizer.SGD, lambda p: 0),
    (Optimizer.SGD_MOMENTUM, lambda p: 4 * p),  # momentum_buffer
    (Optimizer.ADAM, lambda p: 4 + 8 * p),  # step, exp_avg, exp_avg_sq
    (Optimizer.ADAFACTOR, lambda p: 4 + 4 * p),  # step; a vector's variance is whole, not a row and a column
    (Optimizer.HF_ADAFACTOR, lambda p: 4 * p + 4),  # exp_avg_sq of a vector (not factored), 0-d RMS
    (Optimizer.ADAMW_8BIT, lambda p: 2 * p + 2 * 4 * math.ceil(p / 256)),  # uint8 states, an absmax per 256
    (Optimizer.PAGED_ADAMW, lambda p: 8 * p),  # 32-bit states; on the CPU ordinary buffers
])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_steps_the_optimizer_on_the_flat_partition(optimizer, state_bytes, stage):
    """Llama, hidden 64, MLP 176, 2 layers, vocab 256: N = 2 x 16,384 (embedding, untied head) + 64 (final norm)
    + 2 x 50,304 (4 x 4,096 attention, 3 x 11,264 MLP, 2 x 64 norms) = 133,440 parameters, a flat buffer of
    133,440 (a multiple of 2 x 2) and a partition of P = 66,720 elements per rank: the optimizer's states are
    those of one fp32 vector of P elements, made at the first step, whatever the parameters' shapes."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 256, 4))
    layout = Layout(Strategy.DEEPSPEED, 2, _deepspeed(stage, **UNTESTED))
    for rank, timeline in enumerate(r.timeline for r in predict(spec, TrainSetup(1, 8, optimizer=optimizer),
                                                                  layout).ranks):
        ours = timeline[(timeline["module"] == "deepspeed") & (timeline["phase"] == Phase.OPTIMIZER.value)]
        states = ours[ours["category"] == Category.OPTIMIZER_STATE.value]
        assert states[states["step"] == 0]["delta_bytes"].sum() == state_bytes(66_720), rank
        assert (states[states["step"] > 0]["delta_bytes"] > 0).sum() == (optimizer is Optimizer.HF_ADAFACTOR) * 2


def test_zero3_steps_one_vector_per_sub_group():
    """ZeRO-3, 2 ranks, sub_group_size 2,000: sub-groups of whole parameters; 8-bit states for a sub-group
    partition of at least min_8bit_size = 4,096 elements, 32-bit states below."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 256, 4))
    deepspeed = _deepspeed(3, zero_allow_untested_optimizer=True)
    config = json.loads(deepspeed.config_json)
    config["zero_optimization"]["sub_group_size"] = 2000
    layout = Layout(Strategy.DEEPSPEED, 2, DeepSpeedSetup(json.dumps(config), 2))
    timeline = predict(spec, TrainSetup(1, 8, optimizer=Optimizer.ADAMW_8BIT), layout).ranks[0].timeline
    ours = timeline[(timeline["module"] == "deepspeed") & (timeline["phase"] == Phase.OPTIMIZER.value)
                    & (timeline["step"] == 0)]
    masters = timeline[(timeline["category"] == Category.MASTER_WEIGHTS.value) & (timeline["delta_bytes"] > 0)]
    expected = 0
    for master_bytes in masters["delta_bytes"]:
        p = master_bytes // 4
        expected += 2 * p + 8 * math.ceil(p / 256) if p >= 4096 else 8 * p
    assert len(masters) > 2 and any(b // 4 < 4096 for b in masters["delta_bytes"])
    assert ours[ours["category"] == Category.OPTIMIZER_STATE.value]["delta_bytes"].sum() == expected


@pytest.mark.parametrize("optimizer", [o for o in Optimizer if o not in (Optimizer.ADAMW, Optimizer.ADAM)])
def test_deepspeed_refuses_an_untested_optimizer_without_the_flag(optimizer):
    setup = TrainSetup(1, 8, optimizer=optimizer)
    for stage in (1, 2, 3):
        with pytest.raises(InputError, match="zero_allow_untested_optimizer"):
            check_deepspeed_optimizer(setup, _deepspeed(stage))
        check_deepspeed_optimizer(setup, _deepspeed(stage, **UNTESTED))
    check_deepspeed_optimizer(TrainSetup(1, 8, optimizer=Optimizer.ADAM), _deepspeed(2))  # a tested type


def test_optim_zero_rows_cover_the_matrix():
    """(Their errors: `llmsim validate` and the slow test of tests/test_validate.py re-predict every row.)"""
    rows = pd.read_csv(OPTIM_ZERO_CSV)
    stages = rows["ds_config"].map(lambda c: json.loads(c)["zero_optimization"]["stage"])
    assert set(stages) == {1, 2, 3} and set(rows["precision"]) == {"fp32", "bf16"}
    assert set(rows["optimizer"]) == {o.value for o in Optimizer} - {"adamw"}
    assert set(rows.groupby(["model", "measured_at"])["rank"].apply(frozenset)) == {frozenset({0, 1})}  # all ranks
