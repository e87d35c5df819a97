"""Mixture-of-experts models: the experts kernels under fake tensors, the layer structure the trace keeps, and expert
parallelism (transformers' AllToAllEP) under a stated routing."""
import json
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmsim.enums import Precision
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.runs import measure_single
from llmsim.model import moe
from llmsim.model.trace import layer_structure
from llmsim.sim.pipeline import predict

# What a CPU run of from_pretrained(distributed_config=...) holds beyond the prediction: DeviceMesh's rank tensors
# (transformers' dense and expert meshes, int32 each), host memory on a GPU
MESH_TENSOR_BYTES = 16

# (mat_a shape, mat_b shape as stored, transpose mat_b's last two dims, offsets): the three layouts transformers'
# experts and their backward call (2-D x 3-D forward, 2-D x 3-D for the input gradient, 2-D x 2-D for the weight
# gradient); the forward's output has 20 columns, which bf16 and fp16 pad to 24 (the inputs' leading strides must
# be 16-byte multiples, so the other two layouts' outputs are aligned already)
LAYOUTS = [((12, 16), (3, 20, 16), True, [4, 9, 12]), ((12, 24), (3, 24, 16), False, [4, 9, 12]),
           ((16, 12), (12, 24), False, [4, 9, 12])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_shape,b_shape,transpose,offsets", LAYOUTS)
def test_grouped_mm_fake_output_is_the_kernels(dtype, a_shape, b_shape, transpose, offsets):
    """The fake mode's `aten::_grouped_mm` allocates what the CPU kernel allocates: dtype, size, strides, bytes."""
    moe.grouped_mm_as_aten()

    def run(make):
        a, b = make(a_shape, dtype), make(b_shape, dtype)
        b = b.transpose(-2, -1) if transpose else b
        a = a.t().contiguous().t() if len(b_shape) == 2 else a  # the weight gradient's mat_a is column-major
        return torch._grouped_mm(a, b, offs=torch.tensor(offsets, dtype=torch.int32))

    real = run(lambda shape, dtype: torch.randn(shape, dtype=dtype))
    with FakeTensorMode():
        fake = run(lambda shape, dtype: torch.randn(shape, dtype=dtype))
    assert (fake.dtype, fake.shape, fake.stride()) == (real.dtype, real.shape, real.stride())
    assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()


def test_grouped_mm_misaligned_strides_fail_as_the_kernel_does():
    moe.grouped_mm_as_aten()
    offsets = [3, 5]  # mat_a (5, 6) and the weight (2, 6, 4) stored as (2, 4, 6): 6-element (24-byte) strides
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(torch.randn(5, 6), torch.randn(2, 4, 6).transpose(-2, -1),
                          offs=torch.tensor(offsets, dtype=torch.int32))
    with FakeTensorMode(), pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(torch.randn(5, 6), torch.randn(2, 4, 6).transpose(-2, -1),
                          offs=torch.tensor(offsets, dtype=torch.int32))


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3"])
def test_below_sm80_fallback_trace_equals_its_real_run(model):
    """transformers' own per-expert fallback (what a V100 or T4 runs), traced under fake tensors, equals a real
    CPU run that takes the same fallback, to the byte."""
    spec = load_model_spec(model, shrink(model, 64, 4, 512, 4))
    setup = TrainSetup(2, 32, Precision.FP32)
    with moe.grouped_mm_on_cuda((7, 0)), _Ops() as ops:
        real = measure_single(spec, setup)["peak_allocated_bytes"]
        fake = measure_single(spec, setup, fake=True)["peak_allocated_bytes"]
    assert fake == real
    assert "transformers.grouped_mm_fallback.default" in ops.seen and "aten._grouped_mm.default" not in ops.seen


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def test_layer_structure_keeps_irregular_leading_layers():
    setup = TrainSetup(1, 32)
    for model, expected in [("deepseek-v3", (3, 1)), ("deepseek-v2-lite", (1, 1)), ("mixtral-8x7b", (0, 1)),
                            ("gpt-oss-20b", (0, 2))]:
        spec = load_model_spec(model)
        assert layer_structure(spec, setup, 0, spec.num_layers) == expected, model
    sparse_step = load_model_spec("qwen2-57b-a14b", {**shrink("qwen2-57b-a14b", 64, 12, 512, 4),
                                                     "decoder_sparse_step": 2})
    assert layer_structure(sparse_step, setup, 0, 12) == (0, 2)
    dense_two = load_model_spec("qwen3-30b-a3b", {**shrink("qwen3-30b-a3b", 64, 12, 512, 4),
                                                  "mlp_only_layers": [0, 4]})
    assert layer_structure(dense_two, setup, 0, 12) == (5, 1)
    # checkpointing every 2 layers on top of DeepSeek-V3's 3 dense layers
    assert layer_structure(load_model_spec("deepseek-v3"), TrainSetup(1, 32, grad_ckpt=True, ckpt_every=2),
                           0, 61) == (3, 2)
    # a pipeline stage's own layers: past the dense ones, homogeneous
    assert layer_structure(load_model_spec("deepseek-v3"), setup, 30, 61) == (0, 1)


@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen2-57b-a14b"])
def test_router_aux_loss_run_is_predicted(model):
    """With `output_router_logits` the load-balancing loss walks every layer's router logits after the stack (at
    the model's level, not in a layer): the trace keeps every layer, and the prediction equals a real run."""
    from llmsim.sim.pipeline import predict

    spec = load_model_spec(model, {**shrink(model, 64, 6, 512, 4), "output_router_logits": True})
    setup = TrainSetup(2, 32, Precision.BF16_AUTOCAST)
    assert predict(spec, setup).ranks[0].peak_allocated_bytes == measure_single(spec, setup)["peak_allocated_bytes"]


MOE_ZOO = ["mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen2-57b-a14b", "deepseek-v2-lite", "deepseek-v3",
           "olmoe-1b-7b", "gpt-oss-20b", "gpt-oss-120b"]
FLAG_SETS = [["--precision", "fp32"], ["--precision", "bf16", "--grad-ckpt"], ["--precision", "fp16-autocast"],
             ["--precision", "fp16"], ["--lora-rank", "8"], ["--lora-rank", "8", "--lora-targets", "all-linear"],
             ["--quant", "nf4", "--lora-rank", "8", "--lora-targets", "all-linear"],
             ["--strategy", "ddp", "--world-size", "2"], ["--ds-config", "examples/ds_zero2.json", "--world-size", "2"],
             ["--ds-config", "examples/ds_zero3.json", "--world-size", "2"], ["--strategy", "fsdp", "--world-size", "2"],
             ["--tp", "2"], ["--tp", "2", "--ep", "2"], ["--tp", "2", "--ep", "2", "--routing", "collapsed",
                                                         "--dtype", "bfloat16", "--gpu", "h100-80gb"],
             ["--pp", "2"], ["--gpu", "v100-16gb"], ["--gpu", "h100-80gb", "--precision", "bf16"],
             ["--training-args", "examples/training_args.yaml", "--peft-config", "examples/lora_all_linear.json"],
             ["--training-args", "examples/training_args.yaml", "--quantization-config", "examples/bnb_nf4.json",
              "--peft-config", "examples/lora_all_linear.json", "--dtype", "bfloat16"]]
FAST = ("deepseek-v3", "gpt-oss-20b")  # the default run; the other MoE configs under -m slow


@pytest.mark.parametrize("model", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in MOE_ZOO])
def test_no_moe_config_ends_in_a_traceback(model, capsys, monkeypatch):
    """Every MoE zoo config (shrunk: same layout, small widths), under each supported flag, predicts or refuses in
    one line with exit status 2."""
    import json
    from pathlib import Path

    from llmsim.app.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    overrides = [arg for key, value in shrink(model, 64, 5, 512, 8).items()
                 for arg in ("--set", f"{key}={json.dumps(value)}")]
    for flags in FLAG_SETS:
        batch = [] if "--training-args" in flags else ["--micro-batch", "1"]
        status = main(["predict", "--model", model, *overrides, "--seq-len", "32", *batch, "--no-suggest",
                       "--format", "json", *flags])
        error = capsys.readouterr().err.strip()
        assert status in (0, 2), (flags, status)
        if status == 2:
            assert len(error.splitlines()) == 1 and error.startswith("error: "), (flags, error)


