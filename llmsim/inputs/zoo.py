"""Shrunken copies of zoo models, for measured runs that a CPU can afford and for tests.

A shrunken model keeps its architecture (model type, norms, activations, tying, GQA ratio, positional
scheme) and takes smaller widths, depth and vocabulary, written with the config class's own keys.
"""
from __future__ import annotations

from typing import Any

from llmsim.inputs.spec import EXPERT_KEYS, load_model_spec

FFN_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size")
SHRUNK_EXPERTS = 8  # routed experts of a shrunken mixture-of-experts model (at most)
SHRUNK_TOP_K = 2


def shrink(name: str, hidden: int, layers: int, vocab: int, heads: int) -> dict[str, Any]:
    """Config overrides turning zoo model `name` into a `layers`-deep, `hidden`-wide copy. A mixture-of-experts
    model keeps its layout (dense first layers, shared experts, latent attention, attention types) with at most
    `SHRUNK_EXPERTS` routed experts, `SHRUNK_TOP_K` per token."""
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
    if isinstance(original.get("pad_token_id"), int) and original["pad_token_id"] >= vocab:
        overrides["pad_token_id"] = vocab - 1  # the embedding's padding_idx must be a row of the smaller table
    overrides.update(_shrunk_experts(original, hidden, heads, layers))
    return overrides


def _shrunk_experts(original: dict[str, Any], hidden: int, heads: int, layers: int) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key in EXPERT_KEYS:
        if isinstance(original.get(key), int) and original[key] > 0:
            experts = min(original[key], SHRUNK_EXPERTS)
            overrides[key] = experts
            overrides["num_experts_per_tok"] = min(original["num_experts_per_tok"], SHRUNK_TOP_K)
            if original.get("n_group"):  # DeepSeek's group-limited routing: the groups must divide the experts
                overrides["n_group"] = min(original["n_group"], 2)
                overrides["topk_group"] = min(original.get("topk_group") or 1, overrides["n_group"])
    if not overrides:
        return overrides
    head = hidden // heads
    if "kv_lora_rank" in original:  # DeepSeek's multi-head latent attention
        overrides.update(kv_lora_rank=hidden // 4, qk_nope_head_dim=head, qk_rope_head_dim=head // 2,
                         v_head_dim=head)
        if original.get("q_lora_rank"):
            overrides["q_lora_rank"] = hidden // 2
    if original.get("first_k_dense_replace"):
        overrides["first_k_dense_replace"] = min(original["first_k_dense_replace"], max(layers - 1, 0))
    if original.get("mlp_only_layers"):
        overrides["mlp_only_layers"] = [i for i in original["mlp_only_layers"] if i < layers]
    if isinstance(original.get("layer_types"), list):
        types = original["layer_types"]
        overrides["layer_types"] = [types[i % len(types)] for i in range(layers)]
    return overrides
