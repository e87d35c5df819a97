"""Architectures outside the zoo, from transformers' own default configs shrunk: a fresh real run each,
compared with the prediction. Any causal LM transformers builds must work without a formula of its own."""
import json

import pytest
from transformers import AutoConfig

from llmsim.enums import Precision
from llmsim.measure.runs import measure_single
from llmsim.sim.pipeline import predict
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.measure.tolerances import PEAK_ALLOCATED_TOLERANCE

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, num_hidden_layers=5, max_position_embeddings=512)


def small_config(model_type: str, path) -> str:
    config = AutoConfig.for_model(model_type)
    values = config.to_dict()
    for generic, value in SMALL.items():
        key = type(config).attribute_map.get(generic, generic)
        if key in values or generic in ("num_hidden_layers", "hidden_size", "vocab_size"):
            values[key] = value
    if values.get("head_dim"):
        values["head_dim"] = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    values.pop("layer_types", None)  # recomputed for the new depth by the config class
    path.write_text(json.dumps(values))
    return str(path)


@pytest.mark.parametrize("model_type", ["gemma2", "falcon", "phi", "qwen3", "olmo", "starcoder2"])
def test_real_run_matches_prediction(model_type, tmp_path):
    spec = load_model_spec(small_config(model_type, tmp_path / "config.json"))
    setup = TrainSetup(2, 64, Precision.BF16, grad_ckpt=True)
    measured = measure_single(spec, setup)["peak_allocated_bytes"]
    predicted = predict(spec, setup).peak_allocated_bytes
    assert abs(predicted - measured) / measured <= PEAK_ALLOCATED_TOLERANCE[1]
