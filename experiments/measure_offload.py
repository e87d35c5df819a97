"""DeepSpeed ZeRO-Offload (stages 1, 2 and 3, `offload_optimizer: {"device": "cpu"}`, and ZeRO-3's
`offload_param`, the client torch.optim.AdamW) measured on this CPU: `deepspeed.initialize`, `engine.backward`,
`engine.step` under torchrun and gloo, the storage tracker in every rank, and the host side told apart from the
device's as a GPU run holds them (llmsim/model/host_memory.py).

Each run is predicted first (`llmsim.sim.pipeline.predict`, printed before the run starts), then measured; the rows
go to data/measurements/tier2_offload_cpu.csv (one per rank, device and host peaks). Of the ZeRO-1/2 RUNS the first
four were measured while the model was written (llmsim/sim/strategies/zero12.py), the rest predicted before they
were first measured (the last two, torch's fused AdamW, added after the Trainer's offload runs); of the ZeRO-3 ones
the first of each kind (optimizer offload, parameter offload) was measured while llmsim/sim/strategies/zero3.py was
written and the rest predicted first (the comments say which missed, and what was modelled then). Every row is
measured with gloo's worker thread settled after each of DeepSpeed's collectives (`ds_gloo_settle`), which is what
NCCL does at the wait and what the prediction keeps; `--both-ways` then re-runs UNSETTLED several times with gloo's
own timing and prints the peaks beside the settled ones (not kept). A run refused since it was measured is skipped.
Run: python experiments/measure_offload.py [--only I ...] [--both-ways] (about 12 minutes on 2 cores);
experiments/measure_offload.out holds the outputs that made the rows, in order: the ZeRO-1/2 runs, then the ZeRO-3
ones by `--only 23 ... 34`, `--only 35 ... 44`, the default-bucket run's repeats, `--only 45 46 47` and
`--only 48 49`, then DeepSpeed's CPU Adam by `--only 50 ... 61`
and round_robin_gradients by `--only 62 63 64 65`, then "device": "nvme" under ZeRO-1/2 by `--only 66 ... 70`,
then ZeRO-3 on one rank and ZeRO-3's optimizer swapper by `--only 71 ... 87` and `--only 85 85` (the rows of runs 74
and 85 left out of the CSV, see RUNS), then ZeRO-3's parameter swapper by `--only 88 ... 93`, `--only 94`,
`--only 95 ... 98` and `--only 99` (twice: the first run's rows are in data/measurements/pending/). The swappers'
files go to SWAP_DIR, emptied before each run.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from llmsim.enums import Attention
from llmsim.errors import InputError
from llmsim.inputs.dsconfig import ds_setup
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.launch import LaunchFailure
from llmsim.measure.runs import MEASUREMENTS_DIR, append_rows, measure_distributed
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy

OFFLOAD_CSV = MEASUREMENTS_DIR / "tier2_offload_cpu.csv"
SHAPES = {  # (hidden, layers, vocab, heads)
    "llama-2-7b": (128, 3, 2000, 4), "gpt2": (128, 3, 1024, 4), "mistral-7b": (128, 3, 1500, 4),
    "pythia-160m": (96, 3, 1536, 4), "qwen2.5-0.5b": (112, 3, 3000, 7),
}
B = 300_000  # reduce_bucket_size, elements: a few buckets per backward (the embedding, 256,000, fits one)
HOST_PARAMS = {"device": "cpu", "pin_memory": True}  # ZeRO-3's offload_param, as LLaMA-Factory writes it
HOST_PARAMS_UNPINNED = {"device": "cpu", "pin_memory": False}


NVME = {"device": "nvme", "nvme_path": "/local_nvme"}  # DeepSpeed's tutorials' path; ZeRO-1/2 never touch it
SWAP_DIR = "/tmp/llmsim-nvme"  # ZeRO-3's swapper writes its files there (emptied before each run)
BIG = (128, 3, 4099, 4)  # the embedding's and LM head's partitions over 2 ranks: 262,336 fp32, over 1 MiB and not a
# multiple of the 256-element I/O alignment (the swapper writes 262,144 and keeps the rest in memory)


def swapped(stage: int, bf16: bool, pin: bool = True, ga: int = 1, buffers: dict | None = None,
            aio: dict | None = None, **zero) -> dict:
    """ZeRO-3's optimizer offloaded to "nvme" (ZeRO-Infinity's swapper) under SWAP_DIR, otherwise `offload`'s."""
    config = offload(stage, bf16, pin, ga, **zero)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": SWAP_DIR, "pin_memory": pin,
                                                        **(buffers or {})}
    if aio:
        config["aio"] = aio
    return config


