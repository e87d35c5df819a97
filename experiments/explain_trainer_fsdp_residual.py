"""What the Trainer's FSDP rows hold at their peak that the prediction does not (the residual docs/validation.md
gives: full fine-tuning ranks about 2 KB under).

One real Trainer FSDP run (tests/test_trainer_fsdp.py's fresh case: a Mistral shape, bf16, checkpointing,
accumulation 2; torchrun, 2 ranks, gloo released) with the stack of every small allocation recorded, its timeline
set beside the prediction's: the storages live at each peak, as a multiset of sizes, and where the measured run
made those of the sizes the prediction has fewer of (the innermost frames outside torch).

Run: python experiments/explain_trainer_fsdp_residual.py (about 30 s); experiments/explain_trainer_fsdp_residual.out
is its last output.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

SIZES = range(1, 4097)  # the allocations whose stacks are kept: the residual is made of small ones


def worker(job_path: str, out: str) -> None:
    """One rank: the Trainer recipe as measured, with the stack of each small allocation kept."""
    from llmsim.model import trainer_recipe
    from llmsim.model.tracker import StorageTracker

    stacks = {}
    allocate = StorageTracker._allocate

    def recording(self, storage, key, nbytes, block, name):
        if nbytes in SIZES:
            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]
                      if "/torch/" not in f.filename and "/llmsim/" not in f.filename]
            stacks[self._next_serial] = frames[-4:]
        return allocate(self, storage, key, nbytes, block, name)

    StorageTracker._allocate = recording
    sys.argv = [sys.argv[0], job_path, out]
    trainer_recipe.main()
    Path(out, f"stacks{os.environ['RANK']}.json").write_text(json.dumps(stacks))


def _live_at_peak(timeline):
    from llmsim.sim.peaks import replay

    peak = replay(timeline)
    rows = timeline.iloc[:peak.event + 1]
    rows = rows[rows.serial >= 0]
    net = rows.groupby("serial").delta_bytes.sum()
    return peak, net[net > 0]


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4])
        return 0
    import pandas as pd

    from llmsim.inputs.hf import trainer_setup
    from llmsim.inputs.spec import load_model_spec
    from llmsim.sim.pipeline import predict
    from llmsim.sim.strategies import trainer_layout

    from check_gloo_release import MISTRAL_TINY, TRAINER_FIELDS  # this folder

    spec = load_model_spec("mistral-7b", MISTRAL_TINY)
    setup, layout = trainer_layout(spec, trainer_setup(spec, 48, TRAINER_FIELDS, None, "float32", None), 2, None)
    prediction = predict(spec, setup, layout)
    job = {"config": spec.config_dict, "seq_len": setup.seq_len, "load_dtype": setup.load_dtype,
           "training_args": json.loads(setup.training_args), "peft_config": None, "quantization_config": None,
           "kbit_prep": False, "trainer": setup.recipe.value}
    with tempfile.TemporaryDirectory() as out:
        Path(out, "job.json").write_text(json.dumps(job))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__,
                        "--worker", str(Path(out, "job.json")), out], check=True, capture_output=True)
        for rank in range(2):
            measured = pd.read_pickle(Path(out, f"rank{rank}.timeline.pkl"))
            stacks = json.loads(Path(out, f"stacks{rank}.json").read_text())
            peak, live = _live_at_peak(measured)
            predicted_peak, predicted_live = _live_at_peak(prediction.ranks[rank].timeline)
            print(f"rank {rank}: measured {peak.allocated_bytes:,} B, predicted {predicted_peak.allocated_bytes:,} B, "
                  f"difference {peak.allocated_bytes - predicted_peak.allocated_bytes:+,} B")
            more = collections.Counter(live.tolist()) - collections.Counter(predicted_live.tolist())
            fewer = collections.Counter(predicted_live.tolist()) - collections.Counter(live.tolist())
            # the prediction's timeline shrinks and grows some storages in place (FSDP2's resize_): only sizes
            # whose counts differ are listed, those under 4 KiB with the measured run's frames
            print(f"  sizes live only in the measured run: {dict(sorted(more.items()))}")
            print(f"  sizes live only in the prediction: {dict(sorted(fewer.items()))}")
            for nbytes in sorted(more):
                if nbytes not in SIZES:
                    continue
                origins = collections.Counter(" <- ".join(reversed(stacks.get(str(serial), ["(no stack)"])))
                                              for serial, size in live.items() if size == nbytes)
                print(f"  {nbytes} B, measured {sum(origins.values())} live, predicted "
                      f"{int((predicted_live == nbytes).sum())}:")
                for origin, count in origins.most_common():
                    print(f"    {count} x {origin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
