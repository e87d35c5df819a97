"""The HF Trainer recipe, measured: `from_pretrained` (optionally with a BitsAndBytesConfig, then peft's
`prepare_model_for_kbit_training`) -> optional `get_peft_model` -> `Trainer(...).train()`; or, for TRL's recipe,
`SFTTrainer(model, SFTConfig(...), train_dataset=Dataset, processing_class=..., peft_config=...).train()`.

What a user's script does, on this CPU (`use_cpu=True`), with the user's `TrainingArguments` fields and these
measurement-only ones forced (`MEASUREMENT_ARGS`): three optimizer steps, no saving, logging or reporting.
The data is a tokenized dataset as `datasets.map(tokenizer)` leaves it: rows of Python lists `input_ids` and
`labels` (equal, no padding), collated by transformers' `default_data_collator` (which the Trainer picks when
it has no processing class). The checkpoint is written before the tracker starts, in the config's own dtype, as
a hub checkpoint is stored. Peak = the most live tensor bytes from `from_pretrained` to the end of `train()`.
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
import tempfile
from pathlib import Path
from unittest import mock

from llmsim.enums import Phase
from llmsim.model.tracker import StorageTracker

MEASURED_STEPS = 3  # optimizer steps: the canonical three (the first builds the optimizer's states lazily)
DATA_SEED = 0
# Forced for the measurement: the CPU, the steps, and nothing the run writes outside memory
MEASUREMENT_ARGS = {"use_cpu": True, "max_steps": MEASURED_STEPS, "report_to": "none", "save_strategy": "no",
                    "disable_tqdm": True}
DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def checkpoint_dtype(config):
    """The dtype a hub checkpoint of `config` is stored in: its `dtype` / `torch_dtype`, fp32 where it has none."""
    import torch

    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def write_checkpoint(config_dict: dict, directory: Path) -> None:
    """A checkpoint as the hub stores one: the config's weights in its `torch_dtype` (fp32 where it has none)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config_dict)
    dtype = checkpoint_dtype(config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(directory)


def token_rows(vocab_size: int, seq_len: int, count: int) -> list[dict]:
    rng = random.Random(DATA_SEED)
    rows = []
    for _ in range(count):
        ids = [rng.randrange(vocab_size) for _ in range(seq_len)]
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def sft_dataset(vocab_size: int, seq_len: int, count: int):
    """The same token rows as TRL's SFTTrainer takes a tokenized language-modelling dataset: a `datasets.Dataset`
    of `input_ids` (its collator, DataCollatorForLanguageModeling, makes the labels and the attention mask)."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()  # SFTTrainer's dataset preparation (truncation, dropping masked rows) stays silent
    return Dataset.from_list([{"input_ids": row["input_ids"]} for row in token_rows(vocab_size, seq_len, count)])


SFT_PAD, SFT_EOS = "<pad>", "<eos>"


def sft_tokenizer():
    """The processing class SFTTrainer requires, for a dataset already tokenized: a two-token word-level tokenizer
    whose pad and eos tokens are all the trainer reads of it (the collator pads with the pad token's id; rows of
    one length are never padded)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {SFT_PAD: 0, SFT_EOS: 1}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=SFT_PAD)),
                                   pad_token=SFT_PAD, eos_token=SFT_EOS)


class _Phases:
    """Names the Trainer's phases in the tracker (for the breakdown only; the peak does not depend on them):
    forward from the model's forward, backward from its return, optimizer from `on_pre_optimizer_step`."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker, self.step = tracker, 0

    def forward(self, *_):
        self.tracker.set_phase(self.step, Phase.FORWARD)

    def backward(self, *_):
        self.tracker.set_phase(self.step, Phase.BACKWARD)

    def optimizer(self):
        self.tracker.set_phase(self.step, Phase.OPTIMIZER)

    def step_end(self):
        self.step += 1


def _callback(phases: _Phases):
    from transformers import TrainerCallback

    class PhaseCallback(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            phases.optimizer()

        def on_step_end(self, args, state, control, **kwargs):
            phases.step_end()

    return PhaseCallback()


def prepare_kbit(model, args):
    """peft's `prepare_model_for_kbit_training` as TRL's SFTTrainer calls it on a quantized model (trl/trainer/
    sft_trainer.py, `_prepare_peft_model`): checkpointing as the TrainingArguments ask. It freezes the base, casts
    every parameter that is not 4-bit from fp16/bf16 to fp32, and with checkpointing makes the embedding's output
    require grad (a reentrant checkpoint needs an input that does) and turns checkpointing on."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing,
                                           gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)


