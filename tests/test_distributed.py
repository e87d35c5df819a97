"""Tier (c): layouts with several ranks. Committed tier-2 rows are checked in test_validate.py; here:
the DeepSpeed config contract, and fresh real multi-process runs (torchrun, gloo) against predictions."""
import json

import pytest

from llmsim.app.cli import main
from llmsim.inputs.dsconfig import load_ds_config
from llmsim.enums import Precision
from llmsim.measure.runs import measure_distributed
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.inputs.zoo import shrink

TINY = ["--model", "llama-2-7b", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
        "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
        "--set", "vocab_size=256", "--seq-len", "16"]


def _write(tmp_path, config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


BAD = [
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 4}}, [], "stage"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "bucket": 5}}, [], "bucket"),
    ("{not json", [], "cannot read"),
    ({"train_micro_batch_size_per_gpu": 2}, ["--micro-batch", "3"], "contradicts"),
    ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 5}, [], "train_batch_size(5)"),
    ({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}}, [], "fp16"),
    ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}, ["--precision", "fp32"], "contradicts"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}, ["--world-size", "0"], "world-size"),
    ({"zero_optimization": {"stage": 2}}, [], "give --micro-batch"),
    ({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2}}, [],
     "'Lamb' is not modelled"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     [], "offload_optimizer with stage 0 is not modelled yet"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     [], "offload_optimizer.device"),  # DeepSpeed's own validation names the valid devices
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     [], 'device "nvme" needs "nvme_path"'),
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pipeline_read": True}}}, [],
     "offload_optimizer.pipeline_read (the pipelined swapper"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "aio": {"use_gds": True},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}}, [],
     "aio: GDS currently only supported for CUDA"),  # DeepSpeed's own assert, on the CPU llmsim runs on
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "aio": {"block_size": 0},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}}, [],
     "aio.block_size(0) must be a positive integer"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}}, [],
     '"zero_force_ds_cpu_optimizer": false'),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {  # ZeRO-2's nvme is DeepSpeed's cpu offload
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}}, [],
     '"zero_force_ds_cpu_optimizer": false'),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     [], '"zero_force_ds_cpu_optimizer": false'),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
      "optimizer": {"type": "AdamW"}}, ["--optimizer", "sgd"], "optimizer sgd is a client optimizer"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
      "optimizer": {"type": "AdamW"}}, ["--fused"], "--fused sets the client torch.optim.AdamW"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     [], "offload_param without offload_optimizer in fp32 is not modelled yet"),
    ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
     [], 'offload_param.device "nvme" without offload_optimizer is not modelled yet'),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     [], "offload_param is ZeRO-3's"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme", "max_in_cpu": 1000}}},
     ["--lora-rank", "8"], "offload_param.max_in_cpu(1,000) under this rank's LoRA adapter elements is not modelled"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}},
     [], 'offload_param: device "nvme" needs "nvme_path"'),
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
     [], "offload_param is ZeRO-3's"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "aio": {"intra_op_parallelism": 0},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                            "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}, [],
     "aio.intra_op_parallelism(0) must be a positive integer"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, [], "offload_optimizer.ratio 0.3"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "parameter_alignment": True}}, [],
     "parameter_alignment"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
      "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}, ["--optimizer", "sgd"],
     "offload_optimizer with optimizer sgd"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
      "zero_force_ds_cpu_optimizer": False}, ["--foreach"], "offload_optimizer with --foreach"),
    ({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "legacy_fusion": True},
      "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}, [], "legacy_fusion"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3},
      "optimizer": {"type": "AdamW"}}, [], 'grad-accum(4) with DeepSpeed ZeRO-3 and a DeepSpeed "optimizer" section'),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}},
     ["--grad-accum", "2"], "--grad-accum(2) contradicts the DeepSpeed config's gradient_accumulation_steps(4)"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 0, "zero_optimization": {"stage": 2}}, [],
     "gradient_accumulation_steps(0) must be a positive integer"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}, ["--grad-accum", "0"],
     "grad-accum must be a positive integer"),
]


