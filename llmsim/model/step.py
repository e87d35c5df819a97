"""The canonical training step (DESIGN.md), run under a `StorageTracker`.

One function serves both sides of every claim: `measure` runs it on real tensors (the oracle) and the
trace runs it on fake tensors at reduced depth (the predictor). What happens here is what is predicted.

The loop, exactly:
    model = AutoModelForCausalLM.from_config(config, attn_implementation=...)   # fp32
    model.to(torch.bfloat16)                  # precision bf16 only (not with a load dtype: weights as loaded)
    model.train()                             # fine-tuning runs in train mode: dropout masks are real memory
    model.activation_checkpointing_enable(every_n_layers=n)   # --grad-ckpt only (offload=True: --ckpt-offload,
                                              # llmsim/model/offload.py: its inputs copied to host memory)
    opt = torch.optim.AdamW(model.parameters())   # foreach=True (--foreach) or fused=True (--fused) if asked
    x = torch.randint(0, vocab, (micro_batch, seq_len))
    3 times: loss = model(input_ids=x, labels=x).loss   # under torch.autocast(bfloat16) for bf16-autocast
             loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    (--grad-accum n: n times `loss = model(...).loss / n; loss.backward()` before each opt.step())
    (--loss chunked-nll | fused-linear-ce: the model's forward patched as TRL's SFTTrainer or Liger patches it,
     llmsim/model/losses.py)
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from llmsim.model import zero3_hooks
from llmsim.model.host_memory import fsdp_offload
from llmsim.model.offload import offloading
from llmsim.model.losses import compute_loss, install_loss
from llmsim.enums import Category, Device, Optimizer, Phase, Precision, Recipe
from llmsim.inputs.spec import TrainSetup
from llmsim.model.tracker import NO_BLOCK, StorageTracker

ROOT_MODULE = "<root>"  # the FQN "" of the model itself, where HF computes the loss


@dataclass(frozen=True)
class StepInfo:
    """What the traced run tells later stages about the model's structure."""

    blocks_prefix: str  # FQN of the ModuleList of decoder layers, e.g. "model.layers"
    num_blocks: int
    first_module: str  # first leaf module of the forward (the embedding)
    last_module: str  # last leaf module of the forward (the LM head)
    vocab_size: int


def find_blocks(model: nn.Module, expected: int | None) -> tuple[str, nn.ModuleList]:
    """The repeated decoder layers: the ModuleList of one layer class with `expected` (else most) entries."""
    best: tuple[str, nn.ModuleList] = ("", nn.ModuleList())
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len({type(m) for m in module}) != 1:
            continue
        if expected is not None and len(module) == expected:
            return name, module
        if len(module) > len(best[1]):
            best = (name, module)
    return best


