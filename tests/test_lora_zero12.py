"""LoRA under DeepSpeed ZeRO-1/2: hand-computed bytes on a tiny model, and the measured rows' coverage."""
import json

import pandas as pd
import pytest

from llmsim.inputs.dsconfig import DeepSpeedSetup
from llmsim.enums import Category, Phase, Precision
from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.sim.strategies import Layout, Strategy
from llmsim.inputs.zoo import shrink

LORA_ZERO12_CSV = MEASUREMENTS_DIR / "tier2_lora_zero12_cpu.csv"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision,elem", [(Precision.FP32, 4), (Precision.BF16, 2)])
def test_only_the_adapters_are_flattened_and_partitioned(stage, precision, elem):
    """Llama, hidden 64, 2 layers, r=4 on q_proj and v_proj (peft's default): 2 layers x 2 modules x (A 4x64 +
    B 64x4) = 2,048 adapter elements, a multiple of 2 x world size: the flat buffer holds 2,048 elements (bf16
    under bf16: DeepSpeed casts the adapters too), each rank's fp32 master 1,024; the frozen base stays."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 2, 256, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": precision is Precision.BF16}}
    layout = Layout(Strategy.DEEPSPEED, 2, DeepSpeedSetup(json.dumps(config), 2))
    setup = TrainSetup(1, 8, precision, lora_rank=4)
    single = predict(spec, setup).ranks[0].timeline
    for rank in (0, 1):
        timeline = predict(spec, setup, layout).ranks[rank].timeline
        build = timeline[timeline["phase"] == Phase.BUILD.value]
        ours = build[build["module"] == "deepspeed"]
        flat = ours[(ours["category"] == Category.PARAMETER.value) & (ours["delta_bytes"] > 0)]["delta_bytes"]
        assert flat.tolist() == [2048 * elem]
        master = ours[ours["category"] == Category.MASTER_WEIGHTS.value]["delta_bytes"]
        assert master.tolist() == [1024 * 4]
        freed = -ours[(ours["category"] == Category.PARAMETER.value) & (ours["delta_bytes"] < 0)]["delta_bytes"]
        assert freed.sum() == 2048 * elem  # the adapters' own storages, not the base's
        params = build[build["category"] == Category.PARAMETER.value]["delta_bytes"].sum()
        base = single[(single["phase"] == Phase.BUILD.value) & (single["category"] == Category.PARAMETER.value)]
        base_bytes = base["delta_bytes"].sum() - 2048 * 4  # the single process's adapters are fp32
        assert params == base_bytes + 2048 * elem


def test_lora_zero12_rows_cover_the_matrix():
    """(Their errors: `llmsim validate` and the slow test of tests/test_validate.py re-predict every row.)"""
    rows = pd.read_csv(LORA_ZERO12_CSV)
    stages = rows["ds_config"].map(lambda c: json.loads(c)["zero_optimization"]["stage"])
    assert set(stages) == {1, 2} and set(rows["precision"]) == {"fp32", "bf16"}
    assert set(rows["grad_ckpt"]) == {True, False} and (rows["lora_rank"] > 0).all()
    assert {"gpt2", "qwen2.5-0.5b", "opt-125m"} <= set(rows["model"])  # tied embeddings
    assert rows["lora_targets"].notna().any() and rows["lora_targets"].isna().any()  # explicit and peft's default
    assert set(rows.groupby(["model", "measured_at"])["rank"].apply(frozenset)) == {frozenset({0, 1})}  # all ranks
