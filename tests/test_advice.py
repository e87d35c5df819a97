"""`llmsim predict --suggest` (llmsim/app/advice.py): every suggestion is the direct prediction of the changed job,
only changes that fit are listed, cheapest first, and the changes are spelled as the user gives them."""
import json
from dataclasses import replace

import pytest

from llmsim.app.advice import candidates, suggestions
from llmsim.app.cli import main
from llmsim.inputs.gpus import load_gpu
from llmsim.inputs.hf import trainer_setup
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout

GPT2_TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000}


def _card_between(model, setup, layout, fitting_setup, fitting_layout=Layout()):
    """An H100 profile shrunk so that the job as given does not fit and `fitting_setup` does, margin 5 %."""
    h100 = load_gpu("h100-80gb")
    needed = predict(model, setup, layout, h100).deciding_rank.needed_bytes
    smaller = predict(model, fitting_setup, fitting_layout, h100).deciding_rank.needed_bytes
    assert smaller < needed
    return replace(h100, name="test-card", capacity_bytes=round((needed + smaller) / 2 / (1 - h100.margin)))


def test_each_suggestion_is_the_direct_prediction_of_the_changed_job():
    spec = load_model_spec("gpt2", GPT2_TINY)
    setup = TrainSetup(micro_batch=4, seq_len=64)
    lora = replace(setup, lora_rank=16)
    card = _card_between(spec, setup, Layout(), lora)
    assert predict(spec, setup, Layout(), card).verdict in ("tight", "oom")
    advice = suggestions(spec, setup, Layout(), card)
    assert advice and all(s.verdict == "fits" for s in advice)
    assert "--lora-rank 16" in [s.change for s in advice]
    changes = {c.change: c for c in candidates(spec, setup, Layout())}
    order = list(changes)
    assert [s.change for s in advice] == sorted((s.change for s in advice), key=order.index)  # cheapest first
    for s in advice:
        change = changes[s.change]
        direct = predict(spec, change.setup, change.layout, card).deciding_rank
        assert (s.needed_bytes, s.peak_allocated_bytes) == (direct.needed_bytes, direct.peak_allocated_bytes)
    # what does not fit is not listed: a card below every change's need lists nothing
    tiny = replace(card, capacity_bytes=card.cuda_context_bytes + 1)
    assert suggestions(spec, setup, Layout(), tiny) == []


def test_the_trainers_suggestions_are_edits_of_its_files():
    spec = load_model_spec("gpt2", GPT2_TINY)
    setup = trainer_setup(spec, 64, {"per_device_train_batch_size": 4, "optim": "adamw_torch"})
    changes = [c.change for c in candidates(spec, setup, Layout())]
    assert changes == ["optim: adamw_torch_fused", "optim: adamw_8bit", "gradient_checkpointing: true",
                       "per_device_train_batch_size: 2, gradient_accumulation_steps: 2",
                       "--peft-config with r 16 on all-linear"]
    checkpointed = candidates(spec, setup, Layout())[2].setup
    assert checkpointed.grad_ckpt and json.loads(checkpointed.training_args)["gradient_checkpointing"] is True


def test_suggest_on_the_command_line(capsys, monkeypatch):
    from llmsim.app import options

    base = ["predict", "--model", "gpt2", "--seq-len", "64", "--micro-batch", "4"]
    for key, value in GPT2_TINY.items():
        base += ["--set", f"{key}={value}"]
    assert main([*base, "--suggest"]) == 2
    assert "needs --gpu" in capsys.readouterr().err
    assert main([*base, "--suggest", "--gpu", "h100-80gb", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "fits" and "suggestions" not in out  # nothing to suggest for a job that fits
    spec = load_model_spec("gpt2", GPT2_TINY)
    setup = TrainSetup(micro_batch=4, seq_len=64)
    card = _card_between(spec, setup, Layout(), replace(setup, lora_rank=16))
    monkeypatch.setattr(options, "gpu_of", lambda args: card)  # the shrunk card in place of --gpu's
    assert main([*base, "--suggest", "--gpu", "h100-80gb", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] in ("tight", "oom") and "--lora-rank 16" in [s["change"] for s in out["suggestions"]]
    assert all(s["verdict"] == "fits" and s["needed_bytes"] > 0 for s in out["suggestions"])
    assert main([*base, "--suggest", "--gpu", "h100-80gb"]) == 0
    assert "would fit on test-card (cheapest first" in capsys.readouterr().out
    # a tight or oom verdict lists them by default; --no-suggest leaves them out
    assert main([*base, "--gpu", "h100-80gb", "--format", "json"]) == 0
    assert "--lora-rank 16" in [s["change"] for s in json.loads(capsys.readouterr().out)["suggestions"]]
    assert main([*base, "--no-suggest", "--gpu", "h100-80gb", "--format", "json"]) == 0
    assert "suggestions" not in json.loads(capsys.readouterr().out)


def test_a_zero_job_is_offered_its_optimizer_offloaded_once():
    from llmsim.enums import Precision
    from llmsim.inputs.dsconfig import ds_setup
    from llmsim.sim.strategies import Strategy

    model = load_model_spec("gpt2", GPT2_TINY)
    setup = TrainSetup(1, 32, Precision.BF16)
    for stage in (1, 2, 3):
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
        layout = Layout(Strategy.DEEPSPEED, 2, ds_setup(config, 2, 64, None, None))
        offered = [c for c in candidates(model, setup, layout) if c.layout.deepspeed is not None
                   and c.layout.deepspeed.offloads_optimizer]
        assert len(offered) == 1 and offered[0].layout.deepspeed.stage == stage and offered[0].setup == setup
        assert offered[0].layout.deepspeed.config["zero_force_ds_cpu_optimizer"] is False
        # already offloading: not offered again
        assert not [c for c in candidates(model, setup, offered[0].layout) if "offloaded" in c.change]
