"""The prediction table (llmsim/app/report.py): what it shows beside the device's figures."""
from dataclasses import replace

from llmsim.app.report import offloads
from llmsim.enums import Precision
from llmsim.inputs.gpus import load_gpu
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.sim.pipeline import predict


def test_host_memory_is_tabled_where_a_lever_puts_it_there():
    """On a GPU AdamW keeps its `step` counters on the host (4 B a parameter tensor, torch's _init_group): in the
    JSON, not a host column of their own; offloaded checkpoint inputs are."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 300, 4))
    setup = TrainSetup(1, 32, Precision.BF16, grad_ckpt=True)
    plain = predict(spec, setup, gpu=load_gpu("h100-80gb"))
    tensors = sum(1 for name in plain.ranks[0].timeline["tensor"].dropna().unique() if name.endswith(".weight"))
    assert 0 < plain.peak_host_bytes <= 4 * tensors and not offloads(plain)
    offloaded = predict(spec, replace(setup, ckpt_offload=True), gpu=load_gpu("h100-80gb"))
    assert offloads(offloaded) and offloaded.peak_host_bytes > plain.peak_host_bytes
