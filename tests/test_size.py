"""`size` against brute force: doubling-and-bisecting finds what trying every micro-batch finds."""
from dataclasses import replace

import pandas as pd
import pytest

from llmsim.inputs.gpus import GpuProfile
from llmsim.app.size import candidates, fits, largest_micro_batch, size
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink

MiB = 1 << 20
TINY_GPU = GpuProfile("tiny", "test card", "9.0", 120 * MiB, 40 * MiB, 1 * MiB, "test")


def test_size_agrees_with_brute_force():
    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 2048, 4))
    setup = TrainSetup(1, 128)
    monotonic_cases = 0
    top = 16  # the largest micro-batches that fit here are 9 and 10: the search crosses a boundary below it
    for candidate in candidates(spec, setup, max_gpus=2):
        found, _ = largest_micro_batch(spec, setup, candidate, TINY_GPU, max_micro_batch=top)
        fitting = [fits(spec, setup, candidate, mb, TINY_GPU)[0] for mb in range(1, top + 1)]
        if found == 0:
            assert not fitting[0]
        else:  # a micro-batch that fits, next to one that does not
            assert fitting[found - 1] and (found == top or not fitting[found])
        if fitting == sorted(fitting, reverse=True):  # monotonic: exactly the brute-force answer
            assert found == max([mb for mb, ok in zip(range(1, top + 1), fitting) if ok], default=0), candidate.name
            monotonic_cases += 0 < found < top
    assert monotonic_cases >= 1  # the case bites: some micro-batches fit and some do not


def test_size_table_ranks_fitting_layouts_first():
    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 2048, 4))
    frame = size(spec, TrainSetup(1, 128), TINY_GPU, max_gpus=2, max_micro_batch=8)
    assert set(frame["layout"]) == {"single", "ddp", "zero1", "zero2", "zero3"}
    fsdp = size(spec, TrainSetup(1, 128), TINY_GPU, max_gpus=2, max_micro_batch=8, families=("fsdp",))
    assert set(fsdp["layout"]) == {"fsdp", "fsdp-offload"}  # CPUOffloadPolicy: the host takes the model states
    needs = fsdp.set_index("layout")["needed_bytes"]
    assert needs["fsdp-offload"] < needs["fsdp"]
    assert list(frame["fits"]) == sorted(frame["fits"], reverse=True)


def test_size_offload_family_has_parameter_offload_alone_in_bf16():
    """`--layouts offload`: ZeRO-Offload per stage, the optimizer and parameters offloaded, and in bf16 the
    parameters alone, whose device holds the optimizer's side (more than with everything offloaded, less than ZeRO-3's
    whole: the partitions are the host's)."""
    from llmsim.enums import Precision

    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 2048, 4))
    setup = TrainSetup(1, 128, Precision.BF16)
    names = [c.name for c in candidates(spec, setup, max_gpus=2, families=("offload",))]
    assert names == ["zero1-offload", "zero2-offload", "zero3-offload", "zero3-offload-all", "zero3-offload-params"]
    assert "zero3-offload-params" not in [c.name for c in candidates(spec, TrainSetup(1, 128), 2, ("offload",))]
    from llmsim.sim.pipeline import predict

    layouts = {c.name: c.layout_for(1) for c in candidates(spec, setup, 2, ("zero", "offload")) if c.gpus == 2}
    peak = {name: predict(spec, setup, layouts[name]).ranks[0].peak_allocated_bytes
            for name in ("zero3", "zero3-offload-params", "zero3-offload-all")}
    assert peak["zero3-offload-all"] < peak["zero3-offload-params"] < peak["zero3"]


def test_size_bad_input_is_one_line(capsys):
    from llmsim.app.cli import main

    base = ["size", "--model", "gpt2", "--seq-len", "64"]
    assert main(base + ["--gpu", "b300"]) == 2
    assert "valid choices" in capsys.readouterr().err
    assert main(base + ["--gpu", "l4", "--max-gpus", "0"]) == 2
    assert "max-gpus(0)" in capsys.readouterr().err


