"""Re-predict every measured row and compare (DESIGN.md, "Measured truth")."""
from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import pandas as pd

from llmsim.enums import Attention, Loss, Optimizer, Precision, Recipe
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.model.quiet import quiet_libraries
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import LLM_INT8_THRESHOLD, FsdpSetup, ModelSpec, TrainSetup, load_model_spec
from llmsim.inputs.dsconfig import DeepSpeedSetup
from llmsim.inputs.hf import trainer_setup
from llmsim.model.ds_pipe import on_engine
from llmsim.model.ds_script import on_autotp
from llmsim.model.pipelining import Schedule
from llmsim.sim.strategies import Layout, Strategy, trainer_layout
from llmsim.errors import InputError
from llmsim.inputs.gpus import load_gpu
from llmsim.measure.tolerances import DEVICE_TOTAL_TOLERANCE, PEAK_ALLOCATED_TOLERANCE, RESERVED_TOLERANCE


def row_inputs(row: pd.Series) -> tuple[ModelSpec, TrainSetup, Layout]:
    overrides = json.loads(row["overrides"]) if isinstance(row["overrides"], str) else {}
    spec = load_model_spec(row["model"], overrides)
    if row.get("recipe") in ("hf-trainer", "trl-sft"):  # re-read as the CLI reads the user's files (inputs/hf.py)
        seen = row.get("seq_lens_seen")
        if isinstance(seen, str) and "," in seen:
            raise InputError(f"{row['model']}: the job's batches had sequence lengths {seen}; llmsim predicts "
                             "batches of one length (pack or pad to one length to compare)")
        peft, quantization = row.get("peft_config"), row.get("quantization_config")
        quantized = isinstance(quantization, str) and bool(quantization)
        if quantized and (pd.isna(row.get("kbit_prep")) or str(row.get("kbit_prep")) == ""):
            raise InputError(f"{row['model']}: a quantized Trainer row that does not say whether the script called "
                             "prepare_model_for_kbit_training (MemoryRecorder(kbit_prep=True or False))")
        fields = json.loads(row["training_args"])
        launch = row.get("accelerate_config")
        if isinstance(launch, str) and launch:  # `accelerate launch --config_file` ran the script: as the CLI reads it
            fields = _launched(launch, fields)
        setup = trainer_setup(spec, int(row["seq_len"]), fields,
                              json.loads(peft) if isinstance(peft, str) and peft else None, row["dtype"],
                              json.loads(quantization) if quantized else None,
                              kbit_prep=_flag(row, "kbit_prep") if quantized else True, recipe=Recipe(row["recipe"]))
        strategy = Strategy(row["strategy"]) if isinstance(row.get("strategy"), str) else None
        setup, layout = trainer_layout(spec, setup, _int(row, "world_size", 1), strategy)
        init = row.get("fsdp_init")
        if isinstance(init, str) and init:  # the Trainer's FSDP measured as on a GPU (init "host")
            if layout.fsdp is None:
                raise InputError(f"{row['model']}: fsdp_init({init}) on a row whose TrainingArguments ask for no FSDP")
            layout = replace(layout, fsdp=replace(layout.fsdp, init=init))
        return spec, setup, layout
    setup = TrainSetup(micro_batch=int(row["micro_batch"]), seq_len=int(row["seq_len"]),
                       precision=Precision(row["precision"]), attention=Attention(row["attention"]),
                       grad_ckpt=bool(row["grad_ckpt"]), ckpt_every=int(row["ckpt_every"]),
                       steps=int(row["steps"]), build_bf16=_flag(row, "build_bf16"), foreach=_flag(row, "foreach"),
                       optimizer=Optimizer(row["optimizer"]) if isinstance(row.get("optimizer"), str)
                       else Optimizer.ADAMW, grad_accum=_int(row, "grad_accum", 1),
                       quant=row["quant"] if isinstance(row.get("quant"), str) and row["quant"] else None,
                       double_quant=_flag(row, "double_quant"),
                       int8_threshold=_float(row, "int8_threshold", LLM_INT8_THRESHOLD),
                       ckpt_offload=_flag(row, "ckpt_offload"),
                       cuda_default_device=_flag(row, "cuda_default_device"),
                       loss=Loss(row["loss"]) if isinstance(row.get("loss"), str) and row["loss"] else Loss.HF,
                       loss_chunk=_int(row, "loss_chunk", None),
                       lora_modules_to_save=_names(row, "lora_modules_to_save"),
                       trainable_tokens=_tokens(row), fused=_flag(row, "fused"), routing=_routing(row),
                       load_dtype=row["load_dtype"] if row.get("recipe") == "from-pretrained" else None,
                       **_lora(row))
    ds_config = row.get("ds_config")
    deepspeed = (DeepSpeedSetup(ds_config, int(row["world_size"])) if isinstance(ds_config, str) and ds_config
                 else None)
    fsdp_config = row.get("fsdp_config")
    if isinstance(fsdp_config, str) and fsdp_config and not _flag(row, "gloo_settle"):
        raise InputError(f"{row['model']}: an FSDP2 row measured without gloo's settle holds gloo's reduce-scatter "
                         "copy past the call, which NCCL and the prediction do not (llmsim/model/fsdp.py)")
    fsdp = FsdpSetup.from_json(fsdp_config) if isinstance(fsdp_config, str) and fsdp_config else None
    schedule = row.get("schedule")
    if row.get("recipe") == Recipe.DEEPSPEED_PIPE.value:  # DeepSpeed's pipeline engine: the batch over dp = world / pp
        pp, world = int(row["pp"]), int(row["world_size"])
        method = row.get("partition_method")
        layout = Layout(Strategy.DEEPSPEED, world, DeepSpeedSetup(ds_config, world // pp), pp=pp,
                        n_microbatches=int(row["n_microbatches"]))
        return spec, on_engine(setup, layout, method if isinstance(method, str) and method else "parameters"), layout
    layout = Layout(Strategy(row["strategy"]), int(row["world_size"]), deepspeed, fsdp=fsdp, tp=_int(row, "tp", 1),
                    ep=_int(row, "ep", 1), pp=_int(row, "pp", 1), n_microbatches=_int(row, "n_microbatches", 1),
                    schedule=Schedule(schedule) if isinstance(schedule, str) and schedule else Schedule.GPIPE,
                    pp_split=_split(row), stages_per_rank=_int(row, "stages_per_rank", 1))
    if row.get("recipe") == Recipe.DEEPSPEED_AUTOTP.value:  # the DeepSpeed script with AutoTP, as the CLI reads it
        return spec, on_autotp(setup, layout), layout
    return spec, setup, layout


def load_measurements(paths: Iterable[Path] | None = None) -> pd.DataFrame:
    paths = sorted(MEASUREMENTS_DIR.glob("*.csv")) if paths is None else [Path(p) for p in paths]
    frames = [pd.read_csv(p).assign(source=p.name) for p in paths]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def validate(measurements: pd.DataFrame, jobs: int = 1) -> pd.DataFrame:
    """One row per measured rank: measured, predicted, relative error and whether it is in tolerance.
    With `jobs` > 1 the rows are shared out between fresh local processes (spawned: each starts as a new
    `llmsim validate` would), rows of one model and configuration kept together so they reuse a trace."""
    if jobs <= 1 or len(measurements) < 2:
        return _validate_rows(measurements)
    # rows of one model shape, whichever file holds them, share a process: their traces are often the same
    keys = measurements["model"].astype(str) + "|" + measurements["overrides"].astype(str)
    runs = (measurements["rank"].astype(int) == 0).groupby(keys, sort=False).sum()  # one prediction per run
    groups = sorted(measurements.groupby(keys, sort=False).groups.items(), key=lambda item: -runs[item[0]])
    shares: list[list[int]] = [[] for _ in range(jobs)]
    work = [0] * jobs
    for key, index in groups:  # the most runs first, to the share with the fewest runs
        share = work.index(min(work))
        shares[share].extend(index)
        work[share] += int(runs[key])
    chunks = [measurements.loc[sorted(share)] for share in shares if share]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(chunks), mp_context=context,
                             initializer=quiet_libraries) as pool:
        frames = list(pool.map(_validate_rows, chunks))
    order = [i for chunk in chunks for i in chunk.index]
    return pd.concat(frames, ignore_index=True).set_axis(order).sort_index().reset_index(drop=True)