@contextlib.contextmanager
def own_bitsandbytes_overrides():
    """A run's bitsandbytes optimizer overrides start and end empty. With an 8-bit optimizer the Trainer registers
    every embedding for 32-bit states (trainer.py, `create_optimizer`: GlobalOptimManager.register_module_override),
    in a process-wide singleton that also keeps them by (group, parameter) position: left there, they give 32-bit
    states to whatever parameters sit at those positions in every later 8-bit optimizer of the process (a job
    runs one Trainer per process; a sweep or `validate` runs many). A no-op unless bitsandbytes is loaded."""
    def reset():
        if "bitsandbytes" in sys.modules:
            sys.modules["bitsandbytes"].optim.GlobalOptimManager.get_instance().initialize()
    reset()
    try:
        yield
    finally:
        reset()


@contextlib.contextmanager
def accelerate_fsdp_on_cpu():
    """The Trainer's FSDP on this CPU as accelerate runs it on a GPU. TrainingArguments(fsdp=..., fsdp_config=...)
    hands accelerate a FullyShardedDataParallelPlugin, and AcceleratorState turns FSDP on only for accelerator
    devices (MULTI_GPU, MULTI_XPU, ...: accelerate/state.py); a CPU run (MULTI_CPU) drops the plugin silently and
    runs DDP. Here the state is set as it is on a GPU once it is made (distributed type FSDP, the plugin and its
    mixed precision); the rest is accelerate's own path (`fsdp2_prepare_model`, its wrap, its fp32 upcast)."""
    from accelerate import state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def as_on_a_gpu(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = self.distributed_type

    with mock.patch.object(state.AcceleratorState, "__init__", as_on_a_gpu):
        yield


def _fsdp(job: dict):
    """A job whose TrainingArguments ask for FSDP, or launched by `accelerate launch` with FSDP (the variables it
    sets, from which the Trainer's Accelerator builds the plugin): accelerate's FSDP path on, and gloo settled unless
    the job says `gloo_settle: false`; nothing otherwise."""
    if not (job["training_args"].get("fsdp") or _launched_with_fsdp()):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(accelerate_fsdp_on_cpu())
    if job.get("gloo_settle", True):
        from llmsim.model.gloo import settled_collectives

        stack.enter_context(settled_collectives())  # FSDP2's, as the from-pretrained rows settle them
    return stack


def _launched_with_fsdp() -> bool:
    """`accelerate launch` with distributed_type FSDP started this process (accelerate's own reading of it)."""
    from accelerate.utils.environment import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_FSDP")


def _fsdp_offload(tracker: StorageTracker, args, job: dict):
    """The Trainer's FSDP with `fsdp_config` cpu_offload (accelerate's CPUOffloadPolicy()), or measured as on a GPU
    (the job's `fsdp_init` "host": the model loaded on the host, each unit copied to the device by fully_shard): the
    CPU standing in for the host and the device (llmsim/model/host_memory.py), as the trace runs it; nothing
    otherwise."""
    from accelerate.utils.environment import parse_flag_from_env

    offload = bool((getattr(args, "fsdp_plugin_args", None) or {}).get("cpu_offload")) or \
        (_launched_with_fsdp() and parse_flag_from_env("FSDP_OFFLOAD_PARAMS"))
    host_build = job.get("fsdp_init") == "host"
    if not (offload or host_build):  # decided here, not by host_memory.fsdp_offload: a plain run imports none of it
        return contextlib.nullcontext()
    from llmsim.model.host_memory import HostMemory

    return HostMemory(tracker).active_fsdp(offload=offload, host_build=host_build)


def run(job: dict) -> dict:
    """Measure one Trainer run; `job`: config (the HF config dict), seq_len, load_dtype (from_pretrained's
    `dtype`), training_args (TrainingArguments fields), peft_config (LoraConfig fields or None),
    quantization_config (BitsAndBytesConfig fields or None) and kbit_prep (the script calls peft's
    prepare_model_for_kbit_training on the quantized model); trainer "trl-sft" for TRL's SFTTrainer (the
    training_args are then an SFTConfig's fields, and peft_config goes to SFTTrainer)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    sft = job.get("trainer") == "trl-sft"  # TRL's SFTTrainer on an SFTConfig's fields
    if sft:
        from trl import SFTConfig, SFTTrainer
    with tempfile.TemporaryDirectory() as directory, own_bitsandbytes_overrides():
        write_checkpoint(job["config"], Path(directory) / "model")
        # the user's output_dir, like the other MEASUREMENT_ARGS, gives way to the measurement's own
        args = (SFTConfig if sft else TrainingArguments)(**{**job["training_args"], **MEASUREMENT_ARGS,
                                                            "output_dir": str(Path(directory) / "out")})
        # every rank's DistributedSampler share (under torchrun) holds the measured steps' batches
        count = MEASURED_STEPS * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        vocab_size = job["config"]["vocab_size"]
        dataset = (sft_dataset(vocab_size, job["seq_len"], count) if sft else
                   token_rows(vocab_size, job["seq_len"], count))
        peft_config = _peft_config(job.get("peft_config"))
        tracker = StorageTracker()
        phases = _Phases(tracker)
        quantization = job.get("quantization_config")
        loading = {"quantization_config": BitsAndBytesConfig(**quantization)} if quantization else {}
        # ZeRO-Offload's host side apart; the Trainer's FSDP on as accelerate runs it on a GPU
        with tracker, _optimizer_offload(tracker, job["training_args"].get("deepspeed")), _fsdp(job), \
                _fsdp_offload(tracker, args, job):
            model = AutoModelForCausalLM.from_pretrained(Path(directory) / "model", dtype=DTYPES[job["load_dtype"]],
                                                         **loading)
            tracker.adopt([*model.parameters(), *model.buffers()])  # what stayed memory-mapped (on a GPU: copied)
            loaded_dtype = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")  # never quantized
            if quantization and job.get("kbit_prep"):
                model = prepare_kbit(model, args)
            if peft_config is not None and not sft:
                from peft import get_peft_model

                model = get_peft_model(model, peft_config)
            model.register_forward_pre_hook(phases.forward)
            model.register_forward_hook(phases.backward)
            if sft:  # SFTTrainer wraps the model with peft itself, as TRL's scripts pass the LoraConfig
                trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=sft_tokenizer(),
                                     peft_config=peft_config, callbacks=[_callback(phases)])
            else:
                trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[_callback(phases)])
            trainer.train()
            _label(tracker, trainer)
            tracker.finish()
    return {"timeline": tracker.timeline(), "loaded_dtype": loaded_dtype}


def main() -> int:
    """One rank of a Trainer run under torchrun (`python -m torch.distributed.run --nproc_per_node N -m
    llmsim.model.trainer_recipe JOB OUT`): the Trainer finds the ranks in the environment (TrainingArguments,
    accelerate's PartialState: DistributedDataParallel over gloo on the CPU), as a user's `torchrun train.py` does.
    Each rank writes its timeline (a pickled DataFrame) and what it loaded under OUT."""
    import json

    job, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    result = run(job)
    rank = int(os.environ.get("RANK", "0"))
    result["timeline"].to_pickle(out / f"rank{rank}.timeline.pkl")
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "loaded_dtype": result["loaded_dtype"]}))
    return 0


def _optimizer_offload(tracker: StorageTracker, ds_config):
    """ZeRO-Offload's host placement of the run (llmsim/model/host_memory.py, the instrument's part for it, imported
    only for a DeepSpeed job); nothing without optimizer offload."""
    if not ds_config:
        return contextlib.nullcontext()
    from llmsim.model.host_memory import optimizer_offload

    return optimizer_offload(tracker, ds_config)


def _label(tracker: StorageTracker, trainer) -> None:
    """Name what outlives the run, for the breakdown: the parameters and buffers by FQN, the optimizer's states."""
    from llmsim.enums import Category

    named = list(trainer.model.named_parameters())
    tracker.label([p for _, p in named], Category.PARAMETER, [n for n, _ in named], retag=True)
    buffers = list(trainer.model.named_buffers())
    tracker.label([b for _, b in buffers], Category.BUFFER, [n for n, _ in buffers], retag=True)
    states = [s for state in trainer.optimizer.state.values() for s in state.values() if hasattr(s, "untyped_storage")]
    tracker.label(states, Category.OPTIMIZER_STATE, retag=True)


def _peft_config(fields: dict | None):
    if not fields:
        return None
    from peft import LoraConfig

    return LoraConfig(**fields)


if __name__ == "__main__":
    raise SystemExit(main())
