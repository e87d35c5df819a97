"""Mixture-of-experts models as transformers 5 runs them for training, traced under fake tensors.

transformers stores a decoder layer's experts as two 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) and runs them through `experts_implementation`: "grouped_mm" (the default wherever
`torch.nn.functional.grouped_mm` can run: the CPU with torch >= 2.9, CUDA from sm80), the per-expert "eager"
loop, or "batched_mm" (integrations/moe.py, modeling_utils.get_correct_experts_implementation). With
grouped_mm every tensor's size is fixed by the token count and top-k, whatever the router picks: the tokens are
sorted by expert and `offs` only tells the kernel where each expert's rows start. The eager loop indexes the
tokens each expert receives (`torch.where`), whose sizes are the routing's.

Two facts of torch 2.13 shape the trace:
- `aten::_grouped_mm`'s meta function checks CUDA's fast path (bf16 only), while the kernels that run accept
  fp32, bf16 and fp16 (ATen's `_grouped_mm_validate_inputs`; CPU and CUDA fall back to a per-group `mm_out` into
  the one output). `grouped_mm_as_aten()` gives the fake mode ATen's own rules: the dtypes, the 16-byte stride
  checks, and the output `create_grouped_gemm_output_tensor` allocates -- its last dimension padded to 16 bytes
  (`empty_strided`), which the meta function does only on a CUDA build of torch.
- A model whose layers differ (DeepSeek's dense first layers, Qwen-MoE's `mlp_only_layers` and
  `decoder_sparse_step`) is not one layer repeated: `layer_signatures` tells each layer's kind from the model
  transformers builds (on the meta device), so the trace keeps the irregular leading layers and repeats only the
  periodic rest (llmsim/model/trace.py).
"""
from __future__ import annotations

import contextlib
import functools
import json
from unittest import mock

import torch

from llmsim.enums import ROUTINGS

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """ATen's `check_valid_strides_and_return_transposed` (GroupedMMUtils.h): row- or column-major in the last two
    dimensions, the leading stride a multiple of 16 bytes."""
    alignment = 16 // mat.element_size()
    stride, size = mat.stride(), mat.shape
    if stride[-2] == 1 and stride[-1] >= max(1, size[-2]):
        leading = stride[-1]
    elif stride[-1] == 1 and stride[-2] >= max(1, size[-1]):
        leading = stride[-2]
    else:
        raise RuntimeError(f"grouped_mm: invalid strides {tuple(stride)} for sizes {tuple(size)} of {name}")
    if leading % alignment:
        raise RuntimeError(f"grouped_mm: strides should be multiple of 16 bytes ({name} has {leading} elements "
                           f"of {mat.element_size()} bytes)")


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output `aten::_grouped_mm` allocates where it runs (GroupedMMUtils.h, non-ROCm builds)."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        torch._check(mat.dtype in GROUPED_MM_DTYPES,
                     lambda: f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
        torch._check(mat.dim() in (2, 3), lambda: f"{name} has to be 2 or 3d")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a_2d and b_2d):
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    torch._check(bias is None, lambda: "Bias tensor provided, but it is not supported yet.")
    if a_2d or b_2d:
        torch._check(offs is not None and offs.dim() == 1 and offs.dtype == torch.int32,
                     lambda: "grouped_mm needs a 1-D int32 offsets tensor for 2-D operands")
    if a_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)] if b_2d else [mat_a.size(0), mat_b.size(-1)]
    else:
        size = [mat_a.size(1), mat_b.size(1)] if b_2d else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    alignment = 16 // dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if a_2d != b_2d else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


@functools.cache
def grouped_mm_as_aten() -> torch.library.Library:
    """Install ATen's rules as `aten::_grouped_mm`'s meta kernel in this process, once (before any fake
    tensor's dispatch cache holds an output of the other): in the dispatcher, where a fake tensor's kernel call
    lands, and for the Python dispatcher."""
    import warnings

    library = torch.library.Library("aten", "IMPL")  # kept alive by the cache: dropping it unregisters
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        library.impl("_grouped_mm", _grouped_mm_meta, "Meta")
    op = torch.ops.aten._grouped_mm.default
    op.py_kernels[torch._C.DispatchKey.Meta] = _grouped_mm_meta
    op._dispatch_cache.clear()
    return library


def grouped_mm_on_cuda(capability: tuple[int, int]):
    """transformers' choice of kernel for the experts on a CUDA device of `capability` (integrations/moe.py,
    `_can_use_grouped_mm` under torch >= 2.10: `torch.nn.functional.grouped_mm` from sm80), made while the trace
    runs on CPU fake tensors. Below sm80 (V100, T4) it runs its own `transformers::grouped_mm_fallback`: one
    zero-filled output written expert by expert with `mm(out=...)`, its backward two zero-filled gradients
    likewise; no tensor's size depends on the routing there either."""
    from unittest import mock

    from transformers.integrations import moe

    return mock.patch.object(moe, "_can_use_grouped_mm", lambda input, weight, offs: capability >= (8, 0))


