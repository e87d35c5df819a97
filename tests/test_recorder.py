"""The recorder a user adds to a real GPU job (llmsim/measure/recorder.py): run here on the CPU with its CUDA
readings faked, it writes a row that `llmsim validate` re-predicts, with the job's own inputs."""
import json

import pandas as pd
import torch

from llmsim.inputs.gpus import load_gpu
from llmsim.measure.recorder import MemoryRecorder
from llmsim.measure.validate import row_inputs, validate
from llmsim.sim.pipeline import predict


class FakeH100:
    def device_name(self):
        return "NVIDIA H100 80GB HBM3"

    def peaks(self):
        return 1_000_000, 2_000_000

    def used(self):
        return 3_000_000


def _job(tmp_path, out):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256)
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    rows = [{"input_ids": list(range(i, i + 16)), "labels": list(range(i, i + 16))} for i in range(12)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=3,
                             use_cpu=True, report_to="none", save_strategy="no", optim="adamw_torch",
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[MemoryRecorder(out, readings=FakeH100())]).train()


def test_a_recorded_job_is_a_row_validate_re_predicts(tmp_path):
    out = tmp_path / "gpu-rows.csv"
    _job(tmp_path, out)
    row = pd.read_csv(out).iloc[0]
    assert (row["tier"], row["recipe"], row["gpu"], row["seq_len"], row["dtype"]) == \
        (4, "hf-trainer", "h100-80gb", 16, "float32")
    assert (row["peak_allocated_bytes"], row["peak_reserved_bytes"], row["device_total_bytes"]) == \
        (1_000_000, 2_000_000, 3_000_000)
    fields = json.loads(row["training_args"])
    assert fields["per_device_train_batch_size"] == 2 and fields["optim"] == "adamw_torch"
    assert "learning_rate" not in fields  # left at its default: not recorded
    assert json.loads(row["peft_config"])["r"] == 4
    # the model's config was written beside the CSV, and llmsim loads it
    spec, setup, layout = row_inputs(row.assign(source=out.name) if hasattr(row, "assign") else row)
    assert spec.hf_config().hidden_size == 64 and setup.lora_rank == 4 and setup.micro_batch == 2
    # a GPU that matched the prediction, then one 10 % above it: validate compares all three figures
    rank = predict(spec, setup, layout, load_gpu("h100-80gb")).ranks[0]
    frame = pd.read_csv(out)
    frame[["peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"]] = \
        [rank.peak_allocated_bytes, rank.peak_reserved_bytes, rank.device_total_bytes]
    assert validate(frame.assign(source=out.name))["ok"].all()
    frame["device_total_bytes"] = int(rank.device_total_bytes * 1.1)
    assert not validate(frame.assign(source=out.name))["ok"].any()