@pytest.mark.slow  # the default run's 15 minutes; size's brute-force agreement stays there
def test_size_model_parallel_layouts_agree_with_brute_force():
    """TP and PP candidates exist where the model has transformers' plans, and bisecting finds what trying
    every micro-batch finds."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 512)
    found_names = set()
    for candidate in candidates(spec, setup, max_gpus=2, families=("tp", "pp")):
        found_names.add(candidate.name)
        found, _ = largest_micro_batch(spec, setup, candidate, TINY_GPU, max_micro_batch=12)
        fitting = [fits(spec, setup, candidate, mb, TINY_GPU)[0] for mb in range(1, 13)]
        assert fitting == sorted(fitting, reverse=True), candidate.name  # live bytes grow with the micro-batch
        assert found == sum(fitting), candidate.name
        assert 0 < found < 12, candidate.name  # the case bites
    assert found_names == {"tp", "pp"}


def test_3d_family_holds_the_same_per_rank_at_any_number_of_replicas():
    """`--layouts 3d`: DDP x TP x PP shown once per TP x PP split, on 2 replicas (size.REPLICAS_3D), because a rank
    holds the same with 4: on a GPU every stage's ranks predicted at both agree to the byte (torch's replicate over
    the TP shards runs in the trace, a fake process group of the layout's world size). Only the build's few int64
    temporaries of DTensor's mesh indexing (8-64 B, each within one 512 B block of the caching allocator) grow with
    the replicas: on the CPU, 32 B more at the peak with 4."""
    from llmsim.sim.pipeline import predict
    from llmsim.sim.strategies import Strategy

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 256)
    names = {(c.name, c.gpus) for c in candidates(spec, setup, max_gpus=8, families=("3d",))}
    assert names == {("ddpxpp2", 4), ("ddpxpp4", 8), ("ddpxtp2xpp2", 8)}
    three_d = next(c for c in candidates(spec, setup, 8, ("3d",)) if c.name == "ddpxtp2xpp2").layout_for(1)
    assert (three_d.strategy, three_d.dp, three_d.tp, three_d.pp) == (Strategy.DDP, 2, 2, 2)
    by_replicas = {}
    for dp in (2, 4):
        layout = replace(three_d, world_size=dp * 4)
        ranks = predict(spec, setup, layout, TINY_GPU).ranks
        assert len(ranks) == dp * 4
        by_replicas[dp] = {(r.rank % 4, r.peak_allocated_bytes, r.peak_reserved_bytes) for r in ranks}
    assert by_replicas[2] == by_replicas[4] and len(by_replicas[2]) > 1  # the stages differ; the replicas do not


def test_3d_family_needs_what_its_replica_needs_and_more():
    """A 3-D layout's rank is its TP x PP layout's plus DDP's gradient buffers: at every micro-batch it needs at least
    as much (more where the buffers cross a segment), so it fits no larger a micro-batch, and bisecting finds what
    trying every micro-batch finds."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 128)
    pp2, three_d = (next(c for c in candidates(spec, setup, 4, ("pp", "3d")) if (c.name, c.gpus) == key)
                    for key in (("pp", 2), ("ddpxpp2", 4)))
    pipeline = [fits(spec, setup, pp2, mb, TINY_GPU) for mb in range(1, 9)]
    replicated = [fits(spec, setup, three_d, mb, TINY_GPU) for mb in range(1, 9)]
    assert all(need_3d >= need for (_, need), (_, need_3d) in zip(pipeline, replicated))
    assert any(need_3d > need for (_, need), (_, need_3d) in zip(pipeline, replicated))
    fitting = [ok for ok, _ in replicated]
    assert fitting == sorted(fitting, reverse=True) and 0 < sum(fitting) < 8  # monotonic, and the case bites
    assert largest_micro_batch(spec, setup, three_d, TINY_GPU, 8)[0] == sum(fitting) <= sum(ok for ok, _ in pipeline)


