"""GPU kit, part one (tier 4 through the ecosystem's entry points): the HF Trainer on one real GPU, as users write it.

    python experiments/gpu_trainer.py --out DIR [--deadline S]   # on a GPU machine: rows to DIR/tier4_trainer_gpu.csv
    python experiments/gpu_trainer.py --dry-run                  # anywhere: each job resolves; llmsim's prediction
    python experiments/gpu_trainer.py --cpu-check DIR            # anywhere: every job cut small, on this CPU, the
                                                                 # recorder's CUDA readings faked, rows re-read

No llmsim loop runs here. Per zoo model, a child process writes a checkpoint as the hub stores one (the config's own
dtype, random weights made on the GPU, `save_pretrained`); then each job runs in a fresh process, the user's script:
`AutoModelForCausalLM.from_pretrained(checkpoint, dtype=..., [quantization_config=BitsAndBytesConfig(...)])`,
[`prepare_model_for_kbit_training`], [`get_peft_model(model, LoraConfig(...))`],
`Trainer(model, TrainingArguments(...), train_dataset=rows).train()` for three optimizer steps, the Trainer's own
defaults (on CUDA: `adamw_torch_fused`, `max_grad_norm` 1.0, the model moved to the GPU by the Trainer), with
llmsim's `MemoryRecorder` as its one callback (llmsim/measure/recorder.py): the row holds
`torch.cuda.max_memory_allocated()` / `max_memory_reserved()` since the process started and the device's used
memory at each step's end, with the job's own TrainingArguments, LoraConfig and BitsAndBytesConfig, which
`llmsim validate` re-predicts. Each job's CUDA allocator events (`torch.cuda.memory._record_memory_history` from
before `from_pretrained`, no stacks) and the raw readings go to DIR/trainer_traces.tar.gz. The data is what `datasets.map(tokenizer)` leaves: lists of token ids, labels equal,
one length, collated by transformers' `default_data_collator`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PER_JOB_TIMEOUT_S = 150
STEPS = 3
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
NF4_DQ_BF16 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
               "bnb_4bit_compute_dtype": "bfloat16"}
# (name, zoo model, seq_len, TrainingArguments fields, LoraConfig fields or None, from_pretrained dtype,
#  BitsAndBytesConfig fields or None, prepare_model_for_kbit_training)
JOBS = [
    ("full fine-tuning, fp32 load, bf16 autocast, default optim", "qwen2.5-0.5b", 1024,
     {"per_device_train_batch_size": 4, "bf16": True}, None, "float32", None, False),
    ("LoRA all-linear r16, bf16 load, bf16, checkpointing", "llama-2-7b", 2048,
     {"per_device_train_batch_size": 2, "bf16": True, "gradient_checkpointing": True}, LORA, "bfloat16", None, False),
    ("QLoRA nf4 double-quant, bf16 load, bf16, checkpointing, kbit prep", "llama-2-7b", 2048,
     {"per_device_train_batch_size": 2, "bf16": True, "gradient_checkpointing": True}, LORA, "bfloat16",
     NF4_DQ_BF16, True),
    ("full fine-tuning, bf16 load, bf16, checkpointing", "qwen2.5-1.5b", 1024,
     {"per_device_train_batch_size": 4, "bf16": True, "gradient_checkpointing": True}, None, "bfloat16", None, False),
    ("full fine-tuning, bf16 load, bf16, checkpointing, default optim", "llama-2-7b", 2048,
     {"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True}, None, "bfloat16", None, False),
    ("full fine-tuning, fp32, adamw_torch, accumulation 2", "qwen2.5-1.5b", 512,
     {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "optim": "adamw_torch"}, None, "float32",
     None, False),
    ("full fine-tuning, fp32 load, fp16 autocast + GradScaler", "pythia-1.4b", 1024,
     {"per_device_train_batch_size": 2, "fp16": True}, None, "float32", None, False),
    ("full fine-tuning, fp32, default optim", "gpt2", 1024, {"per_device_train_batch_size": 8}, None, "float32",
     None, False),
]
CPU_CHECK_SHAPES = {  # --cpu-check: the same families cut small (the recorder writes their configs beside the CSV)
    "llama-2-7b": {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_hidden_layers": 2,
                   "num_key_value_heads": 4, "vocab_size": 512},
    "qwen2.5-0.5b": {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_hidden_layers": 2,
                     "num_key_value_heads": 2, "vocab_size": 512, "max_window_layers": 2},
    "qwen2.5-1.5b": {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_hidden_layers": 2,
                     "num_key_value_heads": 2, "vocab_size": 512, "max_window_layers": 2},
    "pythia-1.4b": {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
                    "vocab_size": 512},
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512},
}


class _FakeCuda:
    """--cpu-check: the recorder's CUDA readings on a machine without one (as tests/test_recorder.py)."""

    def device_name(self):
        return "NVIDIA H200"

    def peaks(self):
        return 1, 1

    def used(self):
        return 1