@pytest.mark.parametrize("quantization,message", [
    ({"quant_method": "mxfp4"}, "MXFP4 checkpoint"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "quant_method 'fp8'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "--quantization-config")])
def test_a_quantized_checkpoints_config_is_not_predicted_as_unquantized(tmp_path, quantization, message):
    import json

    from llmsim.errors import InputError
    from llmsim.inputs.spec import ZOO_DIR

    config = json.loads((ZOO_DIR / "gpt-oss-20b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(InputError, match=message):
        load_model_spec(str(path))


def test_lora_all_linear_on_moe_is_predicted_and_offered():
    """`--lora-targets all-linear` is peft's shorthand (the router and the experts too on a MoE model); the
    prediction equals a real run, and where peft has no default targets the advice and compare's LoRA levers use it."""
    from llmsim.app.advice import candidates
    from llmsim.model.step import peft_default_targets
    from llmsim.sim.pipeline import predict
    from llmsim.sim.strategies import Layout

    spec = load_model_spec("mixtral-8x7b", shrink("mixtral-8x7b", 64, 4, 512, 4))
    setup = TrainSetup(2, 32, Precision.BF16_AUTOCAST, lora_rank=8, lora_targets=("all-linear",))
    assert predict(spec, setup).ranks[0].peak_allocated_bytes == measure_single(spec, setup)["peak_allocated_bytes"]
    assert not peft_default_targets(spec) and peft_default_targets(load_model_spec("llama-2-7b"))
    lora = [c for c in candidates(spec, TrainSetup(2, 32), Layout()) if c.setup.lora_rank]
    assert lora and all(c.setup.lora_targets == ("all-linear",) for c in lora)


@pytest.mark.parametrize("routing,tokens,top_k,local,ep,expected", [
    ("balanced", 512, 2, 4, 2, [[256, 256], [256, 256]]),  # 256 rows a rank, 512 pairs: half to each rank
    ("balanced", 7, 2, 4, 2, [[4, 4], [4, 3]]),  # uneven slices (4 and 3 rows): torch.chunk's split
    ("collapsed", 512, 2, 4, 2, [[512, 0], [512, 512]]),  # every pair of both ranks onto rank 0's experts
    ("collapsed", 300, 4, 2, 3, [[200, 100, 100], [200, 200, 200]]),  # top-4 over 2 local experts: 2 pairs a row
])
def test_split_sizes(routing, tokens, top_k, local, ep, expected):
    """AllToAllEP's [send_sizes, recv_sizes] for traced rank 0, as llmsim/model/moe.py states them."""
    sizes = moe.split_sizes(routing, tokens, top_k, local, ep, 0)
    assert sizes == expected
    assert sum(sizes[0]) == moe._slice_rows(tokens, ep)[0] * top_k  # the send buffer: the slice's pairs, always


EP_SHAPE = shrink("mixtral-8x7b", 64, 3, 512, 8)  # 8 heads, 2 kv-heads: TP 2 divides both


def test_expert_parallel_bad_input_is_one_line(capsys):
    from llmsim.app.cli import main

    overrides = [arg for key, value in EP_SHAPE.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    base = ["predict", "--model", "mixtral-8x7b", *overrides, "--seq-len", "32", "--micro-batch", "1"]
    cases = [(["--ep", "2"], "it needs tp(1) = ep"),
             (["--tp", "2", "--ep", "4", "--world-size", "4"], "ep(4) shards the experts over the TP group"),
             (["--tp", "2", "--routing", "collapsed"], "it needs expert parallelism"),
             (["--tp", "2", "--ep", "2", "--routing", "lucky"], "routing 'lucky' is not one of balanced, collapsed"),
             (["--tp", "2", "--ep", "2", "--set", "num_local_experts=7", "--set", "num_experts_per_tok=2"],
              "ep(2) must divide the 7 routed experts; valid ep degrees: 7"),
             (["--tp", "2", "--ep", "2", "--pp", "2", "--world-size", "4"], "no pipeline")]
    for flags, message in cases:
        assert main([*base, *flags]) == 2, flags
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error, (flags, error)
    dense = ["predict", "--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--seq-len", "32", "--micro-batch",
             "1", "--tp", "2", "--ep", "2"]
    assert main(dense) == 2
    assert "has no expert-parallel plan" in capsys.readouterr().err


def test_expert_parallel_fresh_run_is_predicted_and_bounded():
    """A fresh from_pretrained(distributed_config=DistributedConfig(tp_size=2, ep_size=2)) run, the routing forced
    onto EP rank 0's experts: rank 0 is the worst-routing prediction, rank 1 (no tokens) under it, and the balanced
    prediction below the bound (the 16 bytes: the device mesh's rank tensors, host memory on a GPU)."""
    from llmsim.measure.runs import measure_from_pretrained
    from llmsim.sim.strategies import Layout

    spec = load_model_spec("mixtral-8x7b", EP_SHAPE)
    layout = Layout(world_size=2, tp=2, ep=2)
    setup = TrainSetup(2, 64, ep=2, load_dtype="float32")
    rows = measure_from_pretrained(spec, replace(setup, routing="collapsed"), layout, "collapsed")
    prediction = predict(spec, setup, layout)
    bound = prediction.routing_bound[0].peak_allocated_bytes
    assert rows[0]["peak_allocated_bytes"] - bound == MESH_TENSOR_BYTES
    assert rows[1]["peak_allocated_bytes"] < bound
    assert prediction.ranks[0].peak_allocated_bytes < bound
    assert [r["routing_check"] for r in rows] == ["exact", "bound"]
