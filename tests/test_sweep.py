"""`llmsim sweep`: a grid file -> one row per combination, equal to `predict` on each (issue 7)."""
import json

import pandas as pd

from llmsim.app.cli import main
from llmsim.sim.pipeline import predict
from llmsim.enums import Precision
from llmsim.inputs.spec import TrainSetup, load_model_spec


def test_sweep_rows_equal_predict_and_bad_combinations_become_error_rows(tmp_path, capsys):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"model": "gpt2", "seq_len": 64, "micro_batch": [1, 2, 0], "precision": "bf16",
                                "grad_ckpt": [False, True]}))
    out = tmp_path / "sweep.csv"
    assert main(["sweep", str(grid), "--out", str(out), "--jobs", "2", "--quiet"]) == 0
    frame = pd.read_csv(out, keep_default_na=False)
    assert len(frame) == 6
    bad = frame[frame["micro_batch"] == 0]
    assert (bad["error"].str.contains("micro-batch must be a positive integer")).all()
    spec = load_model_spec("gpt2")
    for row in frame[frame["micro_batch"] > 0].itertuples():
        expected = predict(spec, TrainSetup(int(row.micro_batch), 64, Precision.BF16, grad_ckpt=row.grad_ckpt))
        assert int(row.peak_allocated_bytes) == expected.peak_allocated_bytes


def test_sweep_file_with_an_unknown_key_is_one_line_exit_2(tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("model: gpt2\nseq_len: 64\nmicro_batch: 1\nbatch_size: 8\n")
    assert main(["sweep", str(grid), "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "batch_size" in err and "valid keys" in err
