"""An 8-bit (LLM.int8) base under LoRA (`--quant int8`, llmsim/model/quantized.py): rows, read-back, the threshold."""
from __future__ import annotations

import pandas as pd

from llmsim.enums import Precision
from llmsim.measure.runs import MEASUREMENTS_DIR, measure_single
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import LLM_INT8_THRESHOLD, TrainSetup, load_model_spec
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE
from llmsim.measure.validate import row_inputs
from llmsim.inputs.zoo import shrink

INT8_CSV = MEASUREMENTS_DIR / "tier1_int8_cpu.csv"
SETUP_COLUMNS = ["model", "overrides", "micro_batch", "seq_len", "precision", "grad_ckpt", "lora_rank"]


def test_int8_rows_read_back_with_their_threshold():
    rows = pd.read_csv(INT8_CSV)
    assert set(rows["quant"]) == {"int8"} and set(rows["int8_threshold"]) == {0.0, LLM_INT8_THRESHOLD}
    assert set(rows["precision"]) == {"fp32", "bf16-autocast"} and set(rows["grad_ckpt"]) == {True, False}
    assert rows["model"].nunique() >= 8
    for _, row in rows.iterrows():
        _, setup, _ = row_inputs(row)
        assert setup.quant == "int8" and setup.int8_threshold == row["int8_threshold"]
    older = pd.read_csv(MEASUREMENTS_DIR / "tier1_cpu.csv").iloc[0]  # written before the column existed
    assert "int8_threshold" not in older.index and row_inputs(older)[1].int8_threshold == LLM_INT8_THRESHOLD


def test_measured_runs_differing_by_the_threshold_alone_are_equal():
    """A CPU training step runs MatMul8bitFp, which never reads llm_int8_threshold: same bytes for 0 and 6."""
    rows = pd.read_csv(INT8_CSV)
    pairs = rows.groupby(SETUP_COLUMNS).filter(lambda g: g["int8_threshold"].nunique() == 2)
    assert len(pairs) >= 2
    assert pairs.groupby(SETUP_COLUMNS)["peak_allocated_bytes"].nunique().eq(1).all()


def test_fresh_int8_run_matches_prediction():
    """A size and setup in no committed row, measured now (about 10 s)."""
    spec = load_model_spec("mistral-7b", shrink("mistral-7b", 96, 5, 900, 4))
    setup = TrainSetup(2, 48, Precision.BF16_AUTOCAST, grad_ckpt=True, lora_rank=4, quant="int8",
                       int8_threshold=0.0)
    measured = measure_single(spec, setup)["peak_allocated_bytes"]
    predicted = predict(spec, setup).peak_allocated_bytes
    assert abs(predicted - measured) / measured <= PEAK_ALLOCATED_TOLERANCE[1]
