"""Every choice llmsim makes is an enum; strings are mapped to them only at the CLI edge."""
from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """What a block of memory holds (the vocabulary of DESIGN.md, stage 3)."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    MASTER_WEIGHTS = "master_weights"
    ACTIVATION = "activation"  # allocated in the forward and still alive when it ends (saved for backward)
    ALLGATHER_BUFFER = "allgather_buffer"
    OUTPUT_GATHER_BUFFER = "output_gather_buffer"
    REDUCE_BUCKET = "reduce_bucket"
    TEMPORARY = "temporary"  # allocated and freed inside one phase
    INPUT = "input"  # the batch: input_ids and labels
    BUFFER = "buffer"  # module buffers (rotary inv_freq, position ids, ...)
    OFFLOADED = "offloaded"  # host memory: checkpoint inputs offloaded by save_on_cpu (llmsim/model/offload.py)
    # host memory: torch Adam/AdamW's 0-d `step` counters, which their for-loop and foreach paths keep on the host
    # while the parameters are on a GPU (torch/optim/adam.py, `_init_group`); the fused path puts them on the device
    HOST_OPTIMIZER_STATE = "host_optimizer_state"
    # host memory of DeepSpeed's optimizer offload: the fp32 master partition, its gradient, the optimizer states,
    # the host staging buffers and the host step's temporaries (llmsim/sim/strategies/zero12.py)
    HOST_OFFLOAD = "host_offload"
    # a GPU's cuBLAS and cuBLASLt workspaces, one per thread that called them (tracker.WORKSPACE_MARKERS)
    WORKSPACE = "workspace"
    OTHER = "other"


class Phase(str, Enum):
    """Where in the canonical step an event happens, in execution order."""

    BUILD = "build"  # from_config, the dtype cast, the optimizer constructor and the batch
    FORWARD = "forward"  # model(input_ids, labels) including the loss
    BACKWARD = "backward"  # loss.backward()
    OPTIMIZER = "optimizer"  # opt.step() and opt.zero_grad(set_to_none=True)


class Precision(str, Enum):
    FP32 = "fp32"  # everything fp32
    BF16 = "bf16"  # model cast to bf16: weights, grads and AdamW states all bf16 (no master weights)
    BF16_AUTOCAST = "bf16-autocast"  # fp32 weights and states, forward under torch.autocast(bfloat16)
    FP16 = "fp16"  # model cast to fp16 (`model.half()`): weights, grads and AdamW states all fp16
    FP16_AUTOCAST = "fp16-autocast"  # torch's AMP recipe: fp32 weights, autocast(float16), torch.amp.GradScaler

    @property
    def cast_dtype(self):
        """The dtype the model is cast to after its build (None: it stays fp32)."""
        import torch

        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self)

    @property
    def autocast_dtype(self):
        import torch

        return {Precision.BF16_AUTOCAST: torch.bfloat16, Precision.FP16_AUTOCAST: torch.float16}.get(self)


class Attention(str, Enum):
    """transformers' `attn_implementation` values llmsim knows."""

    SDPA = "sdpa"
    EAGER = "eager"


class Optimizer(str, Enum):
    """The client optimizer of the canonical step, with torch's defaults."""

    ADAMW = "adamw"  # torch.optim.AdamW
    ADAM = "adam"  # torch.optim.Adam
    SGD = "sgd"  # torch.optim.SGD(lr=1e-3): no state
    SGD_MOMENTUM = "sgd-momentum"  # torch.optim.SGD(lr=1e-3, momentum=0.9): one buffer per parameter
    # torch.optim.Adafactor: factored second moments (row and column vectors of each matrix, the whole tensor for
    # a vector); its step reads tensor values (`.item()`), answered in the fake trace by llmsim.model.trace
    ADAFACTOR = "adafactor"
    # transformers.optimization.Adafactor with its defaults (scale_parameter, relative_step, no first moment)
    HF_ADAFACTOR = "hf-adafactor"
    # bitsandbytes (bnb.optim): 8-bit blockwise AdamW states, and the paged variants (CUDA unified memory;
    # on the CPU bitsandbytes falls back to ordinary buffers)
    ADAMW_8BIT = "adamw8bit"
    PAGED_ADAMW = "paged-adamw"
    PAGED_ADAMW_8BIT = "paged-adamw8bit"

    @property
    def paged(self) -> bool:
        return self in (Optimizer.PAGED_ADAMW, Optimizer.PAGED_ADAMW_8BIT)

    @property
    def bitsandbytes(self) -> bool:
        return self in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW, Optimizer.PAGED_ADAMW_8BIT)


