"""Where ZeRO-3's parameter swapper swaps at fetch time (what llmsim refuses: docs/nvme-offload.md, section 0b), does
DeepSpeed 0.19.8 run? Each case measured through llmsim's measured-run path (deepspeed.initialize, torchrun, gloo,
2 ranks, Llama shape (128, 3, 4099, 4): the embedding's and LM head's fp32 partitions over 1 MiB), the parameters
to "nvme" with buffer_size 300,000 and the optimizer to "cpu":
- past: max_in_cpu 0 (every trainable sub-group stays in its files);
- half: max_in_cpu 300,000 (the later sub-groups do);
- lora: LoRA r 8 (the frozen base's large partitions do);
each with DeepSpeed's default prefetch and with stage3_prefetch_bucket_size 0 ("nopf"); then LoRA without prefetch
on a shape whose layers' frozen partitions are over 1 MiB too ((512, 2, 1000, 8), buffer_size 400,000), where a
partition keeps its slot from its forward to its backward (stage3_max_reuse_distance): with DeepSpeed's 5 slots
("slots-5") llmsim refuses and DeepSpeed fails, with 6 ("slots-6") both run; predicted, then measured.
Run: python experiments/explore_param_swap_fetch.py (about 2 minutes); output:
experiments/explore_param_swap_fetch.out."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from measure_offload import BIG, inputs, offload, swapped_params  # noqa: E402

from llmsim.errors import InputError  # noqa: E402
from llmsim.measure.launch import LaunchFailure  # noqa: E402
from llmsim.measure.runs import measure_distributed  # noqa: E402
from llmsim.sim.pipeline import predict  # noqa: E402

CASES = {"past": ({"max_in_cpu": 0}, {}), "half": ({"max_in_cpu": 300_000}, {}), "lora": ({}, {"lora_rank": 8})}


def main() -> int:
    runs = [(f"{name}{'' if prefetch else '-nopf'}", {} if prefetch else {"stage3_prefetch_bucket_size": 0}, param,
             fields) for name, (param, fields) in CASES.items() for prefetch in (True, False)]
    runs += [(f"slots-{count}", {"stage3_prefetch_bucket_size": 0}, {"buffer_count": count},
              {"lora_rank": 8, "shape": (512, 2, 1000, 8)}) for count in (5, 6)]
    for label, zero, param, fields in runs:
        config = swapped_params(offload(3, False, **zero), 400_000 if label.startswith("slots") else 300_000, **param)
        spec, setup, layout = inputs(("llama-2-7b", 2, config, False, 64, {"shape": BIG, **fields}))
        if label.startswith("slots"):
            try:
                print(label, "llmsim predicts (device, host) per rank:",
                      [(r.peak_allocated_bytes, r.peak_host_bytes) for r in predict(spec, setup, layout).ranks],
                      flush=True)
            except InputError as exc:
                print(label, "llmsim refuses:", exc, flush=True)
        try:
            rows = measure_distributed(spec, setup, layout, timeout_s=300, ds_gloo_settle=True)
            print(label, "completed; (device, host) peak per rank:",
                  [(r["peak_allocated_bytes"], r["peak_host_bytes"]) for r in rows], flush=True)
        except LaunchFailure as exc:
            print(label, "failed:", str(exc).splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