def test_fsdp_pipeline_family_shards_more_with_more_replicas():
    """`--layouts fsdpxpp`: FSDP2 per layer x PP on every split of every GPU count (dp = GPUs / stages); a stage's
    rank holds less with more data-parallel ranks to shard over."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 128)
    found = {(c.name, c.gpus): c for c in candidates(spec, setup, max_gpus=8, families=("fsdpxpp",))}
    assert set(found) == {("fsdpxpp2", 4), ("fsdpxpp2", 8), ("fsdpxpp4", 8)}
    layout = found["fsdpxpp4", 8].layout_for(1)
    assert (layout.dp, layout.pp, layout.fsdp.wrap) == (2, 4, "layers")
    from llmsim.sim.pipeline import predict_stage

    two, four = (predict_stage(spec, setup, found["fsdpxpp2", gpus].layout_for(1), 0, TINY_GPU)[0].peak_allocated_bytes
                 for gpus in (4, 8))
    assert four < two  # stage 0's shards halved (within one allocator segment here: its allocated bytes)


@pytest.mark.slow  # 7 s here: the search itself is the one every family shares, checked against brute force above
def test_fsdp_pipeline_search_agrees_with_brute_force():
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 128)
    candidate = next(c for c in candidates(spec, setup, 4, ("fsdpxpp",)) if c.name == "fsdpxpp2")
    fitting = [fits(spec, setup, candidate, mb, TINY_GPU)[0] for mb in range(1, 9)]
    assert fitting == sorted(fitting, reverse=True) and 0 < sum(fitting) < 8  # monotonic, and the case bites
    assert largest_micro_batch(spec, setup, candidate, TINY_GPU, 8)[0] == sum(fitting)


def test_global_batch_is_made_up_by_the_largest_fitting_micro_batch():
    """DDP splits the global batch over its replicas; one process accumulates: the chosen micro-batch is the
    largest divisor whose prediction fits, as trying them one by one finds."""
    from dataclasses import replace

    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 2048, 4))
    setup = TrainSetup(1, 128)
    frame = size(spec, setup, TINY_GPU, max_gpus=2, global_batch=12, families=("single", "ddp"))
    by_layout = frame.set_index("layout")
    single = [c for c in candidates(spec, setup, 2, ("single",))][0]
    expected = next((mb for mb in (12, 6, 4, 3, 2, 1)
                     if fits(spec, replace(setup, grad_accum=12 // mb), single, mb, TINY_GPU)[0]), 0)
    assert 0 < expected < 12  # the case bites: accumulation is needed
    assert (by_layout.loc["single", "largest_micro_batch"], by_layout.loc["single", "passes"]) == (expected,
                                                                                                  12 // expected)
    ddp = [c for c in candidates(spec, setup, 2, ("ddp",))][0]
    assert by_layout.loc["ddp", "fits"] == fits(spec, setup, ddp, 6, TINY_GPU)[0]
    if not by_layout.loc["ddp", "fits"]:
        assert "micro-batch 6 needs" in by_layout.loc["ddp", "why"]
    odd = size(spec, setup, TINY_GPU, max_gpus=2, global_batch=3, families=("ddp", "fsdp"))
    assert not odd["fits"].any() and odd["why"].str.contains("not a multiple of 2 replicas").all()  # FSDP's ranks too


def test_allow_switches_on_the_fewest_levers_that_fit():
    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 2048, 4))
    setup = TrainSetup(4, 256)
    ddp = [c for c in candidates(spec, setup, 2, ("ddp",))][0]
    plain = fits(spec, setup, ddp, 4, TINY_GPU)[1]
    checkpointed = fits(spec, TrainSetup(4, 256, grad_ckpt=True), ddp, 4, TINY_GPU)[1]
    assert checkpointed < plain
    card = GpuProfile("card", "test card", "9.0", (plain + checkpointed) // 2, 40 * MiB, 1 * MiB, "test")
    kw = dict(max_gpus=2, families=("ddp",), global_batch=8)  # 4 per replica: DDP does not accumulate
    refused = size(spec, setup, card, **kw).iloc[0]  # no lever allowed: micro-batch 4 does not fit
    assert not refused["fits"] and "micro-batch 4 needs" in refused["why"]
    chosen = size(spec, setup, card, allow=("bf16", "ckpt"), **kw).iloc[0]
    assert chosen["fits"] and chosen["levers"] in ("bf16", "ckpt")  # one lever is enough: not both
    assert size(spec, setup, TINY_GPU, allow=("ckpt",), **kw).iloc[0]["levers"] == "-"  # fits as it is


def test_size_new_options_bad_input_is_one_line(capsys):
    from llmsim.app.cli import main

    base = ["size", "--model", "gpt2", "--seq-len", "64", "--gpu", "l4"]
    assert main(base + ["--allow", "ckpt,fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown levers ['fp8']" in err and "ckpt, bf16, lora, offload" in err
    assert main(base + ["--global-batch", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "global-batch must be a positive integer, got 0" in err



@pytest.mark.slow  # the default run's 15 minutes; size's brute-force agreement stays there
def test_pipeline_stage_by_stage_agrees_with_predict(monkeypatch):
    """`size` predicts a pipeline stage by stage and stops at the first stage that cannot fit: the verdict is
    `predict`'s at every micro-batch, the worst rank too where every stage fits; the stages go first, last, the
    others, a failing micro-batch stops at its first stage that cannot fit, and a screen predicts its own stages."""
    import llmsim.app.size as sizing
    from llmsim.sim.allocator import AllocatorConfig
    from llmsim.sim.pipeline import predict
    from llmsim.app.size import _model_parallel, _worst

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    verdicts = set()
    for tp, pp in ((1, 2), (1, 4), (2, 2)):
        layout = _model_parallel(tp, pp)
        for micro_batch in range(1, 9):
            whole = {r.rank: r for r in predict(spec, TrainSetup(micro_batch, 512), layout, TINY_GPU).ranks}
            ok, worst, _ = _worst(spec, TrainSetup(micro_batch, 512), layout, TINY_GPU, AllocatorConfig())
            assert ok == all(r.fits for r in whole.values()), (tp, pp, micro_batch)
            assert worst.needed_bytes == whole[worst.rank].needed_bytes
            if ok:
                assert worst.needed_bytes == max(r.needed_bytes for r in whole.values())
            else:
                assert not whole[worst.rank].fits
            verdicts.add(ok)
    assert verdicts == {True, False}  # the cases bite

    stages = []
    real = sizing.predict_stage
    monkeypatch.setattr(sizing, "predict_stage", lambda *a, **k: stages.append(a[3]) or real(*a, **k))
    layout = _model_parallel(1, 4)
    last = max(mb for mb in range(1, 9) if _worst(spec, TrainSetup(mb, 512), layout, TINY_GPU, AllocatorConfig())[0])
    stages.clear()
    assert _worst(spec, TrainSetup(last, 512), layout, TINY_GPU, AllocatorConfig())[::2] == (True, 0)
    assert stages == [0, 3, 1, 2]  # the first stage, the last, the others
    stages.clear()
    whole = {r.rank: r for r in predict(spec, TrainSetup(last + 1, 512), layout, TINY_GPU).ranks}
    ok, _, unpredicted = _worst(spec, TrainSetup(last + 1, 512), layout, TINY_GPU, AllocatorConfig())
    first_miss = next(i for i, stage in enumerate([0, 3, 1, 2]) if not whole[stage].fits)
    assert not ok and stages == [0, 3, 1, 2][:first_miss + 1] and unpredicted == 3 - first_miss
    stages.clear()
    assert _worst(spec, TrainSetup(1, 512), layout, TINY_GPU, AllocatorConfig(), only=[2, 1])[::2] == (True, 2)
    assert stages == [2, 1]  # a screen predicts its stages alone


@pytest.mark.slow  # local processes (multi-process); the one-process table is checked by default
def test_size_in_processes_is_the_same_table():
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    one = size(spec, TrainSetup(1, 512), TINY_GPU, max_gpus=4, max_micro_batch=8)
    two = size(spec, TrainSetup(1, 512), TINY_GPU, max_gpus=4, max_micro_batch=8, jobs=2)
    assert set(one["layout"]) >= {"pp", "tp", "tp2xpp", "zero3"} and one["fits"].any() and not one["fits"].all()
    pd.testing.assert_frame_equal(one, two)


def test_pipeline_search_screens_then_predicts_the_answer_whole(monkeypatch):
    """A pipeline's search predicts only the stages that bound it so far; where another stage binds at the answer,
    it joins the screen and the search goes on below: the answer is what predicting every stage at every
    micro-batch finds. Synthetic stages: the first is fullest at micro-batch 1, the last binds from 7 on; and a
    pipeline that fits no micro-batch says so from its first stage alone."""
    from types import SimpleNamespace

    import llmsim.app.size as sizing
    from llmsim.app.size import Candidate, _model_parallel

    capacity = 200
    need = {0: lambda mb: 50 + 10 * mb, 1: lambda mb: 20 + 5 * mb, 2: lambda mb: 30 * mb}
    predicted = []

    def stage_ranks(spec, setup, layout, stage, gpu, alloc_conf):
        predicted.append((setup.micro_batch, stage))
        total = need[stage](setup.micro_batch)
        return [SimpleNamespace(rank=stage, needed_bytes=total, fits=total <= capacity)]

    monkeypatch.setattr(sizing, "predict_stage", stage_ranks)
    monkeypatch.setattr(sizing, "_lined", lambda *args: None)  # synthetic stages have no timelines to guess from
    candidate = Candidate("pp", 3, lambda mb, m=None: _model_parallel(1, 3))
    brute = max(mb for mb in range(1, 65) if all(need[s](mb) <= capacity for s in need))
    assert brute == 6
    gpu = replace(TINY_GPU, capacity_bytes=capacity, margin=0.0)  # the card the synthetic stages fit
    found, total = largest_micro_batch(None, TrainSetup(1, 64), candidate, gpu, 64)
    assert (found, total) == (6, 180)
    assert predicted == [(1, 0), (2, 0), (15, 0), (16, 0),  # screened by stage 0, from its line through 1 and 2
                         (15, 0), (15, 2),  # its answer predicted whole: stage 2 cannot fit it
                         (7, 0), (7, 2), (3, 0), (3, 2),  # screened by 0 and 2: bisecting from no fit
                         (6, 0), (6, 2),  # the line through 3's total (90) and 7's (210) meets 200 at 6
                         (6, 0), (6, 2), (6, 1)]  # the answer, whole

    def lined(spec, setup, candidate, stages, gpu, alloc_conf, points, low, top):  # the stages' own lines
        on_line = [mb for mb in range(low, top + 1) if all(need[s](mb) <= capacity for s in stages)]
        return max(on_line) if low in on_line else None

    monkeypatch.setattr(sizing, "_lined", lined)  # where the stages' timelines on their lines say the answer is
    predicted.clear()
    assert largest_micro_batch(None, TrainSetup(1, 64), candidate, gpu, 64) == (6, 180)
    assert predicted == [(1, 0), (2, 0), (15, 0), (16, 0),  # stage 0's lines: 15 fits it, 16 does not
                         (15, 0), (15, 2),  # predicted whole: stage 2 cannot fit it
                         (6, 0), (6, 2),  # the lines of stages 0 and 2 (through 2 and 15): 6
                         (7, 0), (7, 2),  # the line through 6's total and 15's: 7, a miss
                         (6, 0), (6, 2), (6, 1)]  # the answer, whole
    predicted.clear()
    capacity = 55
    assert largest_micro_batch(None, TrainSetup(1, 64), candidate, gpu, 64) == (0, None)
    assert predicted == [(1, 0)]


def test_a_pipeline_stage_grows_on_a_line_with_the_micro_batch():
    """`timeline.on_the_line`: a stage's timeline at micro-batches 3 and 5 is, event for event, the one on the line
    through its timelines at two other micro-batches (1 and 2 for the first stage; 2 and 3 for the last, whose loss
    copies the shifted labels only from micro-batch 2 on: 1 and 2 have not the same events there). On a GPU
    (CUDA's kernels and workspaces), 1F1B over 2 stages and DDP x TP 2 x PP 2."""
    from llmsim.enums import Precision
    from llmsim.model.pipelining import Schedule
    from llmsim.sim.pipeline import checked
    from llmsim.sim.strategies import Layout, Strategy
    from llmsim.sim.timeline import on_the_line
    from llmsim.sim.traced import stage_timeline

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 512, 4))
    for layout in (Layout(world_size=2, pp=2, schedule=Schedule.ONE_F_ONE_B, n_microbatches=2),
                   Layout(Strategy.DDP, 8, tp=2, pp=2, schedule=Schedule.ONE_F_ONE_B, n_microbatches=2)):
        def at(micro_batch: int, stage: int) -> pd.DataFrame:
            setup = checked(spec, TrainSetup(micro_batch, 64, Precision.BF16, grad_ckpt=True), layout, TINY_GPU)
            return stage_timeline(spec, setup, layout, stage)[0]

        first = on_the_line(at(1, 0), at(2, 0))
        assert on_the_line(at(1, 1), at(2, 1)) is None
        last = on_the_line(at(2, 1), at(3, 1), (2, 3))
        for micro_batch in (3, 5):
            pd.testing.assert_frame_equal(first(micro_batch), at(micro_batch, 0))
            pd.testing.assert_frame_equal(last(micro_batch), at(micro_batch, 1))


