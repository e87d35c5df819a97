"""TRL's `ChunkedLogProbFunction` on a device without Triton, ported from trl 1.16.0
(trl/kernels/chunked_logprob.py, Apache-2.0): the same torch ops in the same order, since memory depends on them.

It is not imported from TRL because its backward imports `trl.trainer.utils` (for `maybe_gather_lm_head_ctx`,
a ZeRO-3 gather that is a null context without DeepSpeed), which pulls in TRL's trainer stack (datasets,
accelerate...). What is left out: the Triton kernels (`_forward_kernel`, `_backward_kernel`: CUDA/XPU only,
`check_loss` refuses a GPU target), that ZeRO-3 gather, and `torch.addmm(out_dtype=)` in `_addmm_fp32`, which TRL
takes on CUDA only. Outputs `log_sum_sq_probs` and `mean_logits` keep their flags; SFTTrainer asks for neither.
"""
from __future__ import annotations

import math

import torch

TOKEN_CHUNK_SIZE = 4096  # trl/kernels/chunked_logprob.py: tokens per projection tile
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`acc += a @ b` for an fp32 `acc` (TRL's non-CUDA branch)."""
    acc.addmm_(a.float(), b.float())


def _torch_transform(z, logit_scale, softcap, inv_t, HAS_SOFTCAP):
    z = z * logit_scale
    if HAS_SOFTCAP:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_t


def _forward_tile(tile, targets, running_max, sum_exp, x_sum_exp, sq_sum_exp, z_sum, max_before_target,
                  target_logit, vocab_start, n_cols, logit_scale, softcap, inv_t, HAS_SOFTCAP, HAS_ENTROPY,
                  HAS_LOG_SUM_SQ_PROBS, HAS_MEAN_LOGITS, HAS_IS_TOP1):
    """TRL's `_forward_tile`: fold one tile into the running online-logsumexp statistics."""
    z = _torch_transform(tile.float(), logit_scale, softcap, inv_t, HAS_SOFTCAP)
    local = targets - vocab_start
    if HAS_MEAN_LOGITS:
        z_sum += z.sum(-1)
    if HAS_IS_TOP1:
        before_target = torch.arange(n_cols, device=z.device) < local.unsqueeze(-1)
        max_before_target.copy_(torch.maximum(max_before_target, z.masked_fill(~before_target, -math.inf).amax(-1)))
    new_m = torch.maximum(running_max, z.amax(-1))
    rescale = torch.exp(running_max - new_m)
    e = torch.exp(z - new_m.unsqueeze(-1))
    sum_exp.mul_(rescale).add_(e.sum(-1))
    if HAS_ENTROPY:
        x_sum_exp.mul_(rescale).add_((e * z).sum(-1))
    if HAS_LOG_SUM_SQ_PROBS:
        sq_sum_exp.mul_(rescale * rescale).add_((e * e).sum(-1))
    running_max.copy_(new_m)
    in_tile = (local >= 0) & (local < n_cols)
    target_z = z.gather(-1, local.clamp(0, n_cols - 1).unsqueeze(-1)).squeeze(-1)
    target_logit.copy_(torch.where(in_tile, target_z, target_logit))


def _backward_tile(tile, targets, log_z, entropy, grad_logprobs, grad_entropy, vocab_start, n_cols, logit_scale,
                   softcap, inv_t, HAS_SOFTCAP, HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD):
    """TRL's `_backward_tile`: overwrite the recomputed tile with the gradient of the loss w.r.t. the logits."""
    y = tile.float() * logit_scale
    if HAS_SOFTCAP:
        t = torch.tanh(y / softcap)
        z = softcap * t * inv_t
    else:
        z = y * inv_t
    log_p = z - log_z.unsqueeze(-1)
    p = torch.exp(log_p)
    grad = torch.zeros_like(z)
    if HAS_LOGPROB_GRAD:
        is_target = torch.arange(vocab_start, vocab_start + n_cols, device=z.device) == targets.unsqueeze(-1)
        grad += grad_logprobs.unsqueeze(-1) * (is_target.float() - p)
    if HAS_ENTROPY_GRAD:
        grad -= grad_entropy.unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1))
    grad = grad * inv_t
    if HAS_SOFTCAP:
        grad = grad * (1 - t * t)
    tile.copy_(grad * logit_scale)


