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


def test_a_recorded_qlora_job_carries_its_quantization_and_must_say_whether_it_was_prepared(tmp_path):
    """A bitsandbytes base: the row holds the checkpoint's BitsAndBytesConfig and from_pretrained's dtype (which the
    packed, upcast parameters no longer show), and `kbit_prep` as the user states it; unstated, validate refuses."""
    import pytest
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, Trainer, TrainingArguments

    from llmsim.errors import InputError

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    rows = [{"input_ids": list(range(i, i + 16)), "labels": list(range(i, i + 16))} for i in range(12)]
    for kbit_prep, out in ((True, tmp_path / "prepared.csv"), (None, tmp_path / "unsaid.csv")):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path / "ckpt", dtype=torch.bfloat16,
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.bfloat16))
        model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False),
                               LoraConfig(r=4, target_modules="all-linear"))
        args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                                 use_cpu=True, report_to="none", save_strategy="no", bf16=True, disable_tqdm=True)
        recorder = MemoryRecorder(out, readings=FakeH100(), kbit_prep=kbit_prep)
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[recorder]).train()
    row = pd.read_csv(tmp_path / "prepared.csv").iloc[0]
    assert row["dtype"] == "bfloat16" and json.loads(row["quantization_config"])["bnb_4bit_quant_type"] == "nf4"
    spec, setup, layout = row_inputs(row)
    assert (setup.quant, setup.double_quant, setup.kbit_prep, setup.load_dtype) == ("nf4", True, True, "bfloat16")
    with pytest.raises(InputError, match="prepare_model_for_kbit_training"):
        row_inputs(pd.read_csv(tmp_path / "unsaid.csv").iloc[0])
