"""Human-readable output: bytes become GiB/MiB only here (STYLE.md rule 1)."""
from __future__ import annotations

import pandas as pd

from llmsim.sim.prediction import Prediction, RankPrediction, verdict_why

GIB = 2**30
MIB = 2**20
# Said under every GPU verdict until GPU runs (tier 4, data/measurements/tier4_*.csv) check the figures
GPU_VALIDATION = ("GPU figures (CUDA's kernels, the caching-allocator model, the CUDA context) checked on one H200 "
                  "(torch 2.11, CUDA 13): 30 single-GPU runs, 7 of them HF Trainer jobs, allocated within 0.32 % "
                  "of what they measured (8 to the byte), reserved and device total within 3.7 %; other GPUs' CUDA context not "
                  "measured: docs/gpu-kit.md")


def human_bytes(n: int) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:,.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:,.2f} MiB"
    return f"{n:,} B"


def layout_text(layout) -> str:
    """"ddp x 8 (pp 2, 1f1b over 4 micro-batches)": the strategy over the world, then what splits each rank."""
    parts = [f"ZeRO-{layout.deepspeed.stage}"] if layout.deepspeed is not None else []
    if layout.deepspeed is not None and (size := layout.deepspeed.autotp_size) > 1:  # the engine's own TP
        parts.append(f"AutoTP {size}: the linear layers sharded by DeepSpeed, ZeRO over dp "
                     f"{layout.world_size // size}")
    if layout.deepspeed is not None and layout.deepspeed.offloads_optimizer:  # the step then runs on the host
        steps = "DeepSpeed's CPU Adam" if layout.deepspeed.optimizer_kind == "cpu_adam" else "AdamW"
        offload = layout.deepspeed.config["zero_optimization"]["offload_optimizer"]
        nvme = offload.get("device") == "nvme"
        swap = (f" (device nvme: sub-groups of 1 MiB or more swapped to {offload.get('nvme_path')} through "
                f"{layout.deepspeed.zero().offload_optimizer.buffer_count} pinned host buffers, the rest held "
                "in host memory)")
        params = layout.deepspeed.config["zero_optimization"].get("offload_param") or {}
        param_swap = (f" (parameters on device nvme: partitions of 1 MiB or more written to {params.get('nvme_path')} "
                      f"at zero.Init through {layout.deepspeed.zero().offload_param.buffer_count} pinned host "
                      "buffers, the trainable ones read back into host memory at initialize up to max_in_cpu ("
                      f"{int(layout.deepspeed.zero().offload_param.max_in_cpu):,} elements), the others read at each "
                      "fetch)" if layout.deepspeed.swaps_params else "")
        parts.append("optimizer" + (" and parameters" if layout.deepspeed.offloads_params else "")
                     + f" offloaded to the CPU, where {steps} steps"
                     + (swap if layout.deepspeed.swaps_optimizer
                        else " (device nvme: ZeRO-1/2 hold it in host memory, nothing swapped)" if nvme else "")
                     + param_swap)
    elif layout.deepspeed is not None and layout.deepspeed.offloads_params:  # the step on the device
        parts.append("parameters offloaded to the CPU")
    if layout.fsdp is not None:  # FSDP2: its wrap, resharding and MixedPrecisionPolicy
        fsdp = layout.fsdp
        wrap = {"layers": "fully_shard per layer", "transformers": "transformers' FSDP plan",
                "accelerate": "accelerate's wrap"}[fsdp.wrap]
        parts.append(f"FSDP2, {wrap}, reshard_after_forward {fsdp.reshard_after_forward}, MixedPrecisionPolicy("
                     f"param {fsdp.param_dtype or 'as loaded'}, reduce {fsdp.reduce_dtype or 'as param'})"
                     + (", CPUOffloadPolicy: shards, gradients and AdamW on the host" if fsdp.offload else "")
                     + (", accelerate's activation checkpointing (checkpoint_wrapper per layer)"
                        if fsdp.activation_checkpointing else "")
                     + (", cpu_ram_efficient_loading: rank 0's state dict broadcast"
                        if fsdp.cpu_ram_efficient_loading else ""))
    if layout.tp > 1:
        parts.append(f"tp {layout.tp}" + (" (ddp as torch's replicate)" if layout.strategy.value == "ddp" else ""))
    if layout.ep > 1:
        parts.append(f"ep {layout.ep}")
    if layout.pp > 1 and layout.deepspeed is not None:  # DeepSpeed's own pipeline engine, ranks stage x dp + replica
        parts.append(f"pp {layout.pp} x dp {layout.dp}, DeepSpeed's pipeline engine (TrainSchedule) over "
                     f"{layout.n_microbatches} micro-batches, rank = stage x {layout.dp} + replica")
    elif layout.pp > 1:
        parts.append(f"pp {layout.pp}, {layout.schedule.value} over {layout.n_microbatches} micro-batches"
                     + (f", {layout.stages_per_rank} stages a rank (rank r: stages r, r + {layout.pp}, ...)"
                        if layout.stages_per_rank > 1 else ""))
    return f"{layout.strategy.value} x {layout.world_size}" + (f" ({', '.join(parts)})" if parts else "")


