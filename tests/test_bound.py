"""llmsim/sim/bound.py: the model-state lower bound `size` prunes with is below every rank's predicted peak, counts
exactly the parameters the trace holds, and pruning leaves `size`'s answers as they were."""
from dataclasses import replace

import pytest

from llmsim.sim.bound import EVERY_PARAMETER_TRAINED, STATE_COPIES, rank_lower_bounds
from llmsim.enums import Optimizer, Precision
from llmsim.inputs.gpus import GpuProfile, load_gpu
from llmsim.sim.pipeline import checked, predict
from llmsim.model.pipelining import Schedule
from llmsim.app.size import size
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.inputs.zoo import shrink

MiB = 1 << 20
# (hidden, heads) of each shrunken model: kv-heads keep the model's ratio and must divide by tp 2
WIDTHS = {"llama-2-7b": (64, 4), "mistral-7b": (64, 8), "qwen2.5-7b": (112, 14), "qwen2.5-0.5b": (64, 4),
          "pythia-160m": (64, 4)}

# (zoo model, tp, pp, pp_split, precision, build in bf16, checkpointing, optimizer, GPU or None)
CASES = [
    ("llama-2-7b", 2, 1, None, Precision.FP32, False, False, Optimizer.ADAMW, None),
    ("llama-2-7b", 1, 2, None, Precision.BF16, False, True, Optimizer.ADAMW, None),
    ("llama-2-7b", 2, 2, None, Precision.BF16, True, False, Optimizer.SGD_MOMENTUM, None),
    ("llama-2-7b", 1, 3, None, Precision.FP32, False, True, Optimizer.SGD, None),  # 4 layers: 2, 1, 1
    ("llama-2-7b", 1, 2, (1, 3), Precision.BF16_AUTOCAST, False, False, Optimizer.ADAM, None),
    ("llama-2-7b", 2, 2, None, Precision.BF16, False, True, Optimizer.ADAMW, "h100-80gb"),
    ("mistral-7b", 2, 1, None, Precision.BF16, False, True, Optimizer.ADAMW, None),
    ("mistral-7b", 2, 2, None, Precision.FP32, False, False, Optimizer.ADAMW, None),
    ("qwen2.5-7b", 2, 1, None, Precision.BF16_AUTOCAST, False, False, Optimizer.ADAMW, None),
    ("qwen2.5-7b", 1, 2, None, Precision.BF16, False, True, Optimizer.ADAMW, "a100-40gb"),
    ("qwen2.5-0.5b", 1, 2, None, Precision.BF16, False, False, Optimizer.ADAMW, None),  # tied: embedding twice
    ("pythia-160m", 2, 1, None, Precision.FP32, False, False, Optimizer.ADAMW, None),  # parameters only
    ("pythia-160m", 1, 2, None, Precision.BF16, False, True, Optimizer.ADAMW, None),
]


def _layout(tp: int, pp: int, split) -> Layout:
    return Layout(world_size=tp * pp, tp=tp, pp=pp, schedule=Schedule.ONE_F_ONE_B if split is None else Schedule.GPIPE,
                  n_microbatches=pp, pp_split=split)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}-pp{c[2]}-{c[4].value}-{c[7].value}")
def test_bound_is_below_every_ranks_predicted_peak(case):
    name, tp, pp, split, precision, build_bf16, ckpt, optimizer, gpu_name = case
    hidden, heads = WIDTHS[name]
    spec = load_model_spec(name, shrink(name, hidden, 4, 256, heads))
    setup = TrainSetup(1, 32, precision, grad_ckpt=ckpt, optimizer=optimizer, build_bf16=build_bf16)
    layout, gpu = _layout(tp, pp, split), load_gpu(gpu_name) if gpu_name else None
    bounds = rank_lower_bounds(spec, checked(spec, setup, layout, gpu), layout)
    prediction = predict(spec, setup, layout, gpu)
    assert sorted(bounds) == [r.rank for r in prediction.ranks]
    trained = spec.hf_config().model_type in EVERY_PARAMETER_TRAINED
    copies = 2 + STATE_COPIES.get(optimizer, 0) if trained else 1  # parameter, gradient, states
    for rank in prediction.ranks:
        assert bounds[rank.rank] <= rank.peak_allocated_bytes, (rank.rank, bounds[rank.rank], rank.peak)
        # the parameters the trace holds at the peak, byte for byte: the stage's share, the TP shards, the dtype (on a
        # GPU the breakdown counts the allocator's 512-byte blocks: the tensors' own bytes are the timeline's)
        upto = rank.timeline.iloc[: rank.peak.event + 1]
        parameters = int(upto.loc[upto["category"] == "parameter", "delta_bytes"].sum())
        assert bounds[rank.rank] == copies * parameters, rank.rank


def test_bound_is_not_modelled_outside_tp_and_pp():
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 256, 4))
    setup = TrainSetup(1, 32)
    assert rank_lower_bounds(spec, checked(spec, setup, Layout()), Layout()) == {}
    ddp = Layout(world_size=4, pp=2, strategy=Strategy.DDP)
    assert rank_lower_bounds(spec, checked(spec, setup, ddp), ddp) == {}


@pytest.mark.parametrize("global_batch", [None, 2])
def test_pruned_layouts_keep_sizes_answers(monkeypatch, global_batch):
    """`size` with the bound and without it (every layout traced): the same table, except that the layouts the
    bound prunes say "needs at least"; some are pruned and some fit."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 16)
    two = [_layout(2, 1, None), _layout(1, 2, None)]
    smallest = min(max(rank_lower_bounds(spec, checked(spec, setup, layout), layout).values()) for layout in two)
    context, workspace = 40 * MiB, MiB // 4  # two workspaces share a 2 MiB segment with the small blocks
    # the 2-GPU layouts' model states come within a byte of what the card leaves outside its 5 % margin (with the
    # forward's and the backward's cuBLAS workspaces)
    capacity = context + 2 * workspace + smallest - 1
    while capacity - round(0.05 * capacity) < context + 2 * workspace + smallest - 1:
        capacity += 1
    card = GpuProfile("card", "test card", "9.0", capacity, context, workspace, "test", 0.05)
    kw = dict(max_gpus=4, max_micro_batch=8, families=("tp", "pp", "tpxpp"), global_batch=global_batch)
    pruned = size(spec, setup, card, **kw)
    monkeypatch.setattr("llmsim.app.size.rank_lower_bounds", lambda *args: {})
    traced = size(spec, setup, card, **kw)
    columns = ["layout", "gpus", "largest_micro_batch", "passes", "needed_bytes", "fits"]
    assert pruned[columns].equals(traced[columns])
    at_least = pruned["why"].str.contains("needs at least")
    assert at_least.sum() >= 2 and pruned["fits"].any()  # the case bites both ways
    assert (pruned["why"][~at_least] == traced["why"][~at_least]).all()
    assert traced["why"][at_least].str.contains("micro-batch").all()  # what tracing said: it does not fit


def test_pruning_keeps_the_layouts_not_modelled_answer():
    """A layout `predict` refuses is still refused with its reason, not pruned."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = replace(TrainSetup(1, 16), grad_accum=2)
    tiny = GpuProfile("tiny", "test card", "9.0", 41 * MiB, 40 * MiB, 1 * MiB, "test")
    frame = size(spec, setup, tiny, max_gpus=2, families=("tp",))
    assert frame["why"].iloc[0].startswith("not modelled: grad-accum(2)")