class Loss(str, Enum):
    """How the causal-LM loss is computed from the last hidden states (llmsim/model/losses.py)."""

    HF = "hf"  # transformers' lm_head over every position, logits upcast to fp32 by ForCausalLMLoss
    CHUNKED_NLL = "chunked-nll"  # TRL's SFT loss: its fused LM head in vocabulary tiles (trl 1.16.0)
    FUSED_LINEAR_CE = "fused-linear-ce"  # Liger's fused linear cross-entropy, chunked over tokens


# The routings an expert-parallel trace can state (llmsim/model/moe.py, `split_sizes`): each rank's experts an equal
# share of the (token, slot) pairs, or every pair one rank can take sent to it (the bound of any routing).
ROUTINGS = ("balanced", "collapsed")


class Recipe(str, Enum):
    """How the user's job runs its steps (DESIGN.md, "Recipes"): the loop the trace runs, under fake tensors."""

    CANONICAL = "canonical"  # llmsim's own minimal loop (llmsim/model/step.py)
    # transformers' Trainer itself: `Trainer(model, TrainingArguments(...)).train()` on a model as
    # `from_pretrained(dir, dtype=...)` returns it, optionally wrapped by `get_peft_model` (llmsim/model/trainer_trace.py)
    HF_TRAINER = "hf-trainer"
    # TRL's SFTTrainer (a Trainer subclass) on the same model: `SFTTrainer(model, SFTConfig(...), train_dataset=...,
    # peft_config=...).train()`, with TRL's fused LM head and collator (llmsim/model/trainer_trace.py)
    TRL_SFT = "trl-sft"
    # DeepSpeed's pipeline engine: the model's pieces as a PipelineModule of LayerSpecs, `deepspeed.initialize`, then
    # `engine.train_batch()` per step (llmsim/model/ds_pipe.py); what `--ds-config` with `--pp` describes
    DEEPSPEED_PIPE = "deepspeed-pipe"
    # DeepSpeed's AutoTP training: the DeepSpeed script (`deepspeed.initialize(model=..., optimizer=..., config=...)`,
    # then forward, `engine.backward`, `engine.step`) with `"tensor_parallel": {"autotp_size": N}` in its JSON, the
    # engine sharding the linear layers and running ZeRO-0/1/2 over the data-parallel ranks (llmsim/model/ds_script.py);
    # what `--ds-config` with an autotp_size above 1 describes. The measured script is the canonical DeepSpeed one
    DEEPSPEED_AUTOTP = "deepspeed-autotp"

    @property
    def trainer(self) -> bool:
        """The loop is a library's Trainer (transformers' or TRL's), run on the user's arguments files."""
        return self in (Recipe.HF_TRAINER, Recipe.TRL_SFT)


class Device(str, Enum):
    """The target whose kernels the trace must select (DESIGN.md stage 1)."""

    CPU = "cpu"
    CUDA = "cuda"  # an NVIDIA GPU of a given compute capability (TrainSetup.cuda_capability, from --gpu)


def parse_enum(enum_cls: type[Enum], value: str, what: str) -> Enum:
    """Map a user string to an enum member or raise a one-line error naming the valid choices."""
    from llmsim.errors import InputError

    for member in enum_cls:
        if member.value == value:
            return member
    choices = ", ".join(m.value for m in enum_cls)
    raise InputError(f"unknown {what} {value!r}; valid choices: {choices}")
