"""The predictor traces two steps and repeats the steady second one; the result must be the traced run."""
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from llmsim.enums import Attention, Loss, Optimizer, Precision
from llmsim.sim.peaks import replay
from llmsim.sim.pipeline import expanded
from llmsim.inputs.spec import TrainSetup, load_model_spec, resolve_attention
from llmsim.sim.timeline import TRACED_STEPS, expand, repeat_last_step
from llmsim.model.trace import trace
from llmsim.inputs.zoo import shrink

CASES = [
    ("llama-2-7b", TrainSetup(2, 64)),
    ("llama-2-7b", TrainSetup(1, 32, steps=5)),
    ("qwen2.5-0.5b", TrainSetup(1, 48, Precision.BF16, grad_ckpt=True)),
    ("gpt2", TrainSetup(2, 32, Precision.FP16_AUTOCAST, Attention.EAGER, grad_ckpt=True, ckpt_every=2)),
    ("opt-125m", TrainSetup(1, 40, Precision.BF16_AUTOCAST, grad_accum=2, foreach=True)),
    ("llama-2-7b", TrainSetup(2, 32, Precision.BF16_AUTOCAST, grad_ckpt=True, ckpt_offload=True)),
    ("llama-3.1-8b", TrainSetup(2, 32, Precision.BF16_AUTOCAST, loss=Loss.FUSED_LINEAR_CE)),
    ("qwen2.5-0.5b", TrainSetup(2, 32, Precision.BF16_AUTOCAST, loss=Loss.CHUNKED_NLL)),
    ("llama-2-7b", TrainSetup(1, 32, Precision.BF16, lora_rank=8)),
    ("llama-2-7b", TrainSetup(1, 32, Precision.BF16_AUTOCAST, lora_rank=4, quant="nf4", double_quant=True)),
    ("mistral-7b", TrainSetup(1, 32, optimizer=Optimizer.ADAFACTOR)),
    ("mistral-7b", TrainSetup(1, 32, optimizer=Optimizer.HF_ADAFACTOR)),
    ("gpt2", TrainSetup(1, 32, optimizer=Optimizer.PAGED_ADAMW_8BIT)),
    ("llama-2-7b", TrainSetup(1, 32, optimizer=Optimizer.SGD_MOMENTUM, zero3_hooks=True)),
    ("llama-2-7b", TrainSetup(1, 32, pp=2, pp_stage=1, schedule="1f1b", n_microbatches=3)),
    ("llama-2-7b", TrainSetup(1, 32, Precision.BF16, tp=2)),
]


def _canonical(timeline: pd.DataFrame) -> pd.DataFrame:
    """Serials renumbered by first appearance (markers, < 0, kept): two runs of the same events compare equal."""
    serials = timeline["serial"].to_numpy()
    codes = pd.factorize(serials)[0]
    return timeline.assign(serial=np.where(serials < 0, serials, codes)).reset_index(drop=True)


@pytest.mark.parametrize("model,setup", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_repeated_steps_match_traced_steps(model, setup):
    spec = load_model_spec(model, shrink(model, 64, 5, 512, 4))
    setup = resolve_attention(spec, setup)
    full = expand(trace(spec, setup))
    repeated = repeat_last_step(expand(trace(spec, replace(setup, steps=TRACED_STEPS))), setup.steps)
    assert repeated is not None
    assert len(repeated) == len(full)
    assert replay(repeated).allocated_bytes == replay(full).allocated_bytes
    keys = ["step", "phase", "block", "category"]
    for frame in (repeated, full):  # the most live bytes in each phase, and when it ends
        frame["live"] = frame["delta_bytes"].cumsum()
    assert repeated.groupby(keys[:2])["live"].agg(["max", "last"]).equals(
        full.groupby(keys[:2])["live"].agg(["max", "last"]))
    if setup.precision.autocast_dtype is None:  # the same events, storage for storage
        pd.testing.assert_frame_equal(_canonical(repeated), _canonical(full))
    else:  # autocast drops its cast cache in bulk, in an order that varies from run to run
        assert repeated.groupby(keys)["delta_bytes"].agg(["count", "sum"]).equals(
            full.groupby(keys)["delta_bytes"].agg(["count", "sum"]))
    assert expanded(spec, setup)[0] is not None


def test_an_unsteady_last_step_is_not_repeated():
    """A last step that frees what it did not allocate without allocating its like is not steady."""
    frame = pd.DataFrame({"step": [0, 0, 1, 1], "phase": ["forward"] * 4, "block": [-1] * 4, "module": [""] * 4,
                          "serial": [0, 1, 1, 2], "delta_bytes": [8, 4, -4, 2], "category": ["a"] * 4,
                          "tensor": [""] * 4})
    assert repeat_last_step(frame, 3) is None
    steady = frame.assign(delta_bytes=[8, 4, -4, 4])
    out = repeat_last_step(steady, 4)
    assert out["step"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out["delta_bytes"].tolist() == [8, 4, -4, 4, -4, 4, -4, 4]
    assert out["serial"].tolist()[4:] == [2, 5, 5, 8]  # each step frees what the one before allocated
