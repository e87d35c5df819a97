"""Checkpointing with offload (llmsim/model/offload.py): hand-computed host bytes, a fresh real run, and the reason the
canonical step replaces transformers' save_on_cpu on a machine without an accelerator."""
import pytest
import torch

from llmsim.enums import Attention, Category, Precision
from llmsim.measure.runs import measure_single
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.inputs.zoo import shrink

HIDDEN, LAYERS, MICRO_BATCH, SEQ = 64, 7, 2, 48


@pytest.mark.parametrize("precision,every", [(Precision.FP32, 1), (Precision.BF16, 2),
                                             (Precision.BF16_AUTOCAST, 3)])
def test_host_peak_is_every_checkpointed_layers_input(precision, every):
    """Llama passes only `hidden_states` positionally: one contiguous copy per checkpointed layer (layers 0, n, 2n,
    ...), all alive at the end of the forward. The residual stream is fp32 under autocast, bf16 when cast."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", HIDDEN, LAYERS, 256, 4))
    setup = TrainSetup(MICRO_BATCH, SEQ, precision, Attention.SDPA, True, every, ckpt_offload=True)
    itemsize = 2 if precision is Precision.BF16 else 4
    checkpointed = len(range(0, LAYERS, every))
    prediction = predict(spec, setup)
    assert prediction.peak_host_bytes == checkpointed * MICRO_BATCH * SEQ * HIDDEN * itemsize
    rank = prediction.ranks[0]
    assert Category.OFFLOADED.value not in rank.peak.breakdown_bytes
    assert not rank.timeline["category"].eq(Category.OFFLOADED.value).any()  # the device timeline
    without = predict(spec, TrainSetup(MICRO_BATCH, SEQ, precision, Attention.SDPA, True, every))
    assert without.peak_host_bytes == 0


@pytest.mark.parametrize("model,shape,setup", [
    ("gpt2", (64, 5, 500, 4), TrainSetup(3, 40, Precision.BF16_AUTOCAST, Attention.EAGER, True, 2,
                                         ckpt_offload=True)),
    ("qwen2.5-0.5b", (56, 5, 700, 7), TrainSetup(2, 72, Precision.FP32, Attention.SDPA, True, 1, ckpt_offload=True)),
], ids=["gpt2-eager", "qwen2.5"])
def test_fresh_real_run_matches_device_and_host(model, shape, setup):
    """Sizes that appear in no committed row, measured now (GPT-2 eager also offloads its positional mask)."""
    spec = load_model_spec(model, shrink(model, *shape))
    row = measure_single(spec, setup)
    prediction = predict(spec, setup)
    tolerance = PEAK_ALLOCATED_TOLERANCE[1]
    assert row["peak_host_bytes"] > 0
    assert abs(prediction.peak_allocated_bytes - row["peak_allocated_bytes"]) <= tolerance * row["peak_allocated_bytes"]
    assert abs(prediction.peak_host_bytes - row["peak_host_bytes"]) <= tolerance * row["peak_host_bytes"]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="an accelerator can pin memory")
def test_transformers_offload_cannot_pin_without_an_accelerator():
    """Why the step swaps save_on_cpu for llmsim.model.offload.host_offload: on a CPU-only machine transformers asks for
    pinned memory with device_type "cpu", which torch refuses. If this starts passing, revisit offload.py."""
    from transformers import AutoModelForCausalLM

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 32, 2, 128, 4))
    model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    model.train()
    model.activation_checkpointing_enable(offload=True)
    batch = torch.randint(0, 128, (1, 8))
    with pytest.raises(RuntimeError, match="pin_memory"):
        model(input_ids=batch, labels=batch)


def test_a_gpu_prediction_reads_the_device_events_in_place():
    """On a GPU the replay reads a timeline's device events through the host mask (replay.on_gpu's `device_rows`)
    rather than a copy without the host rows: the same events, peak and breakdown as from split_host's device frame,
    the same host peak, and the rank's timeline, made when asked for, is that frame."""
    from llmsim.inputs.gpus import load_gpu
    from llmsim.model.offload import host_peak_bytes, host_rows, split_host
    from llmsim.sim.replay import on_gpu
    from llmsim.sim.traced import expanded

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", HIDDEN, LAYERS, 256, 4))
    gpu = load_gpu("h100-80gb")
    setup = TrainSetup(MICRO_BATCH, SEQ, Precision.BF16, Attention.SDPA, True, 2, ckpt_offload=True)
    prediction = predict(spec, setup, gpu=gpu)
    traced = expanded(spec, prediction.setup)[0]  # the traced timeline the prediction replayed
    device, host = split_host(traced)
    mask = host_rows(traced)
    assert 0 < mask.sum() < len(traced)  # offloaded inputs and AdamW's host step counters beside the device's
    (serials, deltas, peak), (serials_in_place, deltas_in_place, peak_in_place) = on_gpu(device, gpu), on_gpu(
        traced, gpu, ~mask)
    assert (serials == serials_in_place).all() and (deltas == deltas_in_place).all() and peak == peak_in_place
    rank = prediction.ranks[0]
    assert rank.peak == peak and rank.peak_host_bytes == host_peak_bytes(host) == prediction.peak_host_bytes > 0
    assert rank.timeline.equals(device) and rank.timeline.dtypes.equals(device.dtypes)
