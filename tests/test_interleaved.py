"""Interleaved 1F1B (torch's ScheduleInterleaved1F1B, `--schedule interleaved-1f1b --stages-per-rank V`): the committed
rows measured under torchrun, each rank predicted by running the same schedule under fake tensors; the later
micro-batches' replay equal to computing them; what torch or llmsim refuses, one line and exit status 2."""
import json

import pytest

from llmsim.app.cli import main
from llmsim.enums import Attention, Precision
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.measure.validate import load_measurements, validate
from llmsim.model import chunk_replay
from llmsim.model.pipelining import Schedule, rank_stages
from llmsim.model.trace import forget_traces, trace

CSV = MEASUREMENTS_DIR / "tier2_interleaved_cpu.csv"
TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=8", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "1"]


def test_rank_stages_follow_torchs_looped_placement():
    assert rank_stages(1, 4, 2) == [1, 5] and rank_stages(0, 2, 3) == [0, 2, 4] and rank_stages(3, 4, 1) == [3]


def test_committed_rows_cover_the_schedules():
    """Interleaved 1F1B: 2 and 3 stages a rank over pp 2-4, one round of micro-batches and several (10 on 4 ranks: torch's flexible
    rounds), fp32, bf16 and autocast, checkpointing every 1 and 2 layers, five architectures (a tied embedding on the
    last stage), uneven stages; DistributedDataParallel around each stage, TP x PP, DDP x TP x PP (torch's replicate
    per stage), FSDP2 x PP (reshard after forward on and off) and FSDP2 x TP x PP. Looped BFS, and the zero-bubble
    schedules (ZBV and DualPipeV in a V: rank 0 holds the first and the last stage) alone and with DDP, FSDP2, TP."""
    rows = load_measurements([CSV])
    assert len(rows) >= 100 and set(rows["schedule"]) == {"interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble",
                                                          "zbv-zero-bubble", "dualpipev"}
    assert (rows["schedule"] == "looped-bfs").sum() >= 13
    v_shaped = rows[rows["schedule"].isin(["zbv-zero-bubble", "dualpipev"])]
    assert {"single", "fsdp"} <= set(v_shaped["strategy"]) and set(v_shaped["tp"]) == {1, 2}
    assert (v_shaped["model"] == "qwen2.5-0.5b").any()  # tied: rank 0 holds the embedding and the head
    assert {"single", "ddp", "fsdp"} == set(rows["strategy"]) and set(rows["tp"]) == {1, 2}
    fsdp = rows[rows["strategy"] == "fsdp"]
    assert set(fsdp["tp"]) == {1, 2} and fsdp["fsdp_config"].map(lambda c: json.loads(c)["reshard_after_forward"]
                                                                  ).nunique() == 2
    assert ((rows["strategy"] == "ddp") & (rows["tp"] == 2)).sum() >= 16
    assert set(rows["stages_per_rank"]) == {2, 3} and {2, 3, 4} <= set(rows["pp"])
    assert set(rows["precision"]) == {"fp32", "bf16", "bf16-autocast"}
    assert set(rows.loc[rows["grad_ckpt"], "ckpt_every"]) == {1, 2} and rows["model"].nunique() >= 5
    assert (rows["n_microbatches"] % rows["pp"] != 0).any() and (rows["strategy"] == "ddp").sum() >= 8


def test_committed_runs_predicted_to_the_byte():
    """Three runs re-predicted from their rows: 4 ranks of one layer a stage with checkpointing, DDP around each of
    3 stages a rank over 2 replicas, and FSDP2 x PP without resharding after the forward. Every run: the slow test
    below."""
    rows = load_measurements([CSV])
    fsdp = rows["fsdp_config"].map(lambda c: isinstance(c, str) and not json.loads(c)["reshard_after_forward"])
    chosen = rows[((rows["pp"] == 4) & rows["grad_ckpt"]) | fsdp
                  | ((rows["strategy"] == "ddp") & (rows["stages_per_rank"] == 3))]
    report = validate(chosen)
    assert len(report) == 12 and report["ok"].all()
    assert (report["measured_bytes"] - report["predicted_bytes"] == _over(report)).all()