def test_a_pipeline_search_tries_where_its_stages_lines_say(monkeypatch):
    """With the line through the device totals of micro-batches 1 and 2 taken away (`_extrapolated`: no guess),
    a pipeline's search still goes where the screen stages' timelines on their lines (`_lined`) stop fitting: stage
    0's through 1 and 2 fit up to the maximum (12), which the last stage cannot fit (its logits); then the lines
    of both through 2 and 12 say brute force's answer, which fits, and the one above does not. Doubling and
    bisecting, the old way without a guess, would try 4 and 8 on the way."""
    import llmsim.app.size as sizing

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 512)
    candidate = next(c for c in candidates(spec, setup, max_gpus=2, families=("pp",)))
    gpu = replace(TINY_GPU, capacity_bytes=300 * MiB)  # micro-batch 1 needs 74 MiB, 2 120 MiB, 8 338 MiB
    brute = sum(fits(spec, setup, candidate, mb, gpu)[0] for mb in range(1, 13))
    assert 2 < brute < 12  # the case bites
    trials = []
    worst = sizing._worst

    def recorded(spec, setup, layout, gpu, alloc_conf, only=None):
        trials.append((setup.micro_batch, None if only is None else list(only)))
        return worst(spec, setup, layout, gpu, alloc_conf, only)

    monkeypatch.setattr(sizing, "_worst", recorded)
    monkeypatch.setattr(sizing, "_extrapolated", lambda *args: None)
    assert largest_micro_batch(spec, setup, candidate, gpu, max_micro_batch=12)[0] == brute
    assert trials == [(1, [0]), (2, [0]), (12, [0]), (12, None), (brute, [0, 1]), (brute + 1, [0, 1])], trials