def _validate_rows(measurements: pd.DataFrame) -> pd.DataFrame:
    results = []
    run, prediction = None, None  # one prediction per measured run: its ranks' rows are adjacent and read it
    for _, row in measurements.iterrows():
        spec, setup, layout = row_inputs(row)
        gpu = load_gpu(row["gpu"]) if isinstance(row.get("gpu"), str) and row["gpu"] else None
        if (spec, setup, layout, gpu) != run:
            run, prediction = (spec, setup, layout, gpu), predict(spec, setup, layout, gpu)
        predicted_rank = prediction.ranks[int(row["rank"])]
        predicted = predicted_rank.peak_allocated_bytes
        measured = int(row["peak_allocated_bytes"])
        error = (predicted - measured) / measured
        tolerance = PEAK_ALLOCATED_TOLERANCE[int(row["tier"])]
        device_ok, device_errors = True, {}
        measured_host = _int(row, "peak_host_bytes", 0)  # host memory (--ckpt-offload); rows before it: none
        predicted_host = predicted_rank.peak_host_bytes
        host_error = (predicted_host - measured_host) / measured_host if measured_host else float(predicted_host != 0)
        if int(row["tier"]) == 4 and ("peak_host_bytes" not in row or pd.isna(row["peak_host_bytes"])):
            host_error = 0.0  # a GPU row that did not read the host (the recorder: torch.cuda's figures only)
        if gpu is not None:  # tier 4: the allocator model and the device total too
            for column, value, limit in (("peak_reserved_bytes", predicted_rank.peak_reserved_bytes,
                                          RESERVED_TOLERANCE),
                                         ("device_total_bytes", predicted_rank.device_total_bytes,
                                          DEVICE_TOTAL_TOLERANCE)):
                relative = (value - int(row[column])) / int(row[column])
                device_errors[column.replace("peak_", "").replace("_bytes", "_rel_error")] = relative
                device_ok &= abs(relative) <= limit
        results.append({"source": row["source"], "tier": int(row["tier"]), "model": row["model"],
                        "micro_batch": setup.micro_batch, "seq_len": setup.seq_len,
                        "precision": setup.precision.value, "attention": row.get("attention", ""),
                        "grad_ckpt": setup.grad_ckpt, "ckpt_every": setup.ckpt_every, "lora": setup.lora_rank,
                        "strategy": _strategy_name(layout), "world_size": layout.world_size,
                        "tp": layout.tp, "pp": layout.pp, "rank": int(row["rank"]),
                        "measured_bytes": measured, "predicted_bytes": predicted, "rel_error": error,
                        "measured_host_bytes": measured_host, "predicted_host_bytes": predicted_host,
                        "host_rel_error": host_error, "tolerance": tolerance,
                        "check": "bound" if row.get("routing_check") == "bound" else "exact",
                        "ok": _within(row, error, tolerance) and abs(host_error) <= tolerance and device_ok,
                        "other_releases": other_releases(row), **device_errors})
    return pd.DataFrame(results)


