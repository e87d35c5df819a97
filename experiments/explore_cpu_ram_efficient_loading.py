"""What `fsdp_cpu_ram_efficient_loading: true` (accelerate launch's default for FSDP) changes in a Trainer run,
measured on this CPU: the same accelerate FSDP2 launch YAML with the key false and true, the HF Trainer started by
`accelerate launch --config_file` itself (llmsim.measure.runs.measure_trainer), each rank's peak per phase from the
kept timelines, beside llmsim's prediction of the false one. The study made before it was modelled (when llmsim
refused it); the rows since: `experiments/measure_trainer.py --cases accelerate-fsdp-ram`. Run: python experiments/explore_cpu_ram_efficient_loading.py (about 1 minute); output:
experiments/explore_cpu_ram_efficient_loading.out."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pandas as pd

import llmsim.measure.runs as runs
from llmsim.inputs.accelerate_config import trainer_fsdp_launch
from llmsim.inputs.hf import trainer_setup
from llmsim.inputs.spec import load_model_spec
from llmsim.sim.pipeline import predict
from llmsim.sim.strategies import trainer_layout

LLAMA = {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_hidden_layers": 4,
         "num_key_value_heads": 4, "vocab_size": 2000}
USER = {"per_device_train_batch_size": 2, "gradient_checkpointing": True}  # the script's TrainingArguments


def launch_file(directory: Path, ram_efficient: bool) -> Path:
    config = {"distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "bf16",
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
                              "fsdp_cpu_ram_efficient_loading": ram_efficient, "fsdp_sync_module_states": True}}
    path = directory / f"fsdp_ram_{str(ram_efficient).lower()}.json"
    path.write_text(json.dumps(config))
    return path


def main() -> None:
    spec = load_model_spec("llama-2-7b", LLAMA)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        off, on = launch_file(directory, False), launch_file(directory, True)
        world, fields = trainer_fsdp_launch(off, USER)
        setup, layout = trainer_layout(spec, trainer_setup(spec, 64, fields, None, "float32", None), world, None)
        print("predicted, cpu_ram_efficient_loading false:",
              [(r.peak_allocated_bytes, r.peak.phase) for r in predict(spec, setup, layout).ranks])
        real = runs.torchrun

        def keeping(module, job, world_size, out, timeout_s, accelerate_config=None):
            real(module, job, world_size, out, timeout_s, accelerate_config)
            for timeline in Path(out).glob("rank*.timeline.pkl"):
                shutil.copy(timeline, directory / f"{accelerate_config.stem}_{timeline.name}")

        runs.torchrun = keeping
        for path in (off, on):
            rows = runs.measure_trainer(spec, setup, "float32", layout, accelerate_config=str(path), user_fields=USER)
            print(f"measured, {path.stem}:", [(r["peak_allocated_bytes"], r["peak_phase"]) for r in rows])
            for rank in range(world):
                timeline = pd.read_pickle(directory / f"{path.stem}_rank{rank}.timeline.pkl")
                level = timeline["delta_bytes"].cumsum()
                print(f"  rank {rank} peak per phase:",
                      {phase: int(level[timeline["phase"] == phase].max()) for phase in timeline["phase"].unique()})


if __name__ == "__main__":
    main()
