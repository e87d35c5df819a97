"""ZeRO-1/2 ranks from one template walk (strategies/zero12.py `_Ranks`) are exactly the ranks their own walks give
(`walk_rank`, the reference): every rank's whole timeline, the peak and host peak a prediction reads, and the device
events the allocator model replays, on setups that reach every mark the template leaves."""
import json
from collections import Counter

import pytest

from llmsim.inputs.dsconfig import load_ds_config
from llmsim.enums import Loss, Optimizer, Precision
from llmsim.inputs.gpus import load_gpu, on_gpu
from llmsim.model.offload import host_peak_bytes, split_host
from llmsim.sim.peaks import replay
from llmsim.sim.pipeline import expanded, predict
from llmsim.inputs.spec import TrainSetup, load_model_spec, resolve_attention
from llmsim.sim.strategies import Layout, Strategy, traced_setup, zero12
from llmsim.sim.strategies.zero_common import NO_DECAY, parameters
from llmsim.inputs.zoo import shrink

SPEC = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 256, 4))
BF16, FP32 = Precision.BF16, Precision.FP32
SMALL = 3000  # elements: the embedding and LM head (256 x 64) are larger than the bucket (reduced alone)

# (id, setup, stage, world size, grad accum, zero_optimization extras, DeepSpeed "optimizer" section)
CASES = [
    ("fp32-z1", TrainSetup(2, 16), 1, 4, 1, {}, None),
    ("bf16-z2-ckpt", TrainSetup(1, 16, BF16, grad_ckpt=True), 2, 5, 1, {}, None),
    ("bf16-z1-small", TrainSetup(1, 16, BF16), 1, 3, 1, {"reduce_bucket_size": SMALL}, None),
    ("bf16-z2-small", TrainSetup(1, 16, BF16), 2, 7, 1, {"reduce_bucket_size": SMALL}, None),
    ("fp32-z1-overlap-small", TrainSetup(1, 16), 1, 6, 1, {"overlap_comm": True, "reduce_bucket_size": 5000}, None),
    ("bf16-z2-no-overlap", TrainSetup(1, 16, BF16), 2, 4, 1, {"overlap_comm": False}, None),
    ("fp32-z1-ga3", TrainSetup(1, 16, grad_accum=3), 1, 3, 3, {}, None),
    ("bf16-z2-ga2-small", TrainSetup(1, 16, BF16, grad_accum=2), 2, 5, 2, {"reduce_bucket_size": 4000}, None),
    ("fp32-z1-ga2-overlap-small", TrainSetup(1, 16, grad_accum=2), 1, 4, 2,
     {"overlap_comm": True, "reduce_bucket_size": SMALL}, None),
    ("bf16-z2-lora", TrainSetup(1, 16, BF16, lora_rank=4), 2, 3, 1, {}, None),
    ("fp32-z1-lora-small", TrainSetup(1, 16, lora_rank=4), 1, 6, 1, {"reduce_bucket_size": 300}, None),
    ("bf16-z1-lora-empty-ranks", TrainSetup(1, 16, BF16, lora_rank=1), 1, 300, 1, {}, None),  # 512 elements
    ("bf16-z1-sgd", TrainSetup(1, 16, BF16, optimizer=Optimizer.SGD), 1, 4, 1, {}, None),
    ("fp32-z2-adafactor", TrainSetup(1, 16, optimizer=Optimizer.ADAFACTOR), 2, 3, 1, {}, None),
    ("bf16-z2-ds-adamw", TrainSetup(1, 16, BF16), 2, 4, 1, {}, {"type": "AdamW", "params": {"lr": 1e-4}}),
    ("fp32-z1-ds-torch-adam", TrainSetup(1, 16), 1, 5, 1, {}, {"type": "Adam",
                                                               "params": {"lr": 1e-4, "torch_adam": True}}),
    ("bf16-z2-ckpt-offload", TrainSetup(1, 16, BF16, grad_ckpt=True, ckpt_offload=True), 2, 4, 1, {}, None),
    ("fp32-z1-ckpt-offload-small", TrainSetup(1, 16, grad_ckpt=True, ckpt_offload=True), 1, 3, 1,
     {"reduce_bucket_size": SMALL}, None),
    ("bf16-z1-fused-linear-ce", TrainSetup(1, 16, BF16, loss=Loss.FUSED_LINEAR_CE), 1, 4, 1, {}, None),
    ("fp32-z2-chunked-nll-small", TrainSetup(1, 16, loss=Loss.CHUNKED_NLL), 2, 3, 1, {"reduce_bucket_size": SMALL},
     None),
    ("bf16-z2-fused", TrainSetup(1, 16, BF16, fused=True), 2, 3, 1, {}, None),
    ("bf16-z1-h100", on_gpu(TrainSetup(1, 16, BF16), load_gpu("h100-80gb")), 1, 4, 1, {}, None),  # host steps
    ("bf16-z2-h100-small", on_gpu(TrainSetup(1, 16, BF16), load_gpu("h100-80gb")), 2, 6, 1,
     {"reduce_bucket_size": SMALL}, None),
    ("bf16-z1-200-small", TrainSetup(1, 16, BF16), 1, 200, 1, {"reduce_bucket_size": 6000}, None),
    # the HF Trainer's two param groups (the norms without weight decay: `NO_DECAY`), each flattened apart
    ("bf16-z2-groups-small", TrainSetup(1, 16, BF16), 2, 5, 1, {"reduce_bucket_size": SMALL}, None),
    ("fp32-z1-groups-round-robin", TrainSetup(1, 16), 1, 3, 1, {"round_robin_gradients": True}, None),
    ("bf16-z2-groups-ga2-round-robin", TrainSetup(1, 16, BF16, grad_accum=2), 2, 4, 2,
     {"round_robin_gradients": True, "reduce_bucket_size": 4000}, None),
]