@pytest.mark.parametrize("config,extra,needle", BAD, ids=[b[2] for b in BAD])
def test_bad_deepspeed_config_is_one_line_and_status_2(tmp_path, config, extra, needle, capsys):
    argv = ["predict", *TINY, "--ds-config", _write(tmp_path, config), *extra]
    if "--world-size" not in extra:
        argv += ["--world-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


# Settings DeepSpeed acts on that change what a rank holds and llmsim does not model (dsconfig._FEATURES): each is
# refused, naming the key and what is modelled, rather than predicted as if it were not there
_ZERO1_BF16 = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
FEATURES = [
    ({"tensor_parallel": {"autotp_size": 2, "keep_module_on_host": True}}, "keep_module_on_host(true)"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "expert_parallel.enabled(true) (AutoEP"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size(2) (Ulysses"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "zero_hpz_partition_size(8) (ZeRO++ hpZ"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights(true)"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "zero_quantized_gradients(true)"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow("),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}},
      "optimizer": {"type": "AdamW"}}, "super_offload(true) (SuperOffload"),
    ({"zero_optimization": {"stage": 3, "memory_efficient_linear": False}}, "memory_efficient_linear(false)"),
    ({"zero_optimization": {"stage": 3, "use_all_reduce_for_fetch_params": True}}, "use_all_reduce_for_fetch_params"),
    ({"zero_optimization": {"stage": 3, "module_granularity_threshold": 1000}}, "module_granularity_threshold(1000)"),
    ({"zero_optimization": {"stage": 1, "legacy_stage1": True}}, "legacy_stage1(true)"),
    ({"disable_allgather": True}, "disable_allgather(true)"),
    # ZeRO's tuning keys that take another code path than the plans walk
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}}, "reduce_scatter(false) (gradients all-reduced"),
    ({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, "reduce_scatter(false)"),
    ({"zero_optimization": {"stage": 1, "use_multi_rank_bucket_allreduce": False}},
     "use_multi_rank_bucket_allreduce(false)"),
    ({"zero_optimization": {"stage": 2, "parameter_alignment": True}}, "parameter_alignment (ZeRO-1/2 padding"),
    ({"gradient_clipping": 0.0, "zero_optimization": {"stage": 2, "compute_grad_norm": False}},
     "compute_grad_norm(false)"),
    ({"zero_optimization": {"stage": 3, "stage3_allgather_sequential": True}}, "stage3_allgather_sequential(true)"),
    ({"zero_optimization": {"stage": 3, "enable_sanity_checks": True}}, "enable_sanity_checks(true)"),
    ({"zero_optimization": {"stage": 3, "override_module_apply": False}}, "override_module_apply(false)"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16_master_weights_and_grads(true)"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "immediate_grad_update(true)"),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, 'grad_accum_dtype("fp32") (gradients accumulated in a dtype'),
    ({"communication_data_type": "fp32"}, 'communication_data_type("fp32")'),
    ({"data_types": {"buffer_dtype": "fp32"}}, 'buffer_dtype("fp32")'),
    ({"data_types": {"keep_in_fp32_modules": ["rotary"]}}, 'keep_in_fp32_modules(["rotary"])'),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled(true)"),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile(true) (DeepCompile)"),
    ({"data_efficiency": {"enabled": True}}, "data_efficiency.enabled(true)"),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled(true)"),
    ({"weight_quantization": {"quantized_initialization": {}}}, "weight_quantization("),
    # what DeepSpeed's own parse refuses, in its words
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16_optimizer_states requires "
                                                                  "bf16_master_weights_and_grads"),
    ({"amp": {"enabled": True}}, "Apex AMP integration has been removed"),
    ({"elasticity": {"enabled": True}}, "Elastic training has been removed"),
]