class LayerHooks:
    """Keeps the tracker's (block, module) context in step with the model while it runs."""

    def __init__(self, tracker: StorageTracker, model: nn.Module, expected_blocks: int | None,
                 first_block: int = 0) -> None:
        """`first_block`: the number of the model's first layer (a rank's pipeline stage under a schedule of several
        stages a rank: its layers, and every name under them, are numbered from there, as the whole model numbers
        them)."""
        self.tracker = tracker
        self.model = model
        self.prefix, blocks = find_blocks(model, expected_blocks)
        self.first_block = first_block
        self.num_blocks = len(blocks)
        self.leaf_order: list[str] = []
        self._stack: list[str] = []
        self.label_model()
        for name, module in model.named_modules():
            module.register_forward_pre_hook(self._pre(self.named(name)), with_kwargs=True)
            module.register_forward_hook(self._post(name))
        self._blocks = list(blocks)
        self._block_pre_handles = [block.register_forward_pre_hook(self._block_pre(index), with_kwargs=True)
                                   for index, block in enumerate(blocks)]
        for index, block in enumerate(blocks):
            block.register_forward_hook(self._block_post(index))
        self._hooked: set[str] = set()
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._grad_ready(self.named(name)))
                self._hooked.add(name)

    def named(self, fqn: str) -> str:
        """`fqn` with its layer numbered from `first_block` (`prefix.<i>` -> `prefix.<first_block + i>`)."""
        head = self.prefix + "."
        if not self.first_block or not self.prefix or not fqn.startswith(head):
            return fqn
        index, _, rest = fqn[len(head):].partition(".")
        return f"{head}{int(index) + self.first_block}" + (f".{rest}" if rest else "")

    def enter_blocks_first(self) -> None:
        """Move each layer's entry hook ahead of hooks a wrapper put first (FSDP2's pre-forward, registered with
        `prepend=True`, all-gathers the layer's parameters): what the layer's hooks allocate is the layer's."""
        for handle in self._block_pre_handles:
            handle.remove()
        self._block_pre_handles = [block.register_forward_pre_hook(self._block_pre(index), with_kwargs=True,
                                                                   prepend=True)
                                   for index, block in enumerate(self._blocks)]

    def block_of(self, fqn: str) -> int:
        head = self.prefix + "."
        if self.prefix and fqn.startswith(head):
            return int(fqn[len(head):].split(".", 1)[0]) + self.first_block
        return NO_BLOCK

    def label_model(self) -> None:
        for category, named in ((Category.PARAMETER, self.model.named_parameters()),
                                (Category.PARAMETER, _quantization_states(self.model)),
                                (Category.BUFFER, self.model.named_buffers())):
            named = list(named)
            names, tensors = zip(*named) if named else ((), ())
            self.tracker.label(tensors, category, [self.named(n) for n in names], [self.block_of(n) for n in names],
                               retag=True)

    def adopt_new_parameters(self) -> None:
        """Label the parameters peft added (by their FQN in the base model) and hook their gradients."""
        self.label_model()
        for name, param in self.model.named_parameters():
            if param.requires_grad and name not in self._hooked:
                param.register_post_accumulate_grad_hook(self._grad_ready(self.named(name)))
                self._hooked.add(name)

    def watch(self, optimizer: torch.optim.Optimizer, gpu: bool = False) -> None:
        """Label the gradients before each step and the optimizer's states after it; `gpu`: the trace stands in
        for a GPU run (the CPU device plays CUDA), where some states live on the host (`host_state`)."""
        names = {id(p): n for n, p in self.model.named_parameters()}

        def grads(opt, args, kwargs):
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None and id(p) in names]
            self.tracker.label([p.grad for p in params], Category.GRADIENT, [self.named(names[id(p)]) for p in params],
                               [self.block_of(names[id(p)]) for p in params])

        def states(opt, args, kwargs):
            for group in opt.param_groups:
                for p in group["params"]:
                    items = [(key, t) for key, t in opt.state.get(p, {}).items() if isinstance(t, torch.Tensor)]
                    for key, t in items:
                        host = host_state(opt, group, p, key, t, gpu)
                        self.tracker.label([t], Category.HOST_OPTIMIZER_STATE if host else Category.OPTIMIZER_STATE)

        optimizer.register_step_pre_hook(grads)
        optimizer.register_step_post_hook(states)

    def label_micro_grads(self) -> None:
        """From the second micro-step of gradient accumulation on, name the gradient autograd is about to add into
        a parameter's `.grad` (a tensor hook runs just before its AccumulateGrad) after that parameter."""
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                param.register_hook(self._incoming_grad(name, param))

    def _incoming_grad(self, name: str, param: torch.Tensor):
        def hook(grad):
            if param.grad is not None:
                self.tracker.label([grad], Category.GRADIENT, [self.named(name)], [self.block_of(name)])
        return hook

    def enter_backward(self) -> None:
        self.tracker.block, self.tracker.module = NO_BLOCK, self.leaf_order[-1] if self.leaf_order else ""

    # ---- forward: a module stack; backward: tensor hooks at layer boundaries ----------------------------
    def _forward(self) -> bool:
        return self.tracker.phase is Phase.FORWARD

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if self._forward():
                self._stack.append(name or ROOT_MODULE)
                self.tracker.module = self._stack[-1]
                if not list(module.children()) and name not in self.leaf_order:
                    self.leaf_order.append(name)
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            if self._forward() and self._stack:
                self._stack.pop()
                self.tracker.module = self._stack[-1] if self._stack else ""
            if self._forward() and not name:
                # Past the model's forward no layer runs: what is freed now (autocast dropping its
                # weight-cast cache on exit) belongs to the layer that allocated it.
                self.tracker.frees_by_owner = True
        return hook

    def _block_pre(self, index: int):
        def hook(module, args, kwargs):
            if not self._forward():
                return
            self.tracker.block = self.first_block + index
            self.tracker.frees_by_owner = False
            if index == 0:  # the gradient of layer 0's input is where the backward leaves the layers
                _on_grad(_first_grad_tensor((args, kwargs)), self._enter(NO_BLOCK, self.leaf_order[0]))
        return hook

    def _block_post(self, index: int):
        def hook(module, args, output):
            if not self._forward():
                return
            # The block stays current until the next one starts: what runs between two layers (the
            # decoder loop rebinding `hidden_states`) happens once per layer, so it belongs to a layer.
            block = self.first_block + index
            _on_grad(_first_grad_tensor(output), self._enter(block, f"{self.prefix}.{block}"))
        return hook

    def _grad_ready(self, name: str):
        def hook(param):
            self.tracker.mark_grad_ready(name)
        return hook

    def _enter(self, block: int, module: str):
        def hook(grad):
            self.tracker.block, self.tracker.module = block, module
        return hook

    def info(self, vocab_size: int) -> StepInfo:
        return StepInfo(self.prefix, self.num_blocks, self.leaf_order[0], self.leaf_order[-1], vocab_size)


