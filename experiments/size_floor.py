"""How far `size` is from its target (<= 15x the import of torch and transformers, every family, Llama-2-70B,
seq 4096, bf16, checkpointing, H100-80GB, --max-gpus 64), and how far any search could bring it with traces as
they cost today: the floor.

1. `size` itself, two processes (its answers: each layout's largest micro-batch).
2. In a new process, only the predictions no search can skip: each fitting layout predicted once, at its answer
   (what "fits" rests on), in one process, the traces shared between layouts as `size` shares them. A search that
   guessed every answer at once, and never tried the micro-batch above it or a layout that does not fit, would
   still make these. Timed in one process, and halved for two (an even split, which `size` does not reach: its
   layouts are not of equal cost).

Run: python experiments/size_floor.py  (output in experiments/size_floor.out; about 6 minutes)"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from llmsim.app.size import FAMILIES

MODEL, SEQ, GPU, MAX_GPUS = "llama-2-70b", 4096, "h100-80gb", 64


def _setup():
    from llmsim.enums import Precision
    from llmsim.inputs.spec import TrainSetup

    return TrainSetup(1, SEQ, Precision.BF16, grad_ckpt=True)


def floor(answers_path: str) -> None:
    """Step 2, in this (new) process: each fitting layout predicted at its answer."""
    begin = time.perf_counter()
    import llmsim.model.trace as trace_module
    from llmsim.app.size import candidates
    from llmsim.inputs.gpus import load_gpu
    from llmsim.inputs.spec import load_model_spec
    from llmsim.sim.pipeline import predict

    spec, gpu, setup = load_model_spec(MODEL), load_gpu(GPU), _setup()
    imported = time.perf_counter() - begin
    traces = []
    run = trace_module.run_fake
    trace_module.run_fake = lambda *args, **kwargs: traces.append(args[1].pp_stage) or run(*args, **kwargs)
    answers = json.loads(open(answers_path).read())
    by_key = {(c.name, c.gpus): c for c in candidates(spec, setup, MAX_GPUS, FAMILIES)}
    begin = time.perf_counter()
    for name, gpus, micro_batch in answers:
        layout = by_key[(name, gpus)].layout_for(micro_batch)
        prediction = predict(spec, replace(setup, micro_batch=micro_batch), layout, gpu)
        assert all(rank.fits for rank in prediction.ranks), (name, gpus, micro_batch)
    took = time.perf_counter() - begin
    print(json.dumps({"imported": imported, "took": took, "traces": len(traces), "layouts": len(answers)}))


def main() -> None:
    imports = min(_timed([sys.executable, "-c", "import torch, transformers"]) for _ in range(3))
    print(f"import torch + transformers, fresh process: {imports:.2f} s (best of 3); the target, 15x: "
          f"{15 * imports:.0f} s")
    from llmsim.app.size import size
    from llmsim.inputs.gpus import load_gpu
    from llmsim.inputs.spec import load_model_spec

    begin = time.perf_counter()
    frame = size(load_model_spec(MODEL), _setup(), load_gpu(GPU), max_gpus=MAX_GPUS, families=FAMILIES, jobs=2)
    took = time.perf_counter() - begin
    fitting = frame[frame["fits"]]
    print(f"size, every family, 2 processes, in this process (its imports done): {took:.0f} s = "
          f"{took / imports:.0f}x; {len(frame)} layouts, {len(fitting)} fitting")
    answers = [(row.layout, int(row.gpus), int(row.largest_micro_batch)) for row in fitting.itertuples()]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(answers, file)
    done = subprocess.run([sys.executable, __file__, "--floor", file.name], capture_output=True, text=True,
                          check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"the floor: each of the {result['layouts']} fitting layouts predicted once at its answer, one process "
          f"(its imports {result['imported']:.1f} s aside): {result['took']:.0f} s, {result['traces']} stage "
          f"traces; halved for two processes {result['took'] / 2:.0f} s = {result['took'] / 2 / imports:.0f}x "
          f"the import (target 15x)")


def _timed(argv: list[str]) -> float:
    begin = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - begin


if __name__ == "__main__":
    if sys.argv[1:2] == ["--floor"]:
        floor(sys.argv[2])
    else:
        main()
