"""`llmsim compare`: every lever is a real prediction; the chart is written."""
import pytest

from llmsim.app.cli import main
from llmsim.app.compare import LEVERS, compare_levers
from llmsim.enums import Loss, Optimizer
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink


def test_each_lever_is_the_prediction_of_its_setup():
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 512, 4))
    frame = compare_levers(spec, TrainSetup(2, 64))
    assert list(frame["lever"]) == [label for label, _ in LEVERS]
    baseline = predict(spec, TrainSetup(2, 64)).peak_allocated_bytes
    lora = predict(spec, TrainSetup(2, 64, lora_rank=16)).peak_allocated_bytes
    assert frame["device_total_bytes"].iloc[0] == baseline
    assert frame.set_index("lever").loc["LoRA r=16", "device_total_bytes"] == lora
    qlora = predict(spec, TrainSetup(2, 64, lora_rank=16, quant="nf4", double_quant=True)).peak_allocated_bytes
    assert frame.set_index("lever").loc["QLoRA nf4 r=16", "device_total_bytes"] == qlora
    assert frame["saving_vs_baseline"].iloc[0] == 0
    offload = predict(spec, TrainSetup(2, 64, grad_ckpt=True, ckpt_offload=True))
    row = frame.set_index("lever").loc["checkpointing, inputs offloaded"]
    assert (row["device_total_bytes"], row["peak_host_bytes"]) == (offload.peak_allocated_bytes,
                                                                   offload.peak_host_bytes)
    assert offload.peak_host_bytes > 0 and frame["peak_host_bytes"].iloc[0] == 0
    liger = predict(spec, TrainSetup(2, 64, loss=Loss.FUSED_LINEAR_CE)).peak_allocated_bytes
    assert frame.set_index("lever").loc["fused linear CE (Liger)", "device_total_bytes"] == liger
    adamw8bit = predict(spec, TrainSetup(2, 64, optimizer=Optimizer.ADAMW_8BIT)).peak_allocated_bytes
    assert frame.set_index("lever").loc["8-bit AdamW (bitsandbytes)", "device_total_bytes"] == adamw8bit
    fused = predict(spec, TrainSetup(2, 64, fused=True)).peak_allocated_bytes
    assert frame.set_index("lever").loc["fused AdamW (fused=True)", "device_total_bytes"] == fused
    to_save = predict(spec, TrainSetup(2, 64, lora_rank=16, lora_modules_to_save=("lm_head",))).peak_allocated_bytes
    tokens = predict(spec, TrainSetup(2, 64, trainable_tokens=tuple(range(8)))).peak_allocated_bytes
    levers = frame.set_index("lever")["device_total_bytes"]
    assert levers["LoRA r=16 + LM head trained (modules_to_save)"] == to_save > lora  # the head's copy trains
    assert levers["trainable tokens (8 rows, no LoRA)"] == tokens < baseline


def test_compare_command_writes_the_chart(tmp_path, capsys):
    out = tmp_path / "levers.png"
    argv = ["compare", "--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4",
            "--set", "vocab_size=512", "--seq-len", "32", "--micro-batch", "2", "--gpu", "l4", "--out", str(out)]
    assert main(argv) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "LoRA r=16" in out and "Liger" not in out and "TRL" not in out  # gpt2 on a GPU: neither is modelled


def test_levers_modelled_under_ddp_are_compared_there():
    """Under DDP (tp = pp = 1) every lever but QLoRA is modelled: each row is that layout's own prediction."""
    from llmsim.sim.strategies import Layout, Strategy

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 512, 4))
    ddp = Layout(Strategy.DDP, 2)
    levers = compare_levers(spec, TrainSetup(2, 64), ddp).set_index("lever")
    skipped = {label for label, overrides in LEVERS if "quant" in overrides}
    assert set(levers.index) == {label for label, _ in LEVERS} - skipped
    for label, setup in (("chunked NLL (TRL)", TrainSetup(2, 64, loss=Loss.CHUNKED_NLL)),
                         ("trainable tokens (8 rows, no LoRA)", TrainSetup(2, 64, trainable_tokens=tuple(range(8)))),
                         ("checkpointing, inputs offloaded", TrainSetup(2, 64, grad_ckpt=True, ckpt_offload=True))):
        prediction = predict(spec, setup, ddp)
        assert levers.loc[label, "device_total_bytes"] == prediction.peak_allocated_bytes
        assert prediction.peak_allocated_bytes > predict(spec, setup).peak_allocated_bytes  # DDP's buckets on top


def test_a_deepspeed_optimizer_section_leaves_the_fused_lever_out(tmp_path, capsys):
    """A DeepSpeed JSON with an "optimizer" section steps DeepSpeed's optimizer (here CPU Adam under ZeRO-Infinity),
    so the lever that sets the client AdamW's fused path is not that run's: it is left out, the others compared
    (compare stopped at it with the --fused refusal before)."""
    import json

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 3, "offload_optimizer": {
                                      "device": "nvme", "nvme_path": "/local_nvme"}}}))
    argv = ["compare", "--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
            "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
            "--set", "vocab_size=512", "--seq-len", "32", "--ds-config", str(config), "--world-size", "2",
            "--out", str(tmp_path / "levers.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fused AdamW" not in out and "LoRA r=16" in out and "baseline" in out


@pytest.mark.slow  # local processes (multi-process); the one-process table is checked by default
def test_levers_in_processes_are_the_same_table():
    """`compare --jobs 2`: the lever sets predicted in two processes give the table one process gives."""
    import pandas as pd

    from llmsim.inputs.gpus import load_gpu
    from llmsim.sim.strategies import Layout, Strategy

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 512, 4))
    one = compare_levers(spec, TrainSetup(2, 64), Layout(Strategy.DDP, 2), load_gpu("h100-80gb"))
    two = compare_levers(spec, TrainSetup(2, 64), Layout(Strategy.DDP, 2), load_gpu("h100-80gb"), jobs=2)
    assert len(one) > 15 and one["peak_allocated_bytes"].nunique() > 10  # the levers differ
    pd.testing.assert_frame_equal(one, two)
