"""Two published per-GPU memory estimators for Megatron-style training, ported to compare against llmsim.

1. Megatron-LM's `megatron/training/theoretical_memory_usage.py` (github.com/NVIDIA/Megatron-LM, ported from
   commit d98e8a64ddf34856e74b24714e3bedb2f5a39553; the file last changed in 1bcb3b9e0b02, "Fix LatentMoE
   theoretical memory estimate (#5145)"): `compute_weight_and_optimizer_memory`, `compute_activation_memory`,
   `compute_activation_memory_without_sp` and `report_theoretical_memory`, with Megatron's `args` replaced by
   the frozen dataclass `MegatronArgs`. The source's `compute_*` functions return bytes and
   `report_theoretical_memory` returns "MB" (bytes / 1024**2); every function here returns bytes.
2. Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198):
   the per-layer activation bytes of its Table 2, the first-pipeline-stage total of section 4.2.3 and the
   embedding / output-layer terms of section 4.3, in `korthikanti_activation_bytes`.

Run `python experiments/megatron_formulas.py` for a demo table (llama-2-7b and llama-2-70b).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NUM_BYTES_IN_MEGABYTE = 1024 * 1024  # the source's "MB" (a MiB)
GIB = 1024**3


@dataclass(frozen=True)
class MegatronArgs:
    """The fields of Megatron's `args` that theoretical_memory_usage.py reads (values after `validate_args`).

    Defaults are Megatron's own (argparse in megatron/training/arguments.py, TransformerConfig). Fields left
    None that `validate_args` derives are derived the same way in `__post_init__`: ffn_hidden_size (4h, or
    int(4h * 2/3 / 64) * 64 with swiglu), kv_channels (h // heads), moe_ffn_hidden_size (ffn_hidden_size when MoE),
    expert_tensor_parallel_size (tp) and world_size (tp * pp * dp: no context parallelism). The MoE, MTP, MLA and
    hybrid-model fields default to values that make those branches inert.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    seq_length: int
    micro_batch_size: int = 1
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    group_query_attention: bool = False
    num_query_groups: int | None = None
    swiglu: bool = False
    normalization: str = "LayerNorm"
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True  # read only for the MoE router's bias
    # Parallelism and memory savers.
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    data_parallel_size: int = 1
    world_size: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: str | None = None  # None, "selective" or "full"
    # Mixture of experts: inert while num_experts is None.
    num_experts: int | None = None
    moe_layer_freq: int | Sequence[int] = 1
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_latent_size: int | None = None
    moe_router_topk: int = 2  # read by the source only for its printed active-parameter count
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    # Multi-token prediction: inert while None.
    mtp_num_layers: int | None = None
    # Multi-latent attention: inert while False (argparse defaults).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Hybrid Mamba-Transformer models, which the source does not estimate: inert while None.
    hybrid_layer_pattern: str | None = None

    def __post_init__(self) -> None:
        h = self.hidden_size
        derived = {
            "ffn_hidden_size": int((4 * h * 2 / 3) / 64) * 64 if self.swiglu else 4 * h,
            "kv_channels": h // self.num_attention_heads,
            "expert_tensor_parallel_size": self.tensor_model_parallel_size,
            "world_size": self.tensor_model_parallel_size * self.pipeline_model_parallel_size
            * self.data_parallel_size,
        }
        for name, value in derived.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)