def test_search_from_a_hint_finds_what_brute_force_finds(monkeypatch):
    """`_search` with a hint (the answer on fewer GPUs) gallops from it: for every hint, the brute-force answer when
    "fits" is monotonic, a micro-batch that fits next to one that does not otherwise; two trials when the hint is
    the answer. Synthetic needs, as many bytes as a formula gives."""
    from types import SimpleNamespace

    import llmsim.app.size as sizing
    from llmsim.app.size import Candidate

    trials = []

    def worst(spec, setup, layout, gpu, alloc_conf, only=None):
        trials.append(setup.micro_batch)
        total = need(setup.micro_batch)
        return total <= 100, SimpleNamespace(rank=0, needed_bytes=total), 0

    monkeypatch.setattr(sizing, "_worst", worst)
    candidate = Candidate("ddp", 2, lambda mb: SimpleNamespace(pp=1, tp=1))
    monotonic = [lambda mb, k=k: k * mb for k in (1, 3, 7, 40, 101)] + [lambda mb: 100 + (mb > 20)]
    for need in monotonic:
        brute = max([mb for mb in range(1, 41) if need(mb) <= 100], default=0)
        for hint in [None, *range(1, 46)]:
            trials.clear()
            assert largest_micro_batch(None, TrainSetup(1, 64), candidate, TINY_GPU, 40, hint=hint)[0] == brute
            if hint == brute and 0 < brute < 40:
                assert trials == [brute, brute + 1]
    need = lambda mb: 100 + 5 * (mb % 7 == 3) + (mb > 30)  # noqa: E731 -- fits, except at 3, 10, 17, 24 and above 30
    for hint in [None, *range(1, 41)]:
        found = largest_micro_batch(None, TrainSetup(1, 64), candidate, TINY_GPU, 40, hint=hint)[0]
        assert need(found) <= 100 and need(found + 1) > 100, hint


