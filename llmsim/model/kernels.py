"""The kernels CUDA picks, chosen while the trace runs on CPU fake tensors (DESIGN.md stage 1).

A fake trace on the CPU device runs the CPU's kernels. For a GPU target (`TrainSetup.device` cuda, from
`--gpu`), `cuda_kernels(setup)` swaps in what differs on CUDA and changes memory:

- **SDPA backend**: `F.scaled_dot_product_attention` picks flash / memory-efficient / math as PyTorch's
  `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp` (`select_sdp_backend`, default priority flash ->
  efficient -> math -> cuDNN from `ATen/Context.h`) decides for the GPU's compute capability, dtype, head
  dim, mask and GQA, and runs it as `attention.cpp` does (bool mask -> additive, flash head-dim padding to a
  multiple of 8). Flash and efficient run their real aten ops, whose meta kernels give CUDA's output and
  log-sum-exp shapes (torch/_meta_registrations.py); their backward adds the temporaries the CUDA kernels
  allocate (flash-attention's `mha_bwd`: `softmax_d`, `dq_accum`, and full-head dk/dv for GQA; the
  memory-efficient backward's `delta`). Math is the composite `_scaled_dot_product_attention_math`
  (fp32 upcast of half inputs, the full attention matrix saved, `repeat_interleave` for GQA).
- **dropout**: `F.dropout` in training with 0 < p < 1 takes the fused `native_dropout` on CUDA
  (`aten/src/ATen/native/Dropout.cpp`, `is_fused_kernel_acceptable`), one kernel that writes the output and a
  bool mask, the mask saved for the backward (one byte an element); the CPU's `_dropout_impl` multiplies by a mask
  of the input's dtype (2 or 4 bytes an element, and its temporaries). Measured on an H200: GPT-2's 25 dropouts
  at 8 x 1024 x 768 saved 6,291,456 B masks each (experiments/gpu_runs/2026-12-04, the kit's first run).
- **MoE experts kernel**: transformers runs the experts with `grouped_mm` from sm80 and with its own per-expert
  fallback below (llmsim/model/moe.py, `grouped_mm_on_cuda`); on the CPU it takes grouped_mm.
- **autocast policy**: CUDA casts other ops than the CPU does (softmax, log_softmax, pow, exp, layer_norm,
  rms_norm, sum... run in fp32 on CUDA; on the CPU they stay in the low precision). The CPU autocast
  kernels are replaced for the duration of the trace by Python kernels with CUDA's policy
  (`ATen/autocast_mode.h` / `autocast_mode.cpp` of torch 2.13, lists below), weight casts cached per
  outermost autocast region as `cached_cast` does.

Not modelled (noted in the README): cuDNN attention, which recent PyTorch puts first on sm90/sm100 with
cuDNN >= 9.15.1 (its log-sum-exp has flash's size); the memory-efficient backward's accumulation workspace
and forward `output_accum` buffer (head dims > 128 in half precision); cuBLAS/cuBLASLt internal workspaces
beyond PyTorch's default (gpus.py).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from enum import Enum
from unittest import mock

import torch
import torch.nn.functional as F

from llmsim.enums import Device

HALF = (torch.float16, torch.bfloat16)


class SdpaBackend(str, Enum):
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


def _capability(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def select_sdpa_backend(capability: tuple[int, int], query, key, value, attn_mask, dropout_p: float,
                        is_causal: bool, enable_gqa: bool) -> SdpaBackend:
    """`select_sdp_backend` of sdp_utils.cpp for dense 4-D inputs, default priority (flash, efficient, math)."""
    if _can_use_flash(capability, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return SdpaBackend.FLASH
    if _can_use_efficient(capability, query, key, value):
        return SdpaBackend.EFFICIENT
    return SdpaBackend.MATH


def _heads_ok(query, key, value, enable_gqa: bool, supports_gqa: bool) -> bool:
    """`check_batch_size_and_num_heads_dense` (sdp_utils_cpp.h of torch 2.13)."""
    hq, hk, hv = query.shape[1], key.shape[1], value.shape[1]
    if hq == hk == hv:
        return True
    return supports_gqa and enable_gqa and hk == hv and hq % hk == 0


def _can_use_flash(capability, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    if not (8, 0) <= capability <= (12, 1):  # check_flash_attention_hardware_support
        return False
    if query.dtype not in HALF or attn_mask is not None:  # check_dtypes_flash_attention, check_for_attn_mask
        return False
    head_dim = query.shape[-1]
    if not (head_dim == key.shape[-1] == value.shape[-1] and head_dim <= 256):  # check_head_dim_size_flash
        return False
    sm86_to_89 = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    training = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if sm86_to_89 and training and (192 < head_dim <= 224 or (head_dim > 224 and dropout_p > 0)):
        return False  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if is_causal and query.shape[-2] != key.shape[-2]:  # check_flash_causal_non_square_seqlens
        return False
    return _heads_ok(query, key, value, enable_gqa, supports_gqa=True)


def _can_use_efficient(capability, query, key, value) -> bool:
    if not (5, 0) <= capability <= (12, 1):  # check_mem_efficient_hardware_support
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability >= (8, 0) else (torch.float16,
                                                                                          torch.float32)
    if query.dtype not in dtypes or query.shape[-1] != key.shape[-1]:
        return False
    if capability >= (8, 0):  # minimum_gemm_alignment
        alignment = 4 if query.dtype == torch.float32 else 8
    elif capability >= (7, 0):
        alignment = 1 if query.dtype == torch.float32 else 8
    else:
        alignment = 1
    if query.shape[-1] % alignment or value.shape[-1] % alignment:  # check_head_dim_size_mem_efficient
        return False
    return _heads_ok(query, key, value, enable_gqa=False, supports_gqa=False)  # no GQA here in torch 2.13


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _FlashAttention(torch.autograd.Function):
    """`_scaled_dot_product_flash_attention` with what derivatives.yaml saves for its backward, and the
    temporaries flash-attention's `mha_bwd` allocates (flash_api.cpp): `softmax_d` (B, H, S_q rounded to 128)
    fp32, `dq_accum` (B, S_q rounded to 128, H, D rounded to 32) fp32, full-head dk/dv for GQA."""

    @staticmethod
    def forward(ctx, query, key, value, dropout_p, is_causal, scale):
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = \
            torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                               scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, rng_state, unused)
        ctx.args = (cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, rng_state, unused = ctx.saved_tensors
        cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale = ctx.args
        batch, heads, seq_q, head_dim = query.shape
        seq_q_rounded = _round_up(seq_q, 128)
        head_dim_rounded = _round_up(head_dim, 32) if head_dim <= 192 else 256
        temporaries = [torch.empty(batch, heads, seq_q_rounded, dtype=torch.float32),
                       torch.empty(batch, seq_q_rounded, heads, head_dim_rounded, dtype=torch.float32)]
        if key.shape[1] != heads:
            temporaries += [torch.empty(batch, key.shape[2], heads, head_dim, dtype=query.dtype)
                            for _ in range(2)]
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
            rng_state, unused, scale=scale)
        del temporaries
        return (*grads, None, None, None)


class _EfficientAttention(torch.autograd.Function):
    """`_scaled_dot_product_efficient_attention` with what derivatives.yaml saves, and the backward's `delta`
    (B, H, S_q) fp32 (attention_backward.cu, `_efficient_attention_backward`)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_bias, dropout_p, is_causal, scale, compute_lse):
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_bias, compute_lse, dropout_p, is_causal, scale=scale)
        ctx.save_for_backward(query, key, value, attn_bias, out, lse, seed, offset)
        ctx.args = (dropout_p, is_causal, scale, attn_bias is not None and attn_bias.requires_grad)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, attn_bias, out, lse, seed, offset = ctx.saved_tensors
        dropout_p, is_causal, scale, bias_grad = ctx.args
        delta = torch.empty(query.shape[0], query.shape[1], query.shape[2], dtype=torch.float32)
        grad_q, grad_k, grad_v, grad_bias = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, query, key, value, attn_bias, out, lse, seed, offset, dropout_p,
            [True, True, True, bias_grad], is_causal, scale=scale)
        del delta
        return grad_q, grad_k, grad_v, grad_bias, None, None, None, None


