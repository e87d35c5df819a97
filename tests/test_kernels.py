"""The trace picks CUDA's kernels for a GPU target and the CPU's for --device cpu (issue 6)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmsim.model import kernels
from llmsim.enums import Attention, Precision
from llmsim.inputs.gpus import load_gpu, on_gpu
from llmsim.model.kernels import SdpaBackend, cuda_autocast_policy, select_sdpa_backend
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.model.trace import run_fake
from llmsim.model.tracker import StorageTracker
from llmsim.inputs.zoo import shrink

A100, H100, V100, RTX4090 = (8, 0), (9, 0), (7, 0), (8, 9)


def test_autocast_lists_are_the_installed_torch_kernels():
    cuda = set(kernels.CUDA_POLICY)
    assert kernels.autocast_ops("AutocastCUDA") == cuda | set(kernels.CUDA_BANNED)
    assert kernels.autocast_ops("AutocastCPU") - cuda == set(kernels.CPU_ONLY)


def _qkv(dtype, heads=8, kv_heads=8, seq=128, head_dim=64, kv_seq=None):
    with FakeTensorMode():
        q = torch.empty(2, heads, seq, head_dim, dtype=dtype, requires_grad=True)
        k = torch.empty(2, kv_heads, kv_seq or seq, head_dim, dtype=dtype, requires_grad=True)
        v = torch.empty(2, kv_heads, kv_seq or seq, head_dim, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("capability, dtype, kw, mask, causal, gqa, expected", [
    (H100, torch.bfloat16, {}, False, True, False, SdpaBackend.FLASH),
    (A100, torch.float16, {"kv_heads": 2}, False, True, True, SdpaBackend.FLASH),  # flash takes GQA
    (A100, torch.float32, {}, False, True, False, SdpaBackend.EFFICIENT),  # no fp32 flash
    (A100, torch.float32, {"kv_heads": 2}, False, True, True, SdpaBackend.MATH),  # no GQA in efficient (2.13)
    (A100, torch.bfloat16, {}, True, False, False, SdpaBackend.EFFICIENT),  # a mask rules flash out
    (V100, torch.float16, {}, False, True, False, SdpaBackend.EFFICIENT),  # flash needs sm80
    (V100, torch.bfloat16, {}, False, True, False, SdpaBackend.MATH),  # bf16 efficient needs sm80
    (V100, torch.float16, {"head_dim": 60}, False, True, False, SdpaBackend.MATH),  # fp16 alignment 8 on sm70
    (A100, torch.float16, {"head_dim": 60}, False, True, False, SdpaBackend.FLASH),  # flash pads to 8
    (RTX4090, torch.bfloat16, {"head_dim": 200}, False, True, False, SdpaBackend.EFFICIENT),  # sm89, d in (192,224]
    (H100, torch.bfloat16, {"head_dim": 200}, False, True, False, SdpaBackend.FLASH),
    (H100, torch.bfloat16, {"head_dim": 320}, False, True, False, SdpaBackend.EFFICIENT),  # flash: d <= 256
    (H100, torch.bfloat16, {"kv_seq": 256}, False, True, False, SdpaBackend.EFFICIENT),  # causal, S_q != S_k
])
def test_sdpa_backend_rules(capability, dtype, kw, mask, causal, gqa, expected):
    q, k, v = _qkv(dtype, **kw)
    attn_mask = q.new_empty(1, 1, q.shape[2], k.shape[2]) if mask else None
    assert select_sdpa_backend(capability, q, k, v, attn_mask, 0.0, causal, gqa) is expected


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.seen.setdefault(func.__name__, set()).add(first.dtype if first is not None else None)
        return out


def _ops(model, shape, setup):
    with _Ops() as ops:
        run_fake(load_model_spec(model, shrink(model, *shape)), setup, None)
    return ops.seen


LLAMA = ("llama-2-7b", 128, 2, 1000, 4)


def test_trace_runs_cpu_kernels_for_the_cpu_and_cuda_kernels_for_a_gpu():
    setup = TrainSetup(1, 64, Precision.BF16, Attention.SDPA)
    cpu = _ops(LLAMA[0], LLAMA[1:], setup)
    assert "_scaled_dot_product_flash_attention_for_cpu.default" in cpu
    h100 = _ops(LLAMA[0], LLAMA[1:], on_gpu(setup, load_gpu("h100-80gb")))
    assert {"_scaled_dot_product_flash_attention.default",
            "_scaled_dot_product_flash_attention_backward.default"} <= set(h100)
    assert not any("for_cpu" in op for op in h100)
    v100 = _ops(LLAMA[0], LLAMA[1:], on_gpu(TrainSetup(1, 64, Precision.FP16, Attention.SDPA), load_gpu("v100-16gb")))
    assert "_scaled_dot_product_efficient_attention_backward.default" in v100
    # the math path on CUDA: the attention matrix in fp32 (half inputs are upcast), no fused kernel
    math = _ops(LLAMA[0], LLAMA[1:], on_gpu(setup, load_gpu("v100-16gb")))
    assert math["_safe_softmax.default"] == {torch.float32} and not any("flash" in op for op in math)


def test_trace_applies_cudas_autocast_policy():
    setup = TrainSetup(1, 64, Precision.BF16_AUTOCAST, Attention.EAGER)
    gpt2 = ("gpt2", (64, 2, 512, 4))
    cpu = _ops(gpt2[0], gpt2[1], setup)
    cuda = _ops(gpt2[0], gpt2[1], on_gpu(setup, load_gpu("a100-80gb")))
    # gelu_new: pow(x, 3) is fp32 on CUDA (so is the tanh after it), low precision on the CPU
    for op in ("pow.Tensor_Scalar", "tanh.default"):
        assert cpu[op] == {torch.bfloat16} and cuda[op] == {torch.float32}


def test_cuda_autocast_policy_casts_and_caches_like_cuda():
    x = torch.randn(4, 4, dtype=torch.bfloat16)
    weight = torch.randn(4, 4, requires_grad=True)
    with cuda_autocast_policy():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.softmax(x, -1).dtype == torch.float32  # fp32_set_opt_dtype
            assert torch.softmax(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype stays
            assert torch.nn.functional.layer_norm(x, (4,)).dtype == torch.float32  # fp32
            assert torch.cat([x, x.float()]).dtype == torch.float32  # cat is not CUDA's: plain type promotion
            products = [torch.mm(x.float(), weight) for _ in range(2)]
            assert products[0].dtype == torch.bfloat16 and len(kernels._CACHE.casts) == 1  # the weight cast once
        assert not kernels._CACHE.casts  # the outermost region's exit clears it
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's own policy is back
        assert torch.softmax(x, -1).dtype == torch.bfloat16


def test_flash_attention_keeps_what_cuda_keeps():
    """After the forward of one flash call: out, the fp32 log-sum-exp (B, H, S) and the RNG state (16 + 8 B)."""
    tracker = StorageTracker()
    sdpa = kernels.cuda_scaled_dot_product_attention(H100)
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 8, 128, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with tracker:
            out = sdpa(q, k, v, is_causal=True)
            alive = sum(tracker.timeline()["delta_bytes"])
    assert out.shape == q.shape
    assert alive == q.numel() * 2 + 2 * 8 * 128 * 4 + 16 + 8