def compute_weight_and_optimizer_memory(args: MegatronArgs) -> float:
    """Bytes of weights, gradients and optimizer state on the most loaded model shard (pipeline stage 0).

    Port of the source's `compute_weight_and_optimizer_memory` (which also returns bytes); its `verbose`
    parameter-count prints are left out. The most loaded shard holds 1/pp of the transformer layers, the MTP
    block and the input embedding, plus the untied output layer when pp == 1; TP-sharded weights are divided
    by tp, norms are replicated. Bytes per parameter assume bf16 mixed precision with Adam: 18 (2 bf16 param
    + 4 fp32 main grad + 4 fp32 main param + 8 Adam moments) without the distributed optimizer, 6 + 12 / dp with
    it (main params and moments sharded over data parallel ranks).
    """
    h = args.hidden_size
    # Attention projection size.
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = query_projection_size / h
    # Group Query Attention (the source overwrites args.num_query_groups when GQA is off).
    num_query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    # MoE.
    num_experts = 1 if args.num_experts is None else args.num_experts
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1
    shared_expert_ffn_hidden_size = (
        0 if args.moe_shared_expert_intermediate_size is None else args.moe_shared_expert_intermediate_size
    )
    if args.num_experts is not None:
        if isinstance(args.moe_layer_freq, int):
            moe_layer_pattern = [1 if i % args.moe_layer_freq == 0 else 0 for i in range(args.num_layers)]
        else:
            moe_layer_pattern = list(args.moe_layer_freq)
            assert len(moe_layer_pattern) == args.num_layers, "moe_layer_freq needs one entry per layer"
        num_moe_layers = sum(moe_layer_pattern)
        moe_ffn_hidden_size = args.moe_ffn_hidden_size
    else:
        moe_layer_pattern = [0] * args.num_layers
        num_moe_layers = 0
        moe_ffn_hidden_size = 0
    num_dense_layers = args.num_layers - num_moe_layers
    if args.mtp_num_layers is not None:
        mtp_num_moe_layers = moe_layer_pattern[-1] * args.mtp_num_layers
        mtp_num_dense_layers = (1 - moe_layer_pattern[-1]) * args.mtp_num_layers
    else:
        mtp_num_moe_layers = mtp_num_dense_layers = 0

    # RMSNorm does not have bias, but LayerNorm has.
    norm_size = 1 if args.normalization == "RMSNorm" else 2

    if args.multi_latent_attention:
        assert not args.group_query_attention
        q_head_dim = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            q_term = h * args.num_attention_heads * q_head_dim
        else:  # q lora + rope + q norm
            q_term = args.q_lora_rank * (h + args.num_attention_heads * q_head_dim + norm_size)
        self_attn_term = (
            q_term
            # kv lora + rope + kv norm
            + args.kv_lora_rank * (h + args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) + norm_size)
            + h * args.qk_pos_emb_head_dim
            # o proj
            + (args.num_attention_heads * args.v_head_dim) * h
        )
    else:
        # Q and output projections (2 * h * heads * kv_channels) plus K and V (scaled by groups / heads).
        self_attn_term = 2 * h * h * (
            (1 + (num_query_groups / args.num_attention_heads)) * query_projection_to_hidden_size_ratio
        )

    embedding_size = h * args.padded_vocab_size
    final_layernorm = norm_size * h
    attention_params = self_attn_term
    dense_mlp_params = 2 * h * args.ffn_hidden_size * gated_linear_multiplier
    shared_expert_params = 2 * h * shared_expert_ffn_hidden_size * gated_linear_multiplier
    # Latent MoE projects tokens down before routed experts and projects them back after combine.
    routed_expert_hidden_size = args.moe_latent_size if args.moe_latent_size is not None else h
    routed_expert_params = 2 * routed_expert_hidden_size * moe_ffn_hidden_size * num_experts * gated_linear_multiplier
    latent_projection_params = (
        2 * h * args.moe_latent_size if args.num_experts is not None and args.moe_latent_size is not None else 0
    )
    layernorm_params = 2 * h * norm_size
    router_params = (
        (h * num_experts) + (num_experts if args.add_bias_linear else 0) if args.num_experts is not None else 0
    )
    shared_expert_gate_params = h if shared_expert_ffn_hidden_size > 0 and args.moe_shared_expert_gate else 0
    moe_replicated_params = layernorm_params + latent_projection_params + router_params + shared_expert_gate_params

    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    etp_ep = args.expert_tensor_parallel_size * args.expert_model_parallel_size
    expert_data_parallel_size = args.world_size // (etp_ep * pp)

    # Split params by how they are held on each rank: regular TP, replicated, or EP/ETP.
    tp_sharded_params_in_transformer_block = (
        (attention_params + dense_mlp_params) * num_dense_layers
        + (attention_params + shared_expert_params) * num_moe_layers
    )
    replicated_params_in_transformer_block = (
        layernorm_params * num_dense_layers + moe_replicated_params * num_moe_layers + final_layernorm
    )
    expert_sharded_params_in_transformer_block = routed_expert_params * num_moe_layers
    tp_sharded_params_in_mtp_block = (
        (attention_params + dense_mlp_params) * mtp_num_dense_layers
        + (attention_params + shared_expert_params) * mtp_num_moe_layers
    )
    replicated_params_in_mtp_block = (
        layernorm_params * mtp_num_dense_layers + moe_replicated_params * mtp_num_moe_layers
    )
    expert_sharded_params_in_mtp_block = routed_expert_params * mtp_num_moe_layers

    # Most loaded model shard has 1/pp_size transformer layers, 1 mtp block, and 1 embedding layer.
    tp_sharded_params_on_most_loaded_shard = (
        tp_sharded_params_in_transformer_block / pp + tp_sharded_params_in_mtp_block + embedding_size
    ) / tp
    replicated_params_on_most_loaded_shard = (
        replicated_params_in_transformer_block / pp + replicated_params_in_mtp_block
    )
    expert_sharded_params_on_most_loaded_shard = (
        expert_sharded_params_in_transformer_block / pp + expert_sharded_params_in_mtp_block
    ) / etp_ep
    if args.untie_embeddings_and_output_weights and pp == 1:
        tp_sharded_params_on_most_loaded_shard += embedding_size / tp

    def num_bytes_per_parameter(data_parallel_size: int) -> float:
        # This estimator assumes bf16 training: bf16 model params, fp32 main gradients,
        # fp32 main params, and fp32 Adam states. See docs/user-guide/features/dist_optimizer.md.
        return 18 if not args.use_distributed_optimizer else 6 + (12 / data_parallel_size)

    return (
        (tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard)
        * num_bytes_per_parameter(args.data_parallel_size)
        + expert_sharded_params_on_most_loaded_shard * num_bytes_per_parameter(expert_data_parallel_size)
    )


