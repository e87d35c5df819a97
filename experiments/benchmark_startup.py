"""What a user waits for at the command line, against what any torch program waits for: `llmsim --help` beside
`python -c "import torch"`, and a cold `llmsim predict` of Llama-2-7B (seq 2048, bf16; a new process, so every
import and the trace) beside `python -c "import torch, transformers"`. The commands run in turns, several rounds,
so that both sides see the same machine; the medians and their ratios are printed.
Run: python experiments/benchmark_startup.py [--rounds N]  (output in experiments/benchmark_startup.out)"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLMSIM = [sys.executable, "-m", "llmsim.app.cli"]
PREDICT = "llmsim predict (7B, seq 2048, bf16)"
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import torch, transformers": [sys.executable, "-c", "import torch, transformers"],
    # what any script that trains Llama loads before its first step: transformers' modeling stack (DTensor, FSDP,
    # torch._dynamo, sympy), which `import transformers` alone defers
    "import torch, transformers, modeling_llama": [sys.executable, "-c", "import torch, transformers; "
                                                   "import transformers.models.llama.modeling_llama"],
    "llmsim --help": [*LLMSIM, "--help"],
    PREDICT: [*LLMSIM, "predict", "--model", "llama-2-7b", "--seq-len", "2048",
                                            "--micro-batch", "1", "--precision", "bf16"],
}
TARGETS = (("llmsim --help", "import torch", 0.5), (PREDICT, "import torch, transformers", 2.0),
           (PREDICT, "import torch, transformers, modeling_llama", None))


def wall_s(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=Path(__file__).resolve().parents[1])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    for command in COMMANDS.values():  # once each, unrecorded: the files are in the page cache for every round
        wall_s(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, command in COMMANDS.items():
            times[name].append(wall_s(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{os.cpu_count()} cores, {rounds} rounds, median wall time of a new process (min-max):")
    for name, values in times.items():
        print(f"  {name:<44} {medians[name]:.2f} s ({min(values):.2f}-{max(values):.2f})")
    for name, against, target in TARGETS:
        ratio = medians[name] / medians[against]
        verdict = f" (target <= {target}: {'met' if ratio <= target else 'MISSED'})" if target else ""
        print(f"{name} / {against}: {ratio:.2f}{verdict}")


if __name__ == "__main__":
    main()
