"""QLoRA: a 4-bit base (bitsandbytes nf4/fp4, optionally double-quantized) or an 8-bit one (LLM.int8) under peft
LoRA adapters.

The canonical QLoRA build (what `--quant nf4 --lora-rank r` predicts and what a measured run does):

    save_pretrained of the model in fp32, outside the measured region (a real run loads a checkpoint)
    model = AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4" | "fp4",
                                               bnb_4bit_use_double_quant=..., bnb_4bit_compute_dtype=torch.bfloat16))
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    then the canonical step: train mode, checkpointing (--grad-ckpt), get_peft_model(LoraConfig(r, ...)), AdamW

Every linear layer of the decoder becomes a `bnb.nn.Linear4bit` whose weight packs two 4-bit codes per byte, with
one absmax per 64-element block (double quantization: those absmax in 8 bits, plus one fp32 absmax per 256 of them
and a 256-entry code book, per layer). The LM head stays in fp32. `bnb_4bit_compute_dtype` is bf16, the QLoRA
recipe's.

8-bit (`--quant int8`: BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=--int8-threshold)): every linear
layer of the decoder becomes a `bnb.nn.Linear8bitLt` whose `Int8Params` weight is quantized while it loads
(`Int8Params._quantize`: an fp16 copy of the fp32 weight, then `int8_vectorwise_quant`: int8 CB of the weight's shape
and one fp32 absmax per output row, SCB). In a training step on the CPU bitsandbytes 0.50 never takes LLM.int8's
outlier decomposition: `bnb.matmul` sends a module in train mode on a CPU to `MatMul8bitFp`
(bitsandbytes/autograd/_functions.py, "MatMul8bitLt is slower because no fast kernel for quant/dequant 8bit in
CPU/XPU"), which dequantizes CB to the input's dtype, runs `F.linear`, saves the input for the backward and
dequantizes CB again there; the threshold is read by `MatMul8bitLt` only. So on the CPU every allocation is
independent of the values, for any threshold, and the prediction is exact. On a GPU the step runs `MatMul8bitLt`,
whose outlier columns (|x| > threshold) are a data-dependent size: refused there (`check_quantized`).

The predictor loads a *header-only* checkpoint (the safetensors header of the fp32 state dict over a sparse file:
no bytes written, any model size) under FakeTensorMode, with four patches that make bitsandbytes and transformers'
loader run on fake tensors, each doing what the real code does to memory (`fake_loading`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import tempfile
from pathlib import Path
from unittest import mock

import torch

from llmsim.enums import Device, Recipe
from llmsim.errors import InputError

FOUR_BIT_TYPES = ("nf4", "fp4")
INT8 = "int8"
QUANT_TYPES = (*FOUR_BIT_TYPES, INT8)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def check_quantized(spec, setup) -> None:
    if setup.quant is None:
        return
    if setup.quant not in QUANT_TYPES:
        raise InputError(f"unknown quantization {setup.quant!r}; valid choices: {', '.join(QUANT_TYPES)}")
    if not setup.lora_rank:
        raise InputError(f"quant {setup.quant} freezes a quantized base: it needs LoRA adapters (--lora-rank)")
    if spec.config_json is None:
        raise InputError("quantization needs an HF config (transformers loads the quantized checkpoint)")
    trainer = setup.recipe.trainer  # the user's from_pretrained dtype: the loader and peft decide
    if not trainer and (setup.precision.value not in ("fp32", "bf16-autocast") or setup.build_bf16):
        raise InputError(f"quant {setup.quant} with precision {setup.precision.value} is not modelled; modelled: "
                         "fp32, bf16-autocast (a quantized model cannot be cast; prepare_model_for_kbit_training "
                         "keeps the other weights in fp32)")
    if setup.quant == INT8:
        _check_int8(setup)


def _check_int8(setup) -> None:
    if setup.double_quant:
        raise InputError("double-quant is bnb_4bit_use_double_quant: it needs a 4-bit quant (nf4, fp4), not int8")
    if setup.device is not Device.CPU:
        raise InputError("quant int8 on a GPU is not modelled: its training matmul (bitsandbytes MatMul8bitLt) "
                         "splits off the input columns with |x| > llm_int8_threshold, a size set by the activations' "
                         "values; on the CPU (MatMul8bitFp) no column is split and the prediction is exact")


def quantization_config(setup):
    """The canonical build's BitsAndBytesConfig, or the Trainer recipe's as the user's file gives it."""
    from transformers import BitsAndBytesConfig

    if setup.quantization_config is not None:
        from llmsim.inputs.hf import bitsandbytes_config

        return bitsandbytes_config(json.loads(setup.quantization_config))
    if setup.quant == INT8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=setup.int8_threshold)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=setup.quant,
                              bnb_4bit_use_double_quant=setup.double_quant,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def load_quantized(directory: Path, setup):
    """The canonical QLoRA build: the fp32 checkpoint quantized on load, then prepare_model_for_kbit_training."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(load_checkpoint_quantized(directory, setup),
                                           use_gradient_checkpointing=False)


def load_checkpoint_quantized(directory: Path, setup):
    """`from_pretrained(directory, dtype=..., quantization_config=...)`: fp32 for the canonical build, the user's
    from_pretrained dtype for the Trainer recipe."""
    import bitsandbytes.functional as bnb_functional
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # As in a fresh process: bitsandbytes builds double quantization's 256-entry code book once per process, on
    # first use, and keeps it (`name2qmap`); a fake run must not find one left by another run.
    bnb_functional.name2qmap.clear()
    hf_logging.disable_progress_bar()  # a prediction loads a header-only checkpoint: no bar to show
    # the Trainer recipe's as its script calls it (llmsim/model/trainer_recipe.py); the canonical build's in fp32
    loading = ({"dtype": getattr(torch, setup.load_dtype)} if setup.recipe.trainer
               else {"dtype": torch.float32, "device_map": "cpu"})
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization_config(setup),
                                                attn_implementation=setup.attention.value, **loading)


def real_checkpoint(config) -> Path:
    """The fp32 model saved with save_pretrained (seeded), for a measured run to load."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    directory = Path(tempfile.mkdtemp(prefix="llmsim-ckpt-"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


