"""TRL's SFTTrainer (recipe trl-sft): the user's SFTConfig read with TRL's class (its defaults are not the Trainer's),
the real SFTTrainer measured through its entry points (llmsim/model/trainer_recipe.py), the prediction (TRL's trainer
traced under fake tensors: its fused LM head, its collator) against both."""
import json
import sys

import pandas as pd
import pytest

from llmsim.app.cli import main
from llmsim.enums import Precision, Recipe
from llmsim.errors import InputError
from llmsim.inputs.hf import recipe_facts, trainer_setup
from llmsim.inputs.spec import load_model_spec
from llmsim.measure.runs import MEASUREMENTS_DIR, measure_trainer
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.sim.pipeline import predict

SFT_CSV = MEASUREMENTS_DIR / "trainer_sft_cpu.csv"
SFT_DDP_CSV = MEASUREMENTS_DIR / "trainer_sft_ddp_cpu.csv"
LLAMA_TINY = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_hidden_layers": 3,
              "num_key_value_heads": 2, "vocab_size": 800}


def _setup(fields, peft=None, dtype="float32", seq_len=48, model="llama-2-7b", overrides=LLAMA_TINY):
    spec = load_model_spec(model, overrides)
    return spec, trainer_setup(spec, seq_len, fields, peft, dtype, recipe=Recipe.TRL_SFT)


def test_an_sft_config_is_read_with_trls_defaults_not_the_trainers():
    """The same empty file means checkpointing and bf16 autocast to TRL (SFTConfig), neither to transformers."""
    spec, sft = _setup({"per_device_train_batch_size": 2})
    plain = trainer_setup(spec, 48, {"per_device_train_batch_size": 2}, None, "float32")
    assert sft.grad_ckpt and sft.precision is Precision.BF16_AUTOCAST and sft.recipe is Recipe.TRL_SFT
    assert not plain.grad_ckpt and plain.precision is Precision.FP32
    facts = recipe_facts(sft)
    assert facts["recipe"] == "trl-sft" and facts["loss"] == "TRL's fused LM head (nll)" and "max_length" not in facts
    _, long_rows = _setup({"max_length": 32})
    assert recipe_facts(long_rows)["max_length"] == "32 (rows of 48 tokens truncated)"


@pytest.mark.parametrize("fields, peft, quantization, says", [
    ({"gradient_checkpointing": True, "max_lenght": 64}, None, None, "unknown SFTConfig field 'max_lenght' (did you "
                                                                      "mean 'max_length'?)"),
    ({"packing": True}, None, None, "SFTConfig packing=True: packing"),
    ({"padding_free": True}, None, None, "SFTConfig padding_free=True"),
    ({"loss_type": "nope"}, None, None, "SFTConfig loss_type='nope': valid choices: nll, dft, chunked_nll"),
    ({"activation_offloading": True}, None, None, "activation offloading is not modelled yet"),
    ({"pad_to_multiple_of": 64}, None, None, "SFTConfig pad_to_multiple_of=64: padding rows"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, None, None, "TRL's SFTTrainer under DeepSpeed is not "
                                                                     "modelled yet"),
    ({"fsdp": True}, None, None, "TRL's SFTTrainer with the SFTConfig's fsdp is not modelled yet"),
    ({}, {"r": 4, "target_modules": "all-linear"}, {"load_in_4bit": True}, "a BitsAndBytesConfig base with "
                                                                            "--sft-config is not modelled yet"),
])
def test_what_the_sft_recipe_does_not_model_is_one_line(fields, peft, quantization, says):
    spec = load_model_spec("llama-2-7b", LLAMA_TINY)
    with pytest.raises(InputError) as raised:
        trainer_setup(spec, 48, fields, peft, "float32", quantization, recipe=Recipe.TRL_SFT)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_sft_cli_errors_are_one_line(tmp_path, capsys):
    sft = tmp_path / "sft.yaml"
    sft.write_text("per_device_train_batch_size: 2\n")
    args = tmp_path / "args.json"
    args.write_text("{}")
    base = ["predict", "--model", "llama-2-7b", "--seq-len", "48", "--dtype", "float32"]
    sets = [arg for key, value in LLAMA_TINY.items() for arg in ("--set", f"{key}={value}")]
    for extra, says in (
            (["--sft-config", str(sft), "--training-args", str(args)], "--sft-config and --training-args both"),
            (["--sft-config", str(sft), "--gpu", "a100-40gb"], "TRL's SFTTrainer on a GPU (--gpu) is not modelled"),
            (["--sft-config", str(tmp_path / "missing.yaml")], "cannot read SFTConfig file")):
        capsys.readouterr()
        assert main(base + sets + extra) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_without_trl_an_sft_config_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError, as where it is not installed
    with pytest.raises(InputError, match=r'needs trl installed: pip install "llmsim\[trl\]"'):
        _setup({})


FRESH = [  # (model, overrides, SFTConfig fields, LoraConfig fields given to SFTTrainer, dtype)
    ("mistral-7b", {**LLAMA_TINY, "num_hidden_layers": 5}, {"per_device_train_batch_size": 2},
     {"r": 4, "target_modules": "all-linear", "lora_dropout": 0.1}, "bfloat16"),
    ("qwen2.5-0.5b", {**LLAMA_TINY, "num_hidden_layers": 4, "max_window_layers": 4},
     {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_length": 40}, None, "float32"),
]


@pytest.mark.parametrize("model, overrides, fields, peft, dtype", FRESH, ids=["mistral-lora", "qwen2-truncated"])
def test_a_fresh_sft_run_matches_its_prediction(model, overrides, fields, peft, dtype):
    """A family the committed rows do not hold (Mistral) and a tied one truncated by max_length, deeper than the
    trace: TRL's trainer measured for real, then predicted."""
    spec, setup = _setup(fields, peft, dtype, 48, model, overrides)
    measured = measure_trainer(spec, setup, dtype)[0]["peak_allocated_bytes"]
    predicted = predict(spec, setup).peak_allocated_bytes
    assert abs(predicted - measured) / measured <= PEAK_ALLOCATED_TOLERANCE[1], (predicted, measured)


def test_committed_sft_rows_cover_the_recipe():
    """TRL's SFTTrainer as users run it: its defaults and the fields they change, LoRA through peft_config, four
    families; one process and torchrun's DDP."""
    rows = pd.read_csv(SFT_CSV)
    assert len(rows) >= 48 and (rows["recipe"] == "trl-sft").all() and (rows["trl"] == "1.16.0").all()
    fields = rows["training_args"].map(json.loads)
    assert {load_model_spec(m).config_dict["model_type"] for m in rows["model"]} == {"llama", "qwen2", "gpt2",
                                                                                       "gpt_neox"}
    assert fields.map(lambda f: set(f) == {"per_device_train_batch_size", "learning_rate"}).any()  # TRL's defaults
    for field, value in (("gradient_checkpointing", False), ("bf16", False), ("fp16", True), ("max_length", 64),
                         ("loss_type", "dft"), ("optim", "adafactor"), ("max_grad_norm", 0.0)):
        assert fields.map(lambda f: f.get(field) == value).any(), field
    assert set(rows["load_dtype"]) == {"float32", "bfloat16"}
    peft = rows["peft_config"].dropna().map(json.loads)
    assert peft.map(lambda p: p.get("use_dora", False)).any() and peft.map(lambda p: p.get("lora_dropout", 0)).any()
    ddp = pd.read_csv(SFT_DDP_CSV)
    assert len(ddp) >= 32 and (ddp["strategy"] == "ddp").all() and set(ddp["rank"]) == {0, 1}
