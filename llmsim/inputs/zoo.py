"""Shrunken copies of zoo models, for measured runs that a CPU can afford and for tests.

A shrunken model keeps its architecture (model type, norms, activations, tying, GQA ratio, positional
scheme) and takes smaller widths, depth and vocabulary, written with the config class's own keys.
"""
from __future__ import annotations

from typing import Any

from llmsim.inputs.spec import load_model_spec

FFN_KEYS = ("intermediate_size", "ffn_dim", "n_inner")


def shrink(name: str, hidden: int, layers: int, vocab: int, heads: int) -> dict[str, Any]:
    """Config overrides turning zoo model `name` into a `layers`-deep, `hidden`-wide copy."""
    spec = load_model_spec(name)
    config = spec.hf_config()
    original = spec.config_dict
    keymap = type(config).attribute_map

    def key(generic: str) -> str:
        return keymap.get(generic, generic)

    overrides: dict[str, Any] = {key("hidden_size"): hidden, key("num_hidden_layers"): layers,
                                 "vocab_size": vocab, key("num_attention_heads"): heads}
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads:
        overrides["num_key_value_heads"] = max(1, heads * kv_heads // config.num_attention_heads)
    for ffn_key in FFN_KEYS:
        if original.get(ffn_key):
            ratio = original[ffn_key] / config.hidden_size
            overrides[ffn_key] = int(round(ratio * hidden / 8)) * 8
    if "word_embed_proj_dim" in original:
        overrides["word_embed_proj_dim"] = hidden
    if original.get("head_dim"):
        overrides["head_dim"] = hidden // heads
    if original.get("rotary_dim"):
        overrides["rotary_dim"] = min(original["rotary_dim"], hidden // heads)
    return overrides
