"""The two speed targets set for pipelines and sizing at scale, cold, on this machine, each in a fresh process beside the time of importing torch
and transformers in one (the unit the targets are given in):
- Llama-2-70B, bf16, checkpointing, seq 4096, H100s, PP 16 x TP 8 x DP 8 (1,024 GPUs): <= 3x the import time;
- `llmsim size --model llama-2-70b --seq-len 4096 --gpu h100-80gb --precision bf16 --grad-ckpt --max-gpus 64`
  (every family): <= 15x the import time.
Beside them, the PP 16 x DDP 64 layout on the same 1,024 GPUs under 1F1B and GPipe (16 micro-batches), which
llmsim predicts.
Each prediction is timed 3 times and its best taken, as the import is (this machine's times move by +-0.5 s from
run to run; all three are printed); `size`, once.
Run: python experiments/benchmark_targets.py [--skip-size]  (output in experiments/benchmark_targets.out)"""
from __future__ import annotations

import subprocess
import sys
import time

from llmsim.app.size import FAMILIES  # `size` runs every family, the 3-D one (DDP x TP x PP) included

PREDICT = ["llmsim", "predict", "--model", "llama-2-70b", "--seq-len", "4096", "--gpu", "h100-80gb", "--precision",
           "bf16", "--grad-ckpt", "--micro-batch", "1", "--quiet", "--format", "json"]


SIZE_LIMIT_S = 1800  # the size run is stopped there (its target, 15x the import, is well under a minute)


def timed(argv: list[str], limit_s: float | None = None) -> tuple[float, subprocess.CompletedProcess | None]:
    """Seconds and the finished process; None in its place where it ran past `limit_s`."""
    begin = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        done = None
    return time.perf_counter() - begin, done


def best_of_3(argv: list[str]) -> tuple[float, subprocess.CompletedProcess, str]:
    """The best of three runs, the last run's process, and all three times."""
    runs = [timed(argv) for _ in range(3)]
    return min(took for took, _ in runs), runs[-1][1], " / ".join(f"{took:.1f}" for took, _ in runs)


def main() -> None:
    imports = min(timed([sys.executable, "-c", "import torch, transformers"])[0] for _ in range(3))
    print(f"import torch + transformers, fresh process: {imports:.2f} s (best of 3)")
    took, done, each = best_of_3([*PREDICT, "--strategy", "ddp", "--world-size", "1024", "--tp", "8", "--pp", "16",
                                  "--schedule", "1f1b", "--microbatches", "16", "--jobs", "2"])
    if done.returncode:  # refused: no prediction to time
        print(f"PP 16 x TP 8 x DP 8 on 1,024 H100s (target <= 3x the import): refused, exit status "
              f"{done.returncode}: {done.stderr.strip().splitlines()[-1]}")
    else:
        print(f"PP 16 x TP 8 x DP 8 (DDP as torch's replicate) on 1,024 H100s, 1f1b, 2 processes: {took:.1f} s = "
              f"{took / imports:.1f}x the import (target <= 3x; best of {each} s)")
    for schedule in ("1f1b", "gpipe"):
        took, done, each = best_of_3([*PREDICT, "--strategy", "ddp", "--world-size", "1024", "--pp", "16",
                                      "--schedule", schedule, "--microbatches", "16", "--jobs", "2"])
        print(f"PP 16 x DDP 64 on 1,024 H100s, {schedule}, 2 processes: {took:.1f} s = {took / imports:.1f}x the "
              f"import, exit status {done.returncode} (best of {each} s)")
    if "--skip-size" in sys.argv[1:]:
        print("size --max-gpus 64, every family: not run (--skip-size)")
        return
    took, done = timed(["llmsim", "size", "--model", "llama-2-70b", "--seq-len", "4096", "--gpu", "h100-80gb",
                        "--precision", "bf16", "--grad-ckpt", "--max-gpus", "64", "--layouts",
                        ",".join(FAMILIES), "--jobs", "2", "--quiet"], SIZE_LIMIT_S)
    if done is None:
        print(f"size --max-gpus 64, every family, 2 processes: not done after {took:.0f} s = {took / imports:.0f}x "
              "the import (target <= 15x), stopped")
        return
    fits = [line for line in done.stdout.splitlines() if " True " in line]
    print(f"size --max-gpus 64, every family, 2 processes: {took:.0f} s = {took / imports:.0f}x the import (target "
          f"<= 15x), exit status {done.returncode}, {len(fits)} fitting layouts")


if __name__ == "__main__":
    main()
