"""DeepSpeed ZeRO-0 with a DeepSpeed "optimizer" section, and LoRA with ZeRO-0 (and ZeRO-1/2 with that section):
hand-computed bytes on a tiny model, and the measured rows' coverage (data/measurements/tier2_zero0_dsopt_cpu.csv)."""
import json

import pytest

from llmsim.inputs.dsconfig import DeepSpeedSetup
from llmsim.enums import Category, Phase, Precision
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.sim.strategies.events import live_sizes_at_end_of_build
from llmsim.measure.validate import load_measurements, row_inputs, validate
from llmsim.inputs.zoo import shrink

ZERO0_DSOPT_CSV = MEASUREMENTS_DIR / "tier2_zero0_dsopt_cpu.csv"
FUSED = {"type": "AdamW", "params": {"lr": 1e-4}}
TORCH = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}


def _tiny():
    return load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 256, 4))


def _layout(precision: Precision, optimizer: dict | None, stage: int = 0) -> Layout:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": precision is Precision.BF16}}
    if optimizer is not None:
        config["optimizer"] = optimizer
    return Layout(Strategy.DEEPSPEED, 2, DeepSpeedSetup(json.dumps(config), 2))


def _ours(timeline, phase: Phase, step: int = 0):
    rows = timeline[(timeline["phase"] == phase.value) & (timeline["step"] == step)]
    return rows[rows["module"] == "deepspeed"]


def _deltas(rows, category: Category, sign: int) -> list[int]:
    return [int(d) for d in rows[rows["category"] == category.value]["delta_bytes"] if d * sign > 0]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_fused_adam_in_bf16_is_flattened_by_fp16_optimizer(lora_rank):
    """bf16 + FusedAdam: FP16_Optimizer moves the trainable parameters into one flat bf16 buffer (their own
    storages freed), keeps one flat fp32 master and FusedAdam's two flat states (plus its 4-byte overflow buffer);
    each step flattens the fp32 upcasts of the gradients into one flat fp32 gradient. With LoRA (r=4 on q_proj and
    v_proj: 2 layers x 2 modules x (4x64 + 64x4) = 2,048 elements) the adapters alone; the frozen base stays."""
    spec, setup = _tiny(), TrainSetup(1, 8, Precision.BF16, lora_rank=lora_rank)
    timeline = predict(spec, setup, _layout(Precision.BF16, FUSED)).ranks[0].timeline
    single = predict(spec, setup).ranks[0].timeline
    trainable = 2048 if lora_rank else sum(live_sizes_at_end_of_build(single, Category.PARAMETER)) // 2
    build = _ours(timeline, Phase.BUILD)
    assert _deltas(build, Category.PARAMETER, 1) == [trainable * 2]
    assert -sum(_deltas(build, Category.PARAMETER, -1)) == trainable * 2
    assert _deltas(build, Category.MASTER_WEIGHTS, 1) == [trainable * 4]
    assert _deltas(build, Category.OPTIMIZER_STATE, 1) == [4, trainable * 4, trainable * 4]
    for step in range(setup.steps):
        optimizer = _ours(timeline, Phase.OPTIMIZER, step)
        assert _deltas(optimizer, Category.GRADIENT, 1) == [trainable * 4]  # the flat fp32 gradient
        assert sum(_deltas(optimizer, Category.TEMPORARY, 1)) == trainable * 4  # the upcasts
        assert optimizer["delta_bytes"].sum() == -trainable * 2  # the bf16 gradients dropped, nothing else left


def test_fused_adam_in_fp32_steps_in_place():
    """fp32 + FusedAdam: the optimizer as it is; `exp_avg` and `exp_avg_sq` per parameter at the first step, no
    `step` tensor and no temporaries (torch's AdamW makes `sqrt`/`denom` per parameter), then engine.zero_grad."""
    spec, setup = _tiny(), TrainSetup(1, 8, Precision.FP32)
    timeline = predict(spec, setup, _layout(Precision.FP32, FUSED)).ranks[0].timeline
    sizes = live_sizes_at_end_of_build(predict(spec, setup).ranks[0].timeline, Category.PARAMETER)
    first = timeline[(timeline["phase"] == Phase.OPTIMIZER.value) & (timeline["step"] == 0)]
    assert _deltas(first, Category.OPTIMIZER_STATE, 1) == [n for n in sizes for _ in range(2)]
    assert not _deltas(first, Category.TEMPORARY, 1)
    assert -sum(_deltas(first, Category.GRADIENT, -1)) == sum(sizes)


def test_lora_zero0_reduces_the_adapters_alone():
    """The end-of-backward all-reduce copies the trainable gradients only: the 2,048 adapter elements."""
    spec, setup = _tiny(), TrainSetup(1, 8, Precision.FP32, lora_rank=4)
    timeline = predict(spec, setup, _layout(Precision.FP32, None)).ranks[0].timeline
    assert _deltas(_ours(timeline, Phase.BACKWARD), Category.TEMPORARY, 1) == [2048 * 4]


def test_rows_cover_every_lifted_case_and_read_back():
    rows = load_measurements([ZERO0_DSOPT_CSV])
    cases = set()
    for _, row in rows.iterrows():
        _, setup, layout = row_inputs(row)
        cases.add((layout.deepspeed.stage, layout.deepspeed.optimizer_kind, setup.precision.value,
                   bool(setup.lora_rank)))
    for kind in ("fused", "torch"):
        for precision in ("fp32", "bf16"):
            assert (0, kind, precision, False) in cases
    for precision in ("fp32", "bf16"):
        assert (0, "client", precision, True) in cases
        assert (0, "fused", precision, True) in cases
    assert {(s, k) for s, k, _, lora in cases if lora and s in (1, 2)} >= {(1, "fused"), (2, "fused"), (2, "torch")}


def test_fp16_optimizer_rows_are_within_tolerance():
    """The rows whose peak is FP16_Optimizer's flat step (bf16 + FusedAdam at stage 0), rank 0."""
    rows = load_measurements([ZERO0_DSOPT_CSV])
    flat = [i for i, row in rows.iterrows() if row["rank"] == 0 and row["precision"] == "bf16"
            and row_inputs(row)[2].deepspeed.stage == 0 and row_inputs(row)[2].deepspeed.optimizer_kind == "fused"]
    assert len(flat) >= 3
    assert validate(rows.loc[flat])["ok"].all()
