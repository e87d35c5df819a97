"""Tier (d): the GPU validation kit resolves every configuration on a CPU-only machine (--dry-run);
its real run needs a GPU and is skipped here."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.gpu_validation import MATRIX

KIT = Path(__file__).resolve().parent.parent / "experiments" / "gpu_validation.py"


def test_dry_run_predicts_every_configuration():
    proc = subprocess.run([sys.executable, str(KIT), "--dry-run", "--gpu", "a100-80gb"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("(")]
    assert len(lines) == len(MATRIX) and all("fits a100-80gb" in l for l in lines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_gpu_run_is_within_tier4_tolerances():
    from llmsim.validate import load_measurements, validate

    proc = subprocess.run([sys.executable, str(KIT)], timeout=900)
    assert proc.returncode == 0
    rows = load_measurements([KIT.parent.parent / "data" / "measurements" / "tier4_gpu.csv"])
    assert validate(rows)["ok"].all()