LIMIT = TINY_GPU.capacity_bytes - TINY_GPU.margin_bytes  # what a device total may reach on the tiny card


def searched(monkeypatch, need, max_micro_batch: int = 128) -> tuple[int, list[int]]:
    """`largest_micro_batch` of a one-process layout whose device total at each micro-batch is `need`'s (synthetic,
    no trace), and the micro-batches it tried, in order."""
    from types import SimpleNamespace

    import llmsim.app.size as sizing
    from llmsim.app.size import Candidate

    trials = []

    def worst(spec, setup, layout, gpu, alloc_conf, only=None):
        trials.append(setup.micro_batch)
        total = need(setup.micro_batch)
        return total <= LIMIT, SimpleNamespace(rank=0, needed_bytes=total), 0

    monkeypatch.setattr(sizing, "_worst", worst)
    candidate = Candidate("ddp", 2, lambda mb: SimpleNamespace(pp=1, tp=1))
    return largest_micro_batch(None, TrainSetup(1, 64), candidate, TINY_GPU, max_micro_batch)[0], trials


def test_search_gallops_from_the_line_through_micro_batches_1_and_2(monkeypatch):
    """Without a hint, once micro-batches 1 and 2 fit, `_search` tries where the line through their device totals
    meets the card less its margin, then gallops: the brute-force answer for every monotonic need, and for needs
    that grow linearly four trials (1, 2, the answer, the one above), where doubling and bisecting took up to 10."""
    for base, slope in [(10 * MiB, 1 * MiB), (60 * MiB, 3 * MiB), (100 * MiB, 5 * MiB), (5 * MiB, 27 * MiB)]:
        need = lambda mb, b=base, k=slope: b + k * mb  # noqa: E731
        brute = max([mb for mb in range(1, 129) if need(mb) <= LIMIT], default=0)
        found, trials = searched(monkeypatch, need)
        assert found == brute
        assert trials == [1, 2, brute, brute + 1] if 2 < brute < 128 else len(trials) <= 10
    for need in [lambda mb: 10 * MiB + MiB * mb * mb, lambda mb: 50 * MiB + MiB * (mb > 9) * 60,  # not lines
                 lambda mb: 100 * MiB + (mb > 2) * 10 * MiB, lambda mb: 100 * MiB + mb]:
        brute = max([mb for mb in range(1, 129) if need(mb) <= LIMIT], default=0)
        assert searched(monkeypatch, need)[0] == brute