@pytest.mark.parametrize("changes,needle", FEATURES, ids=[f[1][:40] for f in FEATURES])
def test_a_deepspeed_feature_not_modelled_is_refused_by_name(tmp_path, changes, needle, capsys):
    config = {**_ZERO1_BF16, **changes}
    assert main(["predict", *TINY, "--ds-config", _write(tmp_path, config), "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert "not modelled yet; modelled: " in err or "DeepSpeed config: " in err


def test_a_feature_set_to_what_deepspeed_does_anyway_is_taken(tmp_path):
    """A dtype equal to the model's, AutoTP of 1, ZeRO-3's linear setting under ZeRO-2: DeepSpeed runs as without
    them, and so does the prediction."""
    plain = load_ds_config(_write(tmp_path, _ZERO1_BF16), 4, 64, None, None)
    assert plain.stage == 1
    for changes in ({"data_types": {"grad_accum_dtype": "bf16"}}, {"communication_data_type": "bf16"},
                    {"tensor_parallel": {"autotp_size": 1}}, {"sequence_parallel_size": 1},
                    {"zero_optimization": {"stage": 1, "memory_efficient_linear": False}},
                    {"data_types": {"keep_in_fp32_modules": "auto"}},
                    # DeepSpeed 0.19.8 reads allgather_partitions nowhere (engine.zero_allgather_partitions has no
                    # caller), and ZeRO-1/2 gather each partition in one all_gather_into_tensor whatever the bucket
                    {"zero_optimization": {"stage": 1, "allgather_partitions": False, "allgather_bucket_size": 1e6}},
                    # keys of other stages: ZeRO-3's under ZeRO-1, ZeRO-1/2's under ZeRO-0
                    {"zero_optimization": {"stage": 1, "stage3_allgather_sequential": True,
                                           "override_module_apply": False}},
                    {"zero_optimization": {"stage": 0, "reduce_scatter": False, "parameter_alignment": True}},
                    # checkpoint loading and logging only
                    {"zero_optimization": {"stage": 1, "elastic_checkpoint": True, "load_from_fp32_weights": False,
                                           "log_trace_cache_warnings": True}}):
        assert load_ds_config(_write(tmp_path, {**_ZERO1_BF16, **changes}), 4, 64, None, None).stage in (0, 1), changes
    fp32 = {**_ZERO1_BF16, "bf16": {"enabled": False}, "data_types": {"grad_accum_dtype": "fp32"}}
    assert load_ds_config(_write(tmp_path, fp32), 4, 64, None, None).precision is Precision.FP32


def test_auto_values_resolve_like_transformers(tmp_path):
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    ds = load_ds_config(_write(tmp_path, config), 4, 4096, 2, Precision.BF16)
    resolved = ds.config
    assert resolved["train_batch_size"] == 8 and ds.micro_batch == 2 and ds.precision is Precision.BF16
    zero = resolved["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 40960


@pytest.mark.parametrize("config,grad_accum,expected", [
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}, 3, 3),  # transformers' "auto"
    ({"train_micro_batch_size_per_gpu": 2}, 3, 3),
    ({"train_micro_batch_size_per_gpu": 2}, None, 1),
    ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 16}, None, 4),  # DeepSpeed derives it: 16 / (2 x 2)
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, None, 3),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, 3, 3),
])
def test_gradient_accumulation_steps_is_grad_accum(tmp_path, config, grad_accum, expected):
    """--grad-accum is the JSON's gradient_accumulation_steps; train_batch_size = micro-batch x it x world size."""
    ds = load_ds_config(_write(tmp_path, {**config, "zero_optimization": {"stage": 2}}), 2, 64, None, None, grad_accum)
    assert ds.gradient_accumulation_steps == expected
    assert ds.config["train_batch_size"] == ds.micro_batch * expected * 2