def _quantization_states(model: nn.Module):
    """(name, tensor) of every bitsandbytes 4-bit weight's quantization state: absmax, code book, offset, and the
    double quantization's second-level absmax and code book; of every 8-bit weight (`Int8Params`) its row scales
    SCB, held by the weight until the first forward hands them to the module's `MatmulLtState` (CB, the int8
    data, is the parameter's own storage). They are part of the layer's weights."""
    for name, param in model.named_parameters():
        if isinstance(getattr(param, "SCB", None), torch.Tensor):
            yield f"{name}.SCB", param.SCB
        state = getattr(param, "quant_state", None)
        while state is not None:
            for key, value in vars(state).items():
                if isinstance(value, torch.Tensor):
                    yield f"{name}.quant_state.{key}", value
            state = getattr(state, "state2", None)
            name = f"{name}.state2"


def _first_grad_tensor(tree) -> torch.Tensor | None:
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf
    return None


def _on_grad(tensor: torch.Tensor | None, hook) -> None:
    """Run `hook` just before the autograd node that produced `tensor` runs in the backward."""
    if tensor is not None and tensor.grad_fn is not None:
        tensor.register_hook(hook)


SGD_LR = 1e-3  # torch.optim.SGD has no default learning rate
# bitsandbytes.optim classes, with their defaults (8-bit: blockwise states for tensors of min_8bit_size = 4096
# elements or more, 32-bit states below; paged: CUDA unified memory for tensors of 1e5 elements or more)
BNB_OPTIMIZERS = {Optimizer.ADAMW_8BIT: "AdamW8bit", Optimizer.PAGED_ADAMW: "PagedAdamW",
                  Optimizer.PAGED_ADAMW_8BIT: "PagedAdamW8bit"}


