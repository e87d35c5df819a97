"""Helpers strategies use to read a single-process timeline and splice their own events into it."""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from llmsim.enums import Category, Phase
from llmsim.sim.peaks import Peak
from llmsim.model.tracker import GRAD_READY, NO_BLOCK, TIMELINE_COLUMNS


@dataclass(frozen=True)
class Spliced:
    """A rank's device events as every rank's (the template's `serials`, `deltas`: the same arrays for each rank)
    with the rank's own spliced in: own event j goes before the template's event `at[j]` (at the end where it is
    the template's length), in order. `own_serials` name the rank's own storages apart from the template's (a
    free of a template storage names its template serial); the names are the same in every rank for the same
    event, so that two ranks whose own events agree in a stretch of the template have the same events there. The
    allocator model reads names only to pair a free with its allocation: these events replay as the rank's
    timeline's (`arrays`, the same events under the timeline's serials)."""

    serials: np.ndarray
    deltas: np.ndarray
    at: np.ndarray
    own_serials: np.ndarray
    own_deltas: np.ndarray

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole stream of (serials, delta bytes)."""
        return np.insert(self.serials, self.at, self.own_serials), np.insert(self.deltas, self.at, self.own_deltas)


@dataclass(frozen=True)
class RankEvents:
    """What a prediction needs of one rank, without its timeline: the peak of its device events (`peaks.replay`),
    its host peak (`offload.host_peak_bytes`), and its device events for the allocator model, made when asked, as
    a template's with the rank's own spliced in (ranks replay the stretches they share once,
    `replay._replay_spliced`)."""

    peak: Peak
    peak_host_bytes: int
    spliced: Callable[[], Spliced]


class LazyRanks(Mapping):
    """Rank -> timeline, each built when asked and not kept: for strategies whose every rank differs (ZeRO-1/2's
    partitions), so that a prediction over many ranks holds one rank's timeline at a time. `events`, where given,
    is rank -> `RankEvents`: the same rank's peak and device events, without building its timeline."""

    def __init__(self, world_size: int, build: Callable[[int], pd.DataFrame],
                 events: Callable[[int], RankEvents] | None = None) -> None:
        self.world_size, self.build, self.events = world_size, build, events

    def __getitem__(self, rank: int) -> pd.DataFrame:
        if not 0 <= rank < self.world_size:
            raise KeyError(rank)
        return self.build(rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world_size))

    def __len__(self) -> int:
        return self.world_size


def per_timeline(function=None, *, maxsize: int | None = None):
    """Keep `function(timeline, *args)` for as long as that timeline object lives: the traced timelines are
    cached and read, never changed, by every prediction of a sweep (callers must not change the result).
    With `maxsize`, only the latest `maxsize` results are kept (for results as large as a timeline)."""
    if function is None:
        return functools.partial(per_timeline, maxsize=maxsize)
    results: dict[tuple, tuple[weakref.ref, object]] = {}

    @functools.wraps(function)
    def cached(timeline: pd.DataFrame, *args):
        key = (id(timeline), *args)
        hit = results.get(key)
        if hit is not None and hit[0]() is timeline:
            return hit[1]
        for stale in [k for k, (ref, _) in results.items() if ref() is None]:
            del results[stale]
        value = function(timeline, *args)
        if maxsize is not None and len(results) >= maxsize:
            results.pop(next(iter(results)))
        results[key] = (weakref.ref(timeline), value)
        return value
    return cached


@per_timeline
def live_at_end_of_build(timeline: pd.DataFrame, category: Category) -> pd.DataFrame:
    """The storages of `category` alive when the build ends, in allocation order: serial (index),
    `nbytes` and `name` (a parameter's FQN)."""
    build = timeline[(timeline["phase"] == Phase.BUILD.value) & (timeline["category"] == category.value)]
    net = build.groupby("serial", sort=False).agg(nbytes=("delta_bytes", "sum"), name=("tensor", "last"))
    return net[net["nbytes"] > 0]


@per_timeline
def trainable_names(timeline: pd.DataFrame) -> set[str]:
    """FQNs of the parameters whose gradient autograd accumulates (`requires_grad`): the ones a GRAD_READY marker
    names. With LoRA the frozen base parameters have none."""
    return set(timeline.loc[timeline["serial"] == GRAD_READY, "tensor"])


def live_sizes_at_end_of_build(timeline: pd.DataFrame, category: Category) -> list[int]:
    return [int(n) for n in live_at_end_of_build(timeline, category)["nbytes"]]


def end_of_build(timeline: pd.DataFrame) -> int:
    """Index of the first event after the build phase."""
    after = np.flatnonzero(timeline["phase"].to_numpy() != Phase.BUILD.value)
    return int(after[0]) if len(after) else len(timeline)


def new_events(deltas: list[tuple[int, int, Category]], module: str, step: int, phase: Phase,
               first_serial: int) -> pd.DataFrame:
    """Rows for (serial offset, delta bytes, category) triples; serials start at `first_serial`."""
    rows = [(step, phase.value, NO_BLOCK, module, first_serial + offset, delta, category.value, "")
            for offset, delta, category in deltas]
    return pd.DataFrame(rows, columns=TIMELINE_COLUMNS)


def splice(timeline: pd.DataFrame, at: int, events: pd.DataFrame) -> pd.DataFrame:
    return pd.concat([timeline.iloc[:at], events, timeline.iloc[at:]], ignore_index=True)