def offload(stage: int, bf16: bool, pin: bool = True, ga: int = 1, clip: float = 1.0, nvme: bool = False,
            **zero) -> dict:
    """A DeepSpeed JSON as LLaMA-Factory's and axolotl's offload configs write it, with a client optimizer
    (`nvme`: the optimizer offloaded to "nvme", which ZeRO-1/2 run as "cpu")."""
    device = NVME if nvme else {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, "gradient_clipping": clip,
              "zero_optimization": {"stage": stage, "offload_optimizer": {**device, "pin_memory": pin},
                                    "reduce_bucket_size": B, **zero},
              "zero_force_ds_cpu_optimizer": False}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def params_only(config: dict) -> dict:
    """The same JSON with ZeRO-3's parameters offloaded and the optimizer not (no offload_optimizer: the fp32 master,
    its gradients and AdamW on the device)."""
    zero = {key: value for key, value in config["zero_optimization"].items() if key != "offload_optimizer"}
    return {**{key: value for key, value in config.items() if key != "zero_force_ds_cpu_optimizer"},
            "zero_optimization": zero}


def cpu_adam(config: dict, kind: str = "AdamW") -> dict:
    """The same JSON with DeepSpeed's own optimizer, an "optimizer" section (as DeepSpeed's offload tutorials write
    it): with the optimizer offloaded it builds DeepSpeedCPUAdam (engine.get_optimizer_configuration)."""
    config = {key: value for key, value in config.items() if key != "zero_force_ds_cpu_optimizer"}
    return {**config, "optimizer": {"type": kind, "params": {"lr": 1e-4, "weight_decay": 0.01}}}


def swapped_params(config: dict, buffer_size: int, pin: bool = True, **param) -> dict:
    """The same JSON with ZeRO-3's parameters offloaded to "nvme" (the parameter swapper) under SWAP_DIR, its pool
    `buffer_size` elements a buffer (DeepSpeed's default, 1e8, would be 2 GB of page-locked memory a rank here)."""
    zero = {**config["zero_optimization"], "offload_param": {"device": "nvme", "nvme_path": SWAP_DIR,
                                                             "pin_memory": pin, "buffer_size": buffer_size, **param}}
    return {**config, "zero_optimization": zero}


