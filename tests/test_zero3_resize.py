"""ZeRO-3's plan at a new world size (strategies/zero3_resize.py): a recorded walk evaluated at another W must give
the walked timeline itself, row for row (serials, bytes, order), at every W, whether the reduce-scatter paddings,
the sub-groups or the `torch.cat` of a lone parameter change with W or not."""
import json
from dataclasses import replace

import pandas as pd
import pytest

from llmsim.inputs.dsconfig import DeepSpeedSetup
from llmsim.enums import Optimizer, Precision
from llmsim.inputs.gpus import load_gpu, on_gpu
from llmsim.sim.pipeline import expanded
from llmsim.inputs.spec import TrainSetup, load_model_spec, resolve_attention
from llmsim.sim.strategies import Layout, Strategy, traced_setup
from llmsim.sim.strategies import zero3
from llmsim.sim.strategies.zero3_resize import Sized, World, partitions, sub_group_ends
from llmsim.inputs.zoo import shrink

# Llama: hidden 64, 2 layers, vocabulary 250 (16,000 elements: not a multiple of most W), norms of 64 elements
# (fewer than W from 65 on: every rank past the 64th pads); GPT-2: tied embedding, biases.
LLAMA = ("llama-2-7b", shrink("llama-2-7b", 64, 2, 250, 4))
GPT2 = ("gpt2", shrink("gpt2", 48, 2, 200, 4))
WORLDS = [*range(1, 18), 24, 31, 32, 63, 64, 65, 96, 100, 127, 128, 250, 256, 1000, 1024, 2047, 2048]
SMALL_BUCKETS = {"reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 2000, "stage3_max_live_parameters": 9000,
                 "stage3_max_reuse_distance": 1000}
CASES = {
    "bf16": (LLAMA, TrainSetup(1, 8, Precision.BF16), {}, None),
    "fp32-ckpt-small-buckets": (LLAMA, TrainSetup(1, 8, grad_ckpt=True), SMALL_BUCKETS, None),
    "persistence": (LLAMA, TrainSetup(1, 8, Precision.BF16), {"stage3_param_persistence_threshold": 5000,
                                                               "stage3_model_persistence_threshold": 20000}, None),
    "sub-groups": (LLAMA, TrainSetup(1, 8, Precision.BF16), {"sub_group_size": 5000, "overlap_comm": True}, None),
    "no-contiguous-gradients": (GPT2, TrainSetup(2, 8), {"contiguous_gradients": False, "reduce_bucket_size": 700},
                                None),
    "lora": (LLAMA, TrainSetup(1, 8, Precision.BF16, lora_rank=4), {"reduce_bucket_size": 500}, None),
    "ckpt-offload-grad-accum": (LLAMA, TrainSetup(1, 8, Precision.BF16, grad_ckpt=True, ckpt_offload=True,
                                                  grad_accum=2), {"gradient_accumulation_steps": 2}, None),
    "fused-adam-section": (GPT2, TrainSetup(1, 8, Precision.BF16), {"sub_group_size": 4000},
                           {"type": "AdamW", "params": {"lr": 1e-4}}),
    "torch-adam-section-h100": (LLAMA, TrainSetup(1, 8, Precision.BF16), {},
                                {"type": "AdamW", "params": {"torch_adam": True, "foreach": True}}),
}


def _layout(world: int, zero_section: dict, optimizer: dict | None, setup: TrainSetup) -> Layout:
    zero_section = dict(zero_section)
    accumulation = zero_section.pop("gradient_accumulation_steps", 1)
    config = {"train_micro_batch_size_per_gpu": setup.micro_batch, "gradient_accumulation_steps": accumulation,
              "zero_optimization": {"stage": 3, **zero_section}, "bf16": {"enabled": setup.precision is Precision.BF16}}
    if optimizer is not None:
        config["optimizer"] = optimizer
    return Layout(Strategy.DEEPSPEED, world, DeepSpeedSetup(json.dumps(config), world))


def _traced(model, setup: TrainSetup, layout: Layout, gpu=None):
    """The timeline and setup `pipeline.predict` hands the plan."""
    if gpu is not None:
        setup = on_gpu(setup, gpu)
    setup = traced_setup(replace(resolve_attention(model, setup), zero3_hooks=True), layout)
    return expanded(model, setup)[0], setup


