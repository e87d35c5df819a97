"""Check the model zoo in data/models/*.json.

For every file: the HF config must load (CONFIG_MAPPING[model_type](**d)) and the model must
build on the meta device; prints name, model_type and parameter count. Where a published
parameter count is known it is compared too. Exits non-zero on any load/build failure or on a
mismatch with a known published count.

Usage: .venv/bin/python experiments/check_zoo.py [data/models]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, CONFIG_MAPPING

# Parameter counts as published (HF hub safetensors metadata / model cards), unique tensors
# (tied embeddings counted once).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "opt-125m": 125_239_296,
    "opt-350m": 331_196_416,
    "opt-1.3b": 1_315_758_080,
    "opt-2.7b": 2_651_596_800,
    "opt-6.7b": 6_658_473_984,
    "bloom-560m": 559_214_592,
    "bloom-1b1": 1_065_314_304,
    "bloom-1b7": 1_722_408_960,
    "bloom-3b": 3_002_557_440,
    "bloom-7b1": 7_069_016_064,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "pythia-160m": 162_322_944,
    "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632,
    "pythia-1.4b": 1_414_647_808,
    "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016,
}
# Mixture-of-experts models: the totals their model cards print, rounded there to the digits given (the
# hub's exact totals were not at hand offline); a count passes when it rounds to the card's figure.
# DeepSeek-V3's card says 671B for the main model (685B with the multi-token-prediction module, which
# transformers does not build); gpt-oss is counted with its experts dequantized (MXFP4 on the hub).
PUBLISHED_ROUNDED = {
    "mixtral-8x7b": "46.7e9",
    "qwen3-30b-a3b": "30.5e9",
    "qwen3-235b-a22b": "235e9",
    "qwen2-57b-a14b": "57.4e9",
    "deepseek-v2-lite": "15.7e9",
    "deepseek-v3": "671e9",
    "olmoe-1b-7b": "6.9e9",
    "gpt-oss-20b": "20.9e9",
    "gpt-oss-120b": "116.8e9",
}


def rounds_to(count: int, figure: str) -> bool:
    """Whether `count` rounds to `figure` ("46.7e9": one decimal of billions) at the figure's last digit."""
    mantissa, exponent = figure.split("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    unit = 10 ** (int(exponent) - decimals)
    return abs(count - float(figure)) <= unit / 2


def load_config(path: Path):
    d = json.loads(path.read_text())
    d = {k: v for k, v in d.items() if k != "_name_or_path"}
    model_type = d.pop("model_type")
    return CONFIG_MAPPING[model_type](**d)


def count_params(cfg) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "data" / "models"
    files = sorted(root.glob("*.json"))
    if not files:
        print(f"no config files under {root}", file=sys.stderr)
        return 1
    failures = 0
    print(f"{'name':<20} {'model_type':<10} {'params':>16}  published check")
    for path in files:
        name = path.stem
        try:
            cfg = load_config(path)
            n = count_params(cfg)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            failures += 1
            print(f"{name:<20} {'?':<10} {'LOAD FAILED':>16}  {type(e).__name__}: {e}")
            continue
        pub = PUBLISHED.get(name)
        if name in PUBLISHED_ROUNDED:
            ok = rounds_to(n, PUBLISHED_ROUNDED[name])
            failures += not ok
            check = f"{'ok' if ok else 'MISMATCH'} (model card: {float(PUBLISHED_ROUNDED[name]) / 1e9:g}B)"
        elif pub is None:
            check = "(no published figure)"
        elif pub == n:
            check = "ok"
        else:
            failures += 1
            check = f"MISMATCH published {pub:,} (diff {n - pub:+,})"
        print(f"{name:<20} {cfg.model_type:<10} {n:>16,}  {check}")
    print(f"{len(files)} files, {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