def _first_stage(args: MegatronArgs, layers_memory: float, num_microbatches: int | None) -> float:
    """The part the source's two activation functions share: add the embedding terms for pp in-flight
    micro-batches, then scale by the interleaved schedule's penalty or by the non-interleaved 1F1B discount."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    # Input to embedding (pp_size microbatches in flight): int64 token ids, 8 bytes each.
    memory = layers_memory + 8 * s * b * pp
    # Dropout in embedding layer (pp_size microbatches in flight): 1-byte mask.
    memory += s * b * h * pp
    # Multiply by interleaved PP memory factor.
    if vpp is not None:
        memory *= 1 + (pp - 1) / (pp * vpp)
    # If using non-interleaved schedule, number of microbatches in pipeline can be less than pp_size,
    # so discount accordingly.
    if vpp is None and pp > 1 and num_microbatches is not None:
        memory *= min(1, num_microbatches / pp)
    return memory


def compute_activation_memory(args: MegatronArgs, num_microbatches: int | None = None) -> float:
    """Activation bytes on the first pipeline stage with sequence parallelism and selective recompute.

    Port of the source's `compute_activation_memory` ("Using formula in Table 2 of
    https://arxiv.org/pdf/2205.05198.pdf"; "all calculations in this function are for the first pipeline stage").
    Per layer it stores sbh * (18 + 4 * ffn / h) bytes, Table 2's sequence-parallel + selective-recompute row
    34 sbh with the MLP's 16 sbh (the 2-byte inputs of the activation function and of the second linear, 4h wide
    each) rescaled to ffn_hidden_size; it does not count a SwiGLU MLP's extra gate activation, nor (its TODO) a
    query projection size different from hidden_size.
    Schedule assumed: 1F1B, whose first stage holds pp micro-batches in flight, each with num_layers / pp
    layers, so num_layers layers' activations; the interleaved schedule multiplies by 1 + (pp - 1) / (pp * vpp);
    with fewer than pp micro-batches (num_microbatches, None meaning at least pp) the total is discounted. The
    output layer and cross-entropy (4 sbh (1 + v / h), fp32 logits) count only when pp == 1. Everything,
    embedding terms included, is divided by tp.
    """
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    # Memory footprint from transformer layer (self-attention and MLP).
    per_layer = s * b * h * (18 + (4 * (args.ffn_hidden_size / h)))
    memory = _first_stage(args, per_layer * args.num_layers, num_microbatches)
    if args.pipeline_model_parallel_size == 1:
        # Inputs to output layer and CE loss.
        memory += s * b * h * 4 * (1 + (args.padded_vocab_size / h))
    # Activation memory is partitioned by TP size due to tensor and sequence model parallelism.
    return memory / args.tensor_model_parallel_size


def compute_activation_memory_without_sp(args: MegatronArgs, num_microbatches: int | None = None) -> float:
    """Activation bytes on the first pipeline stage without sequence parallelism.

    Port of the source's `compute_activation_memory_without_sp`: per layer sbh * (10 + 24 / tp), Table 2's
    tensor-parallel + selective-recompute row (4h MLP hard-coded: ffn_hidden_size is not read), times
    num_layers, plus the same embedding terms and 1F1B / interleaving factors as `compute_activation_memory`
    (here not divided by tp); when pp == 1 the bf16 logits (divided by tp) and the final norm's output;
    then a flat 1.05 "buffer for optimizer and miscellaneous temporaries".
    """
    s, b, h, tp = args.seq_length, args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    per_layer = s * b * h * (10 + (24 / tp))
    memory = _first_stage(args, per_layer * args.num_layers, num_microbatches)
    if args.pipeline_model_parallel_size == 1:
        # Logits calculation; the output projection is partitioned across TP.
        logits_size = s * b * args.padded_vocab_size / tp
        # Outputs from final layer norm.
        final_ln_output = s * b * h
        memory += (logits_size + final_ln_output) * 2  # multiply by 2 for bytes
    # Add buffer for optimizer and miscellaneous temporaries (5% overhead).
    return memory * 1.05


def report_theoretical_memory(args: MegatronArgs, num_microbatches: int | None = None) -> tuple[float, float, float]:
    """(weights + optimizer, activations, total) bytes on the most loaded GPU, as the source's
    `report_theoretical_memory` (which prints and returns the three in MB, bytes / 1024**2).

    Its activation formula is `compute_activation_memory` only with sequence parallelism and selective
    recompute, and `compute_activation_memory_without_sp` (a selective-recompute formula too) otherwise: no
    recompute and full recompute are not modelled as such. For hybrid Mamba-Transformer models the source prints
    a notice and returns None; this port raises NotImplementedError.
    """
    if args.hybrid_layer_pattern is not None:
        raise NotImplementedError(
            "Theoretical memory footprints not yet supported for hybrid Mamba-Transformer models."
        )
    weight_and_optimizer_memory = compute_weight_and_optimizer_memory(args)
    if args.sequence_parallel and args.recompute_granularity == "selective":
        activation_memory = compute_activation_memory(args, num_microbatches)
    else:
        activation_memory = compute_activation_memory_without_sp(args, num_microbatches)
    return weight_and_optimizer_memory, activation_memory, weight_and_optimizer_memory + activation_memory


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Megatron's `_vocab_size_with_padding` (megatron/training/tokenizer/tokenizer.py, now
    `vocab_size_with_padding` in megatron/core/tokenizers/utils/build_tokenizer.py): pad the vocabulary to a
    multiple of make_vocab_size_divisible_by * tp."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


def megatron_args_from_hf(config: dict, seq_len: int, micro_batch: int, tp: int, pp: int, dp: int,
                          sequence_parallel: bool = False, recompute: str | None = None,
                          distributed_optimizer: bool = False) -> MegatronArgs:
    """MegatronArgs for an HF llama / mistral / qwen2 style config.json dict.

    hidden_act "silu" maps to swiglu (these models gate their MLP); rms_norm_eps present maps to RMSNorm;
    head_dim, when given, to kv_channels; num_key_value_heads < num_attention_heads to group query attention;
    a missing tie_word_embeddings to False (the Llama/Mistral/Qwen2 config default). The vocabulary is padded
    as Megatron pads it (multiple of 128 * tp). Sequence parallelism is dropped when tp == 1, as
    `validate_args` does. Biases (qwen2's QKV bias) are not counted: the source's formula has none.
    """
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    return MegatronArgs(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        padded_vocab_size=vocab_size_with_padding(config["vocab_size"], 128, tp),
        seq_length=seq_len,
        micro_batch_size=micro_batch,
        ffn_hidden_size=config["intermediate_size"],
        kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
        group_query_attention=kv_heads != heads,
        num_query_groups=kv_heads,
        swiglu=config.get("hidden_act") == "silu",
        normalization="RMSNorm" if "rms_norm_eps" in config else "LayerNorm",
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        sequence_parallel=sequence_parallel and tp > 1,
        use_distributed_optimizer=distributed_optimizer,
        recompute_granularity=recompute,
    )


def korthikanti_activation_bytes(config: dict, seq_len: int, micro_batch: int, tp: int, pp: int,
                                 sequence_parallel: bool, recompute: str | None) -> int:
    """Activation bytes on the first pipeline stage (the most loaded) by Korthikanti et al. 2022.

    Per layer (Table 2; s sequence, b micro-batch, h hidden, a heads, t = tp):
      no recompute:   sbh (34 + 5as/h) unparallelized, sbh (10 + 24/t + 5as/(ht)) with TP,
                      sbh/t (34 + 5as/h) with TP + sequence parallelism;
      selective:      sbh (10 + 24/t) with TP, 34 sbh/t with TP + SP (the 5as^2b attention-score term is recomputed);
      full:           2 sbh, the layer input (section 5: "2sbhL"; the paper's 2sbhL/t variant stores a 1/t slice
                      per TP rank; we use /t only with SP, where the layer input is already sequence-sharded).
    First stage (section 4.2.3): 1F1B keeps p micro-batches in flight, each through L/p layers, so it stores L
    layers' worth (assumes L divisible by p and at least p micro-batches). Section 4.3 adds the input-embedding
    dropout mask sbhp/t and, only when p == 1, the final layer norm 2sbh/t, the output layer's input 2sbh/t and
    the fp32 logits 4sbv/t, together 4sbh/t (1 + v/h). These are added under every recompute mode.
    Assumptions: fp16/bf16 activations (2 bytes an element), 1-byte dropout masks (attention and hidden dropout
    are counted although HF fine-tuning of these models usually runs without dropout), and the softmax
    materialized (no FlashAttention). The formula is for the original GPT block: multi-head attention and a 4h
    GeLU MLP. We plug in h, a, L and v (unpadded vocab_size) from the HF config and deliberately ignore
    intermediate_size, num_key_value_heads and the SwiGLU gate, so a llama-style model's larger gated MLP and
    smaller GQA K/V are not modelled: one source of difference from a measured peak.
    """
    s, b, t, p = seq_len, micro_batch, tp, pp
    h, a = config["hidden_size"], config["num_attention_heads"]
    layers, v = config["num_hidden_layers"], config["vocab_size"]
    sbh = s * b * h
    if recompute is None:
        per_layer = sbh / t * (34 + 5 * a * s / h) if sequence_parallel else sbh * (10 + 24 / t + 5 * a * s / (h * t))
    elif recompute == "selective":
        per_layer = 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    elif recompute == "full":
        per_layer = 2 * sbh / t if sequence_parallel else 2 * sbh
    else:
        raise ValueError(f"recompute must be None, 'selective' or 'full', not {recompute!r}")
    # Section 4.3 states these terms for the sequence-parallel case only (dropout and the final layer norm run
    # sequence-parallel, hence /t). Without SP we undo the /t on exactly those SP-sharded terms (embedding
    # dropout, final norm, output-layer input) and keep the vocab-parallel logits' /t: our adaptation, not
    # a formula printed in the paper.
    sp_t = t if sequence_parallel else 1
    extra = sbh * p / sp_t
    if p == 1:
        extra += 2 * sbh / sp_t + 2 * sbh / sp_t + 4 * s * b * v / t
    return round(per_layer * layers + extra)


def _demo() -> None:
    models = Path(__file__).resolve().parent.parent / "data" / "models"
    layouts = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (4, 4), (8, 8)]
    print("GiB per GPU, bf16, micro-batch 1, dp 1, no distributed optimizer; sequence parallel iff tp > 1.")
    print("Megatron: report_theoretical_memory with selective recompute; Korthikanti: activations only.")
    header = f"{'model':<12}{'seq':>6}{'tp':>4}{'pp':>4}{'M w+opt':>10}{'M act':>9}{'M total':>10}"
    print(header + f"{'K none':>9}{'K sel':>8}{'K full':>8}")
    for name in ("llama-2-7b", "llama-2-70b"):
        config = json.loads((models / f"{name}.json").read_text())
        for seq in (2048, 4096):
            for tp, pp in layouts:
                sp = tp > 1
                args = megatron_args_from_hf(config, seq, 1, tp, pp, 1, sequence_parallel=sp, recompute="selective")
                weights, acts, total = (x / GIB for x in report_theoretical_memory(args))
                korth = [korthikanti_activation_bytes(config, seq, 1, tp, pp, sp, r) / GIB
                         for r in (None, "selective", "full")]
                print(f"{name:<12}{seq:>6}{tp:>4}{pp:>4}{weights:>10.2f}{acts:>9.2f}{total:>10.2f}"
                      f"{korth[0]:>9.2f}{korth[1]:>8.2f}{korth[2]:>8.2f}")


if __name__ == "__main__":
    _demo()
