"""The HF Trainer recipe, traced: transformers' own `Trainer(...).train()` under the storage tracker.

Where the canonical step (llmsim/model/step.py) is llmsim's loop, this runs the library's: the model as
`from_pretrained(dir, dtype=...)` returns it (built here by `from_config` in that dtype: the same parameters, no
checkpoint read; with a BitsAndBytesConfig, `from_pretrained` itself on a header-only checkpoint, then peft's
`prepare_model_for_kbit_training` unless the script skips it), `get_peft_model(model, LoraConfig(**fields))` when a peft config is given, then
`Trainer(model, TrainingArguments(**fields), train_dataset=rows).train()` for three optimizer steps. So the
Trainer's optimizer factory and parameter groups, its prefetched batches (`get_batch_samples` holds a step's
`gradient_accumulation_steps` batches and accelerate's `DataLoaderShard` one more), `num_items_in_batch`, the
loss accumulator, clipping (`max_grad_norm`), accelerate's autocast and GradScaler, and `model.zero_grad()` are the
library's, not a copy of them. Under FakeTensorMode (llmsim/model/trace.py) the values a fake tensor cannot give are
answered as a clean run reads them (`_CLEAN_RUN`).

The data are the measured recipe's (llmsim/model/trainer_recipe.py): rows of `input_ids` and `labels` lists, collated
by `default_data_collator` (for TRL's SFTTrainer, recipe trl-sft: a `datasets.Dataset` of `input_ids`, collated by
TRL's DataCollatorForLanguageModeling, the model's forward replaced by TRL's fused LM head; TRL's own code, run
here as for the Trainer). Phases for the layer bookkeeping: forward from the model's forward, backward from its
return, optimizer from the gradient clipping (which runs with no layer) to the end of the step.
"""
from __future__ import annotations

import contextlib
import functools
import json
import tempfile
from unittest import mock
from typing import Callable

import torch
from torch import nn

from llmsim.enums import Category, Device, Phase, Recipe
from llmsim.model.trainer_recipe import (MEASURED_STEPS, MEASUREMENT_ARGS, prepare_kbit, sft_dataset, sft_tokenizer,
                                         token_rows)
from llmsim.inputs.spec import TrainSetup
from llmsim.model.host_memory import fsdp_offload
from llmsim.model.step import LayerHooks, StepInfo, cast_parameters
from llmsim.model.tracker import StorageTracker

# Values a fake tensor cannot give, answered as a clean real run reads them: no NaN or inf loss
# (`logging_nan_inf_filter`), the data loader's seeds and the sampler's order (any value: every row is alike),
# the logged loss and gradient norm (floats that allocate nothing). (llmsim/model/optimizer_values.py, `_AnswerScalars`)
CLEAN_RUN_NUMBER, CLEAN_RUN_FLAG = 0, False
# transformers' mask builders ask whether the batch's attention mask has a padded position (where a collator makes
# one: TRL's). They take a fake mask for a graph being traced and keep the mask; a real run reads the values. The
# trace's rows are all of one length, so none is padded, and with SDPA or flash attention the causal mask is skipped
# for `is_causal` as a real run skips it (masking_utils: `_ignore_causal_mask_sdpa`, `is_tracing`, `fast_all`)
MASK_READERS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "flash_attention_mask")
NO_PADDING = True