# The libraries whose releases decide what a row's run allocated, as its columns name them: a row measured under
# another release than the one this process predicts with may differ by that release's change (transformers 5.25.0
# took the experts out of Mixtral's TP plan: experiments/check_transformers_drift.py), which validate still counts
MEASURED_WITH = ("torch", "transformers", "deepspeed", "peft", "bitsandbytes", "accelerate")


def other_releases(row: pd.Series) -> str:
    """The libraries this row was measured under at another release than this process runs, as
    "transformers 5.24.0 (here 5.25.0)", comma-separated; "" where every release the row names is the same."""
    from importlib.metadata import PackageNotFoundError, version

    differ = []
    for package in MEASURED_WITH:
        measured = row.get(package)
        if not isinstance(measured, str) or not measured:
            continue
        try:
            here = version(package)
        except PackageNotFoundError:
            here = "not installed"
        if here != measured:
            differ.append(f"{package} {measured} (here {here})")
    return ", ".join(differ)


def _routing(row: pd.Series) -> str:
    """The routing an expert-parallel row is predicted under: a forced balanced routing as stated, a collapsed one or
    the router's own against the worst routing (`routing_check` says whether the rank must equal it or stay under)."""
    routing = row.get("routing")
    if _int(row, "ep", 1) == 1:
        return "balanced"  # no expert parallelism: the routing decides no split
    if routing not in ("balanced", "collapsed", "router"):
        raise InputError(f"{row['model']}: an expert-parallel row must say its routing (balanced, collapsed or "
                         f"router), not {routing!r}")
    return "balanced" if routing == "balanced" else "collapsed"


