"""PyTorch FSDP2 (`fully_shard` on every decoder layer, then the root): the trace runs FSDP2 itself as rank 0 of
the layout's world (llmsim/model/fsdp.py), so the traced timeline is already the rank's own. Every rank runs the
same: FSDP2 pads each shard to ceil(dim 0 / world size) rows, and the trace refuses a parameter whose dim 0 does
not divide evenly (where the last ranks' local shards, and their optimizer states, would be smaller)."""
from __future__ import annotations

import pandas as pd

from llmsim.enums import Precision, Recipe
from llmsim.errors import InputError

# What is measured with FSDP2 (data/measurements/tier2_fsdp_cpu.csv): the canonical step, full fine-tuning, in
# these precisions; checkpointing; reshard on or off; MixedPrecisionPolicy dtypes
PRECISIONS = (Precision.FP32, Precision.BF16, Precision.BF16_AUTOCAST)


def check_supported(setup, layout) -> None:
    if setup.recipe is not Recipe.CANONICAL:
        raise InputError(f"recipe {setup.recipe.value} with strategy fsdp is not modelled yet (accelerate turns "
                         "FSDP on only for GPU runs, so no CPU run of the Trainer with FSDP2 measures it); modelled: "
                         "the canonical step with fully_shard")
    if setup.precision not in PRECISIONS:
        raise InputError(f"precision {setup.precision.value} with strategy fsdp is not modelled yet; modelled: "
                         f"{', '.join(p.value for p in PRECISIONS)} (and MixedPrecisionPolicy's dtypes)")
    if setup.lora_rank or setup.quant is not None:
        raise InputError("LoRA or a quantized base with strategy fsdp is not modelled yet; modelled with FSDP2: "
                         "full fine-tuning")


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    return {rank: timeline for rank in range(layout.world_size)}