# (model, world size, DeepSpeed JSON, grad_ckpt, seq_len, TrainSetup fields)
RUNS = [
    ("llama-2-7b", 2, offload(2, False, pin=False), False, 64, {}),
    ("llama-2-7b", 2, offload(2, True), False, 64, {}),
    ("llama-2-7b", 2, offload(1, False), False, 64, {}),
    ("llama-2-7b", 2, offload(2, False, reduce_bucket_size=500_000_000), False, 64, {}),  # DeepSpeed's default
    # predicted before measured
    ("llama-2-7b", 2, offload(1, True, pin=False), False, 64, {}),
    ("llama-2-7b", 2, offload(2, False, pin=False, overlap_comm=True), False, 64, {}),
    ("llama-2-7b", 2, offload(1, True, overlap_comm=True), True, 64, {}),
    ("llama-2-7b", 2, offload(2, True, clip=0.0), True, 64, {}),
    ("llama-2-7b", 2, offload(2, False, reduce_bucket_size=200_000), False, 64, {}),  # embedding, head: extra large
    ("llama-2-7b", 2, offload(1, True, reduce_bucket_size=200_000), False, 64, {}),
    ("llama-2-7b", 2, offload(2, True, reduce_bucket_size=128 * 128), True, 64, {}),  # "auto": hidden², all large
    ("llama-2-7b", 3, offload(2, False), False, 64, {}),  # three partitions, padded
    ("mistral-7b", 4, offload(2, True, overlap_comm=True), True, 64, {}),
    ("gpt2", 2, offload(2, False), False, 64, {}),  # tied embeddings
    ("qwen2.5-0.5b", 2, offload(1, True), True, 64, {}),  # q/k/v biases, tied
    ("pythia-160m", 3, offload(1, False, pin=False, overlap_comm=True), False, 64, {}),
    # gradient accumulation: stage 2 accumulates on the host, stage 1 in the device gradients
    ("llama-2-7b", 2, offload(2, False, ga=2), False, 64, {"grad_accum": 2}),
    ("llama-2-7b", 2, offload(1, True, ga=2), False, 64, {"grad_accum": 2}),
    ("mistral-7b", 2, offload(2, True, ga=3, overlap_comm=True), True, 64, {"grad_accum": 3}),
    # LoRA: the adapters alone flattened, partitioned and offloaded
    ("llama-2-7b", 2, offload(2, True), False, 64, {"lora_rank": 8}),
    ("mistral-7b", 2, offload(1, False), True, 64, {"lora_rank": 16}),
    # torch's fused AdamW on the host partition (fused=True: no temporaries, `step` beside the parameters)
    ("llama-2-7b", 2, offload(2, True), False, 64, {"fused": True}),
    ("gpt2", 2, offload(1, False, ga=2), True, 64, {"fused": True, "grad_accum": 2}),
    # ZeRO-3 with the optimizer offloaded (zero.Init through HfDeepSpeedConfig); the first measured while the model
    # was written (llmsim/sim/strategies/zero3.py), the rest predicted before they were first measured
    ("llama-2-7b", 2, offload(3, False, pin=False), False, 64, {}),
    ("llama-2-7b", 2, offload(3, True), False, 64, {}),
    ("llama-2-7b", 2, offload(3, True, pin=False, ga=2), False, 64, {"grad_accum": 2}),
    ("llama-2-7b", 2, offload(3, False, sub_group_size=30_000), True, 64, {}),  # several sub-groups
    ("mistral-7b", 3, offload(3, True), False, 64, {}),  # three partitions: the last rank's padding
    ("gpt2", 2, offload(3, False), False, 64, {}),  # tied embeddings
    ("qwen2.5-0.5b", 4, offload(3, True, overlap_comm=True), True, 64, {}),
    ("llama-2-7b", 2, offload(3, True), False, 64, {"lora_rank": 8}),
    ("llama-2-7b", 2, offload(3, False), False, 64, {"fused": True}),
    ("pythia-160m", 2, offload(3, True, ga=3, overlap_comm=True), True, 64, {"grad_accum": 3}),
    ("llama-2-7b", 2, offload(3, True, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=20_000),
     False, 64, {}),
    ("mistral-7b", 2, offload(3, False, reduce_bucket_size=500_000_000), True, 64, {}),  # DeepSpeed's default bucket
    ("qwen2.5-0.5b", 5, offload(3, True), False, 64, {}),  # the last rank's k/v bias partitions are all padding
    # ZeRO-3 with the parameters offloaded too (LLaMA-Factory's ds_z3_offload_config.json); the first measured while
    # the model was written, the rest predicted before they were first measured
    ("llama-2-7b", 2, offload(3, False, pin=False, offload_param=HOST_PARAMS_UNPINNED), False, 64, {}),
    ("llama-2-7b", 2, offload(3, True, offload_param=HOST_PARAMS), False, 64, {}),
    ("llama-2-7b", 2, offload(3, True, ga=2, offload_param=HOST_PARAMS), True, 64, {"grad_accum": 2}),
    ("mistral-7b", 3, offload(3, True, offload_param=HOST_PARAMS, stage3_prefetch_bucket_size=20_000), True, 64, {}),
    ("gpt2", 2, offload(3, False, offload_param=HOST_PARAMS, overlap_comm=True), False, 64, {}),
    ("qwen2.5-0.5b", 4, offload(3, True, offload_param=HOST_PARAMS_UNPINNED, sub_group_size=40_000), True, 64, {}),
    # LoRA: predicted first 5.3 % over, until the model had DeepSpeed's host buffer cast the fp32 adapters to bf16
    ("llama-2-7b", 2, offload(3, True, offload_param=HOST_PARAMS), False, 64, {"lora_rank": 8}),
    ("pythia-160m", 2, offload(3, False, offload_param=HOST_PARAMS, stage3_param_persistence_threshold=0), False,
     64, {"fused": True}),
    ("llama-2-7b", 3, offload(3, True, ga=3, offload_param=HOST_PARAMS, stage3_max_live_parameters=30_000), False,
     64, {"grad_accum": 3}),
    # LoRA with offload_param, predicted before measured once the adapters' cast was modelled
    ("mistral-7b", 2, offload(3, True, offload_param=HOST_PARAMS), True, 64, {"lora_rank": 16}),
    ("qwen2.5-0.5b", 3, offload(3, True, offload_param=HOST_PARAMS_UNPINNED), True, 64, {"lora_rank": 8}),
    ("gpt2", 2, offload(3, False, offload_param=HOST_PARAMS), False, 64, {"lora_rank": 8}),  # fp32: no cast
    # the two tied models above were 3.4 % and 15.9 % under on the host until the LM head's own partition was
    # modelled (zero.Init partitions it before tie_weights replaces it): two more, predicted before measured
    ("qwen2.5-0.5b", 2, offload(3, False, offload_param=HOST_PARAMS), False, 64, {"lora_rank": 16}),
    ("gpt2", 3, offload(3, True, offload_param=HOST_PARAMS_UNPINNED), True, 64, {"lora_rank": 8}),
    # DeepSpeed's CPU Adam (an "optimizer" section), every one predicted before it was first measured
    ("llama-2-7b", 2, cpu_adam(offload(2, False, pin=False)), False, 64, {}),
    ("llama-2-7b", 2, cpu_adam(offload(2, True)), False, 64, {}),
    ("llama-2-7b", 2, cpu_adam(offload(1, True, overlap_comm=True)), True, 64, {}),
    ("mistral-7b", 3, cpu_adam(offload(2, True, ga=2)), False, 64, {"grad_accum": 2}),
    ("gpt2", 2, cpu_adam(offload(1, False)), False, 64, {}),  # tied embeddings
    ("qwen2.5-0.5b", 2, cpu_adam(offload(2, True)), True, 64, {"lora_rank": 8}),
    ("pythia-160m", 2, cpu_adam(offload(2, False), kind="Adam"), False, 64, {}),
    ("llama-2-7b", 2, cpu_adam(offload(3, False)), False, 64, {}),
    ("llama-2-7b", 2, cpu_adam(offload(3, True, sub_group_size=30_000)), True, 64, {}),  # several sub-groups
    ("mistral-7b", 3, cpu_adam(offload(3, True, offload_param=HOST_PARAMS)), False, 64, {}),
    ("gpt2", 2, cpu_adam(offload(3, False, ga=2, offload_param=HOST_PARAMS)), True, 64, {"grad_accum": 2}),
    ("qwen2.5-0.5b", 4, cpu_adam(offload(3, True, offload_param=HOST_PARAMS_UNPINNED)), False, 64, {"lora_rank": 8}),
    # round_robin_gradients (LLaMA-Factory's ZeRO-2 configs set it): the parameters flattened round-robin over the
    # ranks; predicted before measured
    ("llama-2-7b", 2, cpu_adam(offload(2, True, round_robin_gradients=True)), False, 64, {}),
    ("mistral-7b", 3, offload(2, False, round_robin_gradients=True), True, 64, {}),
    ("qwen2.5-0.5b", 4, cpu_adam(offload(1, True, round_robin_gradients=True, overlap_comm=True)), False, 64, {}),
    ("gpt2", 3, cpu_adam(offload(2, True, ga=2, round_robin_gradients=True)), False, 64, {"grad_accum": 2}),
    # "device": "nvme" under ZeRO-1/2, which DeepSpeed runs as "cpu" (stage_1_and_2.py: cpu_offload for any device
    # but none; no swapper, nothing written to nvme_path): predicted before measured
    ("llama-2-7b", 2, offload(2, True, nvme=True), False, 64, {}),
    ("mistral-7b", 2, offload(1, False, nvme=True, overlap_comm=True), True, 64, {}),
    ("qwen2.5-0.5b", 3, cpu_adam(offload(2, True, nvme=True)), False, 64, {}),
    ("gpt2", 2, offload(2, False, pin=False, ga=2, nvme=True), False, 64, {"grad_accum": 2}),
    ("llama-2-7b", 2, offload(1, True, nvme=True), True, 64, {"lora_rank": 8}),
    # ZeRO-3 on one rank, where DeepSpeed gathers nothing (`_no_gather_coalesced`): the first two were measured
    # when the walk was mended (before, optimizer offload was predicted 3,399,152 B over), the rest predicted first
    ("llama-2-7b", 1, offload(3, False), False, 64, {}),
    ("llama-2-7b", 1, offload(3, True, offload_param=HOST_PARAMS), True, 64, {}),
    ("mistral-7b", 1, cpu_adam(offload(3, True)), False, 64, {}),
    # left out of the CSV: host 524,284 B over (1.9 %). The tied LM head's own partition, which zero.Init made before
    # `tie_weights` replaced the parameter (512 KiB on the host under parameter offload), lives until Python's cyclic
    # collector runs: a ZeRO-3 parameter is in a reference cycle with its own method closures (DeepSpeed says so,
    # engine.py), and with parameter offload nothing calls gc.collect() (without it `defragment` does, at
    # initialize). Here it lived to the second step's forward; the walk frees it when it is replaced. The same run
    # on 2 ranks (not kept) was 262,140 B over, freed in the first step; the committed two-rank tied runs were
    # collected before their host peak. When the collector runs is not modelled (docs/deepspeed-memory.md)
    ("gpt2", 1, offload(3, False, ga=2, offload_param=HOST_PARAMS_UNPINNED), False, 64, {"grad_accum": 2}),
    # ZeRO-3's optimizer swapped to "nvme" (ZeRO-Infinity): the first eight measured while the swapper was modelled
    # in llmsim/sim/strategies/zero3.py (all eight within the CPU-offload rows' residual of the same shape: 8 B
    # device in fp32, 72-144 B in bf16, host to the byte), the rest predicted before measured
    ("llama-2-7b", 2, swapped(3, False), False, 64, {}),
    ("llama-2-7b", 2, swapped(3, True), False, 64, {}),
    ("llama-2-7b", 1, swapped(3, False, sub_group_size=300_000), False, 64, {"shape": BIG}),
    ("llama-2-7b", 2, cpu_adam(swapped(3, False)), False, 64, {}),
    ("llama-2-7b", 2, swapped(3, False), False, 64, {"shape": BIG}),  # gradients written, remainders kept
    ("llama-2-7b", 2, swapped(3, True, ga=2, sub_group_size=300_000), True, 64, {"shape": BIG, "grad_accum": 2}),
    ("llama-2-7b", 3, swapped(3, False, buffers={"buffer_count": 5},
                              aio={"block_size": 2097152, "intra_op_parallelism": 2}), False, 64,
     {"shape": (128, 3, 8000, 4)}),
    ("llama-2-7b", 2, swapped(3, True, ga=2), False, 8, {"shape": (256, 3, 8001, 4), "grad_accum": 2}),
    ("qwen2.5-0.5b", 3, cpu_adam(swapped(3, True, sub_group_size=200_000)), True, 64, {"shape": (112, 3, 9000, 7)}),
    ("mistral-7b", 2, swapped(3, False, offload_param=HOST_PARAMS), False, 64, {"shape": (128, 3, 6000, 4)}),
    # left out of the CSV: measured four times, each time one or both ranks 2,665,004 B over on the device, in the
    # tied embedding's reduction (a 2,304,000 B partition-sized storage alive one collective longer), the others to
    # 8 B; its CPU-offload twin does the same (1,909,572 B over in one run of two): gloo's timing, not the swapper
    ("gpt2", 2, swapped(3, False, pin=False, ga=2), True, 64, {"shape": (128, 3, 9000, 4), "grad_accum": 2}),
    ("pythia-160m", 4, swapped(3, True, buffers={"buffer_count": 6}), False, 32, {"shape": (96, 3, 12000, 4)}),
    ("llama-2-7b", 2, swapped(3, True, sub_group_size=100_000), True, 64, {"shape": BIG, "lora_rank": 8}),
    # ZeRO-3's parameters swapped to "nvme" (the parameter swapper, all of them read back into the flat host buffer
    # at initialize): the first measured while it was modelled, the rest predicted before measured
    ("llama-2-7b", 2, swapped_params(offload(3, False), 300_000), False, 64, {"shape": BIG}),
    ("llama-2-7b", 2, swapped_params(offload(3, True), 600_000), True, 64, {"shape": (128, 3, 9000, 4)}),
    ("llama-2-7b", 2, swapped_params(swapped(3, False), 300_000, buffer_count=2), False, 64, {"shape": BIG}),
    ("gpt2", 2, swapped_params(offload(3, False, ga=2), 600_000, pin=False), True, 64,
     {"shape": (128, 3, 9000, 4), "grad_accum": 2}),
    ("qwen2.5-0.5b", 1, cpu_adam(swapped_params(offload(3, True), 1_100_000)), False, 64,
     {"shape": (112, 3, 9000, 7)}),
    ("mistral-7b", 3, swapped_params(swapped(3, True, sub_group_size=200_000), 400_000,
                                     max_in_cpu=2_000_000), False, 64, {"shape": (128, 3, 9000, 4)}),
    # a pool larger than the rest of the host's memory: the host peak is zero.Init's, while the pool's torch.empty
    # and its page-locked replacement both live
    ("llama-2-7b", 2, swapped_params(offload(3, False), 3_000_000), False, 64, {"shape": BIG}),
    # LoRA with the parameters to "nvme": the frozen base's large partitions stay in their files and are read into the
    # pool's slots at each fetch; DeepSpeed's nvme prefetch fails there (experiments/explore_param_swap_fetch.out),
    # so stage3_prefetch_bucket_size 0. The first measured while it was modelled, the rest predicted first
    ("llama-2-7b", 2, swapped_params(offload(3, False, stage3_prefetch_bucket_size=0), 300_000), False, 64,
     {"shape": BIG, "lora_rank": 8}),
    ("llama-2-7b", 2, swapped_params(offload(3, True, stage3_prefetch_bucket_size=0), 600_000), True, 64,
     {"shape": (128, 3, 9000, 4), "lora_rank": 8}),
    ("gpt2", 2, swapped_params(offload(3, False, ga=2, stage3_prefetch_bucket_size=0), 600_000, pin=False,
                               buffer_count=2), True, 64,
     {"shape": (128, 3, 9000, 4), "grad_accum": 2, "lora_rank": 8}),
    ("qwen2.5-0.5b", 1, cpu_adam(swapped_params(offload(3, True, stage3_prefetch_bucket_size=0), 1_100_000)), False,
     64, {"shape": (112, 3, 9000, 7), "lora_rank": 8}),
    # the layers' frozen partitions swapped too, each holding its slot from its forward to its backward: 6 slots at
    # most, DeepSpeed's default 5 fail (llmsim refuses it: experiments/explore_param_swap_fetch.out)
    ("llama-2-7b", 2, swapped_params(offload(3, False, stage3_prefetch_bucket_size=0), 400_000, buffer_count=6),
     False, 64, {"shape": (512, 2, 1000, 8), "lora_rank": 8}),
    # trainable sub-groups past offload_param.max_in_cpu: their partitions of 1 MiB or more stay in their files, are
    # read into the pool's slots at each fetch, into an unpinned fp32 master at initialize and written back from it
    # at each step through `reserve_partitioned_swap_space`'s buffer (stage3_prefetch_bucket_size 0: DeepSpeed fails
    # with prefetching, experiments/explore_param_swap_fetch.out). The first two measured (in that study) before the
    # model was written, the rest predicted before measured
    ("llama-2-7b", 2, swapped_params(offload(3, False, stage3_prefetch_bucket_size=0), 300_000, max_in_cpu=0), False,
     64, {"shape": BIG}),
    ("llama-2-7b", 2, swapped_params(offload(3, False, stage3_prefetch_bucket_size=0), 300_000, max_in_cpu=300_000),
     False, 64, {"shape": BIG}),
    ("llama-2-7b", 2, swapped_params(offload(3, True, stage3_prefetch_bucket_size=0), 600_000, max_in_cpu=0), True,
     64, {"shape": (128, 3, 9000, 4)}),
    ("llama-2-7b", 2, swapped_params(offload(3, False, stage3_prefetch_bucket_size=0, sub_group_size=200_000),
                                     300_000, max_in_cpu=400_000), False, 64, {"shape": BIG}),
    ("llama-2-7b", 2, swapped_params(swapped(3, False, stage3_prefetch_bucket_size=0, sub_group_size=300_000),
                                     300_000, max_in_cpu=100_000), False, 64, {"shape": BIG}),
    ("gpt2", 2, swapped_params(offload(3, False, ga=2, stage3_prefetch_bucket_size=0), 600_000, pin=False,
                               max_in_cpu=0), True, 64, {"shape": (128, 3, 9000, 4), "grad_accum": 2}),
    ("qwen2.5-0.5b", 1, cpu_adam(swapped_params(offload(3, True, stage3_prefetch_bucket_size=0), 1_100_000,
                                                max_in_cpu=500_000)), False, 64, {"shape": (112, 3, 9000, 7)}),
    ("mistral-7b", 3, swapped_params(swapped(3, True, stage3_prefetch_bucket_size=0, sub_group_size=200_000),
                                     400_000, max_in_cpu=0), False, 64, {"shape": (128, 3, 9000, 4)}),
    ("llama-2-7b", 2, swapped_params(offload(3, False, stage3_prefetch_bucket_size=0), 400_000, buffer_count=6,
                                     max_in_cpu=0), False, 64, {"shape": (512, 2, 1000, 8)}),
    # ZeRO-3's parameters offloaded without the optimizer (bf16: llmsim refuses fp32 until a run of it is measured):
    # the partitions on the host, the fp32 master, gradients and AdamW on the device, each step's
    # update copied back into the host buffer. The first measured while it was modelled, the rest predicted first
    ("llama-2-7b", 2, params_only(offload(3, True, offload_param=HOST_PARAMS)), False, 64, {}),
    ("mistral-7b", 3, params_only(offload(3, True, ga=2, offload_param=HOST_PARAMS_UNPINNED)), True, 64,
     {"grad_accum": 2}),
    ("qwen2.5-0.5b", 2, params_only(offload(3, True, offload_param=HOST_PARAMS)), False, 64, {"lora_rank": 8}),
    ("gpt2", 2, params_only(offload(3, True, offload_param=HOST_PARAMS, sub_group_size=40_000)), True, 64, {}),
    ("llama-2-7b", 1, params_only(offload(3, True, offload_param=HOST_PARAMS)), True, 64, {}),
    ("pythia-160m", 4, params_only(offload(3, True, offload_param=HOST_PARAMS, overlap_comm=True,
                                           stage3_prefetch_bucket_size=20_000)), False, 64, {}),
]


