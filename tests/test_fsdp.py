"""PyTorch FSDP2 (--strategy fsdp, llmsim/model/fsdp.py). The committed rows (data/measurements/tier2_fsdp_cpu.csv)
are re-predicted in test_validate.py; here: the reduced-depth trace against the full-depth one, the inputs a user
can get wrong, and (slow) a fresh real run against its prediction."""
import json
from dataclasses import replace

import pytest

from llmsim.app.cli import main
from llmsim.enums import Attention, Precision
from llmsim.errors import InputError
from llmsim.inputs.spec import FsdpSetup, TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.runs import measure_distributed
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.measure.validate import load_measurements
from llmsim.model.trace import run_fake, trace
from llmsim.sim.peaks import replay
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy
from llmsim.sim.timeline import expand, repeat_last_step

TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "2"]


@pytest.mark.parametrize("precision,ckpt,fsdp", [
    (Precision.FP32, True, FsdpSetup()),
    (Precision.FP32, False, FsdpSetup(False, "bfloat16", "float32")),
    (Precision.BF16, True, FsdpSetup(init="full")),
], ids=["meta-fp32-ckpt-reshard", "meta-mixed-precision-no-reshard", "full-bf16-ckpt"])
def test_reduced_depth_trace_expands_to_the_full_depth_run(precision, ckpt, fsdp):
    """Every layer is its own FSDP2 group; its all-gather, reshard, prefetch and reduce-scatter repeat per layer,
    so the three-layer trace expanded to six layers is the six-layer run event for event."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 6, 256, 4))
    setup = TrainSetup(2, 16, precision, Attention.SDPA, ckpt, fsdp=fsdp, fsdp_world=2)
    full, _ = run_fake(spec, setup, None)
    traced = trace(spec, setup)
    assert traced.depth < 6
    expanded = expand(traced)
    columns = ["step", "phase", "block", "delta_bytes", "category"]
    # the meta build's storages of 0 bytes are events of the trace that the expansion drops (no byte changes)
    assert replay(full).allocated_bytes == replay(expanded).allocated_bytes
    events = [frame[frame["delta_bytes"] != 0][columns].reset_index(drop=True) for frame in (full, expanded)]
    assert events[0].equals(events[1])


@pytest.mark.parametrize("init,offload", [("meta", False), ("full", False), ("meta", True)])
def test_two_traced_steps_repeat_into_the_third(init, offload):
    """FSDP2 keeps each unsharded parameter's storage and resizes it up and back to 0 in every step: the steady
    step repeats those resizes on the same storage, and two traced steps repeated are the three-step run."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 3, 256, 4))
    setup = TrainSetup(2, 16, Precision.FP32, Attention.SDPA, True, fsdp=FsdpSetup(init=init, offload=offload),
                       fsdp_world=2)
    two, _ = run_fake(spec, replace(setup, steps=2), None)
    three, _ = run_fake(spec, setup, None)
    repeated = repeat_last_step(two, 3)
    columns = ["step", "phase", "block", "delta_bytes", "category"]
    assert repeated is not None and repeated[columns].equals(three[columns])


def test_committed_rows_cover_the_fsdp_matrix():
    rows = load_measurements()
    rows = rows[(rows["strategy"] == "fsdp") & (rows["recipe"] != "hf-trainer")]  # the Trainer's: test_trainer_fsdp
    assert len(rows) >= 30 and rows["gloo_settle"].astype(bool).all()
    configs = rows["fsdp_config"].map(FsdpSetup.from_json)
    assert {c.reshard_after_forward for c in configs} == {True, False}
    assert {c.param_dtype for c in configs} >= {None, "bfloat16"}
    assert set(rows["world_size"]) >= {2, 3, 4}
    assert set(rows["precision"]) >= {"fp32", "bf16", "bf16-autocast"} and rows["grad_ckpt"].any()