def _within(row: pd.Series, error: float, tolerance: float) -> bool:
    """Within tolerance; for a bound row (`routing_check` bound: a rank under the router's own routing, or one that
    the collapsed routing leaves without tokens), at or under the predicted bound."""
    if row.get("routing_check") == "bound":
        return error >= 0
    return abs(error) <= tolerance


def _strategy_name(layout: Layout) -> str:
    if layout.deepspeed is not None:
        autotp = layout.deepspeed.autotp_size
        return f"zero{layout.deepspeed.stage}" + (f"-autotp{autotp}" if autotp > 1 else "")
    return layout.strategy.value


def _lora(row: pd.Series) -> dict:
    rank = row.get("lora_rank")
    if rank is None or pd.isna(rank) or not int(rank):
        return {}
    targets = row.get("lora_targets")
    return {"lora_rank": int(rank), "lora_alpha": int(row["lora_alpha"]),
            "lora_targets": tuple(targets.split(",")) if isinstance(targets, str) and targets else None}


def _names(row: pd.Series, column: str) -> tuple[str, ...] | None:
    value = row.get(column)
    return tuple(value.split(",")) if isinstance(value, str) and value else None


def _tokens(row: pd.Series) -> tuple[int, ...] | None:
    """Trainable token indices: "0,1,5" (a single index reads back from the CSV as a number)."""
    value = row.get("trainable_tokens")
    if value is None or (not isinstance(value, str) and pd.isna(value)) or not str(value):
        return None
    return tuple(int(float(v)) for v in str(value).split(","))


def _split(row: pd.Series) -> tuple[int, ...] | None:
    value = row.get("pp_split")
    if value is None or pd.isna(value) or not str(value):
        return None
    return tuple(int(v) for v in str(value).split(","))


def _int(row: pd.Series, column: str, default: int | None) -> int | None:
    value = row.get(column)
    return default if value is None or pd.isna(value) else int(value)


def _float(row: pd.Series, column: str, default: float) -> float:
    value = row.get(column)
    return default if value is None or pd.isna(value) else float(value)


def _flag(row: pd.Series, column: str) -> bool:
    value = row.get(column)
    return bool(value) and not pd.isna(value) and str(value) != "False"


def _launched(config: str, fields: dict) -> dict:
    """A row's TrainingArguments as the Trainer ran them under `accelerate launch` with the row's accelerate config
    (its mapping, re-read from a file as the CLI reads the user's: llmsim/inputs/accelerate_config.py)."""
    import tempfile
    from pathlib import Path

    from llmsim.inputs.accelerate_config import trainer_fsdp_launch

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "accelerate.json"
        path.write_text(config)
        return trainer_fsdp_launch(path, fields)[1]
