"""llmsim: predict the per-process peak memory of fine-tuning a causal LM, proven against measured runs.

    >>> import llmsim
    >>> p = llmsim.predict("llama-3.1-8b", seq_len=2048, micro_batch=1, gpu="h100-80gb",
    ...                    training_args="examples/training_args.yaml", peft_config="examples/lora_all_linear.json")
    >>> p.peak_allocated_bytes, p.ranks[0].peak.breakdown_bytes, p.ranks[0].timeline  # a DataFrame

`predict` takes `llmsim predict`'s options as keyword arguments, underscores for dashes (`ds_config=`, `tp=`,
`lora_rank=`, `training_args=`, ...): the same parser reads them, so names, defaults and refusals are the CLI's.
Nothing heavy is imported until it is needed (torch is not imported by `import llmsim`).
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> module: what `llmsim.X` gives, imported when first asked for
_LAZY = {"Prediction": "llmsim.sim.pipeline", "ModelSpec": "llmsim.inputs.spec", "TrainSetup": "llmsim.inputs.spec",
         "load_model_spec": "llmsim.inputs.spec", "InputError": "llmsim.errors", "Category": "llmsim.enums",
         "Phase": "llmsim.enums", "Precision": "llmsim.enums", "Attention": "llmsim.enums", "Device": "llmsim.enums",
         "Recipe": "llmsim.enums"}
# the old keyword names of `predict`, kept: the CLI's option they stand for
_RENAMED = {"attention": "attn", "overrides": "set"}


def predict(model, seq_len: int, micro_batch: int | None = None, **options: Any):
    """The Python face of `llmsim predict`: `llmsim.predict("llama-2-7b", seq_len=2048, micro_batch=1,
    precision="bf16", grad_ckpt=True, gpu="a100-80gb", ds_config="ds.json")`. Flags take True/False; `set` (or
    `overrides`) a dict of config fields; `training_args` / `peft_config` a file path or a dict of fields."""
    from llmsim.app.options import prediction_from_options

    return prediction_from_options(model, seq_len, micro_batch, {_RENAMED.get(k, k): v for k, v in options.items()})


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmsim' has no attribute {name!r}")


__all__ = ["predict", *_LAZY]