BAD = [
    (["--fsdp-param-dtype", "bf16"], "--fsdp-param-dtype needs --strategy fsdp"),
    (["--strategy", "fsdp", "--world-size", "2", "--fsdp-offload", "--fsdp-wrap", "transformers"],
     "fsdp-offload with fsdp-wrap(transformers) is not modelled yet"),
    (["--fsdp-offload"], "--fsdp-offload needs --strategy fsdp"),
    (["--strategy", "fsdp", "--world-size", "2", "--fsdp-param-dtype", "int8"], "fsdp-param-dtype(int8) is not a dtype"),
    (["--strategy", "fsdp", "--world-size", "1"], "world-size(1) must be at least 2"),
    (["--strategy", "fsdp", "--world-size", "4", "--tp", "2", "--fsdp-offload"],
     "--fsdp-offload or fsdp-init host with --pp or --tp is not modelled yet"),
    (["--strategy", "fsdp", "--world-size", "2", "--lora-rank", "8", "--quant", "nf4"],
     "a quantized base with strategy fsdp"),
    (["--strategy", "fsdp", "--world-size", "2", "--lora-rank", "8", "--lora-modules-to-save", "lm_head"],
     "lora-modules-to-save with strategy fsdp is not modelled yet"),
    (["--strategy", "fsdp", "--world-size", "2", "--grad-ckpt", "--ckpt-offload"], "ckpt-offload with strategy fsdp"),
    (["--strategy", "fsdp", "--world-size", "2", "--optimizer", "adamw8bit"], "optimizer adamw8bit with strategy fsdp"),
    (["--strategy", "fsdp", "--world-size", "2", "--fused"], "--fused with strategy fsdp"),
    (["--strategy", "fsdp", "--world-size", "2", "--precision", "fp16"], "precision fp16 with strategy fsdp"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_fsdp_inputs_are_one_line_and_status_2(extra, needle, capsys):
    assert main(["predict", *TINY, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_cpu_offload_keeps_the_model_states_on_the_host():
    """CPUOffloadPolicy, what torch's code does and the trace must show: the fp32 shards, AdamW's two states and
    (until zero_grad) the sharded gradients are host memory -- after the last step exactly the shards and the
    states, 3 x 4 B a local element -- and the device holds none of them: its live bytes between steps are the
    no-offload run's less those host bytes' device counterparts, and its peak is lower."""
    from llmsim.model.offload import split_host

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 256, 4))  # every dim 0 even: no padding
    setup = TrainSetup(2, 16, Precision.FP32, Attention.SDPA, False, fsdp_world=2)
    offload, _ = run_fake(spec, replace(setup, fsdp=FsdpSetup(offload=True)), None)
    plain, _ = run_fake(spec, replace(setup, fsdp=FsdpSetup()), None)
    device, host = split_host(offload)
    elements = (2 * 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64) + 64) // 2  # the rank's half
    assert int(host["delta_bytes"].sum()) == 3 * 4 * elements
    assert int(plain["delta_bytes"].sum()) - int(device["delta_bytes"].sum()) == 3 * 4 * elements
    assert predict(spec, replace(setup, fsdp=None), Layout(Strategy.FSDP, 2, fsdp=FsdpSetup(offload=True))) \
        .ranks[0].peak.allocated_bytes < replay(plain).allocated_bytes
    # a meta build's shards, made on the host and re-pinned as the root's `to_empty` reaches each layer, are that
    # layer's (fsdp._layers_in_their_blocks): traced at 3 layers and expanded, the six-layer run event for event
    # (traced whole until 2026-12-05)
    from test_expansion import assert_same_events

    six = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 6, 256, 4))
    offloaded = replace(setup, fsdp=FsdpSetup(offload=True))
    reduced = trace(six, offloaded)
    assert reduced.depth < 6
    full, _ = run_fake(six, offloaded, None)
    assert_same_events(*(frame[frame["delta_bytes"] != 0] for frame in (expand(reduced), full)))