def _mask_for_efficient(attn_mask, query, key):
    """attention.cpp `preprocess_mask`: pad the last dim to a multiple of 8 when its strides are not aligned
    (then slice back), expand to (B, H, L, S) (a view)."""
    if attn_mask is None:
        return None
    if any(s % 8 for s in attn_mask.stride()[:-1]) or attn_mask.shape[-1] % 8:
        size = attn_mask.shape[-1]
        attn_mask = F.pad(attn_mask, (0, _round_up(size, 8) - size))[..., :size]
    return attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def cuda_scaled_dot_product_attention(capability: tuple[int, int]):
    """`F.scaled_dot_product_attention` as it runs on a CUDA device of this compute capability."""
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        query, key, value, attn_mask = _autocast_args("aten::scaled_dot_product_attention",
                                                      (query, key, value, attn_mask))
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        backend = select_sdpa_backend(capability, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if backend is SdpaBackend.FLASH:
            head_dim = query.shape[-1]
            scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
            padded = _round_up(head_dim, 8)
            if padded == head_dim:
                return _FlashAttention.apply(query, key, value, dropout_p, is_causal, scale)
            # pad_last_dim<8>, the output sliced back (post_process_flash_output)
            query, key, value = (F.pad(t, (0, padded - head_dim)) for t in (query, key, value))
            return _FlashAttention.apply(query, key, value, dropout_p, is_causal, scale)[..., :head_dim]
        if backend is SdpaBackend.EFFICIENT:
            attn_mask = _mask_for_efficient(attn_mask, query, key)
            # should_compute_logsumexp_with_attn_mask (attention.cpp)
            compute_lse = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                          for t in (query, key, value, attn_mask))
            return _EfficientAttention.apply(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                             compute_lse)
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    return sdpa


