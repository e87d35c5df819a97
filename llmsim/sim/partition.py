"""A pipeline's split of the layers over its stages that lowers the most loaded stage (`rebalanced`): what
`predict --suggest` offers as `--pp-split` when a stage does not fit.

torch.distributed.pipelining takes whatever modules the user's script gives each stage, and transformers' balanced
split (`pipelining.layer_range`) gives every stage the same layers, while the stages hold very different memory:
under 1F1B stage s keeps the activations of pp - s micro-batches until their backward, the first stage holds the
embedding and the last the LM head, its logits and the loss. Llama-2-7B over 4 stages of 8 layers (bf16, seq 4096,
8 micro-batches under 1F1B, an A100-40GB) needs 37.2, 30.6, 24.8 and 25.8 GiB; the split found, 6,7,9,10, needs
28.5, 27.0, 27.7 and 30.3 GiB. Megatron-LM has flags for such splits (`--decoder-first-pipeline-num-layers`,
`--decoder-last-pipeline-num-layers`).

What a stage needs is, to a good approximation, what it needs besides its layers plus what each of its layers holds
at its peak: its parameters, gradients, optimizer states and the activations of every micro-batch in flight
(`layer_bytes`: the storages a layer allocated and still live at the stage's peak, over its layers). The split that
minimizes the largest of those sums is found exactly for that line (`balanced`); each split tried is then predicted
in full (the traced stages decide, nothing is estimated in the answer), and each stage's line is corrected through
the two latest predictions of it (the bytes its layers held per layer can move with the layers: its peak phase can
change). A split is offered only where its prediction needs less than the given split's.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

ROUNDS = 3  # splits tried (each one prediction) before the best one found is taken


@dataclass(frozen=True)
class StageLine:
    """A stage's need as a line in its number of layers: `fixed_bytes + layers * per_layer_bytes`."""
    layers: int
    needed_bytes: int  # what the stage needs at `layers` layers (its most needing rank)
    per_layer_bytes: float

    @property
    def fixed_bytes(self) -> float:
        return self.needed_bytes - self.layers * self.per_layer_bytes

    def at(self, layers: int) -> float:
        return self.fixed_bytes + layers * self.per_layer_bytes


def layer_bytes(timeline: pd.DataFrame, peak_event: int, layers_prefix: str) -> int:
    """The bytes a stage's layers hold at its peak (row `peak_event` of its device timeline): the storages live
    there that a layer allocated, its module under `layers_prefix` (`model.layers.3.mlp.up_proj`, a parameter's
    states named by the parameter). A storage is counted where it was made: the loss's gradient freed in the last
    layer's backward is not a layer's; nor are the final norm's and the LM head's, whose rows carry the last
    layer's block."""
    upto = timeline.iloc[: peak_event + 1]
    serial = upto["serial"].to_numpy()
    first = ~pd.Series(serial).duplicated().to_numpy()  # each storage's allocating row
    live = pd.Series(upto["delta_bytes"].to_numpy(dtype=np.int64)).groupby(serial).sum()
    modules = pd.Series(upto["module"].to_numpy()[first], index=serial[first])
    return int(live[modules[modules.str.startswith(f"{layers_prefix}.", na=False)].index].sum())


def balanced(lines: Sequence[StageLine], num_layers: int) -> tuple[int, ...]:
    """The layers per stage (at least one each, `num_layers` in all) that minimize the largest `line.at(layers)`:
    each layer after the first of every stage goes where it makes the smallest sum. The lines do not fall with their
    layers, so this picks the smallest of every stage's sums past its first layer, and the largest one picked (or a
    stage's first, if larger) is the least maximum any split can have."""
    counts = [1] * len(lines)
    heap = [(line.at(2), stage) for stage, line in enumerate(lines)]
    heapq.heapify(heap)
    for _ in range(num_layers - len(lines)):
        _, stage = heapq.heappop(heap)
        counts[stage] += 1
        heapq.heappush(heap, (lines[stage].at(counts[stage] + 1), stage))
    return tuple(counts)


def corrected(line: StageLine, layers: int, needed_bytes: int) -> StageLine:
    """`line` moved to pass through a new prediction (`layers`, `needed_bytes`): the slope through the two where the
    layers differ, never below zero (a layer holds bytes), else the same slope."""
    per_layer = line.per_layer_bytes if layers == line.layers else \
        max(0.0, (needed_bytes - line.needed_bytes) / (layers - line.layers))
    return StageLine(layers, needed_bytes, per_layer)


def rebalanced(split: tuple[int, ...], needed: list[int], first_lines: list[StageLine],
               predicted: Callable[[tuple[int, ...]], list[int]]) -> tuple[tuple[int, ...], list[int]] | None:
    """The split (and its stages' needs) that needs least, of `split` (whose stages need `needed`) and up to ROUNDS
    others found by `balanced` on the stages' lines, each predicted (`predicted(split)`: every stage's need); None
    where none needs less than `split`."""
    best, lines, tried = (split, needed), first_lines, {split}
    for _ in range(ROUNDS):
        trial = balanced(lines, sum(split))
        if trial in tried:
            break
        tried.add(trial)
        trial_needed = predicted(trial)
        if max(trial_needed) < max(best[1]):
            best = (trial, trial_needed)
        lines = [corrected(line, layers, bytes_) for line, layers, bytes_ in zip(lines, trial, trial_needed)]
    return best if best[0] != split else None