def test_cpu_offload_on_a_gpu_steps_adamw_on_the_host(capsys):
    """With the parameters on the host torch's AdamW takes its for-loop path (foreach is for CUDA parameters), and
    the report gives the host peak apart from the device's."""
    import json

    assert main(["predict", *TINY, "--strategy", "fsdp", "--world-size", "2", "--fsdp-offload", "--gpu",
                 "h100-80gb", "--format", "json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert all(rank["peak_host_bytes"] > 0 for rank in ranks)
    assert main(["predict", *TINY, "--strategy", "fsdp", "--world-size", "2", "--fsdp-offload"]) == 0
    table = capsys.readouterr().out
    assert "CPUOffloadPolicy" in table and "host peak" in table
    from llmsim.sim.strategies import traced_setup
    from llmsim.inputs.gpus import load_gpu, on_gpu

    gpu_setup = on_gpu(TrainSetup(2, 16), load_gpu("h100-80gb"))
    assert gpu_setup.foreach
    assert not traced_setup(gpu_setup, Layout(Strategy.FSDP, 2, fsdp=FsdpSetup(offload=True))).foreach
    assert traced_setup(gpu_setup, Layout(Strategy.FSDP, 2, fsdp=FsdpSetup())).foreach


def test_committed_offload_rows_cover_cpu_offload_policy():
    from llmsim.measure.runs import MEASUREMENTS_DIR

    rows = load_measurements([MEASUREMENTS_DIR / "tier2_fsdp_offload_cpu.csv"])
    configs = rows["fsdp_config"].map(FsdpSetup.from_json)
    assert len(rows) >= 40 and all(c.offload for c in configs) and (rows["peak_host_bytes"] > 0).all()
    assert {c.init for c in configs} == {"meta", "full"} and {c.reshard_after_forward for c in configs} == {True, False}
    assert {c.param_dtype for c in configs} == {None, "bfloat16"} and set(rows["world_size"]) == {2, 3, 4}
    assert (rows["lora_rank"] > 0).any() and (rows["grad_accum"] > 1).any() and rows["grad_ckpt"].any()


def test_ranks_with_shorter_shards_keep_them_at_the_first_forward():
    """FSDP2's lazy init keeps a local shard that already is its padded shard's storage; the trace used to re-pad
    every one on a rank with shorter shards (fake storages have no data pointer), which put rank 2 of the committed
    GPT-2 LoRA run on 3 ranks 32,256 B over on the host (experiments/measure_fsdp_offload.out). That run and the
    other GPT-2 run on 3 ranks, whose rank 2 holds less than the others, re-predicted from their rows."""
    from llmsim.measure.runs import MEASUREMENTS_DIR
    from llmsim.measure.validate import validate

    rows = load_measurements([MEASUREMENTS_DIR / "tier2_fsdp_offload_cpu.csv"])
    runs = rows[(rows["model"] == "gpt2") & (rows["world_size"] == 3)]
    assert len(runs) == 6
    report = validate(runs)
    assert (report["predicted_host_bytes"] == report["measured_host_bytes"]).all() and report["ok"].all()
    by_run = report.assign(lora_rank=runs["lora_rank"].to_numpy()).groupby("lora_rank")["measured_host_bytes"]
    assert by_run.nunique().max() == 2  # rank 2 of the run without LoRA holds shorter shards


def test_uneven_shards_make_classes_of_ranks():
    """torch.chunk's split: 10 rows over 4 ranks are 3, 3, 3, 1; 2 rows are 1, 1, 0, 0."""
    from llmsim.model.fsdp import local_rows, rank_classes

    assert [local_rows(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert [local_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    assert rank_classes(frozenset({10, 5, 64}), 4) == [[0, 1], [2], [3]]  # 10: 3,3,3,1; 5: 2,2,1,0
    assert rank_classes(frozenset({64, 128}), 4) == [[0, 1, 2, 3]]


def test_fsdp_shards_the_model_states():
    """Against DDP on the same ranks: FSDP2 keeps 1/W of the parameters, gradients and AdamW states between steps."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 128, 4, 2000, 4))
    setup = TrainSetup(2, 32, Precision.FP32, Attention.SDPA)
    ddp = predict(spec, setup, Layout(Strategy.DDP, 4))
    fsdp = predict(spec, setup, Layout(Strategy.FSDP, 4, fsdp=FsdpSetup()))
    assert fsdp.ranks[0].peak.allocated_bytes < ddp.ranks[0].peak.allocated_bytes / 2


@pytest.mark.parametrize("fsdp", [FsdpSetup(False, init="full"), FsdpSetup(), FsdpSetup(offload=True)],
                         ids=["full-no-reshard", "meta-reshard", "meta-offload"])
def test_on_a_gpu_the_expansion_is_the_full_depth_run_storage_for_storage(fsdp, capsys):
    """The caching-allocator model follows each storage: the reduced-depth expansion resizes each layer's unsharded
    parameters on that layer's own storage, up and back to 0 in every step (timeline._pair_serials), so it is the
    six-layer run event for event and storage for storage, and reserves what it reserves (until 2026-12-05 every
    FSDP2 GPU prediction was traced whole: a Llama-shaped 8-layer model reserved 394 MB at full depth, 1.59 GB
    expanded). With CPUOffloadPolicy too, since a meta build's `to_empty` on the host and FSDP2's re-pinning of each
    new shard are each layer's own (fsdp._layers_in_their_blocks; until then traced whole)."""
    from llmsim.inputs.gpus import load_gpu, on_gpu
    from llmsim.model.offload import split_host
    from llmsim.sim.allocator import NO_LIMIT, AllocatorConfig, replay_reserved
    from llmsim.sim.replay import on_gpu as gpu_events
    from test_expansion import assert_same_events

    gpu = load_gpu("h100-80gb")
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 512, 6, 4096, 8))
    setup = TrainSetup(1, 256, Precision.BF16, Attention.SDPA, True)
    layout = Layout(Strategy.FSDP, 4, fsdp=fsdp)
    predicted = predict(spec, setup, layout, gpu).ranks[0]
    traced = replace(on_gpu(replace(setup, fsdp=layout.fsdp, fsdp_world=4), gpu), steps=2)
    reduced = trace(spec, traced)
    assert reduced.depth < 6
    full, _ = run_fake(spec, traced, None)
    expanded = expand(reduced)
    assert_same_events(*(frame[frame["delta_bytes"] != 0] for frame in (expanded, full)))
    full3, _ = run_fake(spec, replace(traced, steps=3), None)
    device, _ = split_host(full3)  # as the prediction replays it: the host's storages (offloaded shards) apart
    serials, deltas, _ = gpu_events(device, gpu)  # each thread's workspaces where it first calls cuBLAS
    reserved = replay_reserved(serials, deltas, NO_LIMIT, AllocatorConfig(), ()).peak_reserved_bytes
    assert predicted.peak_reserved_bytes == reserved
    assert main(["predict", *TINY, "--strategy", "fsdp", "--world-size", "2", "--gpu", "h100-80gb"]) == 0
    assert "Warning" not in capsys.readouterr().err


@pytest.mark.slow
def test_fresh_fsdp_run_matches_prediction():
    spec = load_model_spec("mistral-7b", shrink("mistral-7b", 96, 3, 1024, 4))
    setup = TrainSetup(2, 48, Precision.BF16, Attention.SDPA, True)
    layout = Layout(Strategy.FSDP, 2, fsdp=FsdpSetup(False, None, None))
    measured = measure_distributed(spec, setup, layout)
    predicted = predict(spec, setup, layout)
    for row in measured:
        want = predicted.ranks[row["rank"]].peak.allocated_bytes
        assert abs(want - row["peak_allocated_bytes"]) <= PEAK_ALLOCATED_TOLERANCE[2] * row["peak_allocated_bytes"]


def test_accelerates_plugin_switches_are_its_own_and_a_row_states_them():
    """cpu_ram_efficient_loading and activation_checkpointing, accelerate's plugin switches, exist only where
    accelerate shards (wrap "accelerate"); a row's fsdp_config names them there, and only there (the committed
    fully_shard rows have no such fields)."""
    trainer = FsdpSetup(init="full", wrap="accelerate", cpu_ram_efficient_loading=True)
    assert FsdpSetup.from_json(trainer.as_json()) == trainer
    checkpointed = FsdpSetup(init="full", wrap="accelerate", activation_checkpointing=True)
    assert FsdpSetup.from_json(checkpointed.as_json()) == checkpointed
    with pytest.raises(InputError, match="activation_checkpointing is accelerate's FSDP plugin switch"):
        FsdpSetup(activation_checkpointing=True)
    assert "cpu_ram_efficient_loading" not in json.loads(FsdpSetup().as_json())
    with pytest.raises(InputError, match="cpu_ram_efficient_loading is accelerate's FSDP plugin switch"):
        FsdpSetup(cpu_ram_efficient_loading=True)
    with pytest.raises(InputError, match="lacks cpu_ram_efficient_loading"):
        FsdpSetup.from_json(json.dumps({k: v for k, v in json.loads(trainer.as_json()).items()
                                        if k != "cpu_ram_efficient_loading"}))
