"""Whether llmsim follows a transformers release's change of TP plans: under whatever transformers is installed,
predict then measure (`llmsim predict --format json`, then `llmsim measure --recipe from-pretrained`) the runs whose
committed rows (measured under transformers 5.24.0) depend on the plans, and print one line per rank: predicted,
measured, error. transformers 5.25.0 took the experts out of Mixtral's TP plan and replaced DeepSeek-V3's expert
entries with attention ones; llmsim traces the installed library, so its prediction should match a run measured
under the same release, whatever the committed rows (5.24.0) say.

- mixtral-8x7b FSDP2 x TP (DistributedConfig(tp_size=2, fsdp_size=2), 4 ranks: FSDP_RUNS' last entry)
- deepseek-v3 balanced bf16 and qwen3-235b-a22b collapsed fp32 at TP 2 x EP 2 (HELDOUT_EP)
- mixtral-8x7b balanced fp32 at TP 2 x EP 2 (EP_RUNS)
- llama-2-7b dense TP 2 (TP_RUNS' first entry), a control the release should not move

The measured rows go to --out-dir (default /tmp/drift<major><minor>, e.g. /tmp/drift525; never data/measurements).
A rank is a MISS when its error passes 1 %, or, where its `routing_check` is "bound" (the collapsed run's rank 1,
left without tokens), when it measures over the prediction (validate's comparison for such ranks).

Run: PYTHONPATH=/path/to/transformers-X:. python experiments/check_transformers_drift.py [--out-dir DIR]
     > experiments/check_transformers_drift.out
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_from_pretrained import EP_RUNS, FSDP_RUNS, HELDOUT_EP, MOE_SHAPES, TP_RUNS, _command, _ep  # noqa: E402


def configs() -> list[tuple[str, list, list[str]]]:
    from llmsim.inputs.zoo import shrink

    model, _, micro_batch, seq_len, flags = FSDP_RUNS[-1]  # mixtral-8x7b FSDP2 x TP, 4 ranks
    runs = [("mixtral-8x7b fsdp2xtp2 fp32", [model, shrink(model, *MOE_SHAPES[model]), micro_batch, seq_len], flags)]
    for model, routing, precision in [*HELDOUT_EP[:2], ("mixtral-8x7b", "balanced", "fp32")]:
        assert (model, routing, precision) in HELDOUT_EP + EP_RUNS
        runs.append((f"{model} tp2xep2 {routing} {precision}", *_ep(model, routing, precision)))
    model, overrides, micro_batch, seq_len, flags = TP_RUNS[0]
    runs.append((f"{model} tp2 fp32 (dense control)", [model, overrides, micro_batch, seq_len], flags))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default=f"/tmp/drift{''.join(transformers.__version__.split('.')[:2])}")
    out_dir = Path(parser.parse_args().out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__} ({Path(transformers.__file__).parent})", flush=True)
    print(f"{'config':42} rank {'predicted B':>12} {'measured B':>12} {'error':>9} check", flush=True)
    misses = 0
    for index, (name, case, flags) in enumerate(configs()):
        done = subprocess.run(_command("predict", *case, flags) + ["--format", "json"], capture_output=True,
                              text=True)
        if done.returncode:
            print(f"{name:42} predict refused: {done.stderr.strip()[-300:]}", flush=True)
            misses += 1
            continue
        predicted = {r["rank"]: r["peak_allocated_bytes"] for r in json.loads(done.stdout)["ranks"]}
        out = out_dir / f"{index}_{case[0]}.csv"
        out.unlink(missing_ok=True)
        done = subprocess.run(_command("measure", *case, flags) + ["--recipe", "from-pretrained", "--out", str(out)],
                              capture_output=True, text=True)
        if done.returncode:
            print(f"{name:42} measure failed: {done.stderr.strip()[-300:]}", flush=True)
            misses += 1
            continue
        for row in pd.read_csv(out).itertuples():
            check = row.routing_check if isinstance(row.routing_check, str) else "exact"
            error = (predicted[row.rank] - row.peak_allocated_bytes) / row.peak_allocated_bytes
            miss = abs(error) > 0.01 if check == "exact" else row.peak_allocated_bytes > predicted[row.rank]
            misses += miss
            print(f"{name:42} {row.rank:4} {predicted[row.rank]:12,} {row.peak_allocated_bytes:12,} {error:+9.4%} "
                  f"{check}{'  MISS' if miss else ''}  (measured under transformers {row.transformers})", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