# ---- CUDA's autocast policy ---------------------------------------------------------------------------
# The AutocastCUDA registrations of torch 2.13 (ATen/autocast_mode.h AT_FORALL_* lists, lines 820-957, and
# the CUDA block of autocast_mode.cpp); tests/test_kernels.py checks they are exactly the ops with an
# AutocastCUDA kernel in the installed torch.
CUDA_LOWER_PRECISION_FP = tuple(f"aten::{n}" for n in """
    _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
    conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm
    baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
    rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose""".split())
CUDA_FP32 = tuple(f"aten::{n}" for n in """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
    pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
    nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
    multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
    binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
    _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
    upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""".split())
CUDA_FP32_SET_OPT_DTYPE = tuple(f"aten::{n}" for n in """
    prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
    linalg_matrix_norm.str_ord sum sum.dim_IntList""".split())
CUDA_FP32_APPEND_DTYPE = {"aten::norm.Scalar": "aten::norm.ScalarOpt_dtype",
                          "aten::norm.ScalarOpt_dim": "aten::norm.ScalarOpt_dim_dtype"}
CUDA_PROMOTE = tuple(f"aten::{n}" for n in """
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add""".split())
CUDA_BANNED = ("aten::binary_cross_entropy",)  # raises on CUDA ("unsafe to autocast")
CUDA_POLICY = {**dict.fromkeys(CUDA_LOWER_PRECISION_FP, "lower_precision_fp"), **dict.fromkeys(CUDA_FP32, "fp32"),
               **dict.fromkeys(CUDA_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
               **dict.fromkeys(CUDA_FP32_APPEND_DTYPE, "fp32_append_dtype"),
               **dict.fromkeys(CUDA_PROMOTE, "promote")}  # op -> its CastPolicy
# Ops the CPU's autocast casts and CUDA's does not (AutocastCPU kernels of torch 2.13 minus the lists above):
# they fall through while tracing for a GPU.
CPU_ONLY = tuple(f"aten::{n}" for n in """
    _addmm_activation _grid_sampler_2d_cpu_fallback _lu_with_info _native_multi_head_attention
    adaptive_avg_pool3d adaptive_max_pool3d avg_pool3d binary_cross_entropy cat cholesky cholesky_inverse
    cholesky_solve conv1d.padding conv2d.padding conv3d.padding cross_entropy_loss ctc_loss.IntList
    ctc_loss.Tensor fake_quantize_per_tensor_affine fft_fft fft_fft2 fft_fftn fft_hfft fft_ifft fft_ifft2
    fft_ifftn fft_ihfft fft_irfft fft_irfft2 fft_irfftn fft_rfft fft_rfft2 fft_rfftn fractional_max_pool2d
    fractional_max_pool3d geqrf grid_sampler_2d grid_sampler_3d index_copy inverse linalg_cholesky
    linalg_cholesky_ex linalg_cond linalg_cond.p_str linalg_eig linalg_eigh linalg_eigvals linalg_eigvalsh
    linalg_householder_product linalg_inv linalg_inv_ex linalg_lstsq linalg_matrix_rank
    linalg_matrix_rank.atol_rtol_float linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.tol_tensor
    linalg_qr linalg_solve linalg_svd linalg_svdvals linalg_tensorinv linalg_tensorsolve lu_solve max_pool3d
    max_unpool2d max_unpool3d mkldnn_rnn_layer multilabel_margin_loss_forward nanquantile nanquantile.scalar
    orgqr ormqr pinverse polar qr quantile quantile.scalar reflection_pad1d reflection_pad2d replication_pad1d
    replication_pad2d replication_pad3d stack stft stft.center svd trace triangular_solve view_as_complex""".split())


def _op(qualified: str):
    name, _, overload = qualified.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def autocast_ops(dispatch_key: str) -> set[str]:
    """Every aten op with a kernel for this autocast dispatch key in the installed torch."""
    return {n for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, dispatch_key)}


