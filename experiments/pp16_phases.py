"""Where a cold Llama-2-70B PP 16 x DDP 64 (1F1B, 16 micro-batches, H100s) prediction's time goes, in one process:
the imports (torch, transformers, Llama's modeling code, pandas, llmsim), then the CLI's `main` with `--jobs 1`,
the stage traces (`run_fake`) timed inside it.
Run: python experiments/pp16_phases.py  (a fresh process each time; output in experiments/pp16_phases.out)"""
import contextlib
import io
import sys
import time

begin = time.perf_counter()
import pandas  # noqa: E402,F401
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers.models.llama import modeling_llama  # noqa: E402,F401

import llmsim.app.cli  # noqa: E402
import llmsim.sim.pipeline  # noqa: E402,F401
from llmsim.model import trace as traces  # noqa: E402

imported = time.perf_counter()
tracing = [0.0]
run_fake = traces.run_fake


def timed(*args, **kwargs):
    start = time.perf_counter()
    try:
        return run_fake(*args, **kwargs)
    finally:
        tracing[0] += time.perf_counter() - start


traces.run_fake = timed
sys.argv = ["llmsim", "predict", "--model", "llama-2-70b", "--seq-len", "4096", "--gpu", "h100-80gb", "--precision",
            "bf16", "--grad-ckpt", "--micro-batch", "1", "--quiet", "--format", "json", "--strategy", "ddp",
            "--world-size", "1024", "--pp", "16", "--schedule", "1f1b", "--microbatches", "16", "--jobs", "1"]
with contextlib.redirect_stdout(io.StringIO()):
    try:
        llmsim.app.cli.main()
    except SystemExit:
        pass
done = time.perf_counter()
print(f"imports {imported - begin:.2f} s, prediction {done - imported:.2f} s, of which the stage traces "
      f"{tracing[0]:.2f} s")