def test_search_takes_the_line_through_a_fit_and_a_miss(monkeypatch):
    """Where micro-batches 1 and 2 lie on a flatter line than the larger ones (their peak is the optimizer step's, the
    larger ones' the activations'), the guess from 1 and 2 overshoots; the line through the last fit and the miss
    lands near the answer (the totals of a DDP x TP 8 x PP 2 layout of Llama-2-70B on 32 H100s: 49.81 and 50.33 GiB
    at 1 and 2, about 6.4 GiB a micro-batch above; its search galloped down from 49 in 13 trials). A total that is
    flat and then jumps moves each line's guess by little: after two such steps the search bisects, so doubling to
    128 (8 trials) and at most three trials a halving of the gap (6) bound it; every answer is brute force's."""
    gib = LIMIT / 75.15  # the measured layout's card, scaled to the tiny one
    measured = {1: 49.81, 2: 50.33}
    assert searched(monkeypatch, lambda mb: int(gib * measured.get(mb, 50.33 + 6.4 * (mb - 2)))) == \
        (5, [1, 2, 49, 5, 6])  # the line through 2 and 49 lands on 5
    for jump in range(1, 128):  # flat, then beyond the card: from the middle of the gap to its fitting end
        for base in (LIMIT // 2, LIMIT // 4, LIMIT - 5):
            found, trials = searched(monkeypatch, lambda mb, j=jump, b=base: b + (mb > j) * LIMIT)
            assert found == jump and len(trials) <= 8 + 3 * 6, (jump, base, trials)


def test_size_with_no_applicable_layout_says_why(capsys):
    """A layout that is not modelled (TP x PP on a model whose LM head is tied to its embedding) says why in its row;
    families that leave no layout (TP/PP with LoRA) are one line naming the reason, not an empty table or a
    traceback."""
    from llmsim.app.cli import main

    base = ["size", "--model", "qwen2.5-0.5b", "--seq-len", "64", "--gpu", "a100-40gb", "--max-gpus", "4"]
    assert main([*base, "--layouts", "tpxpp", "--quiet"]) == 0  # the layout's row says why it is not modelled
    assert "not modelled: tp(2) x pp(2) with tied embeddings" in capsys.readouterr().out
    assert main([*base, "--layouts", "tp,pp", "--lora-rank", "8"]) == 2
    assert "LoRA is not modelled with tensor or pipeline parallelism" in capsys.readouterr().err


def test_a_3d_layout_of_tp_1_is_searched_where_its_pp_layout_is(monkeypatch):
    """`ddpxppN` is DDP around each of `pp`'s N stages: the same stage traces. It goes to the process that searches
    the `pp` layout, after it, so those traces are made once; each keeps its own search, and the table is what each
    family finds alone."""
    import llmsim.app.size as size_module

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    handed_out = []
    in_processes = size_module.in_processes

    def recording(work, items, *args, **kwargs):
        handed_out.extend([[key for chain in item for key, _ in chain] for item in items])
        return in_processes(work, items, *args, **kwargs)

    monkeypatch.setattr(size_module, "in_processes", recording)
    both = size(spec, TrainSetup(1, 128), TINY_GPU, max_gpus=4, max_micro_batch=8, families=("pp", "3d"))
    assert [("pp", 2), ("ddpxpp2", 4)] in handed_out and [("pp", 4)] in handed_out
    assert sum(("ddpxpp2", 4) in item for item in handed_out) == 1
    alone = pd.concat([size(spec, TrainSetup(1, 128), TINY_GPU, max_gpus=4, max_micro_batch=8, families=(family,))
                       for family in ("pp", "3d")])
    key = ["layout", "gpus"]
    pd.testing.assert_frame_equal(both.sort_values(key).reset_index(drop=True),
                                  alone.sort_values(key).reset_index(drop=True))
