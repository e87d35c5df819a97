"""The verdict on a GPU: fits / tight / oom against hand-made needs, the margin, and output that reads at scale
(identical ranks grouped, the deciding rank's breakdown)."""
import json

import pandas as pd
import pytest

from llmsim.app.cli import main
from llmsim.inputs.gpus import DEFAULT_MARGIN, GpuProfile, load_gpu
from llmsim.model.tracker import CUBLAS_WORKSPACE
from llmsim.sim.peaks import replay
from llmsim.sim.replay import on_device

MiB = 1 << 20
CONTEXT, WORKSPACE = 10 * MiB, 2 * MiB


def _timeline(sizes_mib: list[int]) -> pd.DataFrame:
    """A first matmul (the cuBLAS workspace's marker), then one live allocation after another, each freed at the
    end: their sum is the peak, in whole segments."""
    n = len(sizes_mib)
    deltas = [s * MiB for s in sizes_mib] + [-s * MiB for s in sizes_mib]
    return _first_matmul(pd.DataFrame({"serial": list(range(n)) * 2, "delta_bytes": deltas, "category": "activation",
                                       "step": 0, "phase": "forward", "module": "m"}))


def _first_matmul(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` after the tracker's marker of a thread's first cuBLAS call: on a GPU, the workspace's allocation."""
    marker = pd.DataFrame({"serial": [CUBLAS_WORKSPACE], "delta_bytes": [0], "category": "workspace", "step": 0,
                           "phase": "forward", "module": "cublas"})
    return pd.concat([marker, frame], ignore_index=True)


def _card(capacity_mib: int, margin: float = 0.05) -> GpuProfile:
    return GpuProfile("card", "test card", "9.0", capacity_mib * MiB, CONTEXT, WORKSPACE, "test", margin)


def _verdict(sizes_mib: list[int], card: GpuProfile):
    from llmsim.sim.allocator import AllocatorConfig

    timeline = _timeline(sizes_mib)
    return on_device(0, replay(timeline), timeline, card, AllocatorConfig())


@pytest.mark.parametrize("capacity_mib, verdict", [(400, "fits"), (240, "tight"), (150, "oom")])
def test_the_verdict_against_hand_made_needs(capacity_mib, verdict):
    """200 MiB of live tensors in 20-MiB blocks (+ a 2 MiB workspace, 10 MiB of context): on 400 MiB the job needs
    what the allocator reserves plus the context, far outside the 5 % margin (20 MiB); on 240 MiB it runs but
    needs more than 240 - 12 MiB (tight); on 150 MiB the live bytes alone do not fit (oom)."""
    rank = _verdict([20] * 10, _card(capacity_mib))
    assert rank.verdict == verdict and rank.fits == (verdict == "fits")
    assert rank.margin_bytes == round(0.05 * capacity_mib * MiB)
    assert rank.needed_bytes >= 200 * MiB + WORKSPACE + CONTEXT  # never less than the live bytes
    if verdict == "fits":  # the allocator never has to release its cache: what it reserves is what it needs
        assert rank.needed_bytes == rank.device_total_bytes
    if verdict == "tight":
        assert capacity_mib * MiB - rank.margin_bytes < rank.needed_bytes <= capacity_mib * MiB


def test_near_the_card_needed_is_the_least_capacity_it_runs_on():
    """Blocks the allocator cannot reuse for the next size (a freed 30 MiB block, then a 32 MiB request) make its
    unbounded reserved peak larger than the live bytes; at capacity it frees its cache and retries. Near the card
    `needed` is the least capacity on which the model runs the events (to 2 MiB), which lies between the live
    bytes and the unbounded peak."""
    from llmsim.sim.allocator import NO_LIMIT, AllocatorConfig, OutOfMemory, replay_reserved

    deltas = [30 * MiB, -30 * MiB, 32 * MiB, 64 * MiB]
    timeline = _first_matmul(pd.DataFrame({"serial": [0, 0, 1, 2], "delta_bytes": deltas, "category": "activation",
                                           "step": 0, "phase": "forward", "module": "m"}))
    serials, values = timeline["serial"].to_numpy(), timeline["delta_bytes"].to_numpy()
    unbounded = replay_reserved(serials, values, NO_LIMIT, AllocatorConfig(), (WORKSPACE,)).peak_reserved_bytes
    live = 96 * MiB + WORKSPACE
    assert unbounded > live  # the case bites: the freed 30 MiB segment is kept in the cache
    card = _card(unbounded // MiB + 11, margin=0.2)  # the unbounded peak fits, but inside the margin
    rank = on_device(0, replay(timeline), timeline, card, AllocatorConfig())
    least = rank.needed_bytes - CONTEXT
    assert live <= least < unbounded
    replay_reserved(serials, values, least, AllocatorConfig(), (WORKSPACE,))  # it runs there
    with pytest.raises(OutOfMemory):
        replay_reserved(serials, values, least - 2 * MiB - 1, AllocatorConfig(), (WORKSPACE,))


def test_the_margin_option_and_its_refusals(capsys):
    tiny = ["predict", "--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4",
            "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "1", "--format", "json"]
    assert main([*tiny, "--gpu", "a100-40gb"]) == 0
    out = json.loads(capsys.readouterr().out)
    card = load_gpu("a100-40gb")
    assert out["verdict"] == "fits" and out["margin"] == DEFAULT_MARGIN == 0.05
    assert out["margin_bytes"] == card.margin_bytes and "to spare" in out["verdict_why"]
    assert out["ranks"][0]["peak_step"] >= 1  # steps count from 1, as the table prints them
    assert main([*tiny, "--gpu", "a100-40gb", "--margin", "99.99%"]) == 2
    assert "below 50 %" in capsys.readouterr().err
    assert main([*tiny, "--gpu", "a100-40gb", "--margin", "much"]) == 2
    assert "percentage of the card" in capsys.readouterr().err
    assert main([*tiny, "--margin", "10"]) == 2
    assert "needs --gpu" in capsys.readouterr().err
    assert main([*tiny, "--gpu", "a100-40gb", "--margin", "12.5%"]) == 0
    assert json.loads(capsys.readouterr().out)["margin"] == 0.125


def test_identical_ranks_are_one_row_and_the_breakdown_is_the_deciding_ranks(capsys):
    from llmsim.app.report import _rank_groups

    ranks = [type("R", (), dict(rank=i, peak_allocated_bytes=a, peak_reserved_bytes=a, device_total_bytes=a,
                                peak_host_bytes=0, peak=type("P", (), dict(step=0, phase="f", layer="l")),
                                verdict=None)) for i, a in enumerate([5, 5, 5, 7, 5, 5])]
    assert [(first, last) for first, last, _ in _rank_groups(ranks)] == [(0, 2), (3, 3), (4, 5)]
    assert main(["predict", "--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4",
                 "--set", "vocab_size=256", "--seq-len", "16", "--micro-batch", "1", "--world-size", "16",
                 "--gpu", "a100-40gb"]) == 0
    out = capsys.readouterr().out
    assert " 0-15 " in out and "\n    1 " not in out  # sixteen DDP ranks, one row
    assert "checked on one H200" in out


def test_the_gpu_sentence_says_what_the_gpu_rows_checked():
    """report.GPU_VALIDATION quotes the tier-4 rows: their count and the worst allocated error (a new GPU run that
    changes either changes the sentence)."""
    from llmsim.app.report import GPU_VALIDATION
    from llmsim.measure.runs import MEASUREMENTS_DIR
    from llmsim.measure.validate import load_measurements

    rows = load_measurements(sorted(MEASUREMENTS_DIR.glob("tier4*.csv")))
    trainer = (rows["recipe"] == "hf-trainer").sum()
    assert f"{len(rows)} single-GPU runs, {trainer} of them HF Trainer jobs" in GPU_VALIDATION
    assert set(rows["gpu"]) == {"h200"} and "one H200" in GPU_VALIDATION


def test_gpus_lists_every_profile(capsys):
    from llmsim.inputs.gpus import gpu_names

    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in gpu_names()) and "NVIDIA H100 80GB HBM3" in out
