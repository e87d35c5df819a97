"""Tier (a): the optimizers whose step reads tensor values, traced under fake tensors, hold the bytes their
libraries' code allocates (hand-computed), and the value reads are answered as a real run answers them."""
import contextlib
import math

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmsim.enums import Category, Optimizer, Precision
from llmsim.model.optimizer_values import answered_optimizer_values
from llmsim.inputs.spec import TrainSetup, load_model_spec, resolve_attention
from llmsim.model.trace import run_fake
from llmsim.model.tracker import StorageTracker
from llmsim.inputs.zoo import shrink

BNB_BLOCK = 256  # bitsandbytes Optimizer2State.init_state: blocksize
MIN_8BIT_SIZE = 4096  # bitsandbytes optimizers' min_8bit_size default
QMAP_BYTES = 256 * 4  # create_dynamic_map: 256 float32 entries, one signed and one unsigned map


def _state_bytes(optimizer: Optimizer):
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 300, 4))
    setup = resolve_attention(spec, TrainSetup(1, 16, Precision.FP32, optimizer=optimizer, steps=1))
    timeline, _ = run_fake(spec, setup, None)
    states = timeline[(timeline["category"] == Category.OPTIMIZER_STATE.value) & (timeline["delta_bytes"] > 0)]
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        shapes = [p.shape for p in AutoModelForCausalLM.from_config(spec.hf_config()).parameters()]
    return int(states["delta_bytes"].sum()), [math.prod(s) for s in shapes], shapes


def test_adamw8bit_states_are_uint8_with_blockwise_absmax():
    traced, numels, _ = _state_bytes(Optimizer.ADAMW_8BIT)
    expected = 2 * QMAP_BYTES
    for n in numels:
        expected += 2 * (n + 4 * -(-n // BNB_BLOCK)) if n >= MIN_8BIT_SIZE else 2 * 4 * n
    assert traced == expected


def test_torch_adafactor_states_are_factored():
    traced, _, shapes = _state_bytes(Optimizer.ADAFACTOR)
    # per parameter: the step (a 0-d float32), then row_var + col_var of a matrix or variance of a vector
    expected = sum(4 + (4 * (s[0] + s[1]) if len(s) == 2 else 4 * s[0]) for s in shapes)
    assert traced == expected


def test_transformers_adafactor_states_are_factored_with_an_rms():
    traced, _, shapes = _state_bytes(Optimizer.HF_ADAFACTOR)
    # exp_avg_sq_row + exp_avg_sq_col (or exp_avg_sq), and the 0-d RMS tensor (`step` is a Python int)
    expected = sum(4 + (4 * (s[0] + s[1]) if len(s) == 2 else 4 * s[0]) for s in shapes)
    assert traced == expected


def test_quantile_map_in_a_fake_run_allocates_as_a_real_run():
    from bitsandbytes import functional

    def events(fake: bool):
        tracker = StorageTracker()
        answered = answered_optimizer_values(Optimizer.ADAMW_8BIT) if fake else contextlib.nullcontext()
        with (FakeTensorMode() if fake else contextlib.nullcontext()), answered:
            with tracker:
                qmap = functional.create_dynamic_map(signed=True)
        return qmap.shape, list(tracker.timeline()["delta_bytes"])

    assert events(fake=True) == events(fake=False)
