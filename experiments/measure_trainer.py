"""Measure the HF Trainer recipe through the entry points: data/measurements/trainer_cpu.csv.

Each run is `llmsim measure --training-args ... [--peft-config ...] [--dtype ...]` in a fresh process, as a
user's script starts: `from_pretrained` from a checkpoint written before the measured region, optional
`get_peft_model(LoraConfig(...))`, `Trainer(...).train()` for three steps (llmsim/model/trainer_recipe.py).
Small real shapes of four families: Llama (untied), Qwen2 (tied embeddings, biased q/k/v), GPT-2 (Conv1D, learned
positions), GPT-NeoX (Pythia). Run: python experiments/measure_trainer.py [--out CSV] [--only N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "measurements" / "trainer_cpu.csv"
SEQ_LEN = 128
MODELS = {
    "llama-2-7b": {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_hidden_layers": 4,
                   "num_key_value_heads": 4, "vocab_size": 2000},
    "qwen2.5-0.5b": {"hidden_size": 128, "intermediate_size": 320, "num_attention_heads": 4, "num_hidden_layers": 3,
                     "num_key_value_heads": 2, "vocab_size": 3000, "max_window_layers": 3},
    "gpt2": {"n_layer": 3, "n_embd": 96, "n_head": 4, "vocab_size": 1500},
    "pythia-160m": {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 3,
                    "vocab_size": 2500},
}
BASE = {"per_device_train_batch_size": 2, "learning_rate": 2e-5}
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
# (name, TrainingArguments fields over BASE, LoraConfig or None, from_pretrained dtype)
CASES = [
    ("default optim (adamw_torch_fused)", {}, None, "float32"),
    ("adamw_torch", {"optim": "adamw_torch"}, None, "float32"),
    ("sgd", {"optim": "sgd"}, None, "float32"),
    ("adafactor", {"optim": "adafactor"}, None, "float32"),
    ("adamw_8bit", {"optim": "adamw_8bit"}, None, "float32"),
    ("no clipping", {"optim": "adamw_torch", "max_grad_norm": 0.0}, None, "float32"),
    ("accumulation 4", {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 1}, None, "float32"),
    ("bf16 autocast", {"bf16": True}, None, "float32"),
    ("fp16 autocast + GradScaler", {"fp16": True}, None, "float32"),
    ("loaded in bf16", {}, None, "bfloat16"),
    ("loaded in bf16, bf16=True", {"bf16": True}, None, "bfloat16"),
    ("checkpointing, bf16", {"gradient_checkpointing": True, "bf16": True}, None, "float32"),
    ("LoRA all-linear", {}, LORA, "float32"),
    ("LoRA dropout 0.1, bf16 weights", {}, {**LORA, "lora_dropout": 0.1}, "bfloat16"),
    ("DoRA", {}, {**LORA, "use_dora": True}, "float32"),
    ("rsLoRA, bias lora_only, checkpointing", {"gradient_checkpointing": True},
     {**LORA, "use_rslora": True, "bias": "lora_only"}, "float32"),
]


def run_case(model: str, fields: dict, peft: dict | None, dtype: str, out: Path) -> int:
    with tempfile.TemporaryDirectory() as directory:
        args_path = Path(directory) / "training_args.json"
        args_path.write_text(json.dumps({**BASE, **fields}))
        command = [sys.executable, "-m", "llmsim.app.cli", "measure", "--model", model, "--seq-len", str(SEQ_LEN),
                   "--training-args", str(args_path), "--dtype", dtype, "--out", str(out)]
        for key, value in MODELS[model].items():
            command += ["--set", f"{key}={json.dumps(value)}"]
        if peft is not None:
            peft_path = Path(directory) / "adapter_config.json"
            peft_path.write_text(json.dumps(peft))
            command += ["--peft-config", str(peft_path)]
        done = subprocess.run(command, capture_output=True, text=True)
        last = (done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-1]
        print(f"{model:14} {dtype:9} {json.dumps(fields)[:60]:60} {'lora' if peft else '':4} -> {last}", flush=True)
        return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--only", type=int, default=None, help="the first N cases of each model")
    args = parser.parse_args()
    failures = 0
    for model in MODELS:
        for name, fields, peft, dtype in CASES[: args.only]:
            failures += run_case(model, fields, peft, dtype, Path(args.out)) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
