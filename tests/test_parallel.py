"""Tensor and pipeline parallelism: bad layouts, the committed tier-2 matrix, fresh real runs against predictions.
The committed rows themselves are re-predicted in test_validate.py."""
import pytest

from llmsim.app.cli import main
from llmsim.enums import Attention, Precision
from llmsim.measure.runs import measure_distributed
from llmsim.sim.pipeline import predict
from llmsim.model.pipelining import Schedule, layer_range
from llmsim.inputs.spec import FsdpSetup, TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.inputs.zoo import shrink

LLAMA = ["--model", "llama-2-7b", "--set", "num_hidden_layers=4", "--set", "hidden_size=64",
         "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2",
         "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "1"]

BAD = [
    (["--tp", "3"], "tp(3) must divide num_attention_heads(4)"),
    (["--tp", "4"], "tp(4) must divide num_key_value_heads(2)"),
    (["--tp", "2", "--pp", "2", "--set", "vocab_size=255"], "shards intermediate_size and vocab_size unevenly"),
    (["--pp", "5"], "pp(5) is larger than the number of layers(4)"),
    (["--tp", "2", "--world-size", "3"], "does not divide world-size(3)"),
    (["--tp", "2", "--pp", "2", "--world-size", "8", "--strategy", "single"], "world-size(8) must equal pp(2) x tp(2)"),
    (["--tp", "2", "--world-size", "4", "--strategy", "fsdp", "--fsdp-offload"],
     "--fsdp-offload or fsdp-init host with --pp or --tp is not modelled yet"),
    (["--pp", "2", "--world-size", "4", "--strategy", "fsdp", "--fsdp-offload"],
     "--fsdp-offload or fsdp-init host with --pp or --tp is not modelled yet"),
    (["--pp", "2", "--world-size", "4", "--strategy", "fsdp", "--fsdp-wrap", "transformers"],
     "pp(2) x tp(1) with strategy fsdp is not modelled yet"),
    (["--pp", "2", "--world-size", "6", "--strategy", "fsdp"], "do not divide evenly over dp(3) x tp(1)"),
    (["--pp", "2", "--schedule", "1f1b", "--microbatches", "1"], "microbatches(1) >= pp(2)"),
    (["--pp", "2", "--schedule", "zb"], "schedule"),
    (["--tp", "0"], "tp(0) must be >= 1"),
    (["--pp", "2", "--microbatches", "0"], "microbatches(0) must be >= 1"),
    (["--pp", "2", "--pp-split", "1,2"], "pp-split(1,2) must give pp(2) stages of >= 1 layer summing to"),
    (["--pp", "2", "--pp-split", "4,0"], "pp-split(4,0)"),
    (["--pp", "2", "--pp-split", "a,b"], "pp-split(a,b) must be layer counts"),
    (["--pp", "2", "--precision", "fp16-autocast"], "fp16-autocast with pp > 1 is not modelled"),
    (["--tp", "2", "--grad-accum", "2"], "grad-accum(2) with strategy single and tp/pp is not modelled yet"),
    (["--dp", "2", "--tp", "2", "--world-size", "2"], "dp(2) x pp(1) x tp(2) must equal world-size(2)"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_layout_is_one_line_and_status_2(extra, needle, capsys):
    assert main(["predict", *LLAMA, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_tied_lm_head_under_tp_and_pp_is_refused(capsys):
    """TP alone with tied embeddings is built as from_pretrained builds it (tied after the load; measured in
    tier2_tp_from_pretrained_cpu.csv); TP x PP with them is not modelled."""
    argv = ["predict", "--model", "qwen2.5-0.5b", "--set", "num_hidden_layers=2", "--seq-len", "16",
            "--micro-batch", "1", "--tp", "2"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--pp", "2", "--world-size", "4"]) == 2
    assert "tied embeddings" in capsys.readouterr().err


def test_model_without_a_plan_is_refused(capsys):
    argv = ["predict", "--model", "gpt2", "--set", "n_layer=2", "--seq-len", "16", "--micro-batch", "1"]
    assert main([*argv, "--tp", "2"]) == 2
    assert "no tensor-parallel plan" in capsys.readouterr().err
    assert main([*argv, "--pp", "2"]) == 2
    assert "no pipeline plan" in capsys.readouterr().err


def test_layers_split_as_transformers_splits_them():
    assert [layer_range(s, 3, 32) for s in range(3)] == [(0, 11), (11, 22), (22, 32)]
    assert [layer_range(s, 4, 6) for s in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [layer_range(s, 3, 6, (1, 3, 2)) for s in range(3)] == [(0, 1), (1, 4), (4, 6)]


def test_predicted_ranks_follow_the_layout():
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 256, 4))
    setup = TrainSetup(1, 16)
    tp = predict(spec, setup, Layout(world_size=4, tp=4)).ranks
    assert len({r.peak_allocated_bytes for r in tp}) == 1  # an even plan: every TP rank the same
    single = predict(spec, setup).ranks[0].peak_allocated_bytes
    assert tp[0].peak_allocated_bytes < single
    pp = predict(spec, setup, Layout(Strategy.DDP, 4, tp=1, pp=2, n_microbatches=2)).ranks
    assert [r.peak_allocated_bytes for r in pp[:2]] == [r.peak_allocated_bytes for r in pp[2:]]  # replicas
    assert pp[0].peak_allocated_bytes != pp[1].peak_allocated_bytes  # the first and last stages differ


@pytest.mark.parametrize("schedule,pp", [(Schedule.GPIPE, 3), (Schedule.ONE_F_ONE_B, 4)])
def test_stages_traced_in_processes_give_the_same_prediction(schedule, pp):
    """`predict(jobs=2)` traces a pipeline's stages in two processes and caches them as if traced here: every
    rank's timeline, peak and device total, and the layer graph, are those of tracing every stage here. Under 1F1B
    the middle stage 2 is composed here from stage 1's trace as soon as that one is back, while stage 3's goes on."""
    import pandas as pd

    import llmsim.sim.traced as traced
    from llmsim.inputs.gpus import load_gpu
    from llmsim.model.trace import forget_traces, trace

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    layout = Layout(Strategy.DDP, 2 * pp, pp=pp, n_microbatches=pp, schedule=schedule)
    setup, gpu = TrainSetup(2, 64), load_gpu("h100-80gb")
    traced._EXPANDED.clear()
    forget_traces()
    here = predict(spec, setup, layout, gpu)
    for cache in (traced._EXPANDED, traced._TEMPLATES, traced._EXPANDED_TEMPLATES):
        cache.clear()
    forget_traces()
    there = predict(spec, setup, layout, gpu, jobs=2)
    assert trace.cache_info().currsize == 0  # every stage was traced in the other processes
    assert [r.device_total_bytes for r in there.ranks] == [r.device_total_bytes for r in here.ranks]
    assert len({r.device_total_bytes for r in here.ranks}) == 3  # the first, middle and last stages differ
    for ours, theirs in zip(here.ranks, there.ranks):
        assert ours.peak == theirs.peak
        pd.testing.assert_frame_equal(ours.timeline, theirs.timeline)
    assert sorted(there.graph_of().edges) == sorted(here.graph_of().edges)
    assert predict(spec, setup, layout, gpu, jobs=2).ranks[5].peak == here.ranks[5].peak  # cached: no processes


def test_committed_parallel_rows_cover_the_matrix():
    """Issue 4's matrix: >= 40 rank rows over TP 2 and 4, PP 2 and 4, GPipe and 1F1B, >= 3 architectures,
    1-8 micro-batches, and two hybrids (TP x PP, DP x PP)."""
    from llmsim.measure.validate import load_measurements

    rows = load_measurements()
    rows = rows[(rows.get("tp", 1).fillna(1) > 1) | (rows.get("pp", 1).fillna(1) > 1)]
    assert len(rows) >= 40
    assert {2, 4} <= set(rows["tp"]) and {2, 4} <= set(rows["pp"])
    assert {"gpipe", "1f1b"} <= set(rows["schedule"].dropna())
    assert rows["model"].nunique() >= 3
    assert {1, 8} <= set(rows["n_microbatches"])
    assert ((rows["tp"] > 1) & (rows["pp"] > 1)).any()
    assert ((rows["strategy"] == "ddp") & (rows["pp"] > 1)).any()
    replicated = rows[(rows["strategy"] == "ddp") & (rows["tp"] > 1)]  # DDP x TP (x PP): torch's replicate
    assert {1, 2, 4} <= set(replicated["pp"]) and replicated["world_size"].max() >= 16
    sharded = rows[(rows["strategy"] == "fsdp") & (rows["pp"] > 1)]  # FSDP2 x PP (x TP)
    assert {1, 2} <= set(sharded["tp"]) and sharded["world_size"].max() >= 16
    per_layer = rows[(rows["strategy"] == "fsdp") & (rows["pp"] == 1) & ~rows["fsdp_config"].fillna("").str.contains(
        "transformers")]  # FSDP2 x TP, fully_shard per layer
    assert {2, 4} <= set(per_layer["tp"])


FRESH = [
    ("mistral-7b", (64, 3, 600, 8), TrainSetup(2, 32, Precision.BF16, grad_ckpt=True), Layout(world_size=2, tp=2)),
    ("qwen2.5-7b", (56, 3, 700, 14), TrainSetup(1, 32), Layout(world_size=2, pp=2, schedule=Schedule.ONE_F_ONE_B,
                                                              n_microbatches=3)),
    ("llama-3.1-8b", (64, 4, 700, 16), TrainSetup(1, 48, Precision.BF16_AUTOCAST, grad_ckpt=True),
     Layout(Strategy.DDP, 8, tp=2, pp=2, schedule=Schedule.ONE_F_ONE_B, n_microbatches=3)),  # torch's replicate
    ("mistral-7b", (64, 4, 640, 8), TrainSetup(2, 40, Precision.BF16, grad_ckpt=True),  # FSDP2 per layer, per stage
     Layout(Strategy.FSDP, 4, fsdp=FsdpSetup(reshard_after_forward=False), pp=2, n_microbatches=3)),
]


@pytest.mark.parametrize("model,shape,setup,layout", FRESH, ids=["tp2", "pp2-1f1b", "ddp2-tp2-pp2", "fsdp2-pp2"])
def test_fresh_parallel_run_matches_prediction(model, shape, setup, layout):
    spec = load_model_spec(model, shrink(model, *shape))
    rows = measure_distributed(spec, setup, layout, timeout_s=600)
    prediction = predict(spec, setup, layout)
    for row in rows:
        predicted = prediction.ranks[row["rank"]].peak_allocated_bytes
        measured = row["peak_allocated_bytes"]
        assert abs(predicted - measured) / measured <= PEAK_ALLOCATED_TOLERANCE[2]


def test_table_header_names_what_splits_each_rank():
    from llmsim.app.report import layout_text

    assert layout_text(Layout()) == "single x 1"
    assert layout_text(Layout(Strategy.DDP, 8, pp=2, schedule=Schedule.ONE_F_ONE_B, n_microbatches=4)) == \
        "ddp x 8 (pp 2, 1f1b over 4 micro-batches)"
    assert layout_text(Layout(world_size=8, tp=4, pp=2, n_microbatches=2)) == \
        "single x 8 (tp 4, pp 2, gpipe over 2 micro-batches)"
    assert layout_text(Layout(Strategy.DDP, 16, tp=4, pp=2, n_microbatches=2)) == \
        "ddp x 16 (tp 4 (ddp as torch's replicate), pp 2, gpipe over 2 micro-batches)"


def test_predict_pauses_the_cyclic_collector_and_restores_it(monkeypatch):
    """`predict` and `predict_stage` run with Python's cyclic collector off (a full collection in a cold prediction
    walks every object of torch and transformers: 0.2-0.27 s at 70B) and switch it back on afterwards, also when
    the input is refused; a collector the caller switched off stays off."""
    import gc

    from llmsim.sim import pipeline
    from llmsim.errors import InputError
    from llmsim.sim.pipeline import predict_stage

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 256, 4))
    seen = []
    real = pipeline.checked

    def checked(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "checked", checked)
    assert gc.isenabled()
    predict(spec, TrainSetup(1, 16))
    predict_stage(spec, TrainSetup(1, 16), Layout(Strategy.DDP, 2, pp=2, n_microbatches=2), 1)
    with pytest.raises(InputError):
        predict(spec, TrainSetup(1, 16), Layout(world_size=3, tp=3))  # tp(3) must divide the heads(4)
    assert seen == [False, False, False] and gc.isenabled()
    gc.disable()
    try:
        predict(spec, TrainSetup(1, 16))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_stage_built_on_meta_in_a_trace_keeps_its_tied_embedding_one_parameter():
    """A trace builds the whole stack on the meta device outside its modes and makes the kept parameters its fakes
    (tensor_parallel._as_fakes): the tied embedding transformers keeps on the last stage stays the LM head's one
    parameter, as in a real build (FSDP2 x PP shards it once; two objects were two shards, 11 rows more on a
    4-layer Qwen2.5 stage, until the fakes were made once per parameter)."""
    import functools

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from llmsim.model.pipelining import cut
    from llmsim.model.tensor_parallel import parallel_on_meta
    from llmsim.model.trace import hf_builder

    spec = load_model_spec("qwen2.5-0.5b", shrink("qwen2.5-0.5b", 64, 4, 512, 4))
    setup = TrainSetup(1, 32, Precision.FP32, Attention.SDPA, pp=2, pp_stage=1)
    with FakeTensorMode():
        stage = parallel_on_meta(hf_builder(spec, setup, spec.hf_config()), spec.name, None,
                                 functools.partial(cut, stage=1, num_stages=2))
    head, embedding = stage.get_output_embeddings().weight, stage.get_input_embeddings().weight
    assert isinstance(head, FakeTensor) and head.device.type == "meta"
    assert head is embedding
    assert len(list(stage.parameters())) == len({id(p) for _, p in stage.named_parameters(remove_duplicate=False)})


@pytest.mark.slow  # local processes
def test_a_split_tried_after_stages_traced_in_processes_traces_nothing_again(monkeypatch):
    """`predict(jobs=2)` hands back, with each stage's timeline, the traces its processes made (`trace.hand`). A stage
    of alike layers is traced under one canonical split (`trace.stage_split`), so another split of the same pipeline
    predicted here afterwards, as `--suggest` tries them, traces no stage again, and predicts what tracing here does."""
    from dataclasses import replace

    import llmsim.model.trace as trace_module
    import llmsim.sim.traced as traced
    from llmsim.inputs.gpus import load_gpu

    def forget():
        for cache in (traced._EXPANDED, traced._TEMPLATES, traced._EXPANDED_TEMPLATES):
            cache.clear()
        trace_module.forget_traces()

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 14, 2048, 4))
    layout = Layout(Strategy.DDP, 8, pp=4, n_microbatches=4, schedule=Schedule.ONE_F_ONE_B)
    setup, gpu = TrainSetup(1, 64), load_gpu("h100-80gb")
    forget()
    predict(spec, setup, layout, gpu, jobs=2)
    runs = []
    run = trace_module._run_replaying_chunks
    monkeypatch.setattr(trace_module, "_run_replaying_chunks",
                        lambda spec, setup, depth: runs.append(setup.pp_stage) or run(spec, setup, depth))
    split = replace(layout, pp_split=(3, 4, 4, 3))  # the job's is 4, 4, 3, 3; every stage of 3 layers or more
    there = predict(spec, setup, split, gpu)
    assert runs == []
    forget()
    here = predict(spec, setup, split, gpu)
    assert runs  # traced here this time
    assert [r.peak for r in there.ranks] == [r.peak for r in here.ranks]
