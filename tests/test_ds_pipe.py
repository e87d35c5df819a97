"""DeepSpeed's pipeline engine (recipe deepspeed-pipe, llmsim/model/ds_pipe.py): the committed rows measured through
`deepspeed.initialize` and `engine.train_batch` on a PipelineModule, predicted by running the same engine under fake
tensors; what it does not model, one line and exit status 2."""
import json

import pytest

from llmsim.app.cli import main
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.measure.validate import load_measurements, validate

CSV = MEASUREMENTS_DIR / "tier2_ds_pipe_cpu.csv"
TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=4", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256", "--seq-len", "16"]


def _config(tmp_path, **changes) -> str:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 100000}}
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_committed_rows_cover_the_engine():
    """ZeRO-0 and ZeRO-1, fp32 and bf16 (ZeRO-0 in bf16 runs DeepSpeed's BF16_Optimizer), 2-4 stages over 1 and 2
    replicas, DeepSpeed's checkpointing every 1 and 2 layers, four architectures (one with its head tied to its
    embedding: DeepSpeed's TiedLayerSpec on both ends), both partition methods, and
    DeepSpeed's own reduce bucket (two of 5e8 elements under a pipeline: the 2 GB peak of a 3 MB model)."""
    rows = load_measurements([CSV])
    configs = rows["ds_config"].map(json.loads)
    stages = configs.map(lambda c: c["zero_optimization"]["stage"])
    bf16 = configs.map(lambda c: bool(c.get("bf16", {}).get("enabled")))
    assert len(rows) >= 36 and set(rows["recipe"]) == {"deepspeed-pipe"}
    assert set(stages) == {0, 1} and set(bf16) == {False, True} and ((stages == 0) & bf16).any()
    assert {2, 3, 4} <= set(rows["pp"]) and set(rows["world_size"] // rows["pp"]) == {1, 2}
    assert set(rows.loc[rows["grad_ckpt"], "ckpt_every"]) == {1, 2} and rows["model"].nunique() >= 4
    assert (rows["model"] == "qwen2.5-0.5b").sum() >= 8  # tie_word_embeddings: TiedLayerSpec, ReduceTiedGrads
    assert set(rows["partition_method"]) == {"parameters", "uniform"}
    default_bucket = configs.map(lambda c: "reduce_bucket_size" not in c["zero_optimization"])
    assert default_bucket.any() and (rows.loc[default_bucket, "peak_allocated_bytes"] > 2e9).all()


def test_committed_runs_predicted_to_the_byte():
    """Two runs re-predicted from their rows: ZeRO-1 over 2 replicas in fp32 (4 ranks: each replica's partition its
    own trace) and bf16 with checkpointing every 2 layers over 2 replicas. Every run: the slow test below."""
    rows = load_measurements([CSV])
    configs = rows["ds_config"].map(json.loads)
    replicated = rows["world_size"] == 2 * rows["pp"]
    runs = rows[replicated & ~configs.map(lambda c: "bf16" in c)]
    runs = runs.head(4) if len(runs) >= 4 else runs
    checkpointed = rows[replicated & rows["grad_ckpt"] & (rows["ckpt_every"] == 2)]
    report = validate(load_measurements([CSV]).loc[list(runs.index) + list(checkpointed.index)])
    assert len(report) == 8 and report["ok"].all()
    assert (report["predicted_bytes"] == report["measured_bytes"]).all()


@pytest.mark.slow
def test_every_committed_row_predicted():
    report = validate(load_measurements([CSV]), jobs=2)
    assert report["ok"].all() and (report["predicted_bytes"] == report["measured_bytes"]).all()


@pytest.mark.slow
def test_fresh_run_matches_prediction(tmp_path):
    """A run measured now (ZeRO-1, bf16, 3 stages, checkpointing), predicted from the same command line."""
    from llmsim.app.options import build_parser, inputs
    from llmsim.measure.runs import measure_distributed
    from llmsim.sim.pipeline import predict

    config = _config(tmp_path, bf16={"enabled": True}, gradient_accumulation_steps=3)
    argv = ["measure", *TINY, "--ds-config", config, "--pp", "3", "--world-size", "3", "--grad-ckpt"]
    spec, setup, layout = inputs(build_parser().parse_args(argv))
    rows = measure_distributed(spec, setup, layout, timeout_s=900, ds_gloo_settle=True)  # as the committed rows
    prediction = predict(spec, setup, layout)
    assert [r.peak_allocated_bytes for r in prediction.ranks] == [row["peak_allocated_bytes"] for row in rows]


def test_predict_reports_the_engine_and_deepspeeds_rank_order(tmp_path, capsys):
    assert main(["predict", *TINY, "--ds-config", _config(tmp_path), "--pp", "2", "--world-size", "4",
                 "--format", "json", "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)  # DeepSpeed's own prints kept out of the JSON
    peaks = [rank["peak_allocated_bytes"] for rank in out["ranks"]]
    assert len(peaks) == 4 and peaks[0] != peaks[2]  # ranks 0, 1: stage 0; ranks 2, 3: stage 1 (stage x dp + replica)
    assert main(["predict", *TINY, "--ds-config", _config(tmp_path), "--pp", "2", "--world-size", "4",
                 "--jobs", "1"]) == 0
    assert "DeepSpeed's pipeline engine (TrainSchedule) over 4 micro-batches" in capsys.readouterr().out


BAD = [
    ({"zero_optimization": {"stage": 2}}, [], "valid stages: 0, 1"),
    ({"zero_optimization": {"stage": 3}}, [], "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"),
    ({"fp16": {"enabled": True}}, [], "fp16 is not available"),
    ({"optimizer": None}, [], "\"optimizer\" section"),
    ({}, ["--microbatches", "3"], "contradicts the DeepSpeed config's gradient_accumulation_steps(4)"),
    ({}, ["--schedule", "1f1b"], "runs its own TrainSchedule"),
    ({}, ["--pp-split", "2,2"], "partition_method"),
    ({}, ["--partition-method", "balanced"], "valid choices: parameters"),
    ({}, ["--partition-method", "type:Foo"], "matches none of the pipeline's layer classes"),
    ({}, ["--partition-method", "type:["], "the regex does not compile"),
    ({}, ["--lora-rank", "8"], "--lora-rank with DeepSpeed's pipeline engine is not modelled yet"),
    ({}, ["--attn", "eager"], "valid choices: sdpa"),
    ({}, ["--precision", "bf16"], "bf16"),  # the JSON says fp32: refused where the CLI resolves the JSON
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, [],
     "offload_optimizer with pp(2) is not modelled yet"),
    ({"zero_optimizatoin": {"stage": 1}}, [], "did you mean 'zero_optimization'"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, [], "deepspeed.checkpointing.configure"),  # a near miss DeepSpeed would ignore
]


@pytest.mark.parametrize("changes,extra,needle", BAD, ids=[b[2][:40] for b in BAD])
def test_what_the_engine_does_not_model_is_one_line_and_status_2(changes, extra, needle, tmp_path, capsys):
    assert main(["predict", *TINY, "--ds-config", _config(tmp_path, **changes), "--pp", "2", "--world-size", "2",
                 *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_layouts_it_cannot_trace_are_one_line_and_status_2(tmp_path, capsys):
    config = _config(tmp_path)
    for argv, needle in (
            (["--pp", "2", "--world-size", "4", "--tp", "2"], "pp with deepspeed (its pipeline engine)"),
            (["--pp", "2", "--world-size", "130"], "more than the 64 llmsim traces"),
            (["--pp", "8", "--world-size", "8"], "pp(8) is more stages than the PipelineModule's 7 layers"),
            (["--world-size", "2", "--partition-method", "uniform"], "--partition-method is PipelineModule's")):
        assert main(["predict", *TINY, "--ds-config", config, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_compare_takes_checkpointing_as_the_lever(tmp_path):
    """Under DeepSpeed's pipeline engine the JSON sets precision and optimizer: compare tries the module's
    activation_checkpoint_interval (off, 2, 1), which here lowers the fullest rank's peak."""
    from llmsim.app.compare import compare_levers
    from llmsim.app.options import build_parser, inputs

    spec, setup, layout = inputs(build_parser().parse_args(
        ["predict", *TINY[:-2], "--seq-len", "128", "--ds-config", _config(tmp_path), "--pp", "2",
         "--world-size", "2"]))
    frame = compare_levers(spec, setup, layout)
    assert list(frame["lever"]) == ["baseline: the DeepSpeed JSON",
                                    "checkpointing every 2 layers (activation_checkpoint_interval=2)",
                                    "checkpointing (activation_checkpoint_interval=1)"]
    assert frame["peak_allocated_bytes"].iloc[2] < frame["peak_allocated_bytes"].iloc[0]


def test_sweep_passes_the_engines_options():
    """A sweep file's ds_config, pp and partition_method reach predict's parser as the CLI's flags."""
    from llmsim.app.sweep import _argv

    argv = _argv({"model": "llama-2-7b", "seq_len": 64, "ds_config": "ds.json", "pp": 2, "world_size": 4,
                  "partition_method": "uniform", "grad_ckpt": True})
    assert argv[argv.index("--partition-method") + 1] == "uniform" and "--grad-ckpt" in argv
    assert argv[argv.index("--ds-config") + 1] == "ds.json" and argv[argv.index("--pp") + 1] == "2"


def test_a_batch_that_does_not_divide_names_the_data_parallel_ranks(tmp_path, capsys):
    """Under the pipeline engine train_batch_size is split over world-size / pp replicas, not the world."""
    config = _config(tmp_path, train_batch_size=8)  # 2 x 4 micro-batches x 1 replica
    assert main(["predict", *TINY, "--ds-config", config, "--pp", "2", "--world-size", "2", "--quiet",
                 "--jobs", "1"]) == 0
    capsys.readouterr()
    assert main(["predict", *TINY, "--ds-config", config, "--pp", "2", "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "x data-parallel ranks(2) = 16 (world-size / pp under a pipeline)" in err and len(err.splitlines()) == 1