def _layout(tmp_path, setup, stage, world, grad_accum, zero, optimizer) -> Layout:
    config = {"train_micro_batch_size_per_gpu": setup.micro_batch, "gradient_accumulation_steps": grad_accum,
              "zero_optimization": {"stage": stage, **zero}, "bf16": {"enabled": setup.precision is BF16}}
    if optimizer is not None:
        config["optimizer"] = optimizer
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return Layout(Strategy.DEEPSPEED, world, load_ds_config(path, world, 64, setup.micro_batch, setup.precision,
                                                            grad_accum))


def _ranks(tmp_path, case):
    name, setup, *shape = case
    layout = _layout(tmp_path, setup, *shape)
    setup = traced_setup(resolve_attention(SPEC, setup), layout)
    timeline, _ = expanded(SPEC, setup)
    if "groups" in name:  # as llmsim/sim/traced.py marks a Trainer's timeline (a copy: `expanded` keeps its own)
        timeline = timeline.copy()
        timeline.attrs[NO_DECAY] = frozenset(p.name for p in parameters(timeline, 1) if "norm" in p.name)
    rows, own = zero12._walk_inputs(timeline)
    return timeline, layout, setup, zero12._Ranks(timeline, rows, layout, setup, own)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_template_ranks_equal_their_own_walks(tmp_path, case):
    timeline, layout, setup, ranks = _ranks(tmp_path, case)
    lazy = zero12.plan(timeline, layout, setup)
    assert lazy.events is not None  # the template stood for every rank (no fallback to walking them)
    for rank in range(layout.world_size):
        walked = zero12.walk_rank(timeline, layout, setup, rank)
        frame = lazy[rank]
        assert frame.equals(walked) and list(frame.dtypes) == list(walked.dtypes), rank
        device, host = split_host(walked)
        events = lazy.events(rank)
        assert events.peak == replay(device), rank
        assert events.peak_host_bytes == host_peak_bytes(host), rank
        serials, deltas = events.spliced().arrays()  # the device events, each storage under a name of its own
        assert serials.dtype == deltas.dtype == device["serial"].to_numpy().dtype
        assert deltas.tolist() == device["delta_bytes"].tolist()
        names = dict(zip(device["serial"].tolist(), serials.tolist()))
        assert [names[serial] for serial in device["serial"].tolist()] == serials.tolist()
        assert len(set(names.values())) == len(names)
        assert ranks.group_slices(rank) == ranks.groups.group_slices(rank)


def test_the_cases_reach_every_mark(tmp_path):
    """The cases above reach each branch the template's ranks resolve differently."""
    reached = Counter()
    for case in CASES:
        _, layout, _, ranks = _ranks(tmp_path, case)
        for rank in range(layout.world_size):
            mine, inserted, events = ranks.slices(rank), ranks._inserted(rank), ranks.events(rank)
            spliced = {int(ranks.device_before[p]) + j for j, p in enumerate(inserted.position)}  # device indices
            reached["peak at a rank's own event"] += events.peak.event in spliced
            reached["no slice"] += not mine
            reached["padding"] += sum(mine.values()) < sum(ranks.partitions)
            for *_, kind, args in ranks.marks:
                if kind in (zero12._XL_MINE, zero12._XL_OTHER):
                    reached[f"{kind}, freed"] += (args[0] in mine) == (kind == zero12._XL_MINE)
                reached["a later micro-step's grads_in_partition"] += kind == zero12._KEEP_GIP and not args[0]
        reached["host events"] += ranks.peak_host_bytes > 0
    for what in ("peak at a rank's own event", "no slice", "padding", f"{zero12._XL_MINE}, freed",
                 f"{zero12._XL_OTHER}, freed", "host events", "a later micro-step's grads_in_partition"):
        assert reached[what] > 0, what