def by_mesh(params) -> list[dict]:
    """One parameter group per device mesh (plain tensors apart), as transformers' Trainer groups them when a
    tensor-parallel model mixes DTensor and plain parameters: a foreach or fused kernel takes one kind only.
    The for-loop step (the CPU's default) takes both in one group, so the canonical step keeps one there."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for param in params:
        groups.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    return [{"params": group} for group in groups.values()]


def optimizer_class(optimizer: Optimizer) -> type:
    """The class `make_optimizer` builds. Called before the tracker starts, as a training script imports it at
    its top: a first import creates module-level tensors that are no part of the step."""
    if optimizer is Optimizer.HF_ADAFACTOR:
        from transformers.optimization import Adafactor

        return Adafactor
    if optimizer.bitsandbytes:
        import bitsandbytes as bnb

        return getattr(bnb.optim, BNB_OPTIMIZERS[optimizer])
    return {Optimizer.ADAMW: torch.optim.AdamW, Optimizer.ADAM: torch.optim.Adam, Optimizer.SGD: torch.optim.SGD,
            Optimizer.SGD_MOMENTUM: torch.optim.SGD, Optimizer.ADAFACTOR: torch.optim.Adafactor}[optimizer]


def enable_checkpointing(model, every_n_layers: int, offload: bool = False) -> None:
    """transformers' activation checkpointing: `activation_checkpointing_enable` (5.24), or the same method under
    its old name `gradient_checkpointing_enable` (5.17, the GPU image's: the same `every_n_layers` and `offload`)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(every_n_layers=every_n_layers, offload=offload)


def make_optimizer(params, setup: TrainSetup) -> torch.optim.Optimizer:
    foreach = setup.foreach or None
    fused = {"fused": True} if setup.fused else {}  # torch.optim.Adafactor takes no `fused`
    if foreach:
        params = by_mesh(params)
    cls = optimizer_class(setup.optimizer)
    if setup.optimizer in (Optimizer.ADAMW, Optimizer.ADAM, Optimizer.ADAFACTOR):
        return cls(params, foreach=foreach, **fused)
    if setup.optimizer in (Optimizer.SGD, Optimizer.SGD_MOMENTUM):
        momentum = 0.9 if setup.optimizer is Optimizer.SGD_MOMENTUM else 0.0
        return cls(params, lr=SGD_LR, momentum=momentum, foreach=foreach, **fused)
    # transformers' Adafactor: lr=None, scale_parameter=True, relative_step=True, warmup_init=False;
    # bitsandbytes: lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2, min_8bit_size=4096. No foreach path.
    return cls(params)


def host_state(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor, key: str, state: torch.Tensor,
               gpu: bool) -> bool:
    """Whether an optimizer state lives in host memory while the parameters are on a GPU. In a real GPU run its
    device says so. In a trace for a GPU (every tensor on the CPU standing in for CUDA) it is torch Adam/AdamW's
    0-d `step`, which `_init_group` makes with `torch.tensor(0.0, device="cpu")` unless the group is fused or
    capturable (torch/optim/adam.py: "Deliberately host `step` on CPU if both capturable and fused are off"), and
    unless the step runs under `torch.device("cuda")` (`TrainSetup.cuda_default_device`: the caller passes `gpu`
    False), which puts that `torch.tensor(0.0)` on the GPU: the GPU kit's 291 `step` tensors of Llama-2-7B were
    4-byte blocks of the CUDA allocator (experiments/gpu_runs/2026-12-04, trace_07)."""
    if state.device.type != param.device.type:
        return state.device.type == "cpu"
    return (gpu and key == "step" and isinstance(optimizer, torch.optim.Adam)
            and not (group.get("fused") or group.get("capturable")))


def uses_peft(setup: TrainSetup) -> bool:
    """LoRA adapters, or trainable tokens alone (peft's TrainableTokensConfig)."""
    return bool(setup.lora_rank or setup.trainable_tokens)


def import_peft(setup: TrainSetup) -> None:
    """Import peft before the step is tracked: importing its tuners creates module-level tensors (the
    `torch.tensor(1)` defaults of peft/tuners/loha/layer.py's autograd functions, 144 bytes in all) that live as
    long as the process. Imported inside the step, they would count in a process's first LoRA step only."""
    if uses_peft(setup):
        import peft  # noqa: F401


ALL_LINEAR = "all-linear"  # peft's INCLUDE_LINEAR_LAYERS_SHORTHAND: every linear layer but the output head


@functools.lru_cache(maxsize=32)
def _peft_takes_defaults(config_json: str) -> bool:
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(config_json)))
    try:
        get_peft_model(model, LoraConfig(r=8))
    except ValueError:
        return False
    return True


def peft_default_targets(spec) -> bool:
    """Whether `get_peft_model(model, LoraConfig(r=...))` finds targets by itself for this model, as peft decides
    (on the meta device): not on the mixture-of-experts models (peft 0.21 refuses Mixtral's defaults and keeps none
    for Qwen-MoE, DeepSeek, OLMoE, gpt-oss), where a LoRA lever takes `all-linear`."""
    return spec.config_json is None or _peft_takes_defaults(spec.config_json)


def peft_config(model: nn.Module, setup: TrainSetup):
    """The peft config the step passes to `get_peft_model`: `LoraConfig(r, lora_alpha, target_modules,
    modules_to_save, trainable_token_indices)` with a LoRA rank, else `TrainableTokensConfig(token_indices)` (whose
    default target is the model's input embedding, peft/tuners/trainable_tokens/model.py)."""
    from peft import LoraConfig, TrainableTokensConfig

    check_peft_names(model, setup)
    tokens = list(setup.trainable_tokens) if setup.trainable_tokens else None
    if not setup.lora_rank:
        return TrainableTokensConfig(token_indices=tokens)
    targets = list(setup.lora_targets) if setup.lora_targets else None
    if targets == [ALL_LINEAR]:  # peft's shorthand is the string itself, not a module name in a list
        targets = ALL_LINEAR
    return LoraConfig(r=setup.lora_rank, lora_alpha=setup.lora_alpha, target_modules=targets,
                      modules_to_save=list(setup.lora_modules_to_save) if setup.lora_modules_to_save else None,
                      trainable_token_indices=tokens)


