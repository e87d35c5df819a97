"""Where a 1F1B stage's events fall between torch's chunk calls: the ground for issue 23's composition of stage
timelines from templates (llmsim/sim/compose_1f1b.py). For a committed PP row and the stages given, traces each
stage at full depth with a mark at every `forward_one_chunk` / `backward_one_chunk` entry and exit, and prints step 1's segments
(events, net bytes, allocations) between marks.
Run: python experiments/explore_1f1b_chunks.py ROW STAGE [STAGE ...]   (ROW: a row of tier2_pp_cpu.csv; e.g. 8 1 2)
Seen on row 8 (Llama-shaped, pp 4, 1F1B, 8 micro-batches), stages 1 and 2 (warm-ups of 3 and 2): every forward
chunk is 185 events (+41,472 B); backward chunks are 462 events (-25,088 B) but the first (443-444 events, its
gradients allocated), the second (461-462) and the last (461); after a backward, before the next forward, one
16,384 B free (a micro-batch's hidden states: the input gradient sent back once its send is waited for), two in the
cool-down. So the chunks are templates; what moves with the schedule is where a few frees fall."""
from __future__ import annotations

import sys

import pandas as pd

import llmsim.model.step as step
from llmsim.measure.validate import row_inputs
from llmsim.model.trace import run_fake
from llmsim.sim.pipeline import checked
from llmsim.sim.traced import _stage_setup

MARKS: list[tuple[str, int, int, int]] = []  # (F/f: forward entry/exit, B/b: backward, micro-batch, step, row)
_track_chunks = step._track_chunks


def _marked(stage, tracker, hooks, autocast) -> None:
    _track_chunks(stage, tracker, hooks, autocast)
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def marked(call, enter: str, leave: str):
        def run(chunk, *args, **kwargs):
            MARKS.append((enter, chunk, tracker.step, len(tracker._rows)))
            result = call(chunk, *args, **kwargs)
            MARKS.append((leave, chunk, tracker.step, len(tracker._rows)))
            return result
        return run

    stage.forward_one_chunk = marked(forward, "F", "f")
    stage.backward_one_chunk = marked(backward, "B", "b")


def main(row: int, stages: list[int]) -> None:
    step._track_chunks = _marked
    model, setup, layout = row_inputs(pd.read_csv("data/measurements/tier2_pp_cpu.csv").iloc[row])
    setup = checked(model, setup, layout)
    for stage in stages:
        MARKS.clear()
        timeline, _ = run_fake(model, _stage_setup(setup, layout, stage), None)
        print(f"stage {stage}: {len(timeline)} events")
        marks = [mark for mark in MARKS if mark[2] == 1]
        for (kind, chunk, _, begin), (next_kind, next_chunk, _, end) in zip(marks, marks[1:]):
            segment = timeline.iloc[begin:end]
            print(f"  {kind}{chunk} -> {next_kind}{next_chunk}: {len(segment)} events, net "
                  f"{int(segment.delta_bytes.sum()):+,} B, {int((segment.delta_bytes > 0).sum())} allocations")


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(stage) for stage in sys.argv[2:]])
