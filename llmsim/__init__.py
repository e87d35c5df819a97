"""llmsim: predict the per-process peak memory of fine-tuning a causal LM, proven against measured runs.

    >>> import llmsim
    >>> p = llmsim.predict("llama-2-7b", seq_len=2048, micro_batch=1, precision="bf16", grad_ckpt=True)
    >>> p.peak_allocated_bytes, p.ranks[0].peak.breakdown_bytes, p.ranks[0].timeline  # a DataFrame
"""
from __future__ import annotations

from typing import Any

from llmsim.enums import Attention, Category, Device, Phase, Precision, parse_enum
from llmsim.errors import InputError
from llmsim.pipeline import Prediction
from llmsim.spec import ModelSpec, TrainSetup, load_model_spec


def predict(model: str | ModelSpec, seq_len: int, micro_batch: int, precision: str = "fp32",
            attention: str | None = None, grad_ckpt: bool = False, ckpt_every: int = 1, device: str = "cpu",
            overrides: dict[str, Any] | None = None) -> Prediction:
    """The Python face of `llmsim predict`: same names, same validation, same result."""
    from llmsim import pipeline

    spec = model if isinstance(model, ModelSpec) else load_model_spec(model, overrides)
    setup = TrainSetup(micro_batch=micro_batch, seq_len=seq_len,
                       precision=parse_enum(Precision, precision, "precision"),
                       attention=parse_enum(Attention, attention, "attention") if attention else None,
                       grad_ckpt=grad_ckpt, ckpt_every=ckpt_every, device=parse_enum(Device, device, "device"))
    return pipeline.predict(spec, setup)


__all__ = ["predict", "Prediction", "ModelSpec", "TrainSetup", "load_model_spec", "InputError", "Category",
           "Phase", "Precision", "Attention", "Device"]