MAX_NAMES_SHOWN = 10  # valid module names listed in the error for a name the model lacks


def check_peft_names(model: nn.Module, setup: TrainSetup) -> None:
    """What peft would accept silently or fail on late, refused up front: a `modules_to_save` name that ends no
    module's FQN (peft's `_set_trainable` skips it without a word unless told to be strict) and a token index past
    the input embedding's rows."""
    from llmsim.errors import InputError

    modules = [(key, module) for key, module in model.named_modules(remove_duplicate=False) if key]
    for name in setup.lora_modules_to_save or ():
        if not any(key == name or key.endswith("." + name) for key, _ in modules):
            leaves = sorted((key for key, module in modules if not list(module.children())), key=lambda k: k.count("."))
            valid = list(dict.fromkeys(key.rsplit(".", 1)[-1] for key in leaves))  # outermost first: lm_head, ...
            raise InputError(f"lora-modules-to-save: no module {name!r} in {type(model).__name__}; valid names "
                             f"end a module's FQN, e.g. {', '.join(valid[:MAX_NAMES_SHOWN])}")
    embedding = model.get_input_embeddings()
    # the embedding and the modules tied to it (an LM head sharing its weight), which trainable tokens wrap too
    tied = [key for key, module in modules if getattr(module, "weight", None) is embedding.weight]
    both = [key for key in tied for name in setup.lora_modules_to_save or () if key == name or key.endswith("." + name)]
    if setup.trainable_tokens and both:
        raise InputError(f"{both[0]} holds the input embedding's weight: it is either trained fully "
                         "(lora-modules-to-save) or in some rows (trainable-tokens), not both (peft refuses it, or "
                         "fails in the forward for this spelling)")
    vocab_size = embedding.num_embeddings
    if outside := [t for t in setup.trainable_tokens or () if t >= vocab_size]:
        raise InputError(f"trainable-tokens {outside} outside the vocabulary (vocab_size {vocab_size}: indices "
                         f"0..{vocab_size - 1})")


def add_peft(model: nn.Module, setup: TrainSetup) -> nn.Module:
    """peft on the built model: `get_peft_model(model, peft_config(model, setup))`."""
    from peft import get_peft_model

    from llmsim.errors import InputError, one_line

    config = peft_config(model, setup)
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # peft names the target modules it could not find, or a conflict between options
        hint = ""
        if setup.lora_rank and not setup.lora_targets:  # peft keeps no default targets for this model type
            hint = (f" (peft has no default LoRA targets for model type {model.config.model_type!r}: give "
                    "--lora-targets, e.g. all-linear or q_proj,v_proj, or a --peft-config with target_modules or "
                    "target_parameters)")
        raise InputError(f"{'LoRA' if setup.lora_rank else 'trainable tokens'}: {one_line(exc)}{hint}") from exc


add_lora = add_peft  # the name llmsim.measure.dist_worker imports


PEFT_PREFIX = "base_model.model."  # peft's PeftModel -> LoraModel (`base_model`) -> the causal LM (`model`)


def base_fqn(fqn: str) -> str:
    """A module or parameter FQN of the model DeepSpeed wraps as the base model names it (the tracker labels
    parameters by their FQN there): peft's prefix dropped, the root called ROOT_MODULE. peft's own two wrappers
    (`base_model`, `base_model.model`) hold no parameters and keep their names."""
    if not fqn:
        return ROOT_MODULE
    return fqn[len(PEFT_PREFIX):] if fqn.startswith(PEFT_PREFIX) else fqn


def _build_for_training(build: Callable[[], nn.Module], setup: TrainSetup, tracker: StorageTracker,
                        expected_blocks: int | None, first_block: int = 0) -> tuple[nn.Module, LayerHooks]:
    """The opening of both canonical steps: build, hook the layers, cast (bf16/fp16 precision), train mode."""
    model = build()
    hooks = LayerHooks(tracker, model, expected_blocks, first_block)
    as_loaded = setup.load_dtype is not None and setup.recipe is Recipe.CANONICAL  # from_pretrained's, no cast
    if setup.precision.cast_dtype is not None and not setup.cast_after_peft and not as_loaded:
        model.to(setup.precision.cast_dtype)
        hooks.label_model()
    model.train()
    return model, hooks


CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # deepspeed/runtime/engine.py


