"""The `llmsim` command: each subcommand's work and its output. Bad input is one line on stderr and exit status 2;
the arguments themselves are read in `llmsim.app.options`."""
from __future__ import annotations

import gc
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from llmsim.app.options import alloc_conf, build_parser, gpu_of, inputs, prediction, quiet_libraries
from llmsim.enums import Recipe
from llmsim.errors import InputError

EXIT_BAD_INPUT = 2
EXIT_OUT_OF_TOLERANCE = 1
EXIT_RUN_FAILED = 3  # a measured run crashed or timed out


def cmd_predict(args) -> int:
    from llmsim.app.report import prediction_table, suggestions_table

    # on a terminal only: an input error found inside a stage's trace must stay one line where stderr is read
    progress = not args.quiet and sys.stderr.isatty()
    if args.suggest and not args.gpu:
        raise InputError("--suggest lists what would make the job fit on a GPU: it needs --gpu NAME")
    predicted = prediction(args, progress=progress)
    advice = None
    if args.suggest is not False and predicted.verdict in ("tight", "oom"):  # on by default where it can help
        from llmsim.app.advice import suggestions

        spec, setup, layout = inputs(args)
        advice = suggestions(spec, setup, layout, predicted.gpu, predicted.alloc_conf, args.jobs, progress, predicted)
    if args.format == "json":
        print(json.dumps({**predicted.to_dict(args.gpus_per_node),
                          **({"suggestions": [s.to_dict() for s in advice]} if advice is not None else {})},
                         indent=2))
    else:
        print(prediction_table(predicted, args.gpus_per_node))
        if advice is not None:
            print(suggestions_table(advice, predicted.gpu))
    if args.snapshot:
        from llmsim.app.snapshot import write_snapshot

        rank = predicted.deciding_rank if predicted.gpu is not None else \
            max(predicted.ranks, key=lambda r: r.peak_allocated_bytes)
        write_snapshot(rank.timeline, args.snapshot, predicted.gpu)
        print(f"snapshot of rank {rank.rank}: {args.snapshot} (open it in https://pytorch.org/memory_viz)",
              file=sys.stderr if args.format == "json" else sys.stdout)
    if args.plot:
        from llmsim.app.plots import prediction_figure

        prediction_figure(predicted, args.plot)
        print(f"figure: {args.plot}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0


def cmd_compare(args) -> int:

    from llmsim.app.compare import compare_levers
    from llmsim.app.plots import levers_bar_chart
    from llmsim.app.report import human_bytes, layout_text

    spec, setup, layout = inputs(args)
    gpu = gpu_of(args)
    frame = compare_levers(spec, setup, layout, gpu, alloc_conf(args), args.jobs,
                           not args.quiet and sys.stderr.isatty())
    shown = frame.assign(peak=frame["device_total_bytes"].map(human_bytes),
                         saving=frame["saving_vs_baseline"].map(lambda v: f"{100 * v:+.1f} %"),
                         host=frame["peak_host_bytes"].map(lambda b: human_bytes(b) if b else "-"))
    columns = ["lever", "peak", "saving", "peak_phase", "host"] + (["fits"] if gpu else [])
    print(shown[columns].to_string(index=False))
    title = (f"{spec.name}, micro-batch {setup.micro_batch}, seq {setup.seq_len}, {layout_text(layout)}"
             + (f", {gpu.name}" if gpu else ""))
    path = levers_bar_chart(frame, title, Path(args.out), gpu.capacity_bytes if gpu else None)
    print(f"chart: {path}")
    return 0


def cmd_size(args) -> int:
    from llmsim.app.report import human_bytes
    from llmsim.app.size import size

    if args.max_gpus < 1 or args.max_micro_batch < 1:
        raise InputError(f"max-gpus({args.max_gpus}) and max-micro-batch({args.max_micro_batch}) must be >= 1")
    args.micro_batch = 1
    spec, setup, _ = inputs(args)
    gpu = gpu_of(args)
    from llmsim.app.size import DEFAULT_FAMILIES, FAMILIES

    families = tuple(f for f in args.layouts.split(",") if f) if args.layouts else DEFAULT_FAMILIES
    if unknown := [f for f in families if f not in FAMILIES]:
        raise InputError(f"unknown layout families {unknown}; valid choices: {', '.join(FAMILIES)}")
    allow = tuple(name for name in (args.allow or "").split(",") if name)
    frame = size(spec, setup, gpu, args.max_gpus, args.max_micro_batch, alloc_conf(args), families,
                 args.global_batch, allow, args.jobs, not args.quiet, args.cluster)
    title = (f"{spec.name} on {gpu.name} ({human_bytes(gpu.capacity_bytes)}, margin "
             f"{human_bytes(gpu.margin_bytes)}), seq {setup.seq_len}, "
             f"{setup.precision.value}{', checkpointing' if setup.grad_ckpt else ''}")
    if args.plot:
        from llmsim.app.plots import sizing_heatmap

        sizing_heatmap(frame, f"{title}: largest micro-batch", args.plot)
    if args.format == "json":
        print(frame.to_json(orient="records", indent=2))
        return 0
    shown = frame.assign(needs=frame["needed_bytes"].map(lambda b: human_bytes(int(b)) if b == b and b else "-"),
                         headroom=frame["headroom_bytes"].map(lambda b: human_bytes(int(b)) if b == b and b else "-"))
    print(title)
    columns = ["layout", "gpus"] + (["levers"] if allow else []) + ["largest_micro_batch"] + \
        (["passes"] if args.global_batch else []) + ["needs", "headroom", "fits", "why"]
    print(shown[columns].rename(columns={"largest_micro_batch": "micro_batch" if args.global_batch
                                         else "largest_micro_batch"}).to_string(index=False))
    return 0


def cmd_measure(args) -> int:
    from llmsim.app.report import human_bytes
    from llmsim.measure.launch import LaunchFailure
    from llmsim.measure.runs import MEASURED_DEFAULT_CSV, append_rows, measure_distributed, measure_single

    router = getattr(args, "routing", None) == "router"  # measured with the router's own choice
    if router:
        args.routing = "balanced"
    spec, setup, layout = inputs(args)
    if args.recipe == "from-pretrained":
        from llmsim.measure.runs import measure_from_pretrained

        try:
            rows = measure_from_pretrained(spec, replace(setup, ep=layout.ep), layout,
                                           None if router or layout.ep == 1 else setup.routing, args.timeout)
        except LaunchFailure as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_RUN_FAILED
    elif router or layout.ep > 1:
        raise InputError("expert parallelism is measured through transformers' own entry point: --recipe "
                         "from-pretrained")
    elif setup.recipe.trainer:
        from llmsim.measure.runs import measure_trainer

        try:
            launch = getattr(args, "accelerate_config", None)
            rows = measure_trainer(spec, setup, args.dtype or "auto", layout, args.timeout, launch,
                                   args.user_training_args if launch else None)
        except LaunchFailure as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_RUN_FAILED
    elif layout.world_size == 1:
        rows = [measure_single(spec, setup)]
    else:
        try:
            rows = measure_distributed(spec, setup, layout, args.timeout)
        except LaunchFailure as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_RUN_FAILED
    default_out = MEASURED_DEFAULT_CSV  # where the user runs llmsim: the committed rows change only when asked
    if not args.dry_run:
        append_rows(rows, Path(args.out) if args.out else default_out)
    for row in rows:
        host = f", host {human_bytes(row['peak_host_bytes'])}" if row.get("peak_host_bytes") else ""
        print(f"rank {row['rank']}: measured peak allocated {human_bytes(row['peak_allocated_bytes'])} "
              f"({row['peak_allocated_bytes']:,} B){host} in {row['wall_s']} s")
    return 0


def cmd_validate(args) -> int:
    from llmsim.app.report import validation_table
    from llmsim.measure.validate import load_measurements, validate

    results = validate(load_measurements(args.csv or None), jobs=args.jobs)
    print(validation_table(results))
    return 0 if results["ok"].all() else EXIT_OUT_OF_TOLERANCE


def cmd_models(args) -> int:
    from llmsim.inputs.spec import load_model_spec, zoo_names

    print(f"{'name':<20} {'model_type':<10} {'layers':>6} {'parameters':>16}")
    for name in zoo_names():
        spec = load_model_spec(name)
        print(f"{name:<20} {spec.config_dict['model_type']:<10} {spec.num_layers:>6} "
              f"{parameter_count(spec):>16,}")
    return 0


def parameter_count(spec) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.hf_config())
    return sum(p.numel() for p in model.parameters())


