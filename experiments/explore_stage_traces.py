"""What a pipeline stage's trace depends on, and what it costs: the facts a stage composed from a smaller
pipeline's trace (issue 23's next step) would rest on.

1. Depth. Under torch's Schedule1F1B a stage's chunk calls come in an order set by its warm-up W = min(M,
   num_stages - stage) and its M micro-batches. Is its trace the same in a pipeline of another depth where it holds
   the same layers with the same W and M? Traced here on a shrunk Llama (16 layers, two a stage): a middle stage
   with W = 5 (stage 3 of 8, and stage 1 of 6 with `pp_split` 2,2,2,2,2,6) and the last stage (W = 1: of 8, and of
   4 with split 6,4,4,2), M = 8, over one replica (TP x PP alone), under torch's `replicate` (dp 2) and under
   FSDP2 (dp 2), with the CPU's setup and an H100's. Compared event for event, storages numbered in allocation
   order (tests/test_compose_1f1b.py's `in_allocation_order`).
2. Cost against M. The first stage of Llama-2-70B (bf16, checkpointing, seq 4096, micro-batch 1, H100s) traced
   at pp = M = 8, 16 and 32 under `replicate` (its micro-batches from the third on replayed:
   llmsim/model/chunk_replay.py) and under FSDP2 x PP (dp 2: chunk replay refuses, every micro-batch computed).
3. Dispatch. FakeTensorMode's cache over one trace of stages 0 and 1 of Llama-2-70B at TP 4 x PP 16 (one
   replica, micro-batch 4, the rest as in 2): hits, misses and bypasses by reason.

Run: python experiments/explore_stage_traces.py  (about 90 s on 2 cores; output in
experiments/explore_stage_traces.out)"""
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.filterwarnings("ignore")

from llmsim.app.size import _model_parallel  # noqa: E402
from llmsim.enums import Precision  # noqa: E402
from llmsim.inputs.gpus import load_gpu  # noqa: E402
from llmsim.inputs.spec import FsdpSetup, TrainSetup, load_model_spec  # noqa: E402
from llmsim.inputs.zoo import shrink  # noqa: E402
from llmsim.model.trace import forget_traces, trace  # noqa: E402
from llmsim.sim import traced  # noqa: E402
from llmsim.sim.pipeline import checked  # noqa: E402
from test_compose_1f1b import in_allocation_order  # noqa: E402

COLUMNS = ["step", "phase", "block", "module", "serial", "delta_bytes", "category"]
LAYOUTS = {"tp x pp (one replica)": lambda pp, m: _model_parallel(1, pp, m),
           "replicate (dp 2) x pp": lambda pp, m: _model_parallel(1, pp, m, 2),
           "fsdp2 (dp 2) x pp": lambda pp, m: _model_parallel(1, pp, m, 2, FsdpSetup())}


def stage_trace(spec, setup, family: str, pp: int, m: int, stage: int, split=None, gpu=None):
    layout = LAYOUTS[family](pp, m)
    if split is not None:
        layout = replace(layout, pp_split=split)
    stage_setup = replace(traced._stage_setup(checked(spec, setup, layout, gpu), layout, stage), steps=2)
    return trace(spec, stage_setup).timeline


def depth() -> None:
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 16, 512, 4))
    setup = TrainSetup(2, 32, Precision.BF16, grad_ckpt=True)
    print("1. the same layers, W and M in pipelines of two depths (shrunk Llama: 16 layers, two a stage; M = 8)")
    for gpu_name in (None, "h100-80gb"):
        gpu = None if gpu_name is None else load_gpu(gpu_name)
        for family in LAYOUTS:
            pairs = {"middle stage, W = 5 (stage 3 of 8 / stage 1 of 6)":
                     ((8, 3, None), (6, 1, (2, 2, 2, 2, 2, 6))),
                     "last stage, W = 1 (of 8 / of 4)": ((8, 7, None), (4, 3, (6, 4, 4, 2)))}
            for what, ((pp_a, stage_a, split_a), (pp_b, stage_b, split_b)) in pairs.items():
                a = in_allocation_order(stage_trace(spec, setup, family, pp_a, 8, stage_a, split_a, gpu)[COLUMNS])
                b = in_allocation_order(stage_trace(spec, setup, family, pp_b, 8, stage_b, split_b, gpu)[COLUMNS])
                a, b = a.reset_index(drop=True), b.reset_index(drop=True)
                if len(a) == len(b) and a.equals(b):
                    verdict = "equal"
                else:
                    differ = (a != b).any(axis=1) if len(a) == len(b) else None
                    verdict = (f"differ in {int(differ.sum())} rows, the first: {a[differ].iloc[0].to_dict()} / "
                               f"{b[differ].iloc[0].to_dict()}" if differ is not None else "differ in length")
                print(f"  {gpu_name or 'cpu'}, {family}, {what}: {len(a):,} / {len(b):,} events, {verdict}")


def cost() -> None:
    spec = load_model_spec("llama-2-70b")
    setup = TrainSetup(1, 4096, Precision.BF16, grad_ckpt=True)
    gpu = load_gpu("h100-80gb")
    print("2. the first stage of Llama-2-70B (bf16, checkpointing, seq 4096, micro-batch 1, H100s), pp = M, "
          "seconds of one trace (best of 2, after a warm-up trace)")
    for family in ("replicate (dp 2) x pp", "fsdp2 (dp 2) x pp"):
        stage_trace(spec, setup, family, 4, 4, 0, gpu=gpu)  # the process's first trace pays its warm-up
        times = {}
        for m in (8, 16, 32):
            runs = []
            for _ in range(2):
                forget_traces()  # trace keeps the latest traces: each run here is a new one
                start = time.perf_counter()
                stage_trace(spec, setup, family, m, m, 0, gpu=gpu)
                runs.append(time.perf_counter() - start)
            times[m] = min(runs)
        print(f"  {family}: " + ", ".join(f"M = {m}: {t:.2f} s" for m, t in times.items()) +
              f"; {(times[32] - times[8]) / 24 * 1000:.0f} ms a micro-batch")


def dispatch() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = load_model_spec("llama-2-70b")
    setup = TrainSetup(4, 4096, Precision.BF16, grad_ckpt=True)
    gpu = load_gpu("h100-80gb")
    print("3. FakeTensorMode's dispatch cache over one stage trace, Llama-2-70B TP 4 x PP 16, micro-batch 4")
    layout = _model_parallel(4, 16, None)
    for stage in (0, 1):
        forget_traces()
        FakeTensorMode.cache_clear()
        start = time.perf_counter()
        trace(spec, replace(traced._stage_setup(checked(spec, setup, layout, gpu), layout, stage), steps=2))
        took = time.perf_counter() - start
        info = FakeTensorMode.cache_info()
        print(f"  stage {stage}: {took:.2f} s, {info.hits:,} hits, {info.misses:,} misses, bypasses "
              + ", ".join(f"{reason} {count:,}" for reason, count in sorted(info.bypasses.items(),
                                                                          key=lambda item: -item[1])))


if __name__ == "__main__":
    depth()
    cost()
    dispatch()