def _over(report):
    """What a measured rank holds beyond the prediction: 16 B on a DistributedDataParallel rank, as on the DDP x PP
    ranks of tier2_pp_cpu.csv (the rank tensor of the `mesh["dp"]` sub-mesh dist_worker slices inside the tracked step
    for DDP's group, made at the build and kept by the mesh: host memory on a GPU); none otherwise (torch's replicate
    under DDP x TP included)."""
    return ((report["strategy"] == "ddp") & (report["tp"] == 1)) * 16


@pytest.mark.slow
def test_every_committed_row_predicted():
    report = validate(load_measurements([CSV]), jobs=2)
    assert report["ok"].all() and (report["measured_bytes"] - report["predicted_bytes"] == _over(report)).all()


@pytest.mark.slow
def test_fresh_run_matches_prediction():
    """A run measured now (pp 2 x 3 stages a rank, bf16, checkpointing, 4 micro-batches), predicted from the same
    command line."""
    from llmsim.app.options import build_parser, inputs
    from llmsim.measure.runs import measure_distributed
    from llmsim.sim.pipeline import predict

    argv = ["measure", *TINY, "--set", "num_hidden_layers=7", "--precision", "bf16", "--grad-ckpt", "--pp", "2",
            "--world-size", "2", "--schedule", "interleaved-1f1b", "--stages-per-rank", "3", "--microbatches", "4"]
    spec, setup, layout = inputs(build_parser().parse_args(argv))
    rows = measure_distributed(spec, setup, layout, timeout_s=900)
    prediction = predict(spec, setup, layout)
    assert [r.peak_allocated_bytes for r in prediction.ranks] == [row["peak_allocated_bytes"] for row in rows]


