"""What ZeRO-3's swappers write to nvme_path, predicted (`Prediction.nvme_bytes`, llmsim/sim/strategies/zero3.py
`nvme_bytes`) against the files a real run leaves: every swapper run of experiments/measure_offload.py (the
optimizer's, the parameters', or both) re-run through deepspeed.initialize (torchrun, gloo), the files under
nvme_path/zero_stage_3/<optimizer|float32params|bfloat16params>/rank<r> summed per rank. No rows are written (the
memory rows are measure_offload.py's). Run: python experiments/check_nvme_files.py [--only I ...] (about 4 minutes
on 2 cores); output: experiments/check_nvme_files.out (the optimizer swapper's runs, then `--only 88 ... 93` and
`--only 94`, the parameter swapper's)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from measure_offload import RUNS, SWAP_DIR, inputs  # noqa: E402

from llmsim.measure.runs import measure_distributed  # noqa: E402
from llmsim.sim.pipeline import predict  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", type=int, nargs="*", help="indices into measure_offload.RUNS (default: all)")
    only = parser.parse_args().only
    misses = 0
    for index, run in enumerate(RUNS):
        zero = run[2]["zero_optimization"]
        swappers = [zero[key] for key in ("offload_optimizer", "offload_param")
                    if (zero.get(key) or {}).get("device") == "nvme"]
        if zero["stage"] != 3 or not swappers or (only is not None and index not in only):
            continue
        spec, setup, layout = inputs(run)
        predicted = predict(spec, setup, layout).nvme_bytes
        shutil.rmtree(SWAP_DIR, ignore_errors=True)
        measure_distributed(spec, setup, layout, ds_gloo_settle=True)
        root = Path(SWAP_DIR) / "zero_stage_3"
        written = [sum(f.stat().st_size for f in root.glob(f"*/rank{rank}/*.swp"))
                   for rank in range(layout.world_size)]
        files = sorted(f"{f.parent.parent.name}/{f.name}" for f in root.glob("*/rank0/*.swp"))
        misses += written != predicted
        print(index, run[0], layout.world_size, *map(json.dumps, swappers), "predicted", predicted,
              "written", written, "rank 0's files:", files, flush=True)
    shutil.rmtree(SWAP_DIR, ignore_errors=True)
    print(f"{misses} run(s) where the files differ from the prediction")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
