"""`llmsim sweep FILE`: a grid of predictions (issue 7). The file (YAML or JSON) maps `predict`'s options to a
value or a list of values; every combination is predicted, in parallel local processes, one row each.

    model: [llama-2-7b, mistral-7b]
    seq_len: [2048, 4096]
    micro_batch: [1, 2, 4]
    precision: bf16
    grad_ckpt: [false, true]
    gpu: a100-80gb

A combination the options reject (a micro-batch past the learned positions, a layout not modelled) becomes a
row with its one-line `error`; an unknown key rejects the whole file.
"""
from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pandas as pd

from llmsim.errors import InputError, one_line
from llmsim.sim.processes import in_processes

# file key -> predict's option; flags take true/false
OPTIONS = {"model": "--model", "seq_len": "--seq-len", "micro_batch": "--micro-batch", "precision": "--precision",
           "attn": "--attn", "ckpt_every": "--ckpt-every", "optimizer": "--optimizer",
           "build_dtype": "--build-dtype", "lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha",
           "lora_targets": "--lora-targets", "lora_modules_to_save": "--lora-modules-to-save",
           "trainable_tokens": "--trainable-tokens", "strategy": "--strategy", "world_size": "--world-size",
           "tp": "--tp", "pp": "--pp", "dp": "--dp", "pp_split": "--pp-split", "schedule": "--schedule",
           "stages_per_rank": "--stages-per-rank", "microbatches": "--microbatches", "grad_accum": "--grad-accum", "quant": "--quant",
           "int8_threshold": "--int8-threshold",
           "ds_config": "--ds-config", "gpu": "--gpu", "alloc_conf": "--alloc-conf", "margin": "--margin",
           "fsdp_param_dtype": "--fsdp-param-dtype", "fsdp_reduce_dtype": "--fsdp-reduce-dtype",
           "fsdp_init": "--fsdp-init", "partition_method": "--partition-method"}
FLAGS = {"grad_ckpt": "--grad-ckpt", "double_quant": "--double-quant", "ckpt_offload": "--ckpt-offload",
         "foreach": "--foreach", "fused": "--fused", "fsdp_no_reshard": "--fsdp-no-reshard",
         "fsdp_offload": "--fsdp-offload"}


def load_grid(path: str | Path) -> list[dict]:
    """The file's combinations, in file order (the last key varies fastest)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"sweep file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            grid = yaml.safe_load(text)
        else:
            grid = json.loads(text)
    except Exception as exc:  # yaml.YAMLError, json.JSONDecodeError
        raise InputError(f"sweep file {path.name} does not parse: {one_line(exc)}") from exc
    if not isinstance(grid, dict) or not grid:
        raise InputError(f"sweep file {path.name} must map options to values")
    unknown = sorted(set(grid) - set(OPTIONS) - set(FLAGS))
    if unknown:
        raise InputError(f"sweep file {path.name}: unknown key(s) {', '.join(unknown)}; valid keys: "
                         f"{', '.join(sorted([*OPTIONS, *FLAGS]))}")
    for required in ("model", "seq_len"):
        if required not in grid:
            raise InputError(f"sweep file {path.name} needs {required!r}")
    axes = {key: value if isinstance(value, list) else [value] for key, value in grid.items()}
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def _argv(config: dict) -> list[str]:
    argv = ["predict"]
    for key, value in config.items():
        if key in FLAGS:
            argv += [FLAGS[key]] if value else []
        elif value is not None:
            argv += [OPTIONS[key], str(value)]
    return argv


@functools.lru_cache(maxsize=1)
def _parser():
    from llmsim.app.options import build_parser

    return build_parser()


def predict_row(config: dict) -> dict:
    """One combination through `predict`'s own argument handling: the worst rank's figures, or the error."""
    from llmsim.app.options import alloc_conf, gpu_of, inputs
    from llmsim.sim.pipeline import predict

    row = dict(config)
    try:
        args = _parser().parse_args(_argv(config))
        gpu = gpu_of(args)
        prediction = predict(*inputs(args), gpu=gpu, alloc_conf=alloc_conf(args))
    except InputError as exc:
        return {**row, "error": str(exc)}
    except SystemExit:  # argparse has printed why (a value of the wrong type)
        return {**row, "error": "predict's options reject these values"}
    worst = max(prediction.ranks, key=lambda r: r.device_total_bytes)
    return {**row, "ranks": len(prediction.ranks), "peak_allocated_bytes": worst.peak_allocated_bytes,
            "peak_reserved_bytes": worst.peak_reserved_bytes, "device_total_bytes": worst.device_total_bytes,
            "peak_rank": worst.rank, "peak_phase": worst.peak.phase, "fits": worst.fits,
            "verdict": prediction.verdict, "needed_bytes": prediction.deciding_rank.needed_bytes,
            "peak_host_bytes": worst.peak_host_bytes, "error": ""}


def sweep(configs: list[dict], jobs: int = 1, progress: bool = True, cluster: str | None = None) -> pd.DataFrame:
    """One row per configuration, in `jobs` local processes or on the workers of the Dask cluster at `cluster`
    (a scheduler's address: llmsim/sim/processes.py)."""
    frame = pd.DataFrame(in_processes(predict_row, configs, jobs, progress, "config",
                                      chunksize=max(1, len(configs) // (4 * max(jobs, 1))), cluster=cluster))
    for column in ("ranks", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "peak_rank",
                   "peak_host_bytes"):
        if column in frame:  # rejected combinations leave them empty: keep the others integers
            frame[column] = frame[column].astype("Int64")
    return frame


def write(frame: pd.DataFrame, out: str | Path) -> Path:
    out = Path(out)
    if out.suffix == ".parquet":
        try:
            frame.to_parquet(out, index=False)
        except ImportError as exc:
            raise InputError(f"writing {out.name} needs a parquet engine (pip install pyarrow); "
                             "or write .csv") from exc
    elif out.suffix == ".csv":
        frame.to_csv(out, index=False)
    else:
        raise InputError(f"sweep output {out.name}: valid formats are .csv and .parquet")
    return out
