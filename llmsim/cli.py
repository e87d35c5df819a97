"""The `llmsim` command. Strings become enums here; bad input is one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import json
import sys

from llmsim.enums import Attention, Precision, parse_enum
from llmsim.errors import InputError

EXIT_BAD_INPUT = 2
EXIT_OUT_OF_TOLERANCE = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, status 2
        raise InputError(f"{self.prog}: {message}")


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise InputError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="zoo name (llmsim models), path to an HF config.json, "
                   "or module:factory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=str,
                   help="override a config field (JSON value), e.g. --set num_hidden_layers=4")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 | bf16-autocast")
    p.add_argument("--attn", default=None, help="sdpa | eager (default: transformers' choice for the model)")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--ckpt-every", type=int, default=1, help="checkpoint every N-th layer (every_n_layers)")
    p.add_argument("--device", default="cpu", help="cpu")


def _inputs(args):
    from llmsim.enums import Device
    from llmsim.spec import TrainSetup, load_model_spec

    spec = load_model_spec(args.model, dict(_override(t) for t in args.set))
    setup = TrainSetup(
        micro_batch=args.micro_batch, seq_len=args.seq_len,
        precision=parse_enum(Precision, args.precision, "precision"),
        attention=parse_enum(Attention, args.attn, "attention") if args.attn else None,
        grad_ckpt=args.grad_ckpt, ckpt_every=args.ckpt_every,
        device=parse_enum(Device, args.device, "device"))
    return spec, setup


def cmd_predict(args) -> int:
    from llmsim.pipeline import predict
    from llmsim.report import prediction_table

    prediction = predict(*_inputs(args))
    if args.format == "json":
        print(json.dumps(prediction.to_dict(), indent=2))
    else:
        print(prediction_table(prediction))
    return 0


def cmd_measure(args) -> int:
    from llmsim.measure import TIER1_CSV, append_rows, measure_single
    from llmsim.report import human_bytes

    row = measure_single(*_inputs(args))
    if not args.dry_run:
        append_rows([row], args.out or TIER1_CSV)
    print(f"measured peak allocated {human_bytes(row['peak_allocated_bytes'])} "
          f"({row['peak_allocated_bytes']:,} B) in {row['wall_s']} s")
    return 0


def cmd_validate(args) -> int:
    from llmsim.report import validation_table
    from llmsim.validate import load_measurements, validate

    results = validate(load_measurements(args.csv or None))
    print(validation_table(results))
    return 0 if results["ok"].all() else EXIT_OUT_OF_TOLERANCE


def cmd_models(args) -> int:
    from llmsim.spec import load_model_spec, zoo_names

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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="llmsim", description="Predict per-GPU peak memory of LLM fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("predict", help="predict one layout: per-rank peak and breakdown")
    _add_model_args(p)
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_predict)
    p = sub.add_parser("measure", help="run the canonical step for real on this CPU and append a row")
    _add_model_args(p)
    p.add_argument("--out", default=None, help="CSV to append to (default data/measurements/tier1_cpu.csv)")
    p.add_argument("--dry-run", action="store_true", help="measure but write nothing")
    p.set_defaults(func=cmd_measure)
    p = sub.add_parser("validate", help="re-predict every measured row; exit 1 if any is out of tolerance")
    p.add_argument("csv", nargs="*", help="measurement CSVs (default: data/measurements/*.csv)")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("models", help="list the model zoo")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