def cmd_sweep(args) -> int:
    from llmsim.app.sweep import load_grid, sweep, write

    configs = load_grid(args.file)
    frame = sweep(configs, args.jobs, progress=not args.quiet, cluster=args.cluster)
    path = write(frame, args.out)
    failed = int((frame["error"] != "").sum())
    print(f"{len(frame)} configurations ({failed} rejected, see the error column) -> {path}")
    return 0


def cmd_gpus(args) -> int:
    from llmsim.app.report import human_bytes
    from llmsim.inputs.gpus import gpu_names, load_gpu

    print(f"{'name':<12} {'device':<28} {'capability':>10} {'capacity':>12} {'CUDA context':>13}  source")
    for name in gpu_names():
        gpu = load_gpu(name)
        print(f"{name:<12} {gpu.device_name:<28} {gpu.compute_capability:>10} {human_bytes(gpu.capacity_bytes):>12} "
              f"{human_bytes(gpu.cuda_context_bytes):>13}  {gpu.source}")
    return 0


COMMANDS = {"predict": cmd_predict, "compare": cmd_compare, "size": cmd_size, "sweep": cmd_sweep,
            "measure": cmd_measure, "validate": cmd_validate, "models": cmd_models,
            "gpus": cmd_gpus}


def main(argv: list[str] | None = None, exits: bool = False) -> int:
    """The command `argv` says (sys.argv's by default), its exit status. `exits`: the process ends after it without
    a collection (`run`), so a `predict` keeps Python's cyclic collector off from the start, as the prediction
    itself does (`processes.collector_paused`): importing torch, transformers and the model's modeling code makes
    enough objects to set off full collections, each walking all of them (6 in importing modeling_llama, 0.53 s of
    its 2.5 s); a command that predicts many times (`size`, `sweep`, `compare`) collects between predictions."""
    try:
        args = build_parser().parse_args(argv)  # --help and argument errors answer here, before torch is imported
        if exits and args.command == "predict":
            gc.disable()
        quiet_libraries()
        return COMMANDS[args.command](args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # the reader went away (`llmsim models | head`): what it read is what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would raise again
        return 0


def run() -> None:
    """The `llmsim` command: `main`, its output flushed, then the process ends without Python's teardown, which
    collects every object a prediction made (traces, timelines, torch's and transformers' modules): 1.1-1.2 s of a
    cold 8.3 s Llama-2-70B PP 16 x TP 8 x DP 8 prediction. Every file, pool and process group a command opens is
    closed inside it; `main` itself (the tests', a script's) returns as usual."""
    import logging

    status = main(exits=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream was closed
            pass
    os._exit(status)


if __name__ == "__main__":
    run()