@pytest.mark.parametrize("pp,stages_per_rank,microbatches,ckpt", [(2, 2, 4, False), (3, 2, 6, True)])
def test_replayed_micro_batches_make_the_computed_events(pp, stages_per_rank, microbatches, ckpt):
    """Each stage's later micro-batches replayed from its micro-batch 1 (llmsim/model/chunk_replay.py: one replay per
    stage of the rank) make, event for event, what computing every micro-batch makes, on every rank."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 8 if pp == 2 else 6, 512, 4))
    for rank in range(pp):
        setup = TrainSetup(1, 32, Precision.BF16, Attention.SDPA, grad_ckpt=ckpt, pp=pp, pp_stage=rank,
                           schedule="interleaved-1f1b", n_microbatches=microbatches, stages_per_rank=stages_per_rank,
                           steps=2)
        timelines = []
        for replayed in (True, False):
            chunk_replay.ENABLED = replayed
            try:
                forget_traces()
                calls = chunk_replay.ChunkReplay.calls
                timelines.append(trace(spec, setup).timeline.reset_index(drop=True))
                # each stage: every micro-batch from the third on in both steps, and the second in the second step
                assert chunk_replay.ChunkReplay.calls - calls == replayed * stages_per_rank * (
                    2 * (microbatches - chunk_replay.FIRST_REPLAYED) + 1)
            finally:
                chunk_replay.ENABLED = True
        replayed, computed = timelines
        columns = ["step", "phase", "block", "module", "serial", "delta_bytes"]
        assert replayed[columns].equals(computed[columns])
    forget_traces()


def test_predict_names_each_ranks_layers_as_the_model_does(capsys):
    """Rank 0 of pp 2 x 2 holds stages 0 and 2: layers 0-1 and 4-5 of the 8; rank 1 layers 2-3 and 6-7."""
    from llmsim.app.options import build_parser, inputs
    from llmsim.sim.pipeline import predict

    argv = ["predict", *TINY, "--precision", "bf16", "--pp", "2", "--world-size", "2", "--schedule",
            "interleaved-1f1b", "--stages-per-rank", "2", "--microbatches", "4", "--jobs", "1"]
    prediction = predict(*inputs(build_parser().parse_args(argv)))
    blocks = [set(rank.timeline["block"]) - {-1} for rank in prediction.ranks]
    assert blocks == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert main([*argv, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stages_per_rank"] == 2 and out["schedule"] == "interleaved-1f1b"
    assert main(argv) == 0
    assert "interleaved-1f1b over 4 micro-batches, 2 stages a rank (rank r: stages r, r + 2, ...)" in \
        capsys.readouterr().out


BAD = [
    (["--schedule", "interleaved-1f1b"], "stages-per-rank(1) must be >= 2"),
    (["--schedule", "1f1b", "--stages-per-rank", "2"], "runs one stage per rank"),
    (["--schedule", "interleaved-1f1b", "--stages-per-rank", "5"], "more than the number of layers(8)"),
    (["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--microbatches", "5"],
     "in 2 rounds of microbatches // pp(2), which must divide them"),
    (["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--pp-split", "4,4"], "pp-split with schedule "
     "interleaved-1f1b is not modelled"),
    (["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--pp", "1"], "needs a pipeline: pp(1)"),
    (["--schedule", "looped-bfs"], "schedule looped-bfs runs several stages on each rank"),
    (["--schedule", "zbv-zero-bubble", "--stages-per-rank", "3"], "exactly 2 stages on each rank (a V)"),
    (["--schedule", "dualpipev", "--stages-per-rank", "2", "--microbatches", "3"],
     "dualpipev needs microbatches(3) >= its 4 stages"),
    (["--schedule", "interleaved-zero-bubble", "--stages-per-rank", "2", "--microbatches", "5"],
     "which must divide them (torch's ScheduleInterleavedZeroBubble)"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=["no-stages", "stages-without-it", "too-many-stages",
                                                   "rounds", "pp-split", "no-pipeline", "bfs-no-stages", "v-of-3",
                                                   "dualpipev-microbatches", "zero-bubble-rounds"])
def test_refused_with_one_line(extra, message, capsys):
    argv = ["predict", *TINY, "--microbatches", "4", *extra]
    if "--pp" not in extra:
        argv += ["--pp", "2", "--world-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_deepspeeds_pipeline_engine_takes_no_stages_per_rank(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": 1}}))
    argv = ["predict", *TINY[:-2], "--ds-config", str(config), "--pp", "2", "--world-size", "2",
            "--stages-per-rank", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--stages-per-rank with --ds-config and --pp" in err and len(err.strip().splitlines()) == 1


def test_a_refused_replay_logs_nothing(caplog):
    """Under FSDP2 the replay refuses and every micro-batch is computed; torch's multi-stage runtime logs an exception
    raised in an action, with the whole schedule, before re-raising it: not for the refusal."""
    argv = ["predict", *TINY, "--precision", "bf16", "--pp", "2", "--world-size", "4", "--strategy", "fsdp",
            "--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--microbatches", "4", "--jobs", "1"]
    forget_traces()
    with caplog.at_level("ERROR"):
        assert main(argv) == 0
    assert not [record for record in caplog.records if record.name.startswith("torch.distributed.pipelining")]


def test_a_v_puts_the_first_and_last_stages_on_rank_0():
    """zbv-zero-bubble over pp 2: rank 0 holds stages 0 and 3 (layers 0-1 and 6-7), rank 1 stages 1 and 2."""
    from llmsim.app.options import build_parser, inputs
    from llmsim.sim.pipeline import predict

    argv = ["predict", *TINY, "--precision", "bf16", "--pp", "2", "--world-size", "2", "--schedule",
            "zbv-zero-bubble", "--stages-per-rank", "2", "--microbatches", "4", "--jobs", "1"]
    prediction = predict(*inputs(build_parser().parse_args(argv)))
    assert [set(rank.timeline["block"]) - {-1} for rank in prediction.ranks] == [{0, 1, 6, 7}, {2, 3, 4, 5}]
    assert rank_stages(0, 2, 2, Schedule.ZBV_ZERO_BUBBLE) == [0, 3] and rank_stages(3, 4, 2, Schedule.DUALPIPEV) == [3, 4]