class ChunkedLogProbFunction(torch.autograd.Function):
    """Per-token log-probabilities of `hidden @ weight.T` in `[TOKEN_CHUNK_SIZE, chunk_size]` tiles, without the
    `[N, V]` logits; the backward recomputes each tile and accumulates the input and weight gradients in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                logit_scale=1.0, outputs=OPTIONAL_OUTPUTS):
        ctx.set_materialize_grads(False)
        device = hidden.device
        N = hidden.shape[0]
        vocab = weight.shape[0]
        compute_dtype = (
            torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        )
        kernel_args = {"logit_scale": logit_scale, "softcap": final_logit_softcapping or 1.0,
                       "inv_t": 1 / temperature, "HAS_SOFTCAP": final_logit_softcapping is not None}
        output_flags = {f"HAS_{name.upper()}": name in outputs for name in OPTIONAL_OUTPUTS}

        running_max = torch.full((N,), float("-inf"), device=device, dtype=torch.float32)
        sum_exp = torch.zeros((N,), device=device, dtype=torch.float32)
        x_sum_exp = torch.zeros((N,), device=device, dtype=torch.float32)
        sq_sum_exp = torch.zeros((N,), device=device, dtype=torch.float32)
        z_sum = torch.zeros((N,), device=device, dtype=torch.float32)
        max_before_target = torch.full((N,), float("-inf"), device=device, dtype=torch.float32)
        target_logit = torch.zeros((N,), device=device, dtype=torch.float32)
        mm_buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), chunk_size), device=device, dtype=compute_dtype)

        for token_start in range(0, N, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, N)
            n = token_end - token_start
            hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
            for start in range(0, vocab, chunk_size):
                end = min(start + chunk_size, vocab)
                tile = mm_buf[:n, : end - start]
                torch.mm(hidden_chunk, weight[start:end].to(compute_dtype).t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(compute_dtype))
                _forward_tile(tile, targets[token_start:token_end], running_max[token_start:token_end],
                              sum_exp[token_start:token_end], x_sum_exp[token_start:token_end],
                              sq_sum_exp[token_start:token_end], z_sum[token_start:token_end],
                              max_before_target[token_start:token_end], target_logit[token_start:token_end],
                              start, end - start, **output_flags, **kernel_args)

        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
        log_sum_sq_probs = torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) if "log_sum_sq_probs" in outputs else None
        mean_logits = z_sum / vocab if "mean_logits" in outputs else None
        is_top1 = (target_logit >= running_max) & (target_logit > max_before_target) if "is_top1" in outputs else None

        ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z if entropy is None else entropy)
        ctx.compute_dtype = compute_dtype
        ctx.chunk_size = chunk_size
        ctx.kernel_args = kernel_args
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq_probs, mean_logits, is_top1) if x is not None))
        return logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        compute_dtype = ctx.compute_dtype
        chunk_size = ctx.chunk_size
        needs_hidden_grad, needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[:3]
        N = hidden.shape[0]
        vocab = weight.shape[0]
        grad_hidden = (torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if needs_hidden_grad
                       else None)
        grad_weight = (torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if needs_weight_grad
                       else None)
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if needs_bias_grad else None
        mm_buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), chunk_size), device=hidden.device, dtype=compute_dtype)
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None

        for token_start in range(0, N, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, N)
            n = token_end - token_start
            hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
            for start in range(0, vocab, chunk_size):
                end = min(start + chunk_size, vocab)
                w_chunk = weight[start:end].to(compute_dtype)
                tile = mm_buf[:n, : end - start]
                torch.mm(hidden_chunk, w_chunk.t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(compute_dtype))
                _backward_tile(tile, targets[token_start:token_end], log_z[token_start:token_end],
                               entropy[token_start:token_end],
                               grad_logprobs[token_start:token_end] if grad_logprobs is not None else log_z,
                               grad_entropy[token_start:token_end] if grad_entropy is not None else log_z,
                               start, end - start, HAS_LOGPROB_GRAD=grad_logprobs is not None,
                               HAS_ENTROPY_GRAD=grad_entropy is not None, **ctx.kernel_args)
                if grad_hidden is not None:
                    _addmm_fp32(grad_hidden[token_start:token_end], tile, w_chunk)
                if grad_weight is not None:
                    _addmm_fp32(grad_weight[start:end], tile.t(), hidden_chunk)
                if grad_bias is not None:
                    grad_bias[start:end] += tile.sum(dim=0, dtype=torch.float32)

        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None,
                None, None, None, None, None, None)