def test_grad_accum_and_the_json_predict_alike(tmp_path, capsys):
    """--grad-accum 2 with "auto" and gradient_accumulation_steps 2 without the flag are one setup. Under ZeRO-2 the
    second micro-step's backward holds a second grads_in_partition at its peak: on rank 0 the whole numel of every
    parameter overlapping its 57,504-element partition (embedding 16,384, layer 0's 41,088, layer 1's q_proj
    4,096), 4 bytes each."""
    peaks = []
    for config, extra in (({"gradient_accumulation_steps": "auto"}, ["--grad-accum", "2"]),
                          ({"gradient_accumulation_steps": 2}, []), ({}, [])):
        path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, **config,
                                 "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000}})
        assert main(["predict", *TINY, "--seq-len", "128", "--ds-config", path, "--world-size", "2",
                     "--format", "json", *extra]) == 0
        rank0 = json.loads(capsys.readouterr().out)["ranks"][0]
        assert rank0["peak_phase"] == "backward"
        peaks.append(rank0["peak_allocated_bytes"])
    assert peaks[0] == peaks[1] == peaks[2] + (16384 + 41088 + 4096) * 4


def test_zero12_nvme_offload_is_deepspeeds_cpu_offload(tmp_path, capsys):
    """ZeRO-1/2 take any offload_optimizer device but none as their CPU offload (stage_1_and_2.py: cpu_offload):
    "nvme" predicts what "cpu" does, device and host, and says so."""
    figures = []
    for stage in (1, 2):
        for device in ({"device": "cpu"}, {"device": "nvme", "nvme_path": "/local_nvme"}):
            path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "zero_force_ds_cpu_optimizer": False,
                                     "zero_optimization": {"stage": stage, "offload_optimizer": device}})
            assert main(["predict", *TINY, "--seq-len", "64", "--ds-config", path, "--world-size", "2",
                         "--format", "json"]) == 0
            ranks = json.loads(capsys.readouterr().out)["ranks"]
            figures.append([(r["peak_allocated_bytes"], r["peak_host_bytes"]) for r in ranks])
    assert figures[0] == figures[1] and figures[2] == figures[3] and figures[0][0][1] > 0


def test_single_strategy_needs_one_rank(capsys):
    assert main(["predict", *TINY, "--micro-batch", "1", "--strategy", "single", "--world-size", "2"]) == 2
    assert "world-size(2)" in capsys.readouterr().err


# The fresh multi-process runs are slow-marked to keep the default run inside its 15 minutes (the ZeRO-3 one, 50 s,
# last, when FSDP2's rows came); their committed rows are re-predicted there, and the default run keeps fresh
# multi-process TP and PP runs (tests/test_parallel.py)
FRESH = [
    pytest.param("gpt2", (96, 3, 800, 4), TrainSetup(2, 48, Precision.BF16, grad_ckpt=True), Strategy.DDP, None,
                 id="ddp", marks=pytest.mark.slow),
    pytest.param("qwen2.5-0.5b", (80, 3, 900, 4), TrainSetup(1, 40), Strategy.DEEPSPEED,
                 {"stage": 2, "reduce_bucket_size": 30000}, id="zero2", marks=pytest.mark.slow),
    pytest.param("llama-2-7b", (64, 3, 700, 4), TrainSetup(2, 32, Precision.BF16, grad_ckpt=True), Strategy.DEEPSPEED,
                 {"stage": 3, "reduce_bucket_size": 20000, "stage3_prefetch_bucket_size": 8000,
                  "stage3_max_live_parameters": 30000, "stage3_param_persistence_threshold": 100}, id="zero3",
                 marks=pytest.mark.slow),
]


def test_committed_deepspeed_rows_cover_the_matrix():
    """Issue 3's matrix: >= 60 rank rows over stages 0-3, 2-4 ranks, fp32 and bf16, >= 4 architectures,
    checkpointing on and off, default and small buckets, the stage-3 knobs varied."""
    from llmsim.measure.validate import load_measurements

    rows = load_measurements()
    # the canonical step's DeepSpeed rows (the Trainer's carry their JSON in the TrainingArguments, the pipeline
    # engine's are DeepSpeed's own script: their own tests)
    rows = rows[(rows["strategy"] == "deepspeed") & ~rows["recipe"].fillna("canonical").isin(["hf-trainer",
                                                                                             "deepspeed-pipe"])]
    zero = [json.loads(c)["zero_optimization"] for c in rows["ds_config"]]
    assert len(rows) >= 60
    assert {z.get("stage", 0) for z in zero} == {0, 1, 2, 3}
    assert set(rows["world_size"]) == {1, 2, 3, 4, 5} and set(rows["precision"]) == {"fp32", "bf16"}
    assert rows["model"].nunique() >= 4 and set(rows["grad_ckpt"]) == {True, False}
    assert {"reduce_bucket_size" in z for z in zero} == {True, False}
    stage3 = [z for z in zero if z.get("stage") == 3]
    for knob in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold",
                 "stage3_max_reuse_distance", "sub_group_size", "contiguous_gradients", "overlap_comm"):
        assert any(knob in z for z in stage3), knob