def offloads(prediction: Prediction) -> bool:
    """Whether the job puts memory on the host (offloaded checkpoint inputs, ZeRO-Offload, FSDP2's
    CPUOffloadPolicy; the HF Trainer's FSDP on a GPU, whose ranks each load the whole model on the host and upcast
    it there before fully_shard copies it across; DeepSpeed's AutoTP, whose ranks each build the whole model on the
    host before the engine shards it): the table then shows each rank's host peak and a node's.
    Otherwise the host holds only a few scalars (AdamW's `step` counters, kept on the CPU for a CUDA parameter unless
    fused or capturable: torch/optim/adam.py `_init_group`), left to `--format json`'s peak_host_bytes."""
    layout, fsdp = prediction.layout, prediction.setup.fsdp
    return (prediction.setup.ckpt_offload or (layout.deepspeed is not None and (layout.deepspeed.offloads_optimizer
                                                                                or layout.deepspeed.offloads_params
                                                                                or layout.deepspeed.autotp_size > 1))
            or (fsdp is not None and (fsdp.offload or fsdp.init == "host")))


def prediction_table(prediction: Prediction, gpus_per_node: int = 8) -> str:
    s = prediction.setup
    on_host = offloads(prediction) and prediction.peak_host_bytes > 0
    ckpt = f"checkpointing every {s.ckpt_every} layer(s)" if s.grad_ckpt else "no checkpointing"
    if s.fsdp is not None and s.fsdp.activation_checkpointing:
        ckpt = "checkpointing every layer (FSDP's activation_checkpointing)"
    if s.ckpt_offload:
        ckpt += " (inputs offloaded to the host)"
    if s.lora_rank:
        ckpt += f", LoRA r={s.lora_rank}"
    width = max(4, 2 * len(str(prediction.ranks[-1].rank)) + 1)
    lines = [f"{prediction.model.name}: micro-batch {s.micro_batch}, seq {s.seq_len}, {s.precision.value}, "
             f"attention {s.attention.value}, {ckpt}, {layout_text(prediction.layout)}, device {s.device.value}",
             _recipe_line(s, prediction.layout.deepspeed), "",
             f"{'rank':>{width}}  {'peak allocated':>16}  {'peak reserved':>16}  {'device total':>16}  "
             + (f"{'host peak':>16}  " if on_host else "") + "peak at",
             ]
    for first, last, r in _rank_groups(prediction.ranks):
        host = f"{human_bytes(r.peak_host_bytes):>16}  " if on_host else ""
        ranks = f"{first}" if first == last else f"{first}-{last}"
        lines.append(f"{ranks:>{width}}  {human_bytes(r.peak_allocated_bytes):>16}  "
                     f"{human_bytes(r.peak_reserved_bytes):>16}  {human_bytes(r.device_total_bytes):>16}  {host}"
                     f"step {r.peak.step + 1} {r.peak.phase}, {r.peak.layer}")
    if on_host:
        per_node = min(gpus_per_node, prediction.layout.world_size)
        lines += ["", f"host memory per node ({per_node} rank(s) per node, --gpus-per-node): "
                      f"{human_bytes(prediction.host_per_node_bytes(gpus_per_node))}, the sum of its ranks' host peaks "
                      "(live tensor bytes; not the pinned pool's rounding)"]
    if prediction.nvme_bytes is not None:
        deepspeed = prediction.layout.deepspeed
        zero = deepspeed.config["zero_optimization"]
        paths = sorted({zero[key]["nvme_path"] for key, on in (("offload_optimizer", deepspeed.swaps_optimizer),
                                                               ("offload_param", deepspeed.swaps_params)) if on})
        what = [text for text, on in (("the swapped sub-groups' fp32 masters and AdamW states, and the gradient "
                                       "partitions written", deepspeed.swaps_optimizer),
                                      ("the parameter partitions written", deepspeed.swaps_params)) if on]
        per_node = [sum(prediction.nvme_bytes[i:i + gpus_per_node])
                    for i in range(0, len(prediction.nvme_bytes), gpus_per_node)]
        lines += ["", f"NVMe under {' and '.join(paths)}: {human_bytes(max(prediction.nvme_bytes))} a rank at most, "
                      f"{human_bytes(max(per_node))} a node ({'; '.join(what)})"]
    lines += _routing_lines(prediction)
    worst = prediction.deciding_rank
    if prediction.gpu is not None:
        lines += ["", f"{prediction.gpu.name} ({human_bytes(prediction.gpu.capacity_bytes)}): "
                      f"{worst.verdict.upper() if worst.verdict != 'fits' else 'fits'}: {verdict_why(prediction)}",
                  f"(needed = what the allocator reserves, or near the card the least it runs on, + CUDA context; "
                  f"--margin sets the margin; kernels traced: {prediction.setup.device.value})", GPU_VALIDATION]
    if worst.peak.phase == "build" and not s.build_bf16 and s.precision.value == "bf16":
        lines += ["", "note: the peak is the fp32 build of the canonical step; --build-dtype bf16 builds the way "
                      "from_pretrained(dtype=torch.bfloat16) loads"]
    lines += ["", f"breakdown at the peak of rank {worst.rank}:"]
    total = worst.peak_allocated_bytes
    for category, nbytes in sorted(worst.peak.breakdown_bytes.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {category:<18} {human_bytes(nbytes):>14}  {100 * nbytes / total:5.1f} %")
    return "\n".join(lines)


def _routing_lines(prediction: Prediction) -> list[str]:
    """Expert parallelism: the routing the table states, and the worst routing's bound beside it."""
    if prediction.layout.ep == 1:
        return []
    if prediction.routing_bound is None:
        return ["", "routing: collapsed (every token's top-k onto one rank's experts, the most rows a rank's experts "
                    "can receive: the bound of any routing, for every rank)"]
    bound = max(prediction.routing_bound, key=lambda r: (r.needed_bytes or 0, r.peak_allocated_bytes))
    verdict = f", needs {human_bytes(bound.needed_bytes)}: {bound.verdict}" if bound.verdict else ""
    return ["", "routing: balanced (each rank's experts receive an equal share of the tokens); the routing decides "
                "how many rows a rank's experts run on",
            f"worst routing (every token's top-k onto one rank's experts; any rank can be that one): peak "
            f"allocated {human_bytes(bound.peak_allocated_bytes)} per rank{verdict}"]


def _rank_groups(ranks: list[RankPrediction]):
    """(first, last, rank) for each run of consecutive ranks whose row would read the same."""
    def row(r):
        return (r.peak_allocated_bytes, r.peak_reserved_bytes, r.device_total_bytes, r.peak_host_bytes,
                r.peak.step, r.peak.phase, r.peak.layer, r.verdict)
    groups = []
    for r in ranks:
        if groups and groups[-1][1] == r.rank - 1 and row(groups[-1][2]) == row(r):
            groups[-1][1] = r.rank
        else:
            groups.append([r.rank, r.rank, r])
    return [tuple(group) for group in groups]


def suggestions_table(advice, gpu) -> str:
    """`predict --suggest`: the changes that fit, cheapest first, each with what the job then needs."""
    if not advice:
        return (f"\nno single change llmsim models makes it fit on {gpu.name}, nor its levers together "
                "(llmsim/app/advice.py lists what is tried)")
    lines = [f"\nwould fit on {gpu.name} (cheapest first; each a full prediction of the changed job):"]
    for s in advice:
        lines.append(f"  {s.change}: needs {human_bytes(s.needed_bytes)}, peak allocated "
                     f"{human_bytes(s.peak_allocated_bytes)} -- {s.cost}")
    return "\n".join(lines)


def _recipe_line(setup, deepspeed=None) -> str:
    from llmsim.inputs.hf import recipe_facts

    f = recipe_facts(setup, deepspeed)
    clip = f", max_grad_norm {f['max_grad_norm']}" if f["max_grad_norm"] is not None else ""
    return (f"recipe {f['recipe']}: weights {f['load_dtype']}, mixed precision {f['mixed_precision']}, optimizer "
            f"{f['optimizer']}, accumulation {f['grad_accum']}{clip}, peft {f['peft']}"
            + (f", quantization {f['quantization']}" if f["quantization"] != "none" else "")
            + (f", loss {f['loss']}" if "loss" in f else "")
            + (f", max_length {f['max_length']}" if "max_length" in f else ""))


def validation_table(results: pd.DataFrame) -> str:
    shown = results.assign(
        measured=results["measured_bytes"].map(human_bytes),
        predicted=results["predicted_bytes"].map(human_bytes),
        error=results["rel_error"].map(lambda e: f"{100 * e:+.3f} %"))
    columns = ["tier", "model", "micro_batch", "seq_len", "precision", "attention", "grad_ckpt", "ckpt_every",
               "lora", "strategy", "world_size", "rank", "measured", "predicted", "error", "ok"]
    bound = results["check"] == "bound" if "check" in results else pd.Series(False, index=results.index)
    if bound.any():  # expert-parallel ranks checked against the worst routing's bound: "predicted" is the bound
        columns.insert(-1, "check")
    exact = results[~bound]
    worst = exact["rel_error"].abs().max() if len(exact) else 0.0
    summary = (f"{len(results)} rows, {int((~results['ok']).sum())} outside tolerance, "
               f"worst |error| {100 * worst:.3f} %")
    if bound.any():
        summary += (f" over {len(exact)} exact rows; {int(bound.sum())} bound rows (the router's own routing, or a "
                    f"rank the forced routing leaves without tokens) at or under the worst routing's prediction, "
                    f"{100 * results[bound]['rel_error'].min():.2f} % the closest")
    host = results[results["measured_host_bytes"] > 0] if len(results) else results
    if len(host):  # rows with offloaded activations: their host peak is checked too
        summary += (f"; host peak of {len(host)} offload rows: worst |error| "
                    f"{100 * host['host_rel_error'].abs().max():.3f} %")
    other = results["other_releases"].fillna("") if "other_releases" in results else pd.Series("", index=results.index)
    if (other != "").any():  # a library's new release can change what a run allocates: say which rows it concerns
        releases = sorted({part for text in other[other != ""] for part in text.split(", ")})
        summary += (f"\n{int((other != '').sum())} rows were measured under other releases than this run's: "
                    f"{'; '.join(releases)}; their error includes any change between the releases")
    return shown[columns].to_string(index=False) + "\n" + summary