class _Phases:
    """Moves the tracker's phase with the Trainer's loop, and the layer hooks with it."""

    def __init__(self, tracker: StorageTracker, hooks: LayerHooks, gpu: bool) -> None:
        self.tracker, self.hooks, self.step, self.gpu = tracker, hooks, 0, gpu

    def forward(self, module, args, kwargs):
        self.tracker.set_phase(self.step, Phase.FORWARD)
        # the collated batch (the data loader made it before this forward): the model's inputs
        self.tracker.label([v for v in kwargs.values() if isinstance(v, torch.Tensor)], Category.INPUT)

    def backward(self, module, args, output):
        self.tracker.set_phase(self.step, Phase.BACKWARD)
        self.hooks.enter_backward()

    def optimizer(self, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            if self.tracker.phase is not Phase.OPTIMIZER:
                self.tracker.set_phase(self.step, Phase.OPTIMIZER)
            return fn(*args, **kwargs)
        return wrapped


@contextlib.contextmanager
def _cuda_optimizer_defaults(setup: TrainSetup):
    """On a GPU target, torch.optim's own choice for CUDA parameters: the foreach path where the Trainer leaves
    `foreach=None` (`optim="adamw_torch"`, "sgd"), as `_default_to_fused_or_foreach` decides from the parameters'
    device and type (torch/optim/optimizer.py). The trace's parameters are fake tensors on the CPU, where torch
    picks the for-loop; and their type is FakeTensor, which is not among `_foreach_supported_types` (a real
    parameter's is nn.Parameter): both are answered as for a real CUDA parameter."""
    if setup.device is not Device.CUDA:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer

    supported = optimizer._get_foreach_kernels_supported_devices
    with mock.patch.object(optimizer, "_get_foreach_kernels_supported_devices", lambda: [*supported(), "cpu"]), \
            mock.patch.object(optimizer, "_foreach_supported_types", [*optimizer._foreach_supported_types,
                                                                       FakeTensor]):
        yield


@contextlib.contextmanager
def _unpadded_batches():
    """In the mask builders, the attention mask read as a real run reads it (not as a traced graph's), and every
    read of its values answered as for rows of one length."""
    from transformers import masking_utils

    from llmsim.model.optimizer_values import _AnswerScalars

    tracing = masking_utils.is_tracing

    def as_a_real_run(fn):
        @functools.wraps(fn)
        def reader(*args, **kwargs):
            with mock.patch.object(masking_utils, "is_tracing", lambda tensor=None: tracing()), \
                    _AnswerScalars(CLEAN_RUN_NUMBER, NO_PADDING):
                return fn(*args, **kwargs)
        return reader

    with contextlib.ExitStack() as stack:
        for name in MASK_READERS:
            stack.enter_context(mock.patch.object(masking_utils, name, as_a_real_run(getattr(masking_utils, name))))
        yield


@contextlib.contextmanager
def _verbosity_kept():
    """transformers' logging verbosity as the trace found it: the Trainer sets it from the TrainingArguments
    (`log_level_replica`, "warning", on a rank other than 0, which an FSDP trace plays), and it would stay so for
    the rest of the process, printing the next trace's library advice."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _callback(phases: _Phases):
    from transformers import TrainerCallback

    class LayerBookkeeping(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            # accelerate's AcceleratedOptimizer holds torch's; on a GPU target Adam's `step` lives on the host
            phases.hooks.watch(getattr(optimizer, "optimizer", optimizer), gpu=phases.gpu)

        def on_optimizer_step(self, args, state, control, **kwargs):
            phases.tracker.frees_by_owner = True  # model.zero_grad() comes next: each gradient freed by its layer

        def on_step_end(self, args, state, control, **kwargs):
            phases.step += 1

    return LayerBookkeeping()


def run_trainer_step(build: Callable[[], nn.Module], setup: TrainSetup, tracker: StorageTracker,
                     expected_blocks: int | None = None) -> StepInfo:
    """`Trainer(...).train()` on the built model under `tracker` (inside a FakeTensorMode for the trace)."""
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback

    from llmsim.inputs.hf import lora_config, training_arguments
    from llmsim.model.optimizer_values import _AnswerScalars

    fields = json.loads(setup.training_args)
    if setup.trainer_under_deepspeed:  # the engine owns the precision and the step (TrainSetup, the flag)
        fields = {**{k: v for k, v in fields.items() if k != "deepspeed"}, "bf16": False, "fp16": False}
    peft = lora_config(json.loads(setup.peft_config)) if setup.peft_config else None
    torch.manual_seed(0)  # peft is imported by now (lora_config), before the tracked region, as step.py does
    from llmsim.model import zero3_hooks

    # under ZeRO-3, from_pretrained's zero.Init replaces F.linear for the rest of the process (mem_efficient_linear)
    linear = zero3_hooks.linear_as_zero3() if setup.zero3_hooks else contextlib.nullcontext()
    sft = setup.recipe is Recipe.TRL_SFT
    with tempfile.TemporaryDirectory() as directory, tracker, linear, fsdp_offload(tracker, setup.fsdp), \
            _verbosity_kept():
        args = training_arguments(fields, setup.recipe, **MEASUREMENT_ARGS, output_dir=directory)
        count = MEASURED_STEPS * args.per_device_train_batch_size * args.gradient_accumulation_steps
        model = build()
        if setup.quant is not None and setup.kbit_prep:
            model = prepare_kbit(model, args)
        hooks = LayerHooks(tracker, model, expected_blocks)
        vocab_size = model.get_input_embeddings().num_embeddings
        if peft is not None and not sft:  # SFTTrainer calls get_peft_model itself (its peft_config)
            model = _peft_model(model, peft)
        if setup.trainer_under_deepspeed and not setup.zero3_hooks:  # deepspeed.initialize's cast, after
            hooks.label_model()  # get_peft_model (the adapters too); the fp32 adapters named before it frees them
            cast_parameters(model, setup.precision.cast_dtype)
        # (ZeRO-3 casts nothing: the base loaded in the config's dtype under zero.Init, peft's adapters stay fp32,
        # `autocast_adapter_dtype`, as in the canonical ZeRO-3 LoRA step: llmsim/sim/strategies/zero3.py)
        if (peft is not None and not sft) or setup.trainer_under_deepspeed:
            hooks.adopt_new_parameters()
        if setup.label_micro_grads:
            hooks.label_micro_grads()
        if setup.zero3_hooks:  # deepspeed.initialize (in the Trainer's accelerate prepare) registers them last
            from llmsim.model.step import base_fqn

            zero3_hooks.install(model, tracker, base_fqn, hooks.block_of)
        phases = _Phases(tracker, hooks, setup.device is Device.CUDA)
        model.register_forward_pre_hook(phases.forward, with_kwargs=True, prepend=True)
        model.register_forward_hook(phases.backward)
        if sft:
            trainer = _sft_trainer(model, args, sft_dataset(vocab_size, setup.seq_len, count), peft, phases)
            if peft is not None:
                hooks.adopt_new_parameters()
        else:
            trainer = Trainer(model=model, args=args, train_dataset=token_rows(vocab_size, setup.seq_len, count),
                              callbacks=[_callback(phases)])
        trainer.remove_callback(PrinterCallback)  # its end-of-training print: library code stays silent
        trainer._clip_grad_norm = phases.optimizer(trainer._clip_grad_norm)
        trainer._get_grad_norm = phases.optimizer(trainer._get_grad_norm)
        with _AnswerScalars(CLEAN_RUN_NUMBER, CLEAN_RUN_FLAG), _unpadded_batches(), _cuda_optimizer_defaults(setup):
            trainer.train()
        tracker.finish()
    return hooks.info(vocab_size)


def _sft_trainer(model, args, dataset, peft, phases: _Phases):
    """`SFTTrainer(model, args, train_dataset=..., processing_class=..., peft_config=...)`, which adds TRL's fused LM
    head to the model and wraps it with peft; what it or peft refuses is one line."""
    from trl import SFTTrainer

    from llmsim.errors import InputError, one_line

    try:
        return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=sft_tokenizer(),
                          peft_config=peft, callbacks=[_callback(phases)])
    except (ValueError, TypeError) as exc:
        raise InputError(f"SFTTrainer: {one_line(exc)}") from exc


def _peft_model(model, peft):
    """`get_peft_model(model, peft)`; what peft refuses (a target the model lacks, options that do not go together:
    LoRA on expert parameters with dropout) is one line."""
    from peft import get_peft_model

    from llmsim.errors import InputError, one_line

    try:
        return get_peft_model(model, peft)
    except ValueError as exc:
        raise InputError(f"peft config: {one_line(exc)}") from exc
