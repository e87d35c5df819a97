"""peft's extras under ZeRO-0/1/2 (tier2_zero_extras_cpu.csv) and where AdamW's `step` counters live on a GPU."""
import json

import torch

from llmsim.app.cli import main
from llmsim.model.step import host_state
from llmsim.sim.strategies.zero0 import buckets

TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256"]
TINY_PARAMETERS = 2 * 9 + 3  # per layer: q, k, v, o, gate, up, down and two norms; embedding, norm, LM head
STEP_BYTES = 4  # a 0-d fp32 tensor


def test_zero0_flattens_no_lone_gradient():
    """`_flatten_dense_tensors` of one tensor is a view: only buckets of two or more gradients are copied."""
    assert buckets([1024]) == []
    assert buckets([3, 5]) == [8]
    assert buckets([6, 5, 7, 2], limit=10) == [11, 9]  # [6, 5] closes past the limit, [7, 2] is what is left
    assert buckets([6, 5, 20], limit=10) == [11]  # the 20-element gradient alone: a view


def _adamw_states(**kwargs):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], **kwargs)
    p.grad = torch.ones(3)
    opt.step()
    return opt, p


def test_host_state_is_the_for_loop_and_foreach_step_on_a_gpu():
    for kwargs in ({}, {"foreach": True}):
        opt, p = _adamw_states(**kwargs)
        group, state = opt.param_groups[0], opt.state[p]
        assert host_state(opt, group, p, "step", state["step"], gpu=True)
        assert not host_state(opt, group, p, "exp_avg", state["exp_avg"], gpu=True)
        assert not host_state(opt, group, p, "step", state["step"], gpu=False)  # the CPU is the device
    opt, p = _adamw_states(fused=True)
    assert not host_state(opt, opt.param_groups[0], p, "step", opt.state[p]["step"], gpu=True)


def _predict(*args):
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["predict", *TINY, "--seq-len", "16", "--micro-batch", "2", "--format", "json", *args]) == 0
    return json.loads(out.getvalue())


def test_gpu_prediction_keeps_host_steps_off_the_device():
    """On a GPU the foreach AdamW's `step` counters are host memory (one per parameter), the fused one's device."""
    foreach = _predict("--gpu", "h100-80gb")
    fused = _predict("--gpu", "h100-80gb", "--fused")
    cpu = _predict()
    assert foreach["peak_host_bytes"] == TINY_PARAMETERS * STEP_BYTES
    assert fused["peak_host_bytes"] == cpu["peak_host_bytes"] == 0


def test_gpu_zero_ranks_keep_host_steps_off_the_device(tmp_path):
    """ZeRO-1/2 step one flat fp32 partition: one host `step`; ZeRO-3 one per sub-group, and on a GPU its
    initialize stages the partitions in a host buffer (`defragment`), which is then the host peak."""
    for stage in (1, 2, 3):
        path = tmp_path / f"ds{stage}.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}))
        out = _predict("--ds-config", str(path), "--world-size", "2", "--gpu", "h100-80gb")
        hosts = [r["peak_host_bytes"] for r in out["ranks"]]
        if stage < 3:
            assert hosts == [STEP_BYTES] * 2, stage
            continue
        # the embedding and the LM head (256 x 64 each), the final norm, 2 layers of q/k/v/o (64 x 64), gate/up/down
        # (64 x 128) and two norms: every numel even, so each rank holds half of them, in fp32
        numel = 2 * 256 * 64 + 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64)
        assert hosts == [numel // 2 * 4] * 2
