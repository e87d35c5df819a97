"""Issue 5's levers under DeepSpeed ZeRO: every (lever, stage) that check_supported lets through has measured rows."""
import pandas as pd

from llmsim.measure.runs import MEASUREMENTS_DIR
from llmsim.sim.strategies import LEVER_ZERO_STAGES
from llmsim.measure.validate import load_measurements, row_inputs

LEVERS_ZERO_CSV = MEASUREMENTS_DIR / "tier2_levers_zero_cpu.csv"
ZERO_EXTRAS_CSV = MEASUREMENTS_DIR / "tier2_zero_extras_cpu.csv"  # peft's extras, ZeRO-3 offload
GA_ZERO_CSV = MEASUREMENTS_DIR / "tier2_ga_zero_cpu.csv"  # gradient accumulation


def _levers(setup) -> set[str]:
    return ({"loss"} if setup.loss.value != "hf" else set()) | ({"ckpt-offload"} if setup.ckpt_offload else set()) \
        | ({"grad-accum"} if setup.grad_accum > 1 else set()) \
        | ({"peft-extras"} if setup.lora_modules_to_save or setup.trainable_tokens else set())


def test_every_lifted_lever_and_stage_is_measured_in_fp32_and_bf16():
    rows = load_measurements([LEVERS_ZERO_CSV, ZERO_EXTRAS_CSV, GA_ZERO_CSV])
    seen: dict[tuple[str, int], set[str]] = {}
    for _, row in rows.iterrows():
        _, setup, layout = row_inputs(row)
        assert layout.deepspeed is not None and layout.world_size == 2
        if layout.deepspeed.optimizer_kind != "client":  # the runs with a DeepSpeed "optimizer" section
            continue
        for lever in _levers(setup):
            seen.setdefault((lever, layout.deepspeed.stage), set()).add(setup.precision.value)
    lifted = {(lever, stage) for lever, stages in LEVER_ZERO_STAGES.items() for stage in stages}
    assert set(seen) == lifted
    assert all(precisions == {"fp32", "bf16"} for (lever, stage), precisions in seen.items()
               if lever != "peft-extras"), seen  # peft's extras on a bf16 base only where measured so
    for csv in (LEVERS_ZERO_CSV, GA_ZERO_CSV):
        assert (pd.read_csv(csv).groupby("ds_config")["rank"].nunique() == 2).all()


def test_every_ga_row_runs_the_json_accumulation():
    """The measured script stepped at the JSON's gradient_accumulation_steps, which is the row's grad_accum, and
    every lifted stage is measured with 2 and 3 micro-steps."""
    seen: dict[int, set[int]] = {}
    for _, row in load_measurements([GA_ZERO_CSV]).iterrows():
        _, setup, layout = row_inputs(row)
        assert setup.grad_accum == layout.deepspeed.gradient_accumulation_steps > 1
        seen.setdefault(layout.deepspeed.stage, set()).add(setup.grad_accum)
    assert seen == {stage: {2, 3} for stage in LEVER_ZERO_STAGES["grad-accum"]}