def _signature(index: int, layer: torch.nn.Module, types: list | None) -> tuple:
    modules = tuple((name, type(module).__name__) for name, module in layer.named_modules())
    shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters())
    return (types[index] if types else None, modules, shapes)


@functools.lru_cache(maxsize=32)
def layer_signatures(config_json: str) -> tuple[tuple, ...]:
    """One hashable description per decoder layer of the model transformers builds from `config_json` (its
    modules, parameter shapes and attention type): equal signatures, equal layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = next(module for name, module in model.named_modules()
                  if isinstance(module, torch.nn.ModuleList) and len(module) == config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    return tuple(_signature(i, layer, types) for i, layer in enumerate(layers))


def lead_and_period(signatures: list) -> tuple[int, int]:
    """The shortest irregular prefix, then the smallest period of the rest: (lead, period) minimising the
    traced depth lead + 3 * period."""
    best = (len(signatures), 1)
    for lead in range(len(signatures)):
        rest = signatures[lead:]
        for period in range(1, len(rest) + 1):
            if lead + 3 * period >= best[0] + 3 * best[1]:
                break
            if all(rest[i] == rest[i % period] for i in range(len(rest))):
                best = (lead, period)
                break
    return best


# ---- expert parallelism -------------------------------------------------------------------------------------
# How a rank's experts get their tokens in training (transformers/distributed/expert_parallel.py, AllToAllEP, what
# AutoEP picks when gradients flow): the ranks of the TP group share the batch, each keeps its Shard(0) slice of
# the rows, sends every (token, slot) pair to the rank owning the chosen expert with an all-to-all and gets the
# outputs back with a second one. The split sizes are read back to the host (`.tolist()`): they are the routing's,
# which a fake tensor does not know. Only their sums allocate -- the received rows, which the rank's experts run
# on, and the send buffer, which is the rank's own slice times top-k whatever the routing -- so a stated routing
# is enough for the trace:
# (llmsim.enums.ROUTINGS)
# - "balanced": each rank's pairs split evenly over the EP ranks (what a load-balanced router approaches);
# - "collapsed": every token's pairs that one rank can take (min(top-k, local experts) of them) sent to the traced
#   rank: the most rows a rank's experts can receive, so its peak is the bound of any routing (measured:
#   experiments/moe_ep_routing.py). Every rank can be the one, so the bound holds for each.


def _slice_rows(num_tokens: int, tp: int) -> list[int]:
    """The rows each TP rank keeps of a Replicate -> Shard(0) redistribute: torch.chunk's split."""
    from llmsim.model.fsdp import local_rows

    return [local_rows(num_tokens, tp, rank) for rank in range(tp)]


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (index < total % parts) for index in range(parts)]


def split_sizes(routing: str, num_tokens: int, top_k: int, local_experts: int, ep: int, rank: int) -> list[list[int]]:
    """[send_sizes, recv_sizes] of EP rank `rank` (ep == tp: EP rank i holds TP slice i), as AllToAllEP reads them
    back: send_sizes[d] pairs to rank d, recv_sizes[s] from rank s."""
    rows = _slice_rows(num_tokens, ep)
    if routing == "balanced":
        sent = [_even(rows[source] * top_k, ep) for source in range(ep)]
    elif routing == "collapsed":
        here = min(top_k, local_experts)
        sent = []
        for source in range(ep):
            rest = _even(rows[source] * (top_k - here), ep - 1) if ep > 1 else []
            rest.insert(rank, rows[source] * here)
            sent.append(rest)
    else:
        raise ValueError(f"routing {routing!r}: one of {', '.join(ROUTINGS)}")
    return [sent[rank], [sent[source][rank] for source in range(ep)]]


@contextlib.contextmanager
def stated_routing(routing: str):
    """Under FakeTensorMode: AllToAllEP's split sizes answered for `routing` (split_sizes), where a real run reads
    them from the routed counts; every tensor op of the dispatch is transformers' own."""
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers.distributed.expert_parallel import AllToAllEP

    dispatch = AllToAllEP._dispatch_tokens
    answers: list[list[list[int]]] = []

    def dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
        ep = self.ep_mesh.size()
        answers.append(split_sizes(routing, hidden_states.size(0), top_k_index.size(-1), self.num_local_experts,
                                   ep, self.ep_mesh.get_local_rank()))
        try:
            return dispatch(self, hidden_states, top_k_index, top_k_weights)
        finally:
            answers.pop()

    tolist = FakeTensor.tolist

    def answered_tolist(tensor):
        if answers and tuple(tensor.shape) == (2, len(answers[-1][0])):  # torch.stack([send, recv]).tolist()
            return answers[-1]
        return tolist(tensor)

    with mock.patch.object(AllToAllEP, "_dispatch_tokens", dispatch_tokens), \
            mock.patch.object(FakeTensor, "tolist", answered_tolist):
        yield