@functools.lru_cache(maxsize=16)
def header_checkpoint(config_json: str, num_layers: int | None, dtype: torch.dtype = torch.float32) -> Path:
    """The checkpoint save_pretrained would write for this config in `dtype`, as a safetensors header over a sparse
    file: the same tensor names, dtypes and shapes, no data. Only a fake run may load it."""
    from transformers import AutoModelForCausalLM

    from llmsim.inputs.spec import ModelSpec

    config = ModelSpec("checkpoint", config_json).hf_config(num_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        if name in tied:
            continue  # save_pretrained keeps one copy of a tied weight
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    directory = Path(tempfile.mkdtemp(prefix="llmsim-header-ckpt-"))
    config.save_pretrained(directory)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        f.truncate(8 + len(encoded) + offset)  # sparse: the data is never written nor read
    return directory


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
              "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool, "F64": torch.float64}


@contextlib.contextmanager
def fake_loading():
    """Run transformers' quantized loading and bitsandbytes under FakeTensorMode (enter it inside the mode):
    - a safetensors slice is read as an empty tensor of its shape and dtype (a real read allocates the same);
    - `Params4bit` wraps its data with `Tensor._make_subclass`, which refuses a FakeTensor: the fake tensor gets a
      class that is both FakeTensor and Params4bit instead;
    - `create_dynamic_map` builds double quantization's code book with `.tolist()`: it is built for real and
      handed back as a fake tensor of its shape (256 fp32 values per layer, as in a real run).
    An 8-bit weight's `int8_vectorwise_quant` needs no patch: bitsandbytes registers a fake for it (bitsandbytes/
    _ops.py) that allocates its two outputs, CB and SCB, which is what the tracker sees of the real op too. Its CPU
    kernel (backends/default/ops.py) also makes weight-sized temporaries (|A| in fp16, `A * (127 / absmax)` and its
    rounding in fp32) inside the one custom-op call, below the tracker's TorchDispatchMode: neither side counts them
    (README, "What stays out")."""
    import bitsandbytes.functional as bnb_functional
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from transformers import core_model_loading

    make_subclass = torch.Tensor._make_subclass
    materialize = core_model_loading._materialize_copy
    dynamic_map = bnb_functional.create_dynamic_map

    @functools.lru_cache(None)
    def fake_class(cls):
        return type("Fake" + cls.__name__, (FakeTensor, cls), {})

    def make_fake_subclass(cls, data, require_grad=False, *args, **kwargs):
        if isinstance(data, FakeTensor) and not issubclass(cls, FakeTensor):
            out = data.detach()
            out.requires_grad_(require_grad)
            out.__class__ = fake_class(cls)
            return out
        return make_subclass(cls, data, require_grad, *args, **kwargs)

    def materialize_fake(tensor, device=None, dtype=None):
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.empty(tensor.get_shape(), dtype=_ST_DTYPES[tensor.get_dtype()])
        return materialize(tensor, device, dtype)

    def dynamic_map_fake(*args, **kwargs):
        with unset_fake_temporarily():
            real = dynamic_map(*args, **kwargs)
        return torch.empty(real.shape, dtype=real.dtype)

    # bitsandbytes keeps the code books it builds for the rest of the process (`name2qmap`): the fake one a fake
    # load leaves there would reach the next real load of the process (a real run's quantization then fails)
    code_books = dict(bnb_functional.name2qmap)
    try:
        with mock.patch.object(torch.Tensor, "_make_subclass", make_fake_subclass), \
                mock.patch.object(core_model_loading, "_materialize_copy", materialize_fake), \
                mock.patch.object(bnb_functional, "create_dynamic_map", dynamic_map_fake):
            yield
    finally:
        bnb_functional.name2qmap.clear()
        bnb_functional.name2qmap.update(code_books)