def cast_parameters(model: nn.Module, dtype) -> None:
    """DeepSpeed's `_cast_module_mixed_precision` on a model not built in zero.Init: `p.data = p.data.to(dtype)`
    for every floating parameter in `model.parameters()` order (each old storage freed at once), buffers left
    alone (no `buffer_dtype` in the config). With LoRA it runs after get_peft_model, so peft's fp32 adapters
    become bf16 too."""
    if dtype is None:
        return
    for p in model.parameters():
        if p.dtype in CASTABLE_DTYPES and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type  # a fake tensor reports its fake device


def _autocast(model: nn.Module, setup: TrainSetup):
    dtype = setup.precision.autocast_dtype
    return torch.autocast(_device_type(model), dtype=dtype) if dtype is not None else contextlib.nullcontext()


def run_canonical_step(build: Callable[[], nn.Module], setup: TrainSetup, tracker: StorageTracker,
                       expected_blocks: int | None = None,
                       wrap: Callable[[nn.Module], nn.Module] | None = None) -> StepInfo:
    """Run the canonical loop under `tracker` (add a FakeTensorMode around it to run without memory).
    `wrap` puts a data-parallel wrapper (DistributedDataParallel) around the model before the optimizer."""
    torch.manual_seed(0)
    import_peft(setup)
    optimizer_class(setup.optimizer)  # imported before the step, as a training script does
    linear = zero3_hooks.linear_as_zero3() if setup.zero3_hooks else contextlib.nullcontext()
    with tracker, linear, offloading(tracker, setup.ckpt_offload), fsdp_offload(tracker, setup.fsdp):
        model, hooks = _build_for_training(build, setup, tracker, expected_blocks)
        base = model
        vocab_size = base.get_input_embeddings().num_embeddings  # before peft wraps the embedding
        install_loss(base, setup)
        if uses_peft(setup):
            model = add_peft(model, setup)
            if setup.cast_after_peft:  # the fp32 adapters named (their layer known) before the cast frees them
                hooks.label_model()
                cast_parameters(model, setup.precision.cast_dtype)
            hooks.adopt_new_parameters()
        if setup.grad_ckpt:
            enable_checkpointing(base, setup.ckpt_every, setup.ckpt_offload)
        if setup.label_micro_grads:
            hooks.label_micro_grads()
        if setup.zero3_hooks:  # deepspeed.initialize registers them last
            zero3_hooks.install(model, tracker, base_fqn, hooks.block_of)
        if wrap is not None:
            wrapped = wrap(model)
            if wrapped is model:  # FSDP2 shards in place: its sharded parameters named and placed
                hooks.label_model()
            model = wrapped
            hooks.enter_blocks_first()
        autocast = _autocast(model, setup)  # after the wrap: a meta-built model has its device only then
        # torch's AMP recipe for float16: the loss is scaled, gradients unscaled in place before the step
        scaler = (torch.amp.GradScaler(_device_type(model)) if setup.precision is Precision.FP16_AUTOCAST
                  else None)
        optimizer = make_optimizer(model.parameters(), setup)
        hooks.watch(optimizer, gpu=setup.device is Device.CUDA and not setup.cuda_default_device)
        batch = torch.randint(0, vocab_size, (setup.micro_batch, setup.seq_len))
        tracker.label([batch], Category.INPUT)
        for step in range(setup.steps):
            for _ in range(setup.grad_accum):  # gradients accumulate in place after the first backward
                tracker.set_phase(step, Phase.FORWARD)
                with autocast:
                    loss = compute_loss(model, batch, setup)
                    if setup.grad_accum > 1:
                        loss = loss / setup.grad_accum
                tracker.set_phase(step, Phase.BACKWARD)
                hooks.enter_backward()
                if scaler is None:
                    loss.backward()
                else:
                    scaler.scale(loss).backward()
                    tracker.label([scaler._scale, scaler._growth_tracker], Category.OPTIMIZER_STATE)
            tracker.set_phase(step, Phase.OPTIMIZER)
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            tracker.frees_by_owner = True  # zero_grad drops every gradient in parameter order
            optimizer.zero_grad(set_to_none=True)
        tracker.finish()
    return hooks.info(vocab_size)


