"""ZeRO-3's optimizer swapped to NVMe (`offload_optimizer: {"device": "nvme"}`, ZeRO-Infinity's swapper), modelled in
llmsim/sim/strategies/zero3.py and measured through deepspeed.initialize with the files really written
(experiments/measure_offload.py, data/measurements/tier2_offload_cpu.csv)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from llmsim.app.cli import main
from llmsim.enums import Attention, Category
from llmsim.inputs.dsconfig import ds_setup
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy

OFFLOAD_CSV = MEASUREMENTS_DIR / "tier2_offload_cpu.csv"
BIG = (128, 3, 4099, 4)  # 1,108,864 trainable parameters: a partition over 1 MiB at 1 and 2 ranks
MIB = 1 << 20


def _config(bf16: bool = False, **zero) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_force_ds_cpu_optimizer": False,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 300_000,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}, **zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _inputs(config: dict, world: int = 2, shape=BIG, **fields):
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", *shape))
    deepspeed = ds_setup(config, world, shape[0], None, None, fields.get("grad_accum"))
    setup = TrainSetup(2, 64, deepspeed.precision, Attention.SDPA, False, **fields)
    return spec, setup, Layout(Strategy.DEEPSPEED, world, deepspeed=deepspeed)


def _frame(config: dict, world: int = 2, **fields) -> pd.DataFrame:
    """Rank 0's timeline, device and host (the prediction keeps the host's apart)."""
    from llmsim.sim.pipeline import checked
    from llmsim.sim.strategies import zero3
    from llmsim.sim.traced import expanded

    spec, setup, layout = _inputs(config, world, **fields)
    setup = checked(spec, setup, layout, None)
    return zero3.plan(expanded(spec, setup)[0], layout, setup)[0]


def _host(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["category"] == Category.HOST_OFFLOAD.value]


def test_committed_rows_cover_the_swapper():
    rows = pd.read_csv(OFFLOAD_CSV)
    configs = [json.loads(c) for c in rows["ds_config"]]
    swapped = rows[[c["zero_optimization"]["stage"] == 3
                    and (c["zero_optimization"].get("offload_optimizer") or {}).get("device") == "nvme"
                    for c in configs]]
    configs = [json.loads(c) for c in swapped["ds_config"]]
    zero = [c["zero_optimization"] for c in configs]
    assert len(swapped) >= 20 and set(swapped["world_size"]) >= {1, 2, 3, 4}
    assert {bool(c.get("bf16", {}).get("enabled")) for c in configs} == {True, False}
    assert any("optimizer" in c for c in configs) and any("aio" in c for c in configs)  # CPU Adam; aio section
    assert any(z.get("offload_param") for z in zero) and any(z.get("sub_group_size") for z in zero)
    assert {z["offload_optimizer"].get("buffer_count", 4) for z in zero} >= {4, 5, 6}
    assert (swapped["grad_accum"] > 1).any() and (swapped["lora_rank"] > 0).any() and swapped["grad_ckpt"].any()


def test_the_pool_replaces_the_master_and_states_in_host_memory():
    """One sub-group over 1 MiB: the host holds `buffer_count` buffers of its partition rounded up to 256 elements
    from the build on, no fp32 master and, after each step, no AdamW state (step 0 makes them and the swapper
    writes and drops them)."""
    import torch
    from transformers import AutoModelForCausalLM

    frame = _frame(_config())
    cpu = _frame({**_config(), "zero_optimization": {**_config()["zero_optimization"],
                                                      "offload_optimizer": {"device": "cpu"}}})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_inputs(_config())[0].hf_config())
    partition = sum(-(-p.numel() // 2) for p in model.parameters())  # every partition, one sub-group
    pool = (partition + -partition % 256) * 4
    host, cpu_host = _host(frame), _host(cpu)
    built = host[host["phase"] == "build"]
    assert (built["delta_bytes"] == pool).sum() == 4
    # CPU offload's master and the sub-group's fp32 gradient are not made (the zero gradient, dropped, and the
    # gradient partitions' flat buffer are, under both)
    def kept(deltas):
        return (deltas == partition * 4).sum() - (deltas == -partition * 4).sum()

    assert kept(built["delta_bytes"]) == kept(cpu_host[cpu_host["phase"] == "build"]["delta_bytes"]) - 2 == 1
    made = []  # per step: the sub-group's partitions AdamW makes (step 0: the states; every step: sqrt, denom)
    for step in (0, 1, 2):
        deltas = host[(host["step"] == step) & (host["phase"] == "optimizer")]["delta_bytes"]
        made.append((deltas == partition * 4).sum())
        assert kept(deltas) == 0  # each dropped within the step
    assert made == [4, 2, 2]
    # what the host holds after the run: the pool in place of CPU offload's master, states and fp32 gradient
    assert host["delta_bytes"].sum() - cpu_host["delta_bytes"].sum() == 4 * pool - 4 * partition * 4


def test_a_partition_under_the_threshold_is_not_swapped():
    """Sub-groups of under 1 MiB (sub_group_size 100,000 at 2 ranks over a 2,000-word vocabulary) stay in host
    memory as under "cpu", yet the pool is allocated: the host holds more than CPU offload does."""
    zero = {"sub_group_size": 100_000}
    nvme, cpu = _config(**zero), _config(**zero)
    cpu["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    shape = (128, 3, 2000, 4)
    swapped = predict(*_inputs(nvme, shape=shape)).ranks[0]
    offloaded = predict(*_inputs(cpu, shape=shape)).ranks[0]
    assert swapped.peak_allocated_bytes == offloaded.peak_allocated_bytes
    assert swapped.peak_host_bytes > offloaded.peak_host_bytes


def test_too_few_swap_buffers_are_refused_where_deepspeed_fails(tmp_path, capsys):
    path = tmp_path / "ds.json"
    config = _config()
    config["zero_optimization"]["offload_optimizer"]["buffer_count"] = 3
    path.write_text(json.dumps(config))
    args = ["predict", "--model", "llama-2-7b", "--set", "hidden_size=128", "--set", "num_hidden_layers=3",
            "--set", "vocab_size=4099", "--set", "intermediate_size=344", "--set", "num_attention_heads=4",
            "--set", "num_key_value_heads=4", "--seq-len", "64", "--ds-config", str(path), "--world-size", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "buffer_count(3) < 4" in err and "valid: 4 or more" in err and len(err.splitlines()) == 1
    # no sub-group reaches the swap threshold: nothing is swapped and DeepSpeed runs with 3 buffers
    small = [{"vocab_size=4099": "vocab_size=256", "num_hidden_layers=3": "num_hidden_layers=1"}.get(a, a)
             for a in args]
    assert main(small) == 0


def test_the_files_are_the_masters_states_and_written_gradients():
    """Over 2 ranks the 4,099-word embedding and LM head have 262,336-element partitions: each is written in its
    262,144 aligned elements (the 192 left stay in memory); the one sub-group's master and two states in files of
    its partition rounded up to 256 elements. Checked against the files DeepSpeed writes by the fresh run below and
    by experiments/check_nvme_files.py (every swapper run of experiments/measure_offload.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec, setup, layout = _inputs(_config())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.hf_config())
    partition = sum(-(-p.numel() // 2) for p in model.parameters())
    expected = 3 * (partition + -partition % 256) * 4 + 2 * 262_144 * 4
    prediction = predict(spec, setup, layout)
    assert prediction.nvme_bytes == [expected, expected]
    cpu = _config()
    cpu["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert predict(*_inputs(cpu)).nvme_bytes is None


def test_the_table_says_what_is_swapped():
    from llmsim.app.report import layout_text

    from llmsim.app.report import prediction_table

    spec, setup, layout = _inputs(_config())
    assert "device nvme: sub-groups of 1 MiB or more swapped to /local_nvme through 4 pinned host buffers" in \
        layout_text(layout)
    table = prediction_table(predict(spec, setup, layout))
    assert "NVMe under /local_nvme: 11.40 MiB a rank at most, 22.81 MiB a node" in table
    spec, setup, layout = _inputs(_params_swapped(_config()))
    assert ("parameters on device nvme: partitions of 1 MiB or more written to /local_nvme at zero.Init through 5 "
            "pinned host buffers, the trainable ones read back into host memory at initialize up to max_in_cpu "
            "(1,000,000,000 elements), the others read at each fetch)") in layout_text(layout)
    table = prediction_table(predict(spec, setup, layout))
    assert "NVMe under /local_nvme: 2.00 MiB a rank at most, 4.00 MiB a node (the parameter partitions written)" in \
        table


def test_one_rank_gathers_nothing():
    """ZeRO-3 on one rank (`_no_gather_coalesced`): the forward's parameters are their partitions, no all-gather
    buffer; with parameter offload each is a device copy of its host partition."""
    config = _config()
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    frame = _frame(config, world=1)
    forward = frame[(frame["phase"] == "forward") & (frame["category"] == Category.ALLGATHER_BUFFER.value)]
    assert forward.empty
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    frame = _frame(config, world=1)
    forward = frame[(frame["phase"] == "forward") & (frame["category"] == Category.ALLGATHER_BUFFER.value)]
    assert (forward["delta_bytes"] > 0).sum() > 0


def _params_swapped(config: dict, buffer_size: int = 300_000, **param) -> dict:
    """`config` with ZeRO-3's parameters offloaded to "nvme" (the parameter swapper) and the optimizer to the CPU."""
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/local_nvme",
                                                    "buffer_size": buffer_size, **param}
    return config


def test_committed_rows_cover_the_parameter_swapper():
    rows = pd.read_csv(OFFLOAD_CSV)
    zero = [json.loads(c)["zero_optimization"] for c in rows["ds_config"]]
    swapped = rows[[(z.get("offload_param") or {}).get("device") == "nvme" for z in zero]]
    zero = [json.loads(c)["zero_optimization"] for c in swapped["ds_config"]]
    configs = [json.loads(c) for c in swapped["ds_config"]]
    assert len(swapped) >= 10 and set(swapped["world_size"]) >= {1, 2, 3}
    assert {bool(c.get("bf16", {}).get("enabled")) for c in configs} == {True, False}
    assert {z["offload_optimizer"]["device"] for z in zero} == {"cpu", "nvme"}  # beside either optimizer offload
    assert {z["offload_param"].get("pin_memory", False) for z in zero} == {True, False}
    assert any("optimizer" in c for c in configs) and (swapped["grad_accum"] > 1).any() and swapped["grad_ckpt"].any()
    assert any("max_in_cpu" in z["offload_param"] for z in zero)
    past = swapped[[z["offload_param"].get("max_in_cpu", 1e9) < 800_000 and z.get("stage3_prefetch_bucket_size") == 0
                    and not lora for z, lora in zip(zero, swapped["lora_rank"])]]  # trainable sub-groups in files
    assert len(past) >= 15 and set(past["world_size"]) >= {1, 2, 3} and past["grad_ckpt"].any()
    assert (swapped["lora_rank"] > 0).sum() >= 7  # the frozen base read through the pool's slots


def test_the_parameter_pool_is_host_memory_for_the_run():
    """Against offload_param "cpu": the swapper's pool (buffer_count x buffer_size rounded up to the I/O
    alignment, in the model's dtype) and `invalid_buffer`'s 2 bytes, on the host, from zero.Init on; the device is
    unchanged. Here the host peak is the step's, so the difference is the pool's exactly."""
    cpu = _params_swapped(_config())
    cpu["zero_optimization"]["offload_param"] = {"device": "cpu"}
    nvme = _params_swapped(_config(), buffer_size=300_000, buffer_count=3)
    (one,), (other,) = (predict(*_inputs(c), ).ranks[:1] for c in (cpu, nvme))
    pool = 3 * (300_000 + -300_000 % 256) * 4
    assert other.peak_host_bytes - one.peak_host_bytes == pool + 2
    assert other.peak_allocated_bytes == one.peak_allocated_bytes
    frame = _frame(nvme)
    build = _host(frame[frame["phase"] == "build"])
    assert build["delta_bytes"].iloc[:3].tolist() == [pool, pool, -pool]  # the torch.empty, then its locked twin


def test_the_parameter_files_are_the_partitions_over_the_threshold():
    """Each partition of 1 MiB or more in the model's dtype (here the embedding's and the LM head's, 262,336 fp32
    elements at 2 ranks), rounded up to the 256-element I/O alignment, on every rank; in bf16 they are under 1 MiB
    and nothing is written."""
    assert predict(*_inputs(_params_swapped(_config()))).nvme_bytes == [2 * 262_400 * 4] * 2
    assert predict(*_inputs(_params_swapped(_config(bf16=True)))).nvme_bytes == [0, 0]


@pytest.mark.parametrize("param,extra,needle", [
    ({"buffer_size": 100_000}, [], "offload_param.buffer_size(100,000) is under the largest partition the "
                                    "parameter swapper writes (262,336 elements)"),
    ({"max_in_cpu": 500_000}, [], 'offload_param.device "nvme" with stage3_prefetch_bucket_size(50,000,000) is not '
                                  "modelled where partitions stay in their files (the 821,568 trainable elements of "
                                  "the sub-groups past offload_param.max_in_cpu(500,000)"),
    ({}, ["--lora-rank", "8"], 'offload_param.device "nvme" with stage3_prefetch_bucket_size(50,000,000) is not '
                               "modelled where partitions stay in their files (LoRA's frozen base"),
    ({"max_in_cpu": 0, "prefetch": 0}, ["--lora-rank", "8"],
     "offload_param.max_in_cpu(0) under this rank's LoRA adapter elements is not modelled"),
])
def test_what_the_parameter_swapper_is_not_modelled_for_is_refused(tmp_path, capsys, param, extra, needle):
    path = tmp_path / "ds.json"
    param = dict(param)
    zero = {"stage3_prefetch_bucket_size": param.pop("prefetch")} if "prefetch" in param else {}
    path.write_text(json.dumps(_params_swapped(_config(**zero), **{"buffer_size": 300_000, **param})))
    args = ["predict", "--model", "llama-2-7b", "--set", "hidden_size=128", "--set", "num_hidden_layers=3",
            "--set", "vocab_size=4099", "--set", "intermediate_size=344", "--set", "num_attention_heads=4",
            "--set", "num_key_value_heads=4", "--seq-len", "64", "--ds-config", str(path), "--world-size", "2", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_lora_reads_the_frozen_base_into_the_pools_slots_and_too_few_slots_are_refused():
    """LoRA without prefetch: each frozen partition over 1 MiB is read into a slot of the pool at its fetch and keeps
    it until released (stage3_max_reuse_distance keeps a layer's weights from its forward to its backward); on this
    shape 6 at once, so DeepSpeed's 5 fail (measured: experiments/explore_param_swap_fetch.out, "Not enough buffers
    0 for swapping 1") and 6 run (run 99 of experiments/measure_offload.py)."""
    from llmsim.errors import InputError

    config = _params_swapped(_config(stage3_prefetch_bucket_size=0), buffer_size=400_000, buffer_count=5)
    with pytest.raises(InputError, match=r"buffer_count\(5\): the step holds up to 6 partitions .* valid: 6 or more"):
        predict(*_inputs(config, shape=(512, 2, 1000, 8), lora_rank=8))
    config["zero_optimization"]["offload_param"]["buffer_count"] = 6
    predicted = predict(*_inputs(config, shape=(512, 2, 1000, 8), lora_rank=8))
    assert [r.peak_host_bytes for r in predicted.ranks] == [19_206_144] * 2  # measured, run 99


@pytest.mark.parametrize("swapper", ["optimizer", "parameters"])
def test_a_fresh_swapped_run_matches_its_prediction(swapper):
    """A held-out run of each swapper in every test run (about 15 s each): the optimizer's with gradients written
    to files, remainders kept in memory, bf16, two sub-groups; the parameters' in fp32 with two partitions written
    and read back; 2 ranks; device and host peaks and the files' bytes against the prediction. It loads DeepSpeed's
    async_io op, which builds only against libaio: skipped, saying so, on a machine without it."""
    import tempfile
    from pathlib import Path

    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io op needs libaio here (apt-get install libaio-dev)")

    from llmsim.measure.runs import measure_distributed
    from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE

    with tempfile.TemporaryDirectory(prefix="llmsim-nvme-") as swap:
        if swapper == "optimizer":
            config = _config(bf16=True, sub_group_size=400_000)
            config["zero_optimization"]["offload_optimizer"]["nvme_path"] = swap
            spec, setup, layout = _inputs(config, 2, shape=(128, 2, 4500, 4))
        else:
            config = _params_swapped(_config(), buffer_count=2)
            config["zero_optimization"]["offload_param"]["nvme_path"] = swap
            spec, setup, layout = _inputs(config, 2)
        predicted = predict(spec, setup, layout)
        measured = measure_distributed(spec, setup, layout, ds_gloo_settle=True)
        files = sorted(Path(swap).rglob("*.swp"))
        written = [sum(f.stat().st_size for f in files if f.parent.name == f"rank{rank}") for rank in range(2)]
    # the swapper wrote masters, states and gradients; or the two partitions over 1 MiB, on each rank
    assert any("_gradient_" in f.name for f in files) if swapper == "optimizer" else \
        [f.name for f in files] == ["0_param.tensor.swp", "29_param.tensor.swp"] * 2
    assert written == predicted.nvme_bytes
    tolerance = PEAK_ALLOCATED_TOLERANCE[2]
    for row in measured:
        rank = predicted.ranks[row["rank"]]
        assert abs(rank.peak_allocated_bytes - row["peak_allocated_bytes"]) <= tolerance * row["peak_allocated_bytes"]
        assert rank.peak_host_bytes == row["peak_host_bytes"]


def test_sub_groups_past_max_in_cpu_stay_in_their_files():
    """max_in_cpu 0 (no prefetch): the flat host buffer is one element, the partitions stay where zero.Init left them
    (those over 1 MiB in their files), the sub-group's fp32 master is an unpinned host buffer they are read into, and
    the step writes back through `reserve_partitioned_swap_space`'s page-locked buffer, which DeepSpeed sizes from the
    largest sub-group's whole parameters (`ds_numel`), each rounded up to the 256-element I/O alignment: here every
    parameter of this shape, 1,644,288 elements, where the rank's partitions are 821,568. Measured: runs 100-108 of
    experiments/measure_offload.py, host to the byte."""
    frame = _frame(_params_swapped(_config(stage3_prefetch_bucket_size=0), max_in_cpu=0))
    host = _host(frame)
    allocated = host[host["delta_bytes"] > 0]
    reserve = (2 * 524_800 + 3 * (4 * 16_384 + 3 * 44_032 + 2 * 256) + 256) * 4
    at = allocated["delta_bytes"].tolist().index(reserve)
    kept = allocated["serial"].iloc[[at, at + 1]].tolist()  # the reserve, then the sub-group's master
    assert allocated["delta_bytes"].iloc[at + 1] == 821_568 * 4
    assert allocated["delta_bytes"].iloc[:at].tolist()[-2:] == [4, 4]  # the one-element flat buffer, the example
    assert not host[(host["delta_bytes"] < 0) & host["serial"].isin(kept)].shape[0]  # neither is freed
    within = _host(_frame(_params_swapped(_config(stage3_prefetch_bucket_size=0))))
    assert reserve not in within["delta_bytes"].tolist()  # within max_in_cpu: no write-back buffer
