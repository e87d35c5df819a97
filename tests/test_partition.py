"""The pipeline split `predict --suggest` offers (llmsim/sim/partition.py): the least maximum of the stages' lines,
the bytes a stage's layers hold at its peak, and the search that predicts each split it tries."""
import itertools
import random
from dataclasses import replace

import pandas as pd
import pytest

from llmsim.app import advice
from llmsim.enums import Precision
from llmsim.inputs.gpus import GpuProfile, load_gpu
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.model.pipelining import Schedule
from llmsim.sim import partition
from llmsim.sim.allocator import AllocatorConfig
from llmsim.sim.partition import StageLine
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy


def splits(layers: int, stages: int):
    """Every split of `layers` into `stages` stages of one layer or more."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def test_balanced_is_the_least_maximum_of_every_split():
    rng = random.Random(0)
    for _ in range(300):
        stages, layers = rng.randint(2, 5), rng.randint(5, 12)
        if layers < stages:
            continue
        lines = [StageLine(rng.randint(1, 4), rng.randint(0, 10_000), rng.choice([0, rng.uniform(0, 900)]))
                 for _ in range(stages)]
        split = partition.balanced(lines, layers)
        assert sum(split) == layers and min(split) >= 1
        least = min(max(line.at(n) for line, n in zip(lines, s)) for s in splits(layers, stages))
        assert max(line.at(n) for line, n in zip(lines, split)) == pytest.approx(least)


def test_a_stages_layers_hold_the_storages_they_allocated_and_still_live():
    """Storage 1 (a layer's) lives at the peak; 2 (a layer's) is freed before it; 3 (the LM head's, in the last
    layer's block as the tracker tags it) is freed in a layer's rows, which does not count against the layer; 6 is
    allocated by the final norm; 7 by no module; 4 after the peak."""
    rows = [(1, 0, "model.layers.0.mlp", 100), (2, 1, "model.layers.1.self_attn", 30), (3, 1, "lm_head", 50),
            (2, 1, "model.layers.1", -30), (3, 1, "model.layers.1", -50),
            (5, 1, "model.layers.1.mlp.up_proj.weight", 7), (6, 1, "model.norm", 11), (7, -1, None, 13),
            (4, 0, "model.layers.0", 1000)]
    timeline = pd.DataFrame(rows, columns=["serial", "block", "module", "delta_bytes"])
    assert partition.layer_bytes(timeline, 7, "model.layers") == 107
    assert partition.layer_bytes(timeline, 2, "model.layers") == 130
    assert partition.layer_bytes(timeline, 7, "gpt_neox.layers") == 0


def test_the_search_takes_the_best_split_it_predicts_and_corrects_each_stages_line():
    """Stages whose real bytes a layer are not the first guess: the first split tried is what the guess calls best,
    the next one what the corrected lines call best, and the answer is the least of those predicted."""
    truth = [StageLine(8, 1000, 100.0), StageLine(8, 700, 60.0), StageLine(8, 600, 40.0)]
    guess = [StageLine(8, 1000, 90.0), StageLine(8, 700, 90.0), StageLine(8, 600, 90.0)]
    tried = []

    def predicted(split):
        tried.append(split)
        return [round(line.at(n)) for line, n in zip(truth, split)]
    split, needed = partition.rebalanced((8, 8, 8), [1000, 700, 600], guess, predicted)
    first = partition.balanced(guess, 24)
    first_needed = [round(line.at(n)) for line, n in zip(truth, first)]
    second = partition.balanced([partition.corrected(line, n, bytes_)
                                 for line, n, bytes_ in zip(guess, first, first_needed)], 24)
    assert tried[:2] == [first, second] and first != second
    assert split == partition.balanced(truth, 24) and needed == predicted(split)
    assert max(needed) <= min(max(round(line.at(n)) for line, n in zip(truth, s)) for s in splits(24, 3))
    # already the least: nothing offered
    assert partition.rebalanced(split, needed, truth, predicted) is None


SHRUNK = ("llama-2-7b", (128, 9, 512, 4))
CASES = [  # (vocabulary, setup, layout)
    # stage 0 keeps 3 micro-batches' activations (1F1B's warm-up) and the embedding
    (512, TrainSetup(2, 128, Precision.BF16), Layout(world_size=3, pp=3, schedule=Schedule.ONE_F_ONE_B,
                                                     n_microbatches=3)),
    # every stage keeps 4 micro-batches' activations; the last, the LM head and its logits over 8,192 tokens
    (8192, TrainSetup(2, 128, Precision.BF16), Layout(Strategy.DDP, 6, pp=3, schedule=Schedule.GPIPE,
                                                      n_microbatches=4)),
]


@pytest.mark.parametrize("vocab,setup,layout", CASES, ids=["1f1b", "ddp-gpipe"])
def test_the_split_offered_is_its_own_prediction_and_needs_less(vocab, setup, layout):
    hidden, layers, _, heads = SHRUNK[1]
    spec = load_model_spec(SHRUNK[0], shrink(SHRUNK[0], hidden, layers, vocab, heads))
    gpu = load_gpu("h100-80gb")
    given = predict(spec, setup, layout, gpu)
    offered = advice._split_suggestion(spec, setup, layout, gpu, AllocatorConfig(), given)
    assert offered is not None and offered.change.startswith("--pp-split ")
    split = tuple(int(n) for n in offered.change.split()[1].split(","))
    own = predict(spec, setup, replace(layout, pp_split=split), gpu)
    assert offered.needed_bytes == own.deciding_rank.needed_bytes < given.deciding_rank.needed_bytes
    assert sum(split) == spec.num_layers and split != (3, 3, 3)


def test_a_pipeline_that_does_not_fit_is_offered_the_split_before_what_costs_compute():
    _, setup, layout = CASES[0]
    spec = load_model_spec(SHRUNK[0], shrink(SHRUNK[0], *SHRUNK[1]))
    roomy = load_gpu("h100-80gb")
    offered = advice._split_suggestion(spec, setup, layout, roomy, AllocatorConfig(),
                                       predict(spec, setup, layout, roomy))
    given_need = predict(spec, setup, layout, roomy).deciding_rank.needed_bytes
    # a card on which the job needs more than its room and the offered split less
    card = GpuProfile("card", "test card", "9.0", (given_need + offered.needed_bytes) // 2, roomy.cuda_context_bytes,
                      roomy.cublas_workspace_bytes, "test", margin=0.0)
    given = predict(spec, setup, layout, card)
    assert given.verdict != "fits"
    listed = advice.suggestions(spec, setup, layout, card, given=given)
    at = [s.change for s in listed].index(offered.change)
    assert listed[at].verdict == "fits" and listed[at].needed_bytes == offered.needed_bytes
    assert all(s.cost.startswith("none") for s in listed[:at])  # after what costs nothing, before the rest
    assert not any(s.cost.startswith("none") for s in listed[at + 1:]) and len(listed) > at + 1


def test_no_split_is_offered_where_the_layout_has_none_to_change():
    spec = load_model_spec(SHRUNK[0], shrink(SHRUNK[0], *SHRUNK[1]))
    setup = TrainSetup(2, 128, Precision.BF16)
    gpu = load_gpu("h100-80gb")
    single = Layout()
    given = predict(spec, setup, single, gpu)
    assert advice._split_suggestion(spec, setup, single, gpu, AllocatorConfig(), given) is None