UNSETTLED = [3, 0, 12]  # one bucket holding every gradient; a few buckets; four ranks
REPEATS = 3


def inputs(run: tuple):
    model, world, config, ckpt, seq, fields = run
    fields = dict(fields)
    shape = fields.pop("shape", SHAPES[model])  # (hidden, layers, vocab, heads)
    spec = load_model_spec(model, shrink(model, *shape))
    deepspeed = ds_setup(config, world, shape[0], None, None, fields.get("grad_accum"))
    setup = TrainSetup(config["train_micro_batch_size_per_gpu"], seq, deepspeed.precision, Attention.SDPA, ckpt,
                       **fields)
    return spec, setup, Layout(Strategy.DEEPSPEED, world, deepspeed=deepspeed)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=OFFLOAD_CSV)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--only", type=int, nargs="*", help="indices into RUNS (default: all)")
    parser.add_argument("--both-ways", action="store_true", help="then UNSETTLED again with gloo's own timing")
    args = parser.parse_args()
    failures, settled = 0, {}
    for index in (args.only if args.only is not None else range(len(RUNS))):
        spec, setup, layout = inputs(RUNS[index])
        try:
            predicted = predict(spec, setup, layout)
        except InputError as exc:  # measured once and refused since (see RUNS)
            print(index, RUNS[index], "refused:", exc, flush=True)
            continue
        before = [(r.peak_allocated_bytes, r.peak_host_bytes) for r in predicted.ranks]
        print(index, RUNS[index], "predicted (device, host) per rank:", before, flush=True)
        shutil.rmtree(SWAP_DIR, ignore_errors=True)
        try:
            rows = measure_distributed(spec, setup, layout, args.timeout, ds_gloo_settle=True)
        except LaunchFailure as exc:
            failures += 1
            print(f"FAILED {RUNS[index]}: {exc}", flush=True)
            continue
        append_rows(rows, args.out)
        measured = [(r["peak_allocated_bytes"], r["peak_host_bytes"]) for r in rows]
        diffs = [(m[0] - p[0], m[1] - p[1]) for m, p in zip(measured, before)]
        print(index, "measured:", measured, "measured - predicted:", diffs, rows[0]["wall_s"], "s", flush=True)
        settled[index] = [m[0] for m in measured]
    if args.both_ways:
        print("gloo's own timing (no settle) against the settled rows, device peak per rank:")
        for index in UNSETTLED:
            spec, setup, layout = inputs(RUNS[index])
            for _ in range(REPEATS):
                rows = measure_distributed(spec, setup, layout, args.timeout)
                print(index, "settled", settled.get(index), "unsettled",
                      [r["peak_allocated_bytes"] for r in rows], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
