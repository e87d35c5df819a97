"""Measured truth: run the canonical step for real and record what the storage tracker saw (tier 1).

Each run becomes one CSV row per rank in data/measurements/, holding every column needed to re-predict
it (model, config overrides, the setup) and the environment that produced it.
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import tempfile
import time
from importlib import metadata
from pathlib import Path

import pandas as pd

from llmsim.enums import Loss, Optimizer, Precision, Recipe
from llmsim.errors import InputError
from llmsim.model.losses import check_loss
from llmsim.measure.launch import DEFAULT_TIMEOUT_S, build_op, run_ranks, torchrun
from llmsim.model.offload import host_peak_bytes, split_host
from llmsim.sim.peaks import replay
from llmsim.inputs.spec import ModelSpec, TrainSetup, check_fits_positions, resolve_attention
from llmsim.model.step import run_canonical_step
from llmsim.sim.strategies import Layout, Strategy, check_supported
from llmsim.model.pipelining import check_pipeline
from llmsim.model.quantized import check_quantized
from llmsim.model.tensor_parallel import check_expert_parallel, check_tensor_parallel
from llmsim.model.trace import model_builder, run_fake
from llmsim.model.trainer_recipe import own_bitsandbytes_overrides
from llmsim.model.tracker import StorageTracker

MEASUREMENTS_DIR = Path(__file__).resolve().parents[2] / "data" / "measurements"
TIER1_CSV = MEASUREMENTS_DIR / "tier1_cpu.csv"
TIER3_CSV = MEASUREMENTS_DIR / "tier3_fake_fullsize.csv"
TIER2_CSV = MEASUREMENTS_DIR / "tier2_cpu.csv"
MEASURED_DEFAULT_CSV = Path("llmsim-measurements.csv")  # `llmsim measure`'s rows, where the user runs llmsim


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def environment() -> dict[str, str]:
    return {"torch": _version("torch"), "transformers": _version("transformers"),
            "deepspeed": _version("deepspeed"), "python": platform.python_version(),
            "machine": f"{platform.machine()} {platform.system()}".strip()}


def library_versions() -> dict[str, str]:
    """The releases of the libraries a Trainer job runs beside torch and transformers ("" where one is missing)."""
    return {"peft": _version("peft"), "accelerate": _version("accelerate"), "bitsandbytes": _version("bitsandbytes")}


def setup_columns(spec: ModelSpec, setup: TrainSetup) -> dict:
    return {"model": spec.name, "overrides": json.dumps(dict(spec.overrides), sort_keys=True),
            "micro_batch": setup.micro_batch, "seq_len": setup.seq_len, "precision": setup.precision.value,
            "attention": setup.attention.value, "grad_ckpt": setup.grad_ckpt, "ckpt_every": setup.ckpt_every,
            "steps": setup.steps, "optimizer": setup.optimizer.value, "foreach": setup.foreach,
            "build_bf16": setup.build_bf16, "lora_rank": setup.lora_rank, "lora_alpha": setup.lora_alpha,
            "lora_targets": ",".join(setup.lora_targets) if setup.lora_targets else "",
            "grad_accum": setup.grad_accum, "quant": setup.quant or "", "double_quant": setup.double_quant,
            "int8_threshold": setup.int8_threshold, "ckpt_offload": setup.ckpt_offload,
            "loss": setup.loss.value, "loss_chunk": setup.loss_chunk or "",
            "lora_modules_to_save": ",".join(setup.lora_modules_to_save or ()),
            "trainable_tokens": ",".join(map(str, setup.trainable_tokens or ())), "fused": setup.fused,
            **({"cuda_default_device": True} if setup.cuda_default_device else {})}


def measure_single(spec: ModelSpec, setup: TrainSetup, fake: bool = False) -> dict:
    """One canonical step at full size on this CPU; returns the row (not yet written).

    Real tensors give a tier-1 row. `fake` runs the whole model under FakeTensorMode instead (tier 3:
    real PyTorch and transformers code at any size, no memory) -- an oracle, never the predictor.
    """
    setup = resolve_attention(spec, setup)
    check_fits_positions(spec, setup)
    check_quantized(spec, setup)
    check_loss(spec, setup)
    start = time.perf_counter()
    if fake:
        timeline, _ = run_fake(spec, setup, None)
    else:
        tracker = StorageTracker()
        with own_bitsandbytes_overrides():  # none of an earlier Trainer run's in this process
            run_canonical_step(model_builder(spec, setup, None), setup, tracker, None)
        timeline = tracker.timeline()
    wall_s = time.perf_counter() - start
    device, host = split_host(timeline)  # what a GPU run holds on the device, and offloaded to the host
    peak = replay(device)
    return {"tier": 3 if fake else 1, "recipe": setup.recipe.value, **setup_columns(spec, setup),
            "strategy": "single", "world_size": 1,
            "rank": 0, "peak_allocated_bytes": peak.allocated_bytes, "peak_host_bytes": host_peak_bytes(host),
            "device": "cpu-fake" if fake else "cpu",
            **environment(), "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(wall_s, 2)}


def measure_trainer(spec: ModelSpec, setup: TrainSetup, dtype: str, layout: Layout = Layout(),
                    timeout_s: int = DEFAULT_TIMEOUT_S, accelerate_config: str | None = None,
                    user_fields: dict | None = None) -> list[dict]:
    """The HF Trainer recipe run for real through the entry points (llmsim/model/trainer_recipe.py: nothing of the
    predictor's loop); returns one row per rank. `dtype`: from_pretrained's word as the user gave it (resolved in
    `setup`). With several ranks, `torchrun` launches the recipe's script as a user launches theirs and the Trainer
    runs DistributedDataParallel over gloo (tier 2). With the Trainer's FSDP and `layout.fsdp.init` "host" the run is
    measured as on a GPU (the loaded model the host's until fully_shard copies each unit across; the rows say
    `fsdp_init`). `accelerate_config` (with the script's own TrainingArguments `user_fields`): launched by
    `accelerate launch --config_file` itself, the Trainer taking its FSDP plugin from the launcher's variables; the
    rows carry the file's mapping (`accelerate_config`) and the script's fields."""
    from llmsim.model import trainer_recipe as trainer
    from llmsim.inputs.hf import DTYPE_ALIASES
    from llmsim.inputs.hf import read_mapping as _read_mapping

    check_fits_positions(spec, setup)
    check_supported(setup, layout)
    check_swapper_measurable(layout.deepspeed)
    host_build = layout.fsdp is not None and layout.fsdp.init == "host"
    fields = dict(user_fields) if accelerate_config else json.loads(setup.training_args)
    if isinstance(fields.get("deepspeed"), str):  # the JSON itself travels with the job and the row, not its path
        fields["deepspeed"] = json.loads(Path(fields["deepspeed"]).read_text())
    job = {"config": spec.config_dict, "seq_len": setup.seq_len, "load_dtype": DTYPE_ALIASES.get(dtype, dtype),
           "training_args": fields,
           "peft_config": json.loads(setup.peft_config) if setup.peft_config else None,
           "quantization_config": json.loads(setup.quantization_config) if setup.quantization_config else None,
           "kbit_prep": setup.kbit_prep, "trainer": setup.recipe.value,
           # the Trainer's FSDP measured as on a GPU: the model on the host until fully_shard copies it across
           **({"fsdp_init": "host"} if host_build else {})}
    start = time.perf_counter()
    if layout.world_size == 1:
        results = [trainer.run(job)]  # its own bitsandbytes overrides (trainer_recipe.own_bitsandbytes_overrides)
    else:
        with tempfile.TemporaryDirectory(prefix="llmsim-trainer-") as out:
            torchrun("llmsim.model.trainer_recipe", job, layout.world_size, Path(out), timeout_s,
                     Path(accelerate_config) if accelerate_config else None)
            results = [{**json.loads((Path(out) / f"rank{rank}.json").read_text()),
                        "timeline": pd.read_pickle(Path(out) / f"rank{rank}.timeline.pkl")}
                       for rank in range(layout.world_size)]
    wall_s = time.perf_counter() - start
    for result in results:
        if result["loaded_dtype"] != setup.load_dtype:
            raise RuntimeError(f"from_pretrained(dtype={dtype!r}) loaded {result['loaded_dtype']}, where llmsim "
                               f"resolves {setup.load_dtype}")
    attention = resolve_attention(spec, setup).attention.value  # transformers' default, which from_pretrained takes
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for rank, result in enumerate(results):
        device, host = split_host(result["timeline"])  # ZeRO-Offload's host side apart (llmsim/model/host_memory.py)
        peak = replay(device)
        rows.append({
            "tier": 1 if layout.world_size == 1 else 2, "recipe": setup.recipe.value, "model": spec.name,
            "overrides": json.dumps(dict(spec.overrides), sort_keys=True), "seq_len": setup.seq_len,
            "training_args": json.dumps(fields, sort_keys=True), "peft_config": setup.peft_config or "",
            "quantization_config": setup.quantization_config or "", "kbit_prep": setup.kbit_prep, "dtype": dtype,
            "load_dtype": setup.load_dtype, "micro_batch": setup.micro_batch, "grad_accum": setup.grad_accum,
            "precision": setup.precision.value, "attention": attention, "grad_ckpt": setup.grad_ckpt,
            "ckpt_every": 1, "lora_rank": setup.lora_rank, "strategy": layout.strategy.value,
            "world_size": layout.world_size, "rank": rank, "peak_allocated_bytes": peak.allocated_bytes,
            "peak_host_bytes": host_peak_bytes(host), "peak_phase": peak.phase, "device": "cpu", **environment(),
            **library_versions(),
            **({"trl": _version("trl")} if setup.recipe is Recipe.TRL_SFT else {}),
            **({"gloo_settle": True} if layout.fsdp is not None else {}),  # the recipe settles FSDP2's collectives
            **({"fsdp_init": "host"} if host_build else {}),
            **({"accelerate_config": json.dumps(_read_mapping(accelerate_config, "accelerate config"),
                                                sort_keys=True)} if accelerate_config else {}),
            "measured_at": stamp, "wall_s": round(wall_s, 2)})
    return rows


def measure_from_pretrained(spec: ModelSpec, setup: TrainSetup, layout: Layout, routing: str | None = None,
                            timeout_s: int = DEFAULT_TIMEOUT_S, gloo_settle: bool = True) -> list[dict]:
    """Tensor (and expert) parallelism as a user runs it: `from_pretrained(distributed_config=DistributedConfig(
    tp_size=N))` (tp_plan "auto", what the deprecated `tp_plan="auto"` argument becomes), with `ep_size=N` where the
    setup asks for EP, then a plain AdamW loop
    (llmsim/model/from_pretrained_recipe.py: nothing of the predictor); one tier-2 row per rank. The weights load
    in the setup's load dtype (--dtype: float32 or bfloat16) from a checkpoint in the config's dtype. `gloo_settle`:
    give gloo's worker thread a moment after each wait, as NCCL releases there (False: gloo's own timing)."""
    from llmsim.model import trainer_recipe

    setup = resolve_attention(spec, setup)
    check_fits_positions(spec, setup)
    check_tensor_parallel(spec.hf_config(), layout.tp)
    check_expert_parallel(spec.hf_config(), layout.tp, setup.ep)
    fsdp = layout.fsdp is not None and layout.fsdp.wrap == "transformers"  # DistributedConfig(fsdp_size=N)
    unsupported = [name for name, on in (("pp", layout.pp > 1), ("dp", layout.dp > 1 and not fsdp),
                                         ("LoRA", setup.lora_rank),
                                         ("quantization", setup.quant), ("checkpointing", setup.grad_ckpt),
                                         ("accumulation", setup.grad_accum > 1),
                                         ("an optimizer other than AdamW", setup.optimizer is not Optimizer.ADAMW),
                                         ("autocast", setup.precision.autocast_dtype is not None), ("foreach/fused", setup.foreach
                                                                                  or setup.fused),
                                         ("a loss other than transformers'", setup.loss is not Loss.HF))
                   if on]
    if layout.fsdp is not None and not fsdp:
        unsupported.append("FSDP2 wrapped per layer (--fsdp-wrap transformers is what from_pretrained applies)")
    if layout.tp < 2 and not fsdp:
        raise InputError("the from-pretrained recipe measures TP ranks (tp >= 2, with --ep for EP) or FSDP2 as "
                         "transformers applies it (--strategy fsdp --fsdp-wrap transformers); this layout is neither")
    if unsupported:
        raise InputError(f"the from-pretrained recipe runs a plain AdamW loop: not with {', '.join(unsupported)}")
    if setup.load_dtype not in ("float32", "bfloat16"):
        raise InputError("the from-pretrained recipe loads the weights in the dtype it trains in: --dtype float32 "
                         "or bfloat16")
    distributed = {"tp_size": layout.tp, **({"ep_size": setup.ep} if setup.ep > 1 else {})}  # tp_plan "auto"
    if fsdp:  # FSDP2 over the data-parallel ranks (x TP: transformers' 2-D mesh, TP innermost)
        distributed.update(fsdp_size=layout.world_size // layout.tp,
                           fsdp_mixed_precision=layout.fsdp.param_dtype is not None)
    load_dtype = setup.load_dtype
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llmsim-from-pretrained-") as out:
        trainer_recipe.write_checkpoint(spec.config_dict, Path(out) / "model")
        job = {"checkpoint": str(Path(out) / "model"), "config": spec.config_dict, "load_dtype": load_dtype,
               "distributed": distributed, "micro_batch": setup.micro_batch, "seq_len": setup.seq_len,
               "steps": setup.steps, "routing": routing, "gloo_settle": gloo_settle}
        torchrun("llmsim.model.from_pretrained_recipe", job, layout.world_size, Path(out), timeout_s)
        results = [{**json.loads((Path(out) / f"rank{rank}.json").read_text()),
                    "timeline": pd.read_pickle(Path(out) / f"rank{rank}.timeline.pkl")}
                   for rank in range(layout.world_size)]
    wall_s = round(time.perf_counter() - start, 2)
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for result in results:
        if result["loaded_dtype"] != load_dtype:
            raise RuntimeError(f"from_pretrained(dtype={load_dtype}) loaded {result['loaded_dtype']}")
        peak = replay(result["timeline"])
        rows.append({"tier": 2, "recipe": "from-pretrained", **setup_columns(spec, setup), "load_dtype": load_dtype,
                     "strategy": layout.strategy.value,
                     **({"fsdp_config": layout.fsdp.as_json()} if fsdp else {}),
                     "world_size": layout.world_size, "tp": layout.tp, "ep": setup.ep, "pp": 1,
                     "distributed": json.dumps(distributed, sort_keys=True), "routing": (routing or "router") if setup.ep > 1 else "",
                     "routing_check": _routing_check(routing, result["rank"]) if setup.ep > 1 else "",
                     "rank": result["rank"], "peak_allocated_bytes": peak.allocated_bytes, "peak_phase": peak.phase,
                     "gloo_settle": gloo_settle, "device": "cpu", **environment(), "measured_at": stamp, "wall_s": wall_s})
    return rows


def _routing_check(routing: str | None, rank: int) -> str:
    """How validate compares an EP rank: exact where the forced routing is the one predicted (balanced; collapsed on
    rank 0, which owns the experts the forcing picks: from_pretrained_recipe.forced_routing), and at or under the
    worst routing's bound elsewhere (the router's own choice; the collapsed run's ranks left without tokens)."""
    return "exact" if routing == "balanced" or (routing == "collapsed" and rank == 0) else "bound"


def append_rows(rows: list[dict], path: Path = TIER1_CSV) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    if path.exists():
        frame = pd.concat([pd.read_csv(path), frame], ignore_index=True)
    frame.to_csv(path, index=False)


def check_swapper_measurable(deepspeed) -> None:
    """A measured run with one of ZeRO-3's swappers ("nvme") loads DeepSpeed's async_io op, which builds only
    against libaio: one line before any process starts where it cannot (predicting needs none of it). Where it can,
    the op is built here, once, before the run (llmsim.measure.launch.build_op): a CI run's ranks built it inside the
    run's timeout and passed it."""
    if deepspeed is None or not (deepspeed.swaps_optimizer or deepspeed.swaps_params):
        return
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise InputError("measuring offload_optimizer or offload_param \"nvme\" loads DeepSpeed's async_io op, which "
                         "needs libaio (apt-get install libaio-dev) on this machine; predicting it does not")
    build_op("AsyncIOBuilder")


def measure_distributed(spec: ModelSpec, setup: TrainSetup, layout: Layout,
                        timeout_s: int = DEFAULT_TIMEOUT_S, gloo_settle: bool = True,
                        ds_gloo_settle: bool = False) -> list[dict]:
    """A real multi-process run (torchrun, gloo) on this CPU: one tier-2 row per rank. `gloo_settle` (FSDP2): give
    gloo's worker thread a moment after each reduce-scatter to drop its copy, as NCCL holds none
    (llmsim/model/fsdp.py); False measures gloo's own timing (the row says which). `ds_gloo_settle` (DeepSpeed): the
    same after each of DeepSpeed's synchronous collectives (llmsim/measure/dist_worker.py; off by default, as the
    DeepSpeed rows before it were measured; a row with it says `gloo_settle`)."""
    if setup.recipe is Recipe.DEEPSPEED_PIPE:  # DeepSpeed's pipeline engine: its own checks, its own runner
        from llmsim.model.ds_pipe import checked_setup

        return _rows(spec, checked_setup(spec, setup, layout), layout, {
            "framework": "deepspeed_pipe", "config_json": spec.config_json, "ds_config": layout.deepspeed.config,
            "pp": layout.pp, "micro_batch": setup.micro_batch, "seq_len": setup.seq_len, "steps": setup.steps,
            "grad_ckpt": setup.grad_ckpt, "ckpt_every": setup.ckpt_every,
            "partition_method": setup.ds_pipe.partition_method, "ds_gloo_settle": ds_gloo_settle},
            timeout_s, {"partition_method": setup.ds_pipe.partition_method,
                        **({"gloo_settle": True} if ds_gloo_settle else {})})
    if setup.recipe is Recipe.DEEPSPEED_AUTOTP:  # the DeepSpeed script, its JSON's AutoTP sharding the model: its
        from llmsim.model.ds_script import checked_setup  # own checks, then the DeepSpeed job below

        setup = checked_setup(spec, setup, layout)
    else:
        setup = resolve_attention(spec, setup)
        check_fits_positions(spec, setup)
        check_supported(setup, layout)  # what is not modelled (e.g. ckpt-offload with ZeRO) is not measured either
    check_swapper_measurable(layout.deepspeed)
    if layout.fsdp is not None and layout.fsdp.wrap != "layers":  # llmsim/measure/dist_worker.py wraps per layer
        raise InputError("FSDP2 as transformers applies it is measured through transformers' own entry point: "
                         "llmsim measure --recipe from-pretrained")
    check_tensor_parallel(spec.hf_config(), layout.tp)
    check_pipeline(spec.hf_config(), layout.pp, layout.n_microbatches, layout.schedule, layout.pp_split,
                   setup.precision, layout.stages_per_rank)
    fsdp_config = layout.fsdp.as_json() if layout.fsdp else None
    framework = ("deepspeed" if layout.strategy is Strategy.DEEPSPEED
                 else "model_parallel" if layout.tp * layout.pp > 1  # FSDP2 x PP too
                 else "fsdp" if layout.strategy is Strategy.FSDP else "ddp")
    job = {"framework": framework, "model": spec.name, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
           "replicate": layout.strategy is Strategy.DDP and layout.tp > 1,  # DDP x TP: llmsim/model/replicate.py
           "schedule": layout.schedule.value, "n_microbatches": layout.n_microbatches, "pp_split": layout.pp_split,
           "stages_per_rank": layout.stages_per_rank, "config_json": spec.config_json,
           "attention": setup.attention.value, "grad_ckpt": setup.grad_ckpt,
           "ckpt_every": setup.ckpt_every, "micro_batch": setup.micro_batch, "seq_len": setup.seq_len,
           "steps": setup.steps, "precision": setup.precision.value, "build_bf16": setup.build_bf16,
           "lora_rank": setup.lora_rank, "lora_alpha": setup.lora_alpha,
           "lora_targets": list(setup.lora_targets) if setup.lora_targets else None,
           "optimizer": setup.optimizer.value, "grad_accum": setup.grad_accum, "ckpt_offload": setup.ckpt_offload,
           "loss": setup.loss.value, "loss_chunk": setup.loss_chunk,
           "lora_modules_to_save": list(setup.lora_modules_to_save) if setup.lora_modules_to_save else None,
           "trainable_tokens": list(setup.trainable_tokens) if setup.trainable_tokens else None,
           "foreach": setup.foreach, "fused": setup.fused,
           "ds_config": layout.deepspeed.config if layout.deepspeed else None,
           "fsdp_config": fsdp_config, "gloo_settle": gloo_settle, "ds_gloo_settle": ds_gloo_settle}
    columns = {"fsdp_config": fsdp_config, "gloo_settle": gloo_settle} if layout.fsdp else {}
    if layout.stages_per_rank > 1:  # a schedule of several stages a rank
        columns["stages_per_rank"] = layout.stages_per_rank
    if job["replicate"]:  # replicate's collectives settle as FSDP2's (llmsim/measure/dist_worker.py)
        columns["gloo_settle"] = gloo_settle
    if ds_gloo_settle:  # DeepSpeed's collectives settled as well (the offload rows)
        columns["gloo_settle"] = True
    return _rows(spec, setup, layout, job, timeout_s, columns)


def _rows(spec: ModelSpec, setup: TrainSetup, layout: Layout, job: dict, timeout_s: int, columns: dict) -> list[dict]:
    """Run `job` on `layout.world_size` ranks: one tier-2 row per rank."""
    start = time.perf_counter()
    results = run_ranks(job, layout.world_size, timeout_s)
    wall_s = round(time.perf_counter() - start, 2)
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    ds_config = layout.deepspeed.config_json if layout.deepspeed else ""
    return [{"tier": 2, "recipe": setup.recipe.value, **setup_columns(spec, setup), "strategy": layout.strategy.value,
             "world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp,
             "schedule": layout.schedule.value if layout.pp > 1 and not setup.ds_pipe else "", "n_microbatches": layout.n_microbatches,
             "pp_split": ",".join(map(str, layout.pp_split)) if layout.pp_split else "",
             "rank": r.rank, "ds_config": ds_config, **columns,
             "peak_allocated_bytes": r.peak_allocated_bytes, "peak_host_bytes": r.peak_host_bytes,
             "device": "cpu", **environment(), "peft": _version("peft"),
             "measured_at": stamp, "wall_s": wall_s} for r in results]
