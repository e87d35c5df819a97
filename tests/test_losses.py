"""The loss levers (llmsim/model/losses.py): Liger's chunk rule by hand, and the ported/imitated losses computing the
same loss and gradients as transformers' own (so the memory measured is that of a working loss)."""
import pytest
import torch

from llmsim.enums import Loss
from llmsim.model.losses import compute_loss, install_loss, liger_chunk_size
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink


def test_liger_chunk_rule_by_hand():
    # Liger's own example (fused_linear_cross_entropy.py): BT = 4096*4, V = 32000, H = 4096 -> 2048 tokens
    assert liger_chunk_size(4096 * 4, 32000, 4096) == 2048
    # inc_factor = cdiv(3000, 112) = 27; cdiv(600, 27) = 23 -> 32 tokens, 19 chunks, the last one of 24
    assert liger_chunk_size(600, 3000, 112) == 32
    assert liger_chunk_size(10, 3000, 4096) == 10  # one chunk never exceeds the tokens


@pytest.mark.parametrize("loss,chunk", [(Loss.CHUNKED_NLL, 100), (Loss.CHUNKED_NLL, None),
                                        (Loss.FUSED_LINEAR_CE, None)])
def test_loss_and_gradients_match_transformers(loss, chunk):
    from transformers import AutoModelForCausalLM

    spec = load_model_spec("qwen2.5-0.5b", shrink("qwen2.5-0.5b", 56, 2, 300, 7))  # tied embedding
    batch = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    grads = []
    for setup in (TrainSetup(3, 40), TrainSetup(3, 40, loss=loss, loss_chunk=chunk)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
        model.train()
        model.config.use_cache = False  # qwen2's attention dropout is 0: both runs see the same activations
        install_loss(model, setup)
        value = compute_loss(model, batch, setup)
        value.backward()
        grads.append((value.detach(), [p.grad.clone() for p in model.parameters()]))
    (reference, reference_grads), (value, value_grads) = grads
    torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-5)
    for got, want in zip(value_grads, reference_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
