"""The loss levers of issue 5: how the causal-LM loss is computed from the decoder's last hidden states.

`Loss.HF` is transformers' own head and loss: `model(input_ids, labels=labels).loss` materialises the logits
of every position (`lm_head`), and `ForCausalLMLoss` upcasts them to fp32 for the cross-entropy.

`Loss.CHUNKED_NLL` is TRL's SFT loss (trl 1.16.0, `SFTConfig.loss_type="nll"`, the default, whose deprecated
alias is `"chunked_nll"`): `SFTTrainer.__init__` calls `add_fused_lm_head(model, outputs=("log_probs",
"entropy", "is_top1"))` (trl/trainer/utils.py), which replaces `model.forward`; `SFTTrainer.compute_loss` calls
`model(**inputs, fused_lm_head=True)` and sums the negative log-probabilities. The head projects the hidden
states through `lm_head.weight` in tiles of `TOKEN_CHUNK_SIZE` (4096) tokens x `chunk_size` vocabulary columns
(`_CHUNKED_LOGPROB_CHUNK_SIZE`, 32768) inside the custom autograd Function `ChunkedLogProbFunction`
(trl/kernels/chunked_logprob.py, ported in llmsim/model/trl_chunked_logprob.py), which keeps online log-sum-exp
statistics per token, saves the hidden states, the weight, the targets, `log_z` and the entropy, and
recomputes every tile in its backward, where it accumulates the input and weight gradients in fp32. It is
not a chunking over tokens with checkpointed chunks, and its chunk counts vocabulary columns, not tokens.
TRL cannot be imported for it without its trainer stack (the Function's backward imports trl.trainer.utils),
so the Function and the forward wrapper (`add_trl_fused_lm_head`) are ported from trl 1.16.0, same ops in
the same order. On a device without Triton (this CPU) TRL scores every position (`compact=False`) and folds
each tile with torch ops (`_forward_tile`/`_backward_tile`); its Triton path (CUDA) is not modelled
(`check_loss` refuses it).

`Loss.FUSED_LINEAR_CE` is Liger-Kernel's fused linear cross-entropy (liger-kernel 0.8.5,
`apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True)`, which makes the model's forward `lce_forward`,
liger_kernel/transformers/model/llama.py). Liger's kernels are Triton (GPU only), so this module runs an
imitation of its *algorithm*, `LigerFusedLinearCrossEntropy`, ported from
liger_kernel/ops/fused_linear_cross_entropy.py: the same tensors, shapes, dtypes and lifetimes, the same branch
choices for the device, with the Triton cross-entropy kernel replaced by in-place torch ops on the logits chunk.
The real Triton kernel is unvalidated here (GPU only); experiments/gpu_validation.py runs it on a GPU against
this model's prediction. The imitation differs from the kernel by the per-row statistics the kernel keeps in
registers (a few chunk-row vectors, at most 8 bytes per row each, in `_cross_entropy_in_place`).
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from llmsim.enums import Device, Loss, Recipe
from llmsim.errors import InputError
from llmsim.model.trl_chunked_logprob import ChunkedLogProbFunction

IGNORE_INDEX = -100  # transformers', TRL's and Liger's ignore_index

# ---- TRL ----------------------------------------------------------------------------------------------------
TRL_CHUNK_SIZE = 32768  # trl/trainer/utils.py `_CHUNKED_LOGPROB_CHUNK_SIZE`: vocabulary columns per tile
TRL_SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")  # trl/trainer/sft_trainer.py, SFTTrainer.__init__


def add_trl_fused_lm_head(model: nn.Module, chunk_size: int) -> None:
    """`trl.trainer.utils.add_fused_lm_head(model, outputs=TRL_SFT_OUTPUTS)` as SFTTrainer calls it, at
    temperature 1, no softcapping or logit scale (none of the zoo's models has them), ported from trl 1.16.0
    (`_fused_forward`); `chunk_size` is the vocabulary tile width it passes (`_CHUNKED_LOGPROB_CHUNK_SIZE`)."""
    original_forward = model.forward

    def _fused_forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return original_forward(*args, labels=labels, **kwargs)
        kwargs["use_cache"] = False
        backbone_outputs = self.base_model(*args, **kwargs)
        hidden_states = backbone_outputs.last_hidden_state[:, :-1]
        labels = labels[:, 1:]
        lm_head = self.get_output_embeddings()
        hidden_states = hidden_states.to(lm_head.weight.device)
        labels = labels.to(lm_head.weight.device)
        mask = labels != IGNORE_INDEX
        weight, bias = lm_head.weight, lm_head.bias
        compact = False  # `_use_triton(device)`: TRL's torch path, the one modelled (check_loss)
        per_token = ChunkedLogProbFunction.apply(
            hidden_states[mask] if compact else hidden_states.reshape(-1, hidden_states.size(-1)), weight, bias,
            labels[mask] if compact else labels.clamp(min=0).reshape(-1), 1.0, chunk_size, None, 1.0,
            TRL_SFT_OUTPUTS)
        if compact:
            per_token = (None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token)
        else:
            per_token = (None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in per_token)
        log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        return types.SimpleNamespace(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1,
                                     label_mask=mask)

    model.forward = types.MethodType(_fused_forward, model)


def trl_sft_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """`SFTTrainer.compute_loss` for loss_type "nll" (trl/trainer/sft_trainer.py): the fused head's per-token
    log-probabilities, summed and divided by the count of trained tokens. Its metrics (entropy and token
    accuracy, read with `.item()`) are scalars and are left out."""
    outputs = model(input_ids=batch, labels=batch, use_cache=False, fused_lm_head=True)
    per_token_loss = -outputs.log_probs
    num_tokens = outputs.label_mask.sum()
    return per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)


# ---- Liger ----------------------------------------------------------------------------------------------------
LIGER_CHUNK_MEM_CONST = 1  # liger_kernel/ops/fused_linear_cross_entropy.py `_CHUNK_MEM_CONST`
# Model types whose forward Liger replaces with its lce_forward (liger_kernel/transformers/monkey_patch.py,
# MODEL_TYPE_TO_APPLY_LIGER_FN), restricted to text decoders transformers builds with AutoModelForCausalLM.
LIGER_MODEL_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "gemma", "gemma2", "gemma3_text", "glm4", "gpt_oss", "granite", "llama",
    "ministral", "mistral", "mixtral", "nemotron", "olmo2", "olmo3", "phi3", "qwen2", "qwen3", "qwen3_moe",
    "qwen3_next", "smollm3"})
ADDMM_OUT_DTYPE_MIN_MAJOR = 8  # Liger takes torch.addmm(out_dtype=...) into grad_weight from sm80 on


def liger_chunk_size(tokens: int, vocab: int, hidden: int, chunk_mem_const: int = LIGER_CHUNK_MEM_CONST) -> int:
    """Liger's rule (fused_linear_cross_entropy_forward): bound the transient logits to about BT x H elements."""
    inc_factor = -(-vocab // (chunk_mem_const * hidden))
    chunk_size = _next_power_of_2(-(-tokens // inc_factor))
    return min(chunk_size, tokens)


def _next_power_of_2(n: int) -> int:  # triton.next_power_of_2
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _item(tensor: torch.Tensor) -> int:
    """Liger reads `target_mask.sum().item()` to scale the loss; a fake tensor has no value, and the count only
    scales the gradient values, never the memory."""
    return 1 if isinstance(tensor, FakeTensor) else int(tensor.item())


class _Paths:
    """Liger's device-dependent branches: the CUDA ones write into preallocated buffers (`out=`)."""

    def __init__(self, cuda: bool, capability_major: int) -> None:
        self.cuda, self.capability_major = cuda, capability_major

    def can_use_mm_out(self, _input: torch.Tensor, weight: torch.Tensor) -> bool:  # `_can_use_mm_out`
        if (not self.cuda or torch.is_grad_enabled() or _input.dtype != weight.dtype
                or _input.dtype not in (torch.float16, torch.bfloat16, torch.float32)):
            return False
        device_type = _input.device.type
        if torch.is_autocast_enabled(device_type):
            return _input.dtype == torch.get_autocast_dtype(device_type)
        return True


def _cross_entropy_in_place(logits_chunk: torch.Tensor, target_chunk: torch.Tensor, loss_slice: torch.Tensor,
                            n_non_ignore: int) -> None:
    """`liger_cross_entropy_kernel` (liger_kernel/ops/cross_entropy.py) for reduction "mean", no label smoothing,
    z-loss, class weights or softcapping: the loss of each row into `loss_slice` (fp32), and the logits chunk
    overwritten, in its own dtype, by the gradient (softmax - one-hot) / n_non_ignore; rows whose target is
    ignored become zero. The kernel holds its per-row statistics in registers; here they are small row vectors."""
    ignored = target_chunk == IGNORE_INDEX
    safe_target = target_chunk.clamp(min=0).unsqueeze(1)
    target_logit = logits_chunk.gather(1, safe_target).float()
    row_max = logits_chunk.amax(1, keepdim=True)
    logits_chunk.sub_(row_max).exp_()
    sum_exp = logits_chunk.sum(1, keepdim=True, dtype=torch.float32)
    loss_slice.copy_((row_max.float().add_(sum_exp.log()).sub_(target_logit)).squeeze(1))
    loss_slice.masked_fill_(ignored, 0.0).div_(n_non_ignore)
    logits_chunk.div_(sum_exp)
    logits_chunk.scatter_add_(1, safe_target, torch.full_like(target_logit, -1.0, dtype=logits_chunk.dtype))
    logits_chunk.masked_fill_(ignored.unsqueeze(1), 0.0).div_(n_non_ignore)


def fused_linear_cross_entropy_forward(_input, weight, target, paths: _Paths,
                                       chunk_mem_const: int = LIGER_CHUNK_MEM_CONST):
    """liger-kernel 0.8.5 `fused_linear_cross_entropy_forward` for the arguments `LigerForCausalLMLoss` passes
    (no bias, no class weights, reduction "mean", accum_dtype None), its Triton kernel done in place in torch."""
    device = _input.device
    input_requires_grad = _input.requires_grad
    weight_needs_grad = weight.requires_grad
    BT, H = _input.shape
    V = weight.shape[0]
    chunk_size = liger_chunk_size(BT, V, H, chunk_mem_const)
    num_chunks = -(-BT // chunk_size)
    grad_input = torch.zeros_like(_input, device=device)
    grad_weight = torch.zeros_like(weight, device=device) if input_requires_grad and weight_needs_grad else None
    loss_1d = torch.zeros(BT, dtype=torch.float32, device=device)
    target_mask = target != IGNORE_INDEX
    total_n_non_ignore = _item(target_mask.sum())
    use_mm_out = paths.can_use_mm_out(_input, weight)
    logits_storage = torch.empty((chunk_size, V), dtype=_input.dtype, device=device) if use_mm_out else None
    for chunk_id in range(num_chunks):
        start_idx = chunk_id * chunk_size
        end_idx = min((chunk_id + 1) * chunk_size, BT)
        _input_chunk = _input[start_idx:end_idx]
        if logits_storage is not None:
            logits_chunk = logits_storage[: end_idx - start_idx]
            torch.mm(_input_chunk, weight.t(), out=logits_chunk)
        else:
            logits_chunk = _input_chunk @ weight.t()
        target_chunk = target[start_idx:end_idx]
        logits_chunk = logits_chunk.contiguous()
        target_chunk = target_chunk.contiguous()
        _cross_entropy_in_place(logits_chunk, target_chunk, loss_1d[start_idx:end_idx], total_n_non_ignore)
        grad_logits_chunk = logits_chunk
        del logits_chunk
        if input_requires_grad:
            if use_mm_out and grad_logits_chunk.dtype == grad_input.dtype:
                torch.mm(grad_logits_chunk, weight, out=grad_input[start_idx:end_idx])
            else:
                grad_input[start_idx:end_idx] = grad_logits_chunk @ weight
        if grad_weight is not None and input_requires_grad:
            _accumulate_grad_weight(grad_weight, grad_logits_chunk, _input_chunk, paths)
        del grad_logits_chunk, _input_chunk, target_chunk
    del logits_storage
    loss = torch.sum(loss_1d)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    return loss, grad_input, grad_weight


def _accumulate_grad_weight(grad_weight, grad_logits_chunk, _input_chunk, paths: _Paths) -> None:
    """The three branches of Liger's weight-gradient accumulation, chosen as it chooses them."""
    grad_logits_t = grad_logits_chunk.t()
    sm80 = paths.cuda and paths.capability_major >= ADDMM_OUT_DTYPE_MIN_MAJOR
    if sm80 and grad_weight.dtype == torch.float32 and grad_logits_t.dtype in (torch.float16, torch.bfloat16):
        input_chunk = _input_chunk
        if input_chunk.dtype != grad_logits_t.dtype:
            input_chunk = input_chunk.to(grad_logits_t.dtype)
        torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=torch.float32, out=grad_weight)
        del input_chunk
    elif (sm80 and grad_logits_t.dtype in (torch.float16, torch.bfloat16)
          and grad_weight.dtype == grad_logits_t.dtype):
        input_chunk = _input_chunk
        if input_chunk.dtype != grad_logits_t.dtype:
            input_chunk = input_chunk.to(grad_logits_t.dtype)
        torch.addmm(grad_weight, grad_logits_t, input_chunk, out=grad_weight)
        del input_chunk
    else:  # Liger's legacy fallback: a parameter-sized temporary per chunk
        grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()
    del grad_logits_t


class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """`LigerFusedLinearCrossEntropyFunction` (liger-kernel 0.8.5) for reduction "mean": the gradients with
    respect to the input and the LM-head weight are computed in the forward and saved; the backward only scales
    them in place by the incoming gradient (`element_mul_kernel`). Liger wraps forward and backward in
    `torch.amp.custom_fwd`/`custom_bwd` without `cast_inputs`, which leaves the caller's autocast state as it is
    (the forward runs under it); that wrapper allocates nothing and is left out."""

    @staticmethod
    def forward(ctx, _input, weight, target, paths: _Paths):
        loss, grad_input, grad_weight = fused_linear_cross_entropy_forward(_input, weight, target, paths)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        # Liger skips the scaling when `torch.equal(grad_output, torch.tensor(1.0))`; the scaling is in place
        # (no allocation) either way, so only the comparison's one-element tensor is reproduced.
        one = torch.tensor(1.0, device=grad_output.device)
        del one
        grad_input.mul_(grad_output)
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None, None


def add_liger_lce_forward(model: nn.Module, setup) -> None:
    """`lce_forward` (liger_kernel/transformers/model/llama.py; mistral, qwen2... alike) in training mode with
    labels: the backbone, then `LigerForCausalLMLoss` (liger_kernel/transformers/model/loss_utils.py) on the
    hidden states and `lm_head.weight`; the LM head module itself never runs."""
    capability = int(setup.cuda_capability.split(".")[0]) if setup.cuda_capability else 0

    def lce_forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.base_model(input_ids=input_ids, **kwargs)
        hidden_states = outputs[0]
        kept_hidden_states = hidden_states[:, slice(0, None), :]
        weight = self.get_output_embeddings().weight
        cuda = setup.device is Device.CUDA or kept_hidden_states.device.type == "cuda"
        if cuda and not setup.cuda_capability:
            capability_major = torch.cuda.get_device_capability(kept_hidden_states.device)[0]
        else:
            capability_major = capability
        loss = liger_for_causal_lm_loss(kept_hidden_states, weight, labels, self.config.hidden_size,
                                        _Paths(cuda, capability_major))
        return types.SimpleNamespace(loss=loss, logits=None)

    model.forward = types.MethodType(lce_forward, model)


def liger_for_causal_lm_loss(hidden_states, lm_head_weight, labels, hidden_size: int, paths: _Paths):
    """`LigerForCausalLMLoss` -> `fixed_fused_linear_cross_entropy` (reduction "mean") ->
    `liger_fused_linear_cross_entropy`, with no pre-shifted labels."""
    labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift_labels = labels[..., 1:].contiguous()
    hidden_states = hidden_states.view(-1, hidden_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(hidden_states.device)
    return FUSED_LINEAR_CROSS_ENTROPY.apply(hidden_states, lm_head_weight, shift_labels, paths)


# The GPU validation kit swaps in Liger's real Triton Function here (experiments/gpu_validation.py).
FUSED_LINEAR_CROSS_ENTROPY = LigerFusedLinearCrossEntropy


# ---- the lever ----------------------------------------------------------------------------------------------------
def install_loss(model: nn.Module, setup) -> None:
    """Patch the built model's forward as TRL's SFTTrainer or Liger does (before LoRA wraps it)."""
    if setup.loss is Loss.CHUNKED_NLL:
        add_trl_fused_lm_head(model, setup.loss_chunk or TRL_CHUNK_SIZE)
    elif setup.loss is Loss.FUSED_LINEAR_CE:
        add_liger_lce_forward(model, setup)


def compute_loss(model: nn.Module, batch: torch.Tensor, setup) -> torch.Tensor:
    """The loss of the canonical step's forward, whichever lever is pulled."""
    if setup.loss is Loss.CHUNKED_NLL:
        return trl_sft_loss(model, batch)
    return model(input_ids=batch, labels=batch).loss


def check_loss(spec, setup) -> None:
    """What is modelled: TRL's torch path (no Triton: the CPU), Liger on the model types it patches."""
    if setup.recipe is Recipe.TRL_SFT and setup.device is Device.CUDA:
        raise InputError("TRL's SFTTrainer on a GPU (--gpu) is not modelled yet: its fused LM head then scores only "
                         "the valid positions with Triton kernels; modelled: its torch path (the CPU)")
    if setup.loss is Loss.CHUNKED_NLL and setup.device is Device.CUDA:
        raise InputError("loss chunked-nll on a GPU (--gpu) is not modelled yet: TRL then scores only the valid "
                         "positions with its Triton kernels; modelled: its torch path (the CPU)")
    if setup.loss is Loss.FUSED_LINEAR_CE and spec.config_json is not None:
        model_type = spec.config_dict.get("model_type")
        if model_type not in LIGER_MODEL_TYPES:
            raise InputError(f"loss fused-linear-ce: Liger has no fused linear cross-entropy for model_type "
                             f"{model_type!r}; valid model types: {', '.join(sorted(LIGER_MODEL_TYPES))}")