def write_checkpoint(model: str, directory: str, cpu_check: bool) -> None:
    """Child process: the zoo model's checkpoint as the hub stores it (llmsim's Trainer recipe writes it), its random
    weights made on the GPU (fast at 7B)."""
    import torch

    from llmsim.inputs.spec import load_model_spec
    from llmsim.model import trainer_recipe

    spec = load_model_spec(model, CPU_CHECK_SHAPES[model] if cpu_check else None)
    with torch.device("cpu" if cpu_check else "cuda"):
        trainer_recipe.write_checkpoint(spec.config_dict, Path(directory))


def run_job(index: int, checkpoint: str, out: str, cpu_check: bool) -> None:
    """Child process: the user's script for JOBS[index], the recorder its one callback."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    from llmsim.measure.recorder import MemoryRecorder
    from llmsim.model.trainer_recipe import token_rows

    name, model_name, seq_len, fields, lora, dtype, bnb, kbit_prep = JOBS[index]
    if cpu_check:
        seq_len, fields = 32, {**fields, "use_cpu": True}
        if fields.get("fp16"):  # fp16 mixed precision needs a GPU (the Trainer refuses it on the CPU)
            fields = {key: value for key, value in fields.items() if key != "fp16"}
    loading = {"quantization_config": BitsAndBytesConfig(**bnb)} if bnb else {}
    if not cpu_check:  # the allocator's own events, from the first allocation on (`_raw_readings` saves them)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10**7)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype), **loading)
    if bnb and kbit_prep:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(fields.get("gradient_checkpointing")))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(output_dir=output_dir, max_steps=STEPS, report_to="none", save_strategy="no",
                                 disable_tqdm=True, **fields)
        count = STEPS * args.per_device_train_batch_size * args.gradient_accumulation_steps
        rows = token_rows(model.config.vocab_size, seq_len, count)
        recorder = MemoryRecorder(out, model=None if cpu_check else model_name, gpu="h200",
                                  readings=_FakeCuda() if cpu_check else None,
                                  kbit_prep=kbit_prep if bnb else None)
        Trainer(model=model, args=args, train_dataset=rows,
                callbacks=[_raw_readings(out, index, cpu_check), recorder]).train()


def _raw_readings(out: str, index: int, cpu_check: bool):
    """A callback that writes the readings alone, before the recorder builds its row (which imports more of
    llmsim): one JSON line per job beside the CSV, so a row the recorder could not write is still evidence; on the
    GPU the job's allocator events too (`_save_allocator_trace`)."""
    import torch
    from transformers import TrainerCallback

    class RawReadings(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            if cpu_check:
                figures = {"allocated": _FakeCuda().peaks()[0]}
            else:
                free, total = torch.cuda.mem_get_info()
                figures = {"allocated": torch.cuda.max_memory_allocated(),
                           "reserved": torch.cuda.max_memory_reserved(), "used_at_end": total - free,
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
                _save_allocator_trace(Path(out).parent / f"trainer_trace_{index:02d}.pkl")
            with open(Path(out).with_suffix(".raw.jsonl"), "a") as handle:
                handle.write(json.dumps({"job": index, "name": JOBS[index][0], **figures}) + "\n")

    return RawReadings()


def _save_allocator_trace(path: Path) -> None:
    """The job's CUDA allocator events, in the kit's format (experiments/gpu_validation.py `allocator_events`)."""
    import pickle

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's root
    from experiments.gpu_validation import allocator_events

    with open(path, "wb") as handle:
        pickle.dump({"allocator": allocator_events()}, handle)


def _bundle_traces(out: Path) -> None:
    """The jobs' allocator traces and raw readings in one archive, DIR/trainer_traces.tar.gz (a lent machine sends
    back 8 files at most)."""
    import tarfile

    members = sorted(out.glob("trainer_trace_*.pkl")) + sorted(out.glob("*.raw.jsonl"))
    if not members:
        return
    with tarfile.open(out / "trainer_traces.tar.gz", "w:gz") as tar:
        for path in members:
            tar.add(path, arcname=path.name)
    for path in members:
        path.unlink()


def dry_run() -> int:
    """Each job's prediction for an H200, as `llmsim validate` will make it (the recorder's row, before the run)."""
    from llmsim.app.report import human_bytes
    from llmsim.inputs.gpus import load_gpu
    from llmsim.inputs.hf import trainer_setup
    from llmsim.inputs.spec import load_model_spec
    from llmsim.sim.pipeline import predict
    from llmsim.sim.strategies import trainer_layout

    gpu = load_gpu("h200")
    for name, model, seq_len, fields, lora, dtype, bnb, kbit_prep in JOBS:
        spec = load_model_spec(model)
        setup = trainer_setup(spec, seq_len, fields, lora, dtype, bnb, kbit_prep=kbit_prep if bnb else True)
        setup, layout = trainer_layout(spec, setup, 1, None)
        rank = predict(spec, setup, layout, gpu).ranks[0]
        print(f"{model} {name}: allocated {human_bytes(rank.peak_allocated_bytes)}, reserved "
              f"{human_bytes(rank.peak_reserved_bytes)}, device total {human_bytes(rank.device_total_bytes)}",
              flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="write rows (tier4_trainer_gpu.csv), the configs and a log here")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="start no job after this many seconds")
    parser.add_argument("--cpu-check", type=Path, help="run every job cut small on this CPU, rows to this folder")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--only", help="comma-separated job indices")
    parser.add_argument("--checkpoint", nargs=2, help=argparse.SUPPRESS)  # child: MODEL DIR
    parser.add_argument("--job", nargs=3, help=argparse.SUPPRESS)  # child: INDEX CHECKPOINT CSV
    args = parser.parse_args()
    cpu_check = args.cpu_check is not None
    if args.checkpoint:
        write_checkpoint(*args.checkpoint, cpu_check)
        return 0
    if args.job:
        run_job(int(args.job[0]), args.job[1], args.job[2], cpu_check)
        return 0
    if args.dry_run:
        return dry_run()
    out = args.cpu_check or args.out
    out.mkdir(parents=True, exist_ok=True)
    csv = out / ("tier4_trainer_cpu_check.csv" if cpu_check else "tier4_trainer_gpu.csv")
    flags = ["--cpu-check", str(args.cpu_check)] if cpu_check else []
    indices = [int(i) for i in args.only.split(",")] if args.only else range(len(JOBS))
    start, failures = time.perf_counter(), 0
    with tempfile.TemporaryDirectory() as scratch:
        checkpoints = {}
        for index in indices:
            if time.perf_counter() - start > args.deadline:
                print(f"deadline: job {index} and after not run", flush=True)
                break
            name, model = JOBS[index][:2]
            began = time.perf_counter()
            try:
                if model not in checkpoints:
                    directory = str(Path(scratch) / model)
                    subprocess.run([sys.executable, __file__, "--checkpoint", model, directory, *flags], check=True,
                                   capture_output=True, text=True, timeout=PER_JOB_TIMEOUT_S)
                    checkpoints[model] = directory
                    print(f"checkpoint {model}: {time.perf_counter() - began:.0f} s", flush=True)
                proc = subprocess.run([sys.executable, __file__, "--job", str(index), checkpoints[model], str(csv),
                                       *flags], capture_output=True, text=True, timeout=PER_JOB_TIMEOUT_S)
                if proc.returncode:
                    raise RuntimeError(proc.stderr[-3000:])
            except (subprocess.SubprocessError, RuntimeError) as error:
                failures += 1
                text = getattr(error, "stderr", None) or str(error)
                print(f"FAILED {model} {name}: {type(error).__name__}\n{str(text)[-3000:]}", flush=True)
                with open(out / "failures.log", "a") as log:
                    log.write(f"=== trainer job {index}: {model} {name}\n{text}\n")
                continue
            print(f"{model} {name}: {time.perf_counter() - began:.0f} s", flush=True)
    if not cpu_check:
        _bundle_traces(out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