def run_pipeline_step(build: Callable[[], nn.Module] | list[Callable[[], nn.Module]], setup: TrainSetup,
                      tracker: StorageTracker, pp_group, wrap: Callable[[nn.Module], nn.Module] | None = None,
                      replay_chunks: bool = False, first_blocks: list[int] | None = None) -> StepInfo:
    """One rank of the canonical PP step (llmsim/model/pipelining.py) under `tracker`: `build` gives the stage's
    model (under a schedule of several stages a rank a list, one per stage the rank holds, `pipelining.rank_stages`,
    whose layers are numbered from `first_blocks`), `pp_group` the process group of the pipeline; `wrap` puts
    DistributedDataParallel around each stage (torch's PipelineStage runs DDP's no_sync for every micro-batch but
    the last). With `replay_chunks` (a fake trace), the model's forward and backward of micro-batches 2 and later,
    and of micro-batch 1 after the first step, are micro-batch 1's events replayed, and those of micro-batch 0 after
    the first step micro-batch 0's (llmsim/model/chunk_replay.py)."""
    from torch.distributed.pipelining import PipelineStage

    from llmsim.model.chunk_replay import ChunkReplay, unshards_seen
    from llmsim.model.pipelining import Schedule, rank_stages, stage_forward, stage_io

    torch.manual_seed(0)
    optimizer_class(setup.optimizer)
    schedule_kind = Schedule(setup.schedule)
    stage_indices = rank_stages(setup.pp_stage, setup.pp, setup.stages_per_rank, schedule_kind)
    num_stages = setup.pp * setup.stages_per_rank
    builds = build if isinstance(build, list) else [build]
    if len(builds) != len(stage_indices):
        raise ValueError(f"{len(builds)} builds for stages {stage_indices}")
    with tracker:
        stages, modules, all_hooks, replays = [], [], [], []
        for stage_index, stage_build, first in zip(stage_indices, builds, first_blocks or [0] * len(builds)):
            model, hooks = _build_for_training(stage_build, setup, tracker, None, first)
            if setup.grad_ckpt:
                enable_checkpointing(model, setup.ckpt_every)
            model.forward = stage_forward(model, stage_index, num_stages)
            replay = None
            if replay_chunks:
                replay = ChunkReplay(tracker)
                replays.append(replay)
                model.forward = replay.wrap(model.forward)
            vocab_size = int(model.config.vocab_size)
            dtype = setup.precision.cast_dtype or torch.float32
            example = stage_io(stage_index, num_stages, setup.micro_batch, setup.seq_len,
                               int(model.config.hidden_size), vocab_size, dtype, setup.precision.autocast_dtype or dtype)
            stage_module = wrap(model) if wrap is not None else model
            if replay is not None:  # whose parameters' gradients a replayed micro-batch 0 sets
                replay.module = stage_module
            if wrap is not None:  # as run_canonical_step: FSDP2's (replicate's) in-place wrap, its parameters named
                if stage_module is model:  # and placed, and each layer entered before FSDP2's pre-forward runs
                    hooks.label_model()
                hooks.enter_blocks_first()
            autocast = _autocast(model, setup)  # where the parameters are once wrapped (FSDP2 materialises a meta
            # build)
            stage = PipelineStage(stage_module, stage_index, num_stages, torch.device("cpu"), input_args=example[0],
                                  output_args=example[1], group=pp_group)
            _track_chunks(stage, tracker, hooks, autocast, replay)
            stages.append(stage)
            modules.append(stage_module)
            all_hooks.append(hooks)

        def loss_fn(logits, labels):
            return model.loss_function(logits, labels, vocab_size)  # transformers' causal-LM loss, the last stage's

        schedule = schedule_kind.schedule_class(stages if schedule_kind.multi_stage else stages[0],
                                                setup.n_microbatches, loss_fn=loss_fn)
        # one optimizer over every stage the rank holds, as a plain script steps a list of modules
        optimizer = make_optimizer([p for module in modules for p in module.parameters()], setup)
        for hooks in all_hooks:
            hooks.watch(optimizer, gpu=setup.device is Device.CUDA and not setup.cuda_default_device)
        batch = torch.randint(0, vocab_size, (setup.micro_batch * setup.n_microbatches, setup.seq_len))
        tracker.label([batch], Category.INPUT)
        # the rank with the first stage feeds the batch, the one with the last its labels (rank 0 both in a V), and a
        # new list for each step's losses
        inputs, holds_last = (batch,) if 0 in stage_indices else (), num_stages - 1 in stage_indices
        with contextlib.ExitStack() as reduced:
            if wrap is not None:  # torch's REDUCE_GRAD (FSDP2's post-backward of every group after the last
                for hooks in all_hooks:  # micro-batch) under each group's layer
                    reduced.enter_context(_groups_reduced_in_their_layers(hooks))
                if replays:  # the unshards in micro-batch 0's forward, made again where it is replayed
                    reduced.enter_context(unshards_seen(replays))
            for step in range(setup.steps):
                tracker.set_phase(step, Phase.FORWARD)
                schedule.step(*inputs, **({"target": batch, "losses": []} if holds_last else {}))
                tracker.set_phase(step, Phase.OPTIMIZER)
                optimizer.step()
                tracker.frees_by_owner = True
                optimizer.zero_grad(set_to_none=True)
        tracker.finish()
    first, last = all_hooks[0], all_hooks[-1]
    return StepInfo(first.prefix, sum(hooks.num_blocks for hooks in all_hooks), first.leaf_order[0],
                    last.leaf_order[-1], vocab_size)


