"""Packaging that fits a user's environment: llmsim installs beside a torch in its supported range (not one exact
release), the tests install against the torch every committed row was measured with, and each prediction and
row names its torch."""
import configparser
import importlib.metadata
from pathlib import Path

import pandas as pd
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _torch_requirement(requirements) -> Requirement:
    found = [Requirement(r) for r in requirements if Requirement(r).name == "torch"]
    assert len(found) == 1, found
    return found[0]


def test_the_installed_metadata_admits_a_torch_range_with_the_installed_torch_in_it():
    import torch

    installed = _torch_requirement(importlib.metadata.requires("llmsim"))
    declared = _torch_requirement(line.strip() for line in _setup_cfg_requires()
                                  if line.strip() and not line.strip().startswith("#"))
    assert installed.specifier == declared.specifier, "the install is older than setup.cfg: pip install -e . again"
    assert Version(torch.__version__.split("+")[0]) in installed.specifier
    # a range: the releases it is checked on, not one pin and not anything
    assert all(Version(v) in installed.specifier for v in ("2.13.0", "2.13.1", "2.14.0", "2.14.1"))
    assert not any(Version(v) in installed.specifier for v in ("2.12.1", "2.15.0", "3.0.0"))


def _setup_cfg_requires() -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config["options"]["install_requires"].splitlines()


def test_the_constraints_hold_the_install_to_the_rows_torch():
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    torch_pin = _torch_requirement(str(pin) for pin in pins)
    measured_with = set()
    for path in (ROOT / "data" / "measurements").glob("*.csv"):
        if path.name.startswith("tier4"):  # a GPU's own torch build (tests/test_validate.py names it)
            continue
        measured_with |= set(pd.read_csv(path)["torch"].astype(str).str.split("+").str[0])
    assert measured_with == {str(spec.version) for spec in torch_pin.specifier}, measured_with
    assert (ROOT / ".ci" / "run").read_text().count("-c constraints.txt") == 1
    assert "pip install -c constraints.txt" in (ROOT / "README.md").read_text().split("```")[1]


def test_a_prediction_names_the_torch_it_traced(capsys):
    import json

    import torch

    from llmsim.app.cli import main

    tiny = ["--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4", "--set",
            "vocab_size=256"]
    assert main(["predict", *tiny, "--seq-len", "16", "--micro-batch", "1", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["torch"] == torch.__version__


def test_the_constraints_hold_trl_to_the_one_the_sft_rows_were_measured_with():
    """trl is an optional dependency (the trl-sft recipe); the tests install the release its rows name."""
    from llmsim.inputs.hf import TRL_MEASURED

    pins = {Requirement(line).name: Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    rows = pd.concat(pd.read_csv(path) for path in (ROOT / "data" / "measurements").glob("trainer_sft*.csv"))
    assert set(rows["trl"].astype(str)) == {TRL_MEASURED} == {str(s.version) for s in pins["trl"].specifier}
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    assert any(Requirement(r).name == "trl" for r in extras["trl"].split() if r) and "trl" in extras["test"]
