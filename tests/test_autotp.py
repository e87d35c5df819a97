"""DeepSpeed's AutoTP training (`"tensor_parallel": {"autotp_size": N}` in the JSON of the DeepSpeed script): the
committed rows measured under torchrun, each rank predicted by running the same script, DeepSpeed's engine, AutoTP's
layers and ZeRO-0/1/2 included, under fake tensors; what is not modelled, one line and exit status 2."""
import json

import pytest

from llmsim.app.cli import main
from llmsim.enums import Precision, Recipe
from llmsim.inputs.dsconfig import ds_setup
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.measure.runs import MEASUREMENTS_DIR, measure_distributed
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.measure.validate import load_measurements, validate
from llmsim.model.ds_script import on_autotp
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy

CSV = MEASUREMENTS_DIR / "tier2_autotp_cpu.csv"
TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256", "--seq-len", "16"]
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}, "tensor_parallel": {"autotp_size": 2}}


def _write(tmp_path, config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_committed_rows_cover_the_layouts():
    """ZeRO-0, 1 and 2; AutoTP 2 and 4, alone and over 2 data-parallel replicas; fp32 and bf16, checkpointing,
    gradient accumulation, DeepSpeed's FusedAdam beside the client AdamW; Llama, GQA (Mistral, Llama-3.1), q/k/v
    biases (Qwen2.5), a tied head (Qwen2.5-0.5B) and GPT-NeoX's fused QKV."""
    rows = load_measurements([CSV])
    assert set(rows["recipe"]) == {Recipe.DEEPSPEED_AUTOTP.value} and rows["gloo_settle"].all()
    configs = rows["ds_config"].map(json.loads)
    assert set(configs.map(lambda c: c["zero_optimization"]["stage"])) == {0, 1, 2}
    autotp = configs.map(lambda c: c["tensor_parallel"]["autotp_size"])
    assert set(autotp) == {2, 4} and (rows["world_size"] > autotp).any()  # ZeRO over several replicas
    assert set(rows["precision"]) == {"fp32", "bf16"} and rows["grad_ckpt"].any() and (rows["grad_accum"] > 1).any()
    assert configs.map(lambda c: "optimizer" in c).any()
    assert configs.map(lambda c: c["zero_optimization"].get("overlap_comm", False)).any()  # transformers' example
    assert {"llama-2-7b", "mistral-7b", "qwen2.5-7b", "qwen2.5-0.5b", "pythia-160m", "llama-3.1-8b"} <= set(rows["model"])


def test_committed_runs_predicted_to_the_byte():
    """Three runs re-predicted from their rows: ZeRO-1 over AutoTP 2 in 2 replicas, ZeRO-2 with checkpointing and
    gradient accumulation, and the tied Qwen2.5-0.5B. Every run: the slow test below."""
    rows = load_measurements([CSV])
    configs = rows["ds_config"].map(json.loads)
    stage = configs.map(lambda c: c["zero_optimization"]["stage"])
    chosen = rows[((stage == 1) & (rows["world_size"] == 4) & (rows["model"] == "llama-2-7b"))
                  | ((stage == 2) & (rows["grad_accum"] == 2) & (rows["model"] == "llama-2-7b"))
                  | (rows["model"] == "qwen2.5-0.5b")]
    report = validate(chosen)
    assert len(report) == 10 and report["ok"].all()
    assert (report["measured_bytes"] == report["predicted_bytes"]).all()


@pytest.mark.slow
def test_every_committed_row_predicted():
    report = validate(load_measurements([CSV]), jobs=2)
    assert report["ok"].all() and (report["measured_bytes"] == report["predicted_bytes"]).all()


@pytest.mark.slow
def test_a_fresh_run_is_predicted():
    """ZeRO-2 over AutoTP 2 in 2 replicas, fp32, checkpointing: measured now, predicted rank by rank."""
    spec = load_model_spec("llama-2-7b", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                          "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256})
    config = {**BASE, "bf16": {"enabled": False}, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    layout = Layout(Strategy.DEEPSPEED, 4, ds_setup(config, 4, 64, None, None))
    setup = on_autotp(TrainSetup(2, 32, Precision.FP32, None, True), layout)
    measured = [row["peak_allocated_bytes"] for row in measure_distributed(spec, setup, layout, ds_gloo_settle=True)]
    predicted = [rank.peak.allocated_bytes for rank in predict(spec, setup, layout, jobs=2).ranks]
    assert all(abs(p - m) <= PEAK_ALLOCATED_TOLERANCE[2] * m for p, m in zip(predicted, measured)), (measured, predicted)
    assert predicted == measured  # to the byte, as every committed row


def test_the_layout_line_and_json_name_autotp(tmp_path, capsys):
    config = _write(tmp_path, BASE)
    assert main(["predict", *TINY, "--ds-config", config, "--world-size", "4", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "deepspeed x 4 (ZeRO-1, AutoTP 2: the linear layers sharded by DeepSpeed, ZeRO over dp 2)" in out
    assert "recipe deepspeed-autotp" in out
    assert main(["predict", *TINY, "--ds-config", config, "--world-size", "2", "--jobs", "1", "--format",
                 "json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert len(ranks) == 2 and ranks[0]["peak_allocated_bytes"] > 0


def test_the_batch_counts_every_rank_as_deepspeed_does(tmp_path, capsys):
    """DeepSpeed's config checks train_batch_size against every rank of the world, the tensor-parallel ones too
    (DeepSpeedConfig takes dist.get_world_size() without an mpu): 2 x 1 x 4 on 4 ranks, not 2 x 1 x 2 replicas."""
    assert main(["predict", *TINY, "--ds-config", _write(tmp_path, {**BASE, "train_batch_size": 8}),
                 "--world-size", "4", "--jobs", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["predict", *TINY, "--ds-config", _write(tmp_path, {**BASE, "train_batch_size": 4}),
                 "--world-size", "4", "--jobs", "1"]) == 2
    assert "train_batch_size(4) != train_micro_batch_size_per_gpu(2)" in capsys.readouterr().err


REFUSED = [
    ({"zero_optimization": {"stage": 3}}, [], "ZeRO stage 3 with tensor_parallel.autotp_size is not modelled yet"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW"}}, [],
     "offload with tensor_parallel.autotp_size is not modelled yet"),
    ({"tensor_parallel": {"autotp_size": 4}}, ["--world-size", "6"],
     "tensor_parallel.autotp_size(4) does not divide world-size(6); valid autotp sizes: 2, 3, 6"),
    ({}, ["--world-size", "128"], "world-size(128) is more than the 64 llmsim traces"),
    ({}, ["--lora-rank", "8"], "--lora-rank with DeepSpeed's AutoTP is not modelled yet"),
    ({}, ["--loss", "chunked-nll"], "--loss chunked-nll with DeepSpeed's AutoTP is not modelled yet"),
    ({"zero_allow_untested_optimizer": True}, ["--optimizer", "sgd"],
     "--optimizer sgd with DeepSpeed's AutoTP is not modelled yet"),
    ({}, ["--pp", "2"], "--tp/--pp with DeepSpeed's AutoTP (tensor_parallel.autotp_size 2)"),
    ({}, ["--tp", "2"], "with strategy deepspeed is not modelled"),
    ({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}, [], "tensor_parallel.tp_overlap_comm(true)"),
    ({}, ["--set", "tie_word_embeddings=true", "--set", "vocab_size=255"],
     "a head tied to the embedding with vocab_size(255) that tensor_parallel.autotp_size(2) does not divide"),
]


@pytest.mark.parametrize("changes,extra,needle", REFUSED, ids=[r[2][:40] for r in REFUSED])
def test_what_is_not_modelled_is_one_line_and_status_2(tmp_path, changes, extra, needle, capsys):
    argv = ["predict", *TINY, "--ds-config", _write(tmp_path, {**BASE, **changes}), "--jobs", "1", *extra]
    if "--world-size" not in extra:
        argv += ["--world-size", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_the_trainer_under_autotp_is_refused(tmp_path, capsys):
    """The HF Trainer hands the JSON to accelerate's DeepSpeed plugin: with AutoTP that is not modelled (the
    DeepSpeed script is)."""
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "bf16": True, "use_cpu": True,
                                "output_dir": str(tmp_path)}))
    config = _write(tmp_path, {**BASE, "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}})
    assert main(["predict", *TINY, "--training-args", str(args), "--ds-config", config, "--world-size", "2",
                 "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "AutoTP" in err, err


def test_compare_takes_checkpointing_as_the_lever(tmp_path):
    """Under AutoTP the JSON sets precision and optimizer, as under the pipeline engine: compare tries
    checkpointing (off, every 2 layers, every layer) on the JSON as given."""
    from llmsim.app.compare import compare_levers
    from llmsim.app.options import build_parser, inputs

    spec, setup, layout = inputs(build_parser().parse_args(
        ["predict", *TINY[:-2], "--set", "num_hidden_layers=4", "--seq-len", "128", "--ds-config",
         _write(tmp_path, BASE), "--world-size", "2"]))
    frame = compare_levers(spec, setup, layout)
    assert list(frame["lever"]) == ["baseline: the DeepSpeed JSON", "checkpointing every 2 layers", "checkpointing"]
    assert frame["device_total_bytes"].iloc[2] < frame["device_total_bytes"].iloc[0]


def test_what_would_make_it_fit_is_the_scripts_lever(tmp_path):
    """`--suggest` (on by default where a job does not fit) under AutoTP: the JSON sets the precision, optimizer and
    layout, so checkpointing is what is tried; the canonical step's levers are not (building one, a fused optimizer,
    stopped a 70B prediction with a refusal naming tp(8))."""
    from llmsim.app.advice import candidates
    from llmsim.app.options import build_parser, inputs

    spec, setup, layout = inputs(build_parser().parse_args(
        ["predict", *TINY, "--ds-config", _write(tmp_path, BASE), "--world-size", "2"]))
    assert [change.change for change in candidates(spec, setup, layout)] == ["--grad-ckpt"]
    changed = candidates(spec, setup, layout)[0]
    assert changed.setup.grad_ckpt and changed.setup.recipe is Recipe.DEEPSPEED_AUTOTP and changed.layout == layout
    spec, setup, layout = inputs(build_parser().parse_args(
        ["predict", *TINY, "--ds-config", _write(tmp_path, BASE), "--world-size", "2", "--grad-ckpt"]))
    assert candidates(spec, setup, layout) == []