@contextlib.contextmanager
def _groups_reduced_in_their_layers(hooks: LayerHooks):
    """FSDP2's (and replicate's) `FSDPParamGroup.post_backward` run as the tracker's layer of the group's module: a
    pipeline stage calls it for every group at once after its last micro-batch (torch's REDUCE_GRAD,
    `PipelineStage.perform_reduce_grad`), outside any layer's backward; each group's reduction, gradient buffers and
    reshard are its own layer's, as the expansion to full depth reads them (llmsim/sim/timeline.py)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    blocks = {id(module): hooks.block_of(name) for name, module in hooks.model.named_modules()}
    post_backward = FSDPParamGroup.post_backward

    def in_its_layer(group, *args, **kwargs):
        tracker = hooks.tracker
        block = max((blocks.get(id(module), NO_BLOCK) for module in group.modules), default=NO_BLOCK)
        if block == NO_BLOCK or tracker.phase is not Phase.BACKWARD:
            return post_backward(group, *args, **kwargs)
        with tracker.in_layer(block, f"{hooks.prefix}.{block}"):
            return post_backward(group, *args, **kwargs)

    with mock.patch.object(FSDPParamGroup, "post_backward", in_its_layer):
        yield


def _track_chunks(stage, tracker: StorageTracker, hooks: LayerHooks, autocast, replay=None) -> None:
    """The schedule interleaves micro-batches' forwards and backwards: keep the tracker's phase in step, and run
    each micro-batch's forward under `autocast`, as the canonical step runs the model's forward (the loss, which
    transformers computes in fp32 anyway, and the backward outside it, as torch's AMP recipe has it). With
    `replay` (chunk_replay.ChunkReplay), tell it where each chunk call and torch's stage_backward begin and end."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
    calls = replay or _NoReplay()

    def forward_one_chunk(chunk, *args, **kwargs):
        tracker.set_phase(tracker.step, Phase.FORWARD)
        begin = len(tracker._rows)
        with calls.forward(chunk), autocast:
            output = forward(chunk, *args, **kwargs)
        tracker.chunks.append(("F", chunk, tracker.step, begin, len(tracker._rows)))
        return output

    def backward_one_chunk(chunk, *args, **kwargs):
        tracker.set_phase(tracker.step, Phase.BACKWARD)
        hooks.enter_backward()
        begin = len(tracker._rows)
        with calls.backward(chunk):
            backward(chunk, *args, **kwargs)
        tracker.chunks.append(("B", chunk, tracker.step, begin, len(tracker._rows)))

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    weight = stage.backward_weight_one_chunk

    def backward_weight_one_chunk(chunk, *args, **kwargs):  # a zero-bubble schedule's weight gradients
        tracker.set_phase(tracker.step, Phase.BACKWARD)
        hooks.enter_backward()
        begin = len(tracker._rows)
        weight(chunk, *args, **kwargs)
        tracker.chunks.append(("W", chunk, tracker.step, begin, len(tracker._rows)))

    stage.backward_weight_one_chunk = backward_weight_one_chunk
    if replay is not None:
        engine = stage.backward_maybe_with_nosync

        def backward_maybe_with_nosync(*args, **kwargs):
            result = engine(*args, **kwargs)
            replay.engine_returned()
            return result
        stage.backward_maybe_with_nosync = backward_maybe_with_nosync


class _NoReplay:
    forward = backward = staticmethod(lambda chunk: contextlib.nullcontext())