class _CastCache:
    """`cached_cast`'s cache (autocast_mode.cpp): fp32 leaf tensors that require grad and are not views,
    cast to the low precision once per outermost autocast region (cleared when it exits)."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cacheable = (dtype == torch.get_autocast_dtype("cpu") and tensor.dtype == torch.float32
                     and tensor.requires_grad and tensor.is_leaf and not tensor._is_view()
                     and torch.is_autocast_cache_enabled() and not torch.is_inference_mode_enabled())
        if not cacheable:
            return tensor.to(dtype)
        hit = self.casts.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        with torch.enable_grad():
            cast = tensor.to(dtype)
        self.casts[id(tensor)] = (weakref.ref(tensor), cast)
        return cast

    def clear(self) -> None:
        self.casts.clear()


_CACHE = _CastCache()


def _eligible(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast_tree(value, dtype: torch.dtype):
    if _eligible(value) and value.dtype != dtype:
        return _CACHE.cast(value, dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_tree(v, dtype) for v in value)
    return value


def _cast_args(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """The arguments cast in the order CUDA's wrapper casts them: `WrapFunction_` calls `cached_cast` once per
    argument inside one call expression, which GCC (the compiler of torch's Linux builds) evaluates right to left;
    measured on an H200, a Linear under autocast casts its bias, then its weight, then its input."""
    cast_kwargs = {k: _cast_tree(v, dtype) for k, v in reversed(list(kwargs.items()))}
    cast_args = [_cast_tree(arg, dtype) for arg in reversed(args)]
    return tuple(reversed(cast_args)), {k: cast_kwargs[k] for k in kwargs}


def _autocast_args(qualified: str, args: tuple) -> tuple:
    """Cast `args` as CUDA's autocast would for `qualified` (only its lower-precision and fp32 policies)."""
    if not torch.is_autocast_enabled("cpu"):
        return args
    policy = CUDA_POLICY.get(qualified)
    if policy == "lower_precision_fp":
        return _cast_tree(args, torch.get_autocast_dtype("cpu"))
    if policy == "fp32":
        return _cast_tree(args, torch.float32)
    return args


def _kernel(qualified: str):
    """A Python AutocastCPU kernel with CUDA's policy for `qualified` (autocast_mode.h WrapFunction_); the
    policy is chosen here, once, not on every call."""
    op = _op(qualified)
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    policy = CUDA_POLICY[qualified]

    def redispatch(target, args, kwargs):
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return target(*args, **kwargs)

    if policy == "lower_precision_fp":
        return lambda *args, **kwargs: redispatch(op, *_cast_args(args, kwargs, torch.get_autocast_dtype("cpu")))
    if policy == "fp32":
        return lambda *args, **kwargs: redispatch(op, *_cast_args(args, kwargs, torch.float32))
    if policy == "fp32_append_dtype":
        target = _op(CUDA_FP32_APPEND_DTYPE[qualified])

        def append_dtype(*args, **kwargs):
            dtype = torch.float32 if args and _eligible(args[0]) else args[0].dtype
            return redispatch(target, args, {**kwargs, "dtype": dtype})
        return append_dtype
    if policy == "promote":
        def promote(*args, **kwargs):
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if _eligible(t)]
            to = torch.float32 if any(t.dtype == torch.float32 for t in tensors) else torch.get_autocast_dtype("cpu")
            return redispatch(op, *_cast_args(args, kwargs, to))
        return promote
    # fp32_set_opt_dtype: tensors are not cast; if the first argument is eligible, an unset dtype becomes float32
    position = [a.name for a in op._schema.arguments].index("dtype")  # ScalarType? reads "Optional[int]" here

    def set_opt_dtype(*args, **kwargs):
        if args and _eligible(args[0]):
            if position < len(args):
                args = (*args[:position], args[position] or torch.float32, *args[position + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        return redispatch(op, args, kwargs)
    return set_opt_dtype


@contextlib.contextmanager
def cuda_autocast_policy():
    """Replace the CPU's autocast kernels by CUDA's policy: ops CUDA casts get a Python kernel, ops only the
    CPU casts fall through (no cast)."""
    library = torch.library.Library("aten", "IMPL")
    with _quiet_override_warnings():
        for qualified in sorted(CUDA_POLICY.keys() | set(CPU_ONLY)):
            name = qualified.removeprefix("aten::")
            if qualified in CUDA_POLICY:
                library.impl(name, _kernel(qualified), "AutocastCPU")
            else:
                library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    clear = torch.clear_autocast_cache

    def clear_autocast_cache():  # torch.autocast.__exit__ calls it when the outermost region exits
        _CACHE.clear()
        clear()
    try:
        with mock.patch.object(torch, "clear_autocast_cache", clear_autocast_cache):
            yield
    finally:
        _CACHE.clear()
        library._destroy()


@contextlib.contextmanager
def _quiet_override_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        yield


class _NativeDropout(torch.autograd.Function):
    """CUDA's `native_dropout`: the output and a bool mask in one kernel, the mask saved; its backward
    (`native_dropout_backward`) writes the gradient in one kernel."""

    @staticmethod
    def forward(ctx, input, p):
        mask = torch.empty_like(input, dtype=torch.bool)
        ctx.save_for_backward(mask)
        return torch.empty_like(input)

    @staticmethod
    def backward(ctx, grad_output):
        return torch.empty_like(grad_output), None


def cuda_dropout(dropout=F.dropout):
    """`F.dropout` as CUDA runs it: the fused kernel where `at::dropout` takes it, the CPU's function elsewhere."""

    def run(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and not inplace and input.numel() > 0:
            return _NativeDropout.apply(input, p)
        return dropout(input, p, training, inplace)
    return run


@contextlib.contextmanager
def cuda_kernels(setup):
    """While the trace runs: the kernels of `setup`'s target (nothing changes for the CPU)."""
    if setup.device is not Device.CUDA:
        yield
        return
    from llmsim.model.moe import grouped_mm_on_cuda

    capability = _capability(setup.cuda_capability)
    with cuda_autocast_policy(), grouped_mm_on_cuda(capability), \
            mock.patch.object(F, "scaled_dot_product_attention", cuda_scaled_dot_product_attention(capability)), \
            mock.patch.object(F, "dropout", cuda_dropout()):
        yield