@pytest.mark.parametrize("model,shape,setup,strategy,zero", FRESH)
def test_fresh_multiprocess_run_matches_prediction(tmp_path, model, shape, setup, strategy, zero):
    spec = load_model_spec(model, shrink(model, *shape))
    deepspeed = None
    if zero is not None:
        config = {"train_micro_batch_size_per_gpu": setup.micro_batch, "zero_optimization": zero,
                  "bf16": {"enabled": setup.precision is Precision.BF16}}
        deepspeed = load_ds_config(_write(tmp_path, config), 2, shape[0], None, setup.precision)
    layout = Layout(strategy, 2, deepspeed)
    rows = measure_distributed(spec, setup, layout, timeout_s=600)
    prediction = predict(spec, setup, layout)
    for row in rows:
        predicted = prediction.ranks[row["rank"]].peak_allocated_bytes
        measured = row["peak_allocated_bytes"]
        assert abs(predicted - measured) / measured <= PEAK_ALLOCATED_TOLERANCE[2]


@pytest.mark.parametrize("allocator", ["compiled", "python"])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_ranks_taking_chunks_from_earlier_ranks_replay_like_alone(tmp_path, monkeypatch, stage, allocator):
    """ZeRO-1/2 ranks differ only in the events of their partition: the allocator model replays a rank's chunks of
    events that no earlier rank replayed from the same state, and takes the others' peaks from the earlier ranks
    (replay._replay_spliced); every rank's reserved peak is what its own whole replay gives."""
    from llmsim.sim import allocator as allocator_module
    from llmsim.sim import replay
    from llmsim.sim.allocator import NO_LIMIT, AllocatorConfig, replay_reserved
    from llmsim.inputs.gpus import load_gpu
    from llmsim.inputs.zoo import shrink

    if allocator == "compiled" and allocator_module._allocator is None:
        pytest.skip("llmsim.sim._allocator was not built")
    monkeypatch.setenv("LLMSIM_ALLOCATOR", allocator)
    monkeypatch.setattr(replay, "CHECKPOINT_EVERY", 256)  # chunks small enough for a 4-layer model's events
    monkeypatch.setattr(replay, "_REPLAYED", {})
    monkeypatch.setattr(replay, "_LAZY_PREDICTED", {})
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000},
              "bf16": {"enabled": True}}
    world = 12
    layout = Layout(Strategy.DEEPSPEED, world, load_ds_config(_write(tmp_path, config), world, 64, 1, Precision.BF16))
    gpu = load_gpu("h100-80gb")
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 512, 4))
    prediction = predict(spec, TrainSetup(1, 32, Precision.BF16, grad_ckpt=True), layout, gpu)
    chunks = next(iter(replay._REPLAYED.values()))
    assert len(chunks.replayed) == world and chunks.replayed[0] == chunks.count > 1  # the first replays every chunk
    assert sum(own < chunks.count for own in chunks.replayed) >= world // 2  # most take chunks from earlier ranks
    for rank in prediction.ranks:
        timeline = rank.timeline
        serials = timeline["serial"].to_numpy()  # the workspaces made first, as the spliced replay makes them
        alone = replay_reserved(serials, timeline["delta_bytes"].to_numpy(), NO_LIMIT, AllocatorConfig(),
                                replay._workspaces(serials, gpu))
        assert rank.peak_reserved_bytes == alone.peak_reserved_bytes
