"""DeepSpeed ZeRO-Offload (stages 1, 2 and 3, the optimizer on the host): the measured rows, how a CPU run tells the
host from the device, and what the prediction keeps on each side."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from llmsim.enums import Attention, Category, Precision
from llmsim.inputs.dsconfig import ds_setup
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.model.host_memory import HOST_DEVICE, HostMemory
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.model.tracker import StorageTracker
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import Layout, Strategy

OFFLOAD_CSV = MEASUREMENTS_DIR / "tier2_offload_cpu.csv"
SHAPE = (128, 3, 2000, 4)


def _config(stage: int, bf16: bool = False, pin: bool = True, **zero) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_force_ds_cpu_optimizer": False,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 300_000,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": pin}, **zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _predict(config: dict, world: int = 2, gpu=None, **fields):
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", *SHAPE))
    deepspeed = ds_setup(config, world, SHAPE[0], None, None)
    setup = TrainSetup(2, 64, deepspeed.precision, Attention.SDPA, False, **fields)
    return predict(spec, setup, Layout(Strategy.DEEPSPEED, world, deepspeed=deepspeed), gpu=gpu)


def test_committed_rows_cover_the_offload_matrix():
    rows = pd.read_csv(OFFLOAD_CSV)
    configs = [json.loads(c) for c in rows["ds_config"]]
    zero = [c["zero_optimization"] for c in configs]
    assert len(rows) >= 40
    assert {z["stage"] for z in zero} == {1, 2, 3}
    assert {bool(c.get("bf16", {}).get("enabled")) for c in configs} == {True, False}
    stage3 = rows[[z["stage"] == 3 for z in zero]]
    assert len(stage3) >= 24 and set(stage3["world_size"]) >= {2, 3, 4} and (stage3["lora_rank"] > 0).any()
    assert len({z.get("sub_group_size") for z in zero if z["stage"] == 3}) >= 2  # one and several sub-groups
    params = [bool(z.get("offload_param")) for z in zero]
    assert sum(params) >= 20 and {z["offload_param"]["pin_memory"] for z in zero if z.get("offload_param")} == {
        True, False}
    assert {z["offload_optimizer"]["pin_memory"] for z in zero if z.get("offload_optimizer")} == {True, False}
    assert {bool(z.get("overlap_comm")) for z in zero} == {True, False}
    assert {c["gradient_accumulation_steps"] for c in configs} >= {1, 2, 3}
    assert set(rows["world_size"]) >= {2, 3, 4} and (rows["lora_rank"] > 0).any() and rows["grad_ckpt"].any()
    assert (rows["peak_host_bytes"] > 0).all()  # every rank holds its optimizer on the host
    cpu_adam = [z for c, z in zip(configs, zero) if "optimizer" in c]  # DeepSpeed's CPU Adam
    assert len(cpu_adam) >= 28 and {z["stage"] for z in cpu_adam} == {1, 2, 3}
    assert any(z.get("offload_param") for z in cpu_adam) and any(z.get("sub_group_size") for z in cpu_adam)


def test_committed_trainer_rows_cover_offload_as_recipes_write_it():
    rows = pd.read_csv(MEASUREMENTS_DIR / "trainer_offload_cpu.csv")
    fields = [json.loads(a) for a in rows["training_args"]]
    assert len(rows) >= 24 and (rows["peak_host_bytes"] > 0).all()
    assert {f["deepspeed"]["zero_optimization"]["stage"] for f in fields} == {1, 2, 3}
    nvme = [f for f in fields
            if (f["deepspeed"]["zero_optimization"].get("offload_optimizer") or {}).get("device") == "nvme"]
    assert len(nvme) >= 16 and {f["deepspeed"]["zero_optimization"]["stage"] for f in nvme} == {3}  # ZeRO-Infinity
    assert {"zero_force_ds_cpu_optimizer" in f["deepspeed"] for f in nvme} == {True, False}  # CPU Adam or AdamW
    assert {f.get("optim", "adamw_torch_fused") for f in fields} == {"adamw_torch_fused", "adamw_torch"}
    assert {f.get("gradient_accumulation_steps", 1) for f in fields} == {1, 2} and rows["grad_ckpt"].any()
    assert rows["model"].nunique() == 4


def test_committed_rows_cover_parameter_offload_without_the_optimizers():
    """ZeRO-3 with offload_param and no offload_optimizer: the canonical step through deepspeed.initialize
    (measure_offload.py runs 109-114) and the Trainer (`--cases params-offload`, LoRA among them: its adapters stay
    fp32, DeepSpeed's `self.dtype` being its optimizer's first parameter's), bf16, host and device alike."""
    canonical = pd.read_csv(OFFLOAD_CSV)
    zero = [json.loads(c)["zero_optimization"] for c in canonical["ds_config"]]
    alone = canonical[[bool(z.get("offload_param")) and not z.get("offload_optimizer") for z in zero]]
    assert len(alone) >= 12 and set(alone["world_size"]) >= {1, 2, 3, 4} and (alone["lora_rank"] > 0).any()
    assert alone["grad_ckpt"].any() and (alone["grad_accum"] > 1).any() and (alone["peak_host_bytes"] > 0).all()
    trainer = pd.read_csv(MEASUREMENTS_DIR / "trainer_offload_cpu.csv")
    fields = [json.loads(a)["deepspeed"]["zero_optimization"] for a in trainer["training_args"]]
    alone = trainer[[bool(z.get("offload_param")) and not z.get("offload_optimizer") for z in fields]]
    assert len(alone) >= 18 and alone["model"].nunique() >= 3 and (alone["lora_rank"] > 0).sum() >= 6


def test_without_optimizer_offload_the_master_crosses_from_the_host():
    """offload_param alone, bf16: the fp32 master is made on the device from the host partitions
    (`flat.to(device, fp32)`, then its clone) and each step's update is copied back into them: on a GPU both copies
    cross and change the dtype, so ATen converts on the host through an fp32 host copy (blocking `copy_kernel_cuda`);
    on the CPU they convert in place. So a GPU's host side has two more fp32 transients a sub-group than the CPU's
    (at initialize and at each of the 3 steps), besides the flat buffer's pinned copy."""
    from llmsim.inputs.gpus import load_gpu
    from llmsim.sim.pipeline import checked
    from llmsim.sim.strategies import zero3
    from llmsim.sim.traced import expanded

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", *SHAPE))
    host = {}
    config = _config(3, bf16=True, pin=False, offload_param={"device": "cpu", "pin_memory": False})
    del config["zero_optimization"]["offload_optimizer"]
    for gpu in (load_gpu("h100-80gb"), None):
        layout = Layout(Strategy.DEEPSPEED, 2, deepspeed=ds_setup(config, 2, SHAPE[0], None, None))
        setup = checked(spec, TrainSetup(2, 64, Precision.BF16, Attention.SDPA, False), layout, gpu)
        timeline = zero3.plan(expanded(spec, setup)[0], layout, setup)[0]
        host[gpu is not None] = timeline.loc[timeline["category"] == Category.HOST_OFFLOAD.value, "delta_bytes"]
        assert (timeline["category"] == Category.MASTER_WEIGHTS.value).any()  # the master on the device
    staging = 552_896 * 4  # one sub-group: this rank's partitions (1,105,792 parameters over 2 ranks) in fp32
    assert (host[True] == staging).sum() == 1 + 3 and (host[False] == staging).sum() == 0
    assert (host[True] > 0).sum() == (host[False] > 0).sum() + 1 + 4


def test_committed_trainer_rows_cover_llama_factorys_configs_as_shipped():
    """The Trainer with LLaMA-Factory's ZeRO-2 (round_robin_gradients), ZeRO-2 offload (no zero_force: accelerate
    swaps in DeepSpeed's CPU Adam) and ZeRO-3 offload configs, each kept as shipped."""
    from llmsim.inputs.dsconfig import ds_setup as setup_of

    rows = pd.read_csv(MEASUREMENTS_DIR / "trainer_llamafactory_cpu.csv")
    configs = [json.loads(a)["deepspeed"] for a in rows["training_args"]]
    assert len(rows) >= 40 and rows["model"].nunique() == 4 and (rows["lora_rank"] > 0).any()
    zero = [c["zero_optimization"] for c in configs]
    assert {z["stage"] for z in zero} == {2, 3} and all(z.get("round_robin_gradients") for z in zero
                                                        if z["stage"] == 2)
    swapped = [setup_of(c, 2, 128, 2, None, 1, launcher="accelerate").replaces_client_optimizer for c in configs]
    assert sum(swapped) >= 24 and all("zero_force_ds_cpu_optimizer" not in c for c in configs)
    assert (rows["peak_host_bytes"] > 0).sum() == sum(swapped)


class _Offloading:
    """What DeepSpeed's ZeRO optimizer does with its host name (stage_1_and_2.py, `__init__`)."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.cpu_offload = True
        self.device = "cpu"
        self.master = weights.detach().clone().to(device=self.device, dtype=torch.float32)
        self.staging = torch.full(self.master.shape, 0.0, device=self.master.device)
        self.on_device = torch.zeros(3)


def _allocations(tracker: StorageTracker) -> tuple[list[int], list[int]]:
    """The bytes of each allocation of a finished tracker's timeline, (on the host, on the device), in order."""
    timeline = tracker.timeline()
    allocated = timeline[timeline["delta_bytes"] > 0]
    on_host = allocated["category"] == Category.HOST_OFFLOAD.value
    return allocated.loc[on_host, "delta_bytes"].tolist(), allocated.loc[~on_host, "delta_bytes"].tolist()


def test_a_cpu_run_holds_on_the_host_what_a_gpu_run_would():
    tracker = StorageTracker()
    with tracker:
        memory = HostMemory(tracker)
        with memory.active((_Offloading,)):
            weights = torch.ones(256)
            offloading = _Offloading(weights)
            assert offloading.master.device == HOST_DEVICE and offloading.on_device.device.type == "cpu"
            denom = offloading.master.sqrt() + 1  # AdamW on the host partition
            back = offloading.master.to("cpu")  # to the device: a copy, as on a GPU (the CPU would alias)
            assert back.data_ptr() != offloading.master.data_ptr()
            del denom, back
        tracker.finish()
    host, device = _allocations(tracker)
    # host: master, staging, sqrt, + 1; device: the weights, their clone, the zeros, the copy back
    assert host == [1024, 1024, 1024, 1024] and device == [1024, 1024, 12, 1024]


def test_a_deep_copy_stays_where_its_source_is_and_meta_is_no_crossing():
    """`copy.deepcopy` of a host tensor copies its storage without an op on host inputs: the copy is the host's (and
    its `new_empty([])`, as in the trace's stand-in, torch/_tensor.py), a device tensor's the device's; a move to the
    meta device makes nothing on either side (accelerate's `model.to("meta")`)."""
    import copy

    tracker = StorageTracker()
    with tracker:
        memory = HostMemory(tracker)
        with memory.active((_Offloading,)):
            offloading = _Offloading(torch.ones(256))
            host_copy, device_copy = copy.deepcopy(offloading.master), copy.deepcopy(offloading.on_device)
            assert memory.is_host(host_copy) and not memory.is_host(device_copy)
            assert offloading.master.to("meta").is_meta and offloading.on_device.to(torch.device("meta")).is_meta
            del host_copy, device_copy
        tracker.finish()
    host, device = _allocations(tracker)
    # host: master, staging, its copy and the copy's 0-d start; device: weights, clone, zeros, copy and its 0-d start
    assert host == [1024, 1024, 1024, 4] and device == [1024, 1024, 12, 12, 4]


def test_offload_moves_the_optimizer_to_the_host():
    for stage in (1, 2):
        kept = _predict({**_config(stage), "zero_optimization": {"stage": stage, "reduce_bucket_size": 300_000}})
        offloaded = _predict(_config(stage))
        assert kept.peak_host_bytes == 0 < offloaded.peak_host_bytes
        assert offloaded.peak_allocated_bytes < kept.peak_allocated_bytes
        # master partition, its gradient, the staging copy, AdamW's two states and its sqrt/denom temporaries (P fp32
        # each), and the largest parameter's unused host buffer; P = ceil(N / 4) * 4 / 2
        numel = 2 * 2000 * 128 + 3 * (4 * 128 * 128 + 3 * 128 * 344 + 2 * 128) + 128  # embedding, head, layers
        partition = -(-numel // 4) * 4 // 2
        # + three 0-d fp32 norms: the last step's global norm, and this step's two
        assert offloaded.peak_host_bytes == 7 * 4 * partition + 2000 * 128 * 4 + 3 * 4
        assert offloaded.host_per_node_bytes(8) == 2 * offloaded.peak_host_bytes
        assert offloaded.host_per_node_bytes(1) == offloaded.peak_host_bytes


def test_zero3_offload_keeps_master_gradients_and_states_on_the_host():
    numel = 2 * 2000 * 128 + 3 * (4 * 128 * 128 + 3 * 128 * 344 + 2 * 128) + 128
    partition = numel // 2  # every parameter's numel is even: no padding on 2 ranks
    for bf16 in (False, True):
        config = _config(3, bf16=bf16)
        kept = _predict({**config, "zero_optimization": {"stage": 3, "reduce_bucket_size": 300_000}})
        offloaded = _predict(config)
        assert kept.peak_host_bytes == 0 < offloaded.peak_host_bytes
        assert offloaded.peak_allocated_bytes < kept.peak_allocated_bytes
        # the fp32 master and its fp32 gradient, the gradient partitions (in the model's dtype), AdamW's two states
        # and its sqrt/denom temporaries; + the inf/nan tracker (1 B) and four 0-d fp32 norms (the sub-group's, their
        # combination, this step's global norm and the last step's, which the engine still holds)
        elem = 2 if bf16 else 4
        assert offloaded.peak_host_bytes == (2 * 4 + elem + 4 * 4) * partition + 1 + 4 * 4
        # offload_param: the partitions themselves on the host too, the device without them
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        params = _predict(config)
        assert params.peak_host_bytes == offloaded.peak_host_bytes + elem * partition
        assert params.peak_allocated_bytes < offloaded.peak_allocated_bytes


def test_deepspeeds_cpu_adam_steps_in_place_on_the_host():
    """DeepSpeedCPUAdam (an "optimizer" section with the optimizer offloaded) keeps AdamW's two fp32 states on the
    host and steps in compiled code, in place, as torch's fused AdamW does: no sqrt/denom temporaries. Against the
    client AdamW on the for-loop path each rank's host peak is 2 x 4 B per partition element lower (stages 1 and 2,
    where the step makes the host peak); against the fused client it is lower by the fused path's 0-d `step`
    alone, which torch keeps beside the host partition and CPU Adam keeps as a Python int."""
    numel = 2 * 2000 * 128 + 3 * (4 * 128 * 128 + 3 * 128 * 344 + 2 * 128) + 128
    section = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    for stage, partition in ((1, -(-numel // 4) * 4 // 2), (2, -(-numel // 4) * 4 // 2), (3, numel // 2)):
        for bf16 in (False, True):
            client = _config(stage, bf16=bf16)
            adam = {key: value for key, value in client.items() if key != "zero_force_ds_cpu_optimizer"}
            cpu_adam, fused = _predict({**adam, **section}), _predict(client, fused=True)
            assert cpu_adam.peak_host_bytes == fused.peak_host_bytes - 4
            assert [r.peak_allocated_bytes for r in cpu_adam.ranks] == [r.peak_allocated_bytes for r in fused.ranks]
            if stage < 3:
                assert cpu_adam.peak_host_bytes == _predict(client).peak_host_bytes - 2 * 4 * partition


def test_a_client_optimizer_offloaded_without_zero_force_is_refused_unless_accelerate_swaps_it():
    """deepspeed.initialize refuses a client optimizer with the optimizer offloaded unless
    "zero_force_ds_cpu_optimizer" is false; accelerate (the HF Trainer) swaps in DeepSpeedCPUAdam instead."""
    from llmsim.errors import InputError

    config = {key: value for key, value in _config(2).items() if key != "zero_force_ds_cpu_optimizer"}
    with pytest.raises(InputError, match="zero_force_ds_cpu_optimizer"):
        ds_setup(config, 2, SHAPE[0], None, None)
    swapped = ds_setup(config, 2, SHAPE[0], None, None, launcher="accelerate")
    assert swapped.optimizer_kind == "cpu_adam" and swapped.replaces_client_optimizer
    kept = ds_setup({**config, "zero_force_ds_cpu_optimizer": False}, 2, SHAPE[0], None, None, launcher="accelerate")
    assert kept.optimizer_kind == "client" and not kept.replaces_client_optimizer


def test_zero3_on_a_gpu_defragments_through_the_host_and_pins_copies():
    """On a GPU `defragment` stages the partitions in a host buffer and frees them before the flat device buffer
    is made (the CPU's host buffer is the flat buffer); with pin_memory each offload buffer is a pinned copy of a
    pageable one."""
    from llmsim.inputs.gpus import load_gpu
    from llmsim.sim.pipeline import checked
    from llmsim.sim.strategies import zero3
    from llmsim.sim.traced import expanded

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", *SHAPE))
    flat = (2 * 2000 * 128 + 3 * (4 * 128 * 128 + 3 * 128 * 344 + 2 * 128) + 128) // 2 * 2  # bf16 partitions
    host = {}
    for offload, pin, gpu in ((False, False, True), (False, False, False), (True, True, True), (True, False, True),
                              (True, True, False)):
        config = _config(3, bf16=True, pin=pin)
        if not offload:
            config["zero_optimization"].pop("offload_optimizer")
        deepspeed = ds_setup(config, 2, SHAPE[0], None, None)
        layout = Layout(Strategy.DEEPSPEED, 2, deepspeed=deepspeed)
        gpu_profile = load_gpu("h100-80gb") if gpu else None
        setup = checked(spec, TrainSetup(2, 64, Precision.BF16, Attention.SDPA, False), layout, gpu_profile)
        timeline = zero3.plan(expanded(spec, setup)[0], layout, setup)[0]
        host[offload, pin, gpu] = timeline.loc[timeline["category"] == Category.HOST_OFFLOAD.value, "delta_bytes"]
    assert host[False, False, True].tolist() == [flat, -flat] and host[False, False, False].empty
    pinned, pageable, cpu = host[True, True, True], host[True, False, True], host[True, True, False]
    # the sub-group's fp32 gradient and the gradient partitions are pinned copies (the master is never pinned);
    # on a GPU only: defragment's staging, the master's bf16 staging and that of each update copied back (one
    # sub-group, three steps)
    assert (pinned > 0).sum() == (pageable > 0).sum() + 2 and (pageable > 0).sum() == (cpu > 0).sum() + 1 + 1 + 3
    assert pinned.sum() == pageable.sum() and pinned.cumsum().max() == pageable.cumsum().max()


def test_with_parameter_offload_the_step_copies_host_to_host():
    """With offload_param the bf16 partitions live on the host (`param_groups_fp16_flat_cpu_memory`): the step's
    copy of each updated fp32 master into them converts in place, as on the CPU, with no bf16 host staging (which a
    copy across to the device makes: ATen's `copy_kernel_cuda`). A GPU's host side differs from the CPU's by the
    flat buffer's pinned copy only (accelerator.pin_memory, whatever pin_memory says)."""
    from llmsim.inputs.gpus import load_gpu
    from llmsim.sim.pipeline import checked
    from llmsim.sim.strategies import zero3
    from llmsim.sim.traced import expanded

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", *SHAPE))
    host = {}
    for gpu in (load_gpu("h100-80gb"), None):
        config = _config(3, bf16=True, pin=False, offload_param={"device": "cpu", "pin_memory": False})
        layout = Layout(Strategy.DEEPSPEED, 2, deepspeed=ds_setup(config, 2, SHAPE[0], None, None))
        setup = checked(spec, TrainSetup(2, 64, Precision.BF16, Attention.SDPA, False), layout, gpu)
        timeline = zero3.plan(expanded(spec, setup)[0], layout, setup)[0]
        host[gpu is not None] = timeline.loc[timeline["category"] == Category.HOST_OFFLOAD.value, "delta_bytes"]
    assert (host[True] > 0).sum() == (host[False] > 0).sum() + 1


def test_pinned_buffers_are_copies_on_a_gpu_only():
    from llmsim.inputs.gpus import load_gpu
    from llmsim.sim.pipeline import checked
    from llmsim.sim.strategies.zero12 import walk_rank
    from llmsim.sim.traced import expanded

    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", *SHAPE))
    host = {}
    for pin in (True, False):
        for gpu in (load_gpu("h100-80gb"), None):
            deepspeed = ds_setup(_config(2, bf16=True, pin=pin), 2, SHAPE[0], None, None)
            layout = Layout(Strategy.DEEPSPEED, 2, deepspeed=deepspeed)
            setup = checked(spec, TrainSetup(2, 64, Precision.BF16, Attention.SDPA, False), layout, gpu)
            timeline = walk_rank(expanded(spec, setup)[0], layout, setup, 0)
            host[pin, gpu is not None] = timeline.loc[timeline["category"] == Category.HOST_OFFLOAD.value,
                                                      "delta_bytes"]
    assert host[True, False].tolist() == host[False, False].tolist()  # the CPU accelerator pins nothing
    pinned, pageable = host[True, True], host[False, True]
    assert (pinned > 0).sum() == (pageable > 0).sum() + 4  # master, staging, unused buffer, gradient: copied
    assert pinned.sum() == pageable.sum() and pinned.cumsum().max() == pageable.cumsum().max()


@pytest.mark.slow
@pytest.mark.parametrize("zero", [
    {"stage": 2, "overlap_comm": True},
    {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}, "sub_group_size": 20_000},
])
def test_fresh_offload_run_matches_prediction(zero):
    from llmsim.measure.runs import measure_distributed
    from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE

    spec = load_model_spec("gpt2", shrink("gpt2", 96, 3, 900, 4))
    deepspeed = ds_setup(_config(bf16=True, **zero), 2, 96, None, None, 2)
    setup = TrainSetup(2, 48, Precision.BF16, Attention.SDPA, True, grad_accum=2)
    layout = Layout(Strategy.DEEPSPEED, 2, deepspeed=deepspeed)
    measured = measure_distributed(spec, setup, layout, ds_gloo_settle=True)
    predicted = predict(spec, setup, layout)
    tolerance = PEAK_ALLOCATED_TOLERANCE[2]
    for row in measured:
        rank = predicted.ranks[row["rank"]]
        assert abs(rank.peak_allocated_bytes - row["peak_allocated_bytes"]) <= tolerance * row["peak_allocated_bytes"]
        assert abs(rank.peak_host_bytes - row["peak_host_bytes"]) <= tolerance * row["peak_host_bytes"]


def test_the_table_says_what_is_offloaded():
    from llmsim.app.report import layout_text

    for zero, words in (({"stage": 2}, "ZeRO-2, optimizer offloaded to the CPU"),
                        ({"stage": 3, "offload_param": {"device": "cpu"}},
                         "ZeRO-3, optimizer and parameters offloaded to the CPU")):
        config = _config(**zero)
        config["zero_optimization"].update(zero)
        layout = Layout(Strategy.DEEPSPEED, 2, deepspeed=ds_setup(config, 2, SHAPE[0], None, None))
        assert words in layout_text(layout)
