"""experiments/megatron_formulas.py: Megatron-LM's theoretical_memory_usage port and Korthikanti et al.'s
activation formulas, checked against arithmetic done by hand from the source and the paper."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import megatron_formulas as mf  # noqa: E402

# s = 16, b = 2, h = 64 -> sbh = 2048; a = 4; L = 2; v = 100.
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
        "intermediate_size": 256, "hidden_act": "gelu", "tie_word_embeddings": True}
S, B, SBH = 16, 2, 16 * 2 * 64


def tiny_args(**overrides) -> mf.MegatronArgs:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128, seq_length=S,
                  micro_batch_size=B, ffn_hidden_size=256)
    return mf.MegatronArgs(**(fields | overrides))


def test_korthikanti_unparallelized_is_34sbh_plus_5as2b_per_layer_plus_section_4_3():
    per_layer = 34 * SBH + 5 * 4 * S**2 * B  # 69632 + 10240 = 79872
    extras = SBH * 1 + 2 * SBH + 2 * SBH + 4 * S * B * 100  # dropout mask (p=1) + final LN + output input + fp32 logits
    assert per_layer * 2 + extras == 182784
    assert mf.korthikanti_activation_bytes(TINY, S, B, 1, 1, False, None) == 182784


def test_korthikanti_tensor_parallel_row():
    # sbh (10 + 24/t + 5as/(ht)) with t = 4: 2048 * (10 + 6 + 1.25) = 35328 per layer; pp = 2 adds sbhp = 4096.
    assert mf.korthikanti_activation_bytes(TINY, S, B, 4, 2, False, None) == 35328 * 2 + 4096
    assert mf.korthikanti_activation_bytes(TINY, S, B, 4, 2, False, "selective") == 2048 * 16 * 2 + 4096


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_korthikanti_sequence_parallel_divides_the_whole_first_stage_by_t(recompute):
    unparallel = mf.korthikanti_activation_bytes(TINY, S, B, 1, 2, False, recompute)
    assert mf.korthikanti_activation_bytes(TINY, S, B, 4, 2, True, recompute) * 4 == unparallel
    assert mf.korthikanti_activation_bytes(TINY, S, B, 4, 2, False, recompute) * 4 > unparallel


def test_korthikanti_rejects_an_unknown_recompute():
    with pytest.raises(ValueError):
        mf.korthikanti_activation_bytes(TINY, S, B, 1, 1, False, "block")


def test_megatron_weight_and_optimizer_bytes_by_hand():
    # attention 2*h*h*(1 + 4/4)*(16*4/64) = 16384, MLP 2*64*256 = 32768, norms 2*64*2 = 256 per layer;
    # tp-sharded 2*(16384 + 32768) + embedding 64*128 = 106496, replicated 2*256 + final norm 128 = 640.
    params = 106496 + 640
    assert mf.compute_weight_and_optimizer_memory(tiny_args()) == params * 18
    # Distributed optimizer over dp = 4: 6 + 12/4 = 9 bytes per parameter.
    assert mf.compute_weight_and_optimizer_memory(tiny_args(use_distributed_optimizer=True,
                                                            data_parallel_size=4)) == params * 9
    # tp = pp = 2: (98304/2 + 8192)/2 + 640/2 = 28992 on the first stage.
    assert mf.compute_weight_and_optimizer_memory(tiny_args(tensor_model_parallel_size=2,
                                                            pipeline_model_parallel_size=2)) == 28992 * 18
    # Untied output layer counts only when pp == 1.
    assert mf.compute_weight_and_optimizer_memory(tiny_args(untie_embeddings_and_output_weights=True)) == (
        (params + 8192) * 18)


@pytest.mark.parametrize("name, params", [("llama-2-7b", 6_738_415_616), ("llama-2-70b", 68_976_648_192)])
def test_megatron_counts_llama_parameters_exactly(name, params):
    config = json.loads((ROOT / "data" / "models" / f"{name}.json").read_text())
    args = mf.megatron_args_from_hf(config, 4096, 1, 1, 1, 1)
    assert (args.swiglu, args.normalization, args.padded_vocab_size) == (True, "RMSNorm", 32000)
    assert mf.compute_weight_and_optimizer_memory(args) == params * 18


def test_megatron_sequence_parallel_activation_by_hand():
    args = tiny_args(padded_vocab_size=256, tensor_model_parallel_size=2, sequence_parallel=True,
                     recompute_granularity="selective")
    # sbh (18 + 4*256/64) * L = 139264, token ids 8sbp = 256, embedding dropout sbhp = 2048,
    # output layer + CE 4sbh (1 + 256/64) = 40960; all divided by tp = 2.
    assert mf.report_theoretical_memory(args)[1] == (139264 + 256 + 2048 + 40960) / 2


def test_megatron_without_sp_activation_by_hand():
    args = tiny_args(padded_vocab_size=256, tensor_model_parallel_size=2)
    # sbh (10 + 24/2) * L = 90112, + 256 + 2048, + 2 * (sb * 256 / 2 + sbh) = 12288, then * 1.05.
    assert mf.report_theoretical_memory(args)[1] == pytest.approx((90112 + 256 + 2048 + 12288) * 1.05)


def test_megatron_matches_korthikanti_for_a_4h_mlp_but_for_the_token_ids():
    args = mf.megatron_args_from_hf(TINY, S, B, tp=2, pp=2, dp=1, sequence_parallel=True, recompute="selective")
    korthikanti = mf.korthikanti_activation_bytes(TINY, S, B, 2, 2, True, "selective")
    assert mf.compute_activation_memory(args) - korthikanti == 8 * S * B * 2 / 2


def test_megatron_pipeline_schedule_factors():
    base = mf.compute_activation_memory(tiny_args(pipeline_model_parallel_size=4))
    assert mf.compute_activation_memory(tiny_args(pipeline_model_parallel_size=4), num_microbatches=2) == base / 2
    interleaved = tiny_args(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    assert mf.compute_activation_memory(interleaved) == pytest.approx(base * (1 + 3 / 8))


def test_vocab_padding_matches_megatron():
    assert mf.vocab_size_with_padding(32000, 128, 1) == 32000
    assert mf.vocab_size_with_padding(32000, 128, 8) == 32768
    assert mf.vocab_size_with_padding(50257, 128, 1) == 50304