@pytest.mark.parametrize("case", list(CASES))
def test_resized_plan_is_the_walk(case, monkeypatch):
    (name, overrides), setup, zero_section, optimizer = CASES[case]
    model = load_model_spec(name, overrides)
    gpu = load_gpu("h100-80gb") if case.endswith("h100") else None
    timeline, traced = _traced(model, setup, _layout(2, zero_section, optimizer, setup), gpu)
    walked = {world: zero3.walk(timeline, _layout(world, zero_section, optimizer, setup), traced) for world in WORLDS}
    recorded = []
    record = zero3.record
    monkeypatch.setattr(zero3, "record", lambda *args: recorded.append(args[1].world_size) or record(*args))
    for world in [2, *WORLDS]:  # the first records; then a W walks again only for sub-groups never recorded
        fast = zero3.plan(timeline, _layout(world, zero_section, optimizer, setup), traced)
        assert len(fast) == world and fast[0] is fast[world - 1]
        pd.testing.assert_frame_equal(fast[0], walked[world] if world in walked else zero3.walk(
            timeline, _layout(world, zero_section, optimizer, setup), traced))
    trainable = [numel for numel in _numels(timeline, traced, zero_section, optimizer)]
    size = zero3._Rank(timeline, [], _layout(2, zero_section, optimizer, setup), traced).zero.sub_group_size
    # one rank is walked, never recorded (it gathers nothing: zero3._Rank._alone)
    distinct = {sub_group_ends(partitions(pd.Series(trainable).to_numpy(), w).tolist(), size)
                for w in [2, *WORLDS] if w > 1}
    assert len(recorded) == len(distinct) and recorded[0] == 2
    assert (len(distinct) > 1) == (case in ("sub-groups", "fused-adam-section"))


def _numels(timeline, setup, zero_section, optimizer):
    rank = zero3._Rank(timeline, [], _layout(2, zero_section, optimizer, setup), setup)
    return [p.numel for p in rank.trainable]


def test_walked_paddings_vary_with_the_world_size():
    """The cases above reach the paddings: the same step has more events at W = 1,000 than at 1,024."""
    (name, overrides), setup, zero_section, optimizer = CASES["bf16"]
    timeline, traced = _traced(load_model_spec(name, overrides), setup, _layout(2, zero_section, optimizer, setup))
    lengths = {world: len(zero3.plan(timeline, _layout(world, zero_section, optimizer, setup), traced)[0])
               for world in (1000, 1024)}
    assert lengths[1000] > lengths[1024]


def test_a_client_optimizer_other_than_adamw_is_walked(monkeypatch):
    """Its recorded step depends on the sub-group sizes in its own ways: no program, the walk at every W."""
    (name, overrides), _, _, _ = CASES["bf16"]
    setup = TrainSetup(1, 8, optimizer=Optimizer.ADAMW_8BIT)
    section = {"sub_group_size": 5000}
    layout = _layout(3, section, None, setup)
    config = json.loads(layout.deepspeed.config_json)
    config["zero_allow_untested_optimizer"] = True
    layout = replace(layout, deepspeed=DeepSpeedSetup(json.dumps(config), 3))
    timeline, traced = _traced(load_model_spec(name, overrides), setup, layout)
    monkeypatch.setattr(zero3, "record", lambda *args: pytest.fail("recorded"))
    pd.testing.assert_frame_equal(zero3.plan(timeline, layout, traced)[0], zero3.walk(timeline, layout, traced))


def test_sized_refuses_any_use_but_a_factor():
    """A partition or W read in a decision of the walk raises instead of freezing the recorded W's answer."""
    partition, world = Sized(3, ((0, 1),)), World(8)
    assert (partition * world * 2).formula == (((0, 1),), 1, 2) and int(partition * world * 2) == 48
    for use in (lambda: partition + 1, lambda: 1 + partition, lambda: partition < 4, lambda: partition == 3,
                lambda: bool(partition), lambda: 10 % world, lambda: range(world), lambda: world * 2,
                lambda: partition * partition, lambda: sum([partition]), lambda: -partition):
        with pytest.raises(TypeError, match="world size"):
            use()