def test_a_template_that_cannot_stand_for_every_rank_walks_each(tmp_path, monkeypatch):
    """Where the template diverges (`_Diverges`), plan falls back to one walk per rank, and predict to timelines."""
    setup = TrainSetup(1, 16, BF16)
    layout = _layout(tmp_path, setup, 1, 3, 1, {"reduce_bucket_size": SMALL}, None)
    fast = predict(SPEC, setup, layout)

    def diverge(self):
        raise zero12._Diverges("forced")
    monkeypatch.setattr(zero12._Template, "_keep_slices", diverge)
    timeline, _ = expanded(SPEC, traced_setup(resolve_attention(SPEC, setup), layout))
    assert zero12.plan(timeline, layout, setup).events is None
    monkeypatch.setattr("llmsim.sim.pipeline.plan", lambda timeline, layout, setup: zero12.plan(timeline, layout, setup))
    walked = predict(SPEC, setup, layout)
    assert [r.to_dict() for r in walked.ranks] == [r.to_dict() for r in fast.ranks]
    assert all(a.timeline.equals(b.timeline) for a, b in zip(walked.ranks, fast.ranks))


@pytest.mark.parametrize("stage", [1, 2])
def test_ranks_replayed_in_processes_are_the_ranks_replayed_here(tmp_path, stage):
    """`predict(jobs=2)` replays ZeRO-1/2's ranks on a GPU in two forked processes, blocks of neighbouring ranks
    each: every rank's peak, reserved bytes, device total and verdict are those of one process, and its frame is
    rebuilt here on demand."""
    import llmsim.sim.replay as replay

    setup = TrainSetup(1, 16, BF16, grad_ckpt=True)
    layout = _layout(tmp_path, setup, stage, 200, 1, {"reduce_bucket_size": 6000}, None)
    gpu = load_gpu("h100-80gb")
    forks = []
    real = replay._lazy_ranks_in_processes
    replay._lazy_ranks_in_processes = lambda *args: forks.append(args[-1]) or real(*args)
    try:
        here = predict(SPEC, setup, layout, gpu).ranks
        replay._REPLAYED_PLAN[0] = lambda: None  # the processes start without this process's replays, and the
        there = predict(SPEC, setup, layout, gpu, jobs=2).ranks  # ranks are predicted again
        again = predict(SPEC, setup, layout, gpu, jobs=2).ranks  # kept: no processes
    finally:
        replay._lazy_ranks_in_processes = real
    assert forks == [2]  # 200 ranks: one call, two processes (jobs=1 stays here)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in there]
    assert [r.rank for r in there] == list(range(200))
    for ours, theirs in zip(here, there):
        assert (theirs.peak, theirs.peak_reserved_bytes, theirs.device_total_bytes, theirs.fits) == \
            (ours.peak, ours.peak_reserved_bytes, ours.device_total_bytes, ours.fits)
    assert there[123].timeline.equals(here[123].timeline)
    assert not here[123].timeline.equals(here[0].timeline)  # the ranks' events differ: each its own replay


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_rank_in_the_tree_of_chunks_reserves_what_its_own_walk_does(tmp_path, monkeypatch, case, expandable):
    """On a GPU the allocator model reads a rank's events as the template's with its own spliced in, and replays
    the ranks as one tree of chunks (replay._replay_spliced): every rank's reserved peak is the whole replay of
    its own walk's device events. Small chunks and few states kept, so that walks join and states let go are
    replayed again."""
    from llmsim.sim import replay
    from llmsim.sim.allocator import NO_LIMIT, AllocatorConfig, replay_reserved

    monkeypatch.setattr(replay, "CHECKPOINT_EVERY", 64)
    monkeypatch.setattr(replay, "_MAX_STATES", 8)
    monkeypatch.setattr(replay, "_REPLAYED", {})
    timeline, layout, setup, ranks = _ranks(tmp_path, case)
    config, extra = AllocatorConfig(expandable_segments=expandable), (load_gpu("h100-80gb").cublas_workspace_bytes,)
    for rank in sorted({*range(0, layout.world_size, max(1, layout.world_size // 12)), layout.world_size - 1}):
        device, _ = split_host(zero12.walk_rank(timeline, layout, setup, rank))
        alone = replay_reserved(device["serial"].to_numpy(), device["delta_bytes"].to_numpy(), NO_LIMIT, config,
                                extra).peak_reserved_bytes
        assert replay._replay_spliced(ranks.events(rank).spliced(), NO_LIMIT, config, extra) == alone, rank
    chunks = next(iter(replay._REPLAYED.values()))
    assert chunks.count > 8 and sum(chunks.replayed) < chunks.count * len(chunks.replayed)  # the ranks share
