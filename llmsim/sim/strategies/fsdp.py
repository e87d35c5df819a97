"""PyTorch FSDP2 (`fully_shard` on every decoder layer, then the root): the trace runs FSDP2 itself as one rank of
the layout's world (llmsim/model/fsdp.py), so a traced timeline is already a rank's own. Ranks whose local shards
have the same sizes run the same (FSDP2 pads every shard to ceil(dim 0 / world size) rows; a dim 0 that does not
divide leaves the last ranks shorter local shards and AdamW states): `rank_classes` groups them, and
llmsim.sim.pipeline traces one rank of each group."""
from __future__ import annotations

import functools

import pandas as pd

from llmsim.enums import Device, Optimizer, Precision, Recipe
from llmsim.errors import InputError

# What is measured with FSDP2 (data/measurements/tier2_fsdp_cpu.csv): the canonical step, full fine-tuning and LoRA
# (get_peft_model before fully_shard: the frozen base sharded and gathered, no gradient or state), in these
# precisions; checkpointing; reshard on or off; MixedPrecisionPolicy dtypes; the model built whole or on the meta
# device
PRECISIONS = (Precision.FP32, Precision.BF16, Precision.BF16_AUTOCAST)


def check_supported(setup, layout) -> None:
    if (layout.fsdp.wrap == "accelerate") != (setup.recipe is Recipe.HF_TRAINER):
        if layout.fsdp.wrap == "accelerate":
            raise InputError("fsdp-wrap(accelerate) is the HF Trainer's FSDP: give it as the TrainingArguments' fsdp "
                             "and fsdp_config (--training-args), not as a flag")
        raise InputError(f"recipe {setup.recipe.value} with strategy fsdp is not modelled yet; modelled: the "
                         "canonical step with fully_shard, and the HF Trainer's FSDP2 from its TrainingArguments "
                         "(fsdp, fsdp_config)")
    if setup.recipe is Recipe.HF_TRAINER:
        # the Trainer, accelerate and FSDP2 run in the trace; what the rows (trainer_fsdp_cpu.csv) do not measure:
        if setup.quant is not None:
            raise InputError("a quantized base with the Trainer's FSDP is not modelled yet; modelled: full "
                             "fine-tuning and LoRA")
        return
    if setup.precision not in PRECISIONS:
        raise InputError(f"precision {setup.precision.value} with strategy fsdp is not modelled yet; modelled: "
                         f"{', '.join(p.value for p in PRECISIONS)} (and MixedPrecisionPolicy's dtypes)")
    # on a GPU the foreach path is torch's own choice for CUDA parameters (llmsim.inputs.gpus.on_gpu sets it)
    if setup.optimizer is not Optimizer.ADAMW or setup.fused or (setup.foreach and setup.device is not Device.CUDA):
        what = "--fused" if setup.fused else "--foreach" if setup.foreach else f"optimizer {setup.optimizer.value}"
        raise InputError(f"{what} with strategy fsdp is not modelled yet; modelled with FSDP2: torch.optim.AdamW as "
                         "torch picks its path (the for-loop on the CPU, foreach on a GPU)")
    if setup.quant is not None:
        raise InputError("a quantized base with strategy fsdp is not modelled yet; modelled with FSDP2: full "
                         "fine-tuning and LoRA")
    if layout.tp * layout.pp > 1 and layout.fsdp.wrap == "layers" and (layout.fsdp.offload or
                                                                        layout.fsdp.init == "host"):
        raise InputError("--fsdp-offload or fsdp-init host with --pp or --tp is not modelled yet (no row measures them "
                         "on a (dp, pp, tp) mesh); modelled there: fully_shard per layer, built on the meta device or "
                         "whole")
    if layout.fsdp.offload and setup.tp > 1:
        raise InputError("--fsdp-offload with --tp is not modelled yet (no row measures CPUOffloadPolicy on a 2-D "
                         "mesh); modelled: CPUOffloadPolicy over a 1-D mesh (--strategy fsdp --world-size N)")


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    """Every rank runs the traced timeline: the case of one rank class. llmsim.sim.pipeline traces one rank of each
    class (`rank_classes`) and gives it to that class's ranks."""
    return {rank: timeline for rank in range(layout.world_size)}


def rank_classes(model, setup, world_size: int) -> list[list[int]]:
    """The ranks in groups of equal local shards (llmsim/model/fsdp.py, `rank_classes`); with accelerate's
    `cpu_ram_efficient_loading` rank 0 (the main process, whose state dict every rank's shards are loaded from) is
    a group of its own."""
    from llmsim.model import fsdp

    classes = fsdp.rank_classes(_dim0_sizes(model, setup.lora_rank, setup.lora_targets, setup.peft_config), world_size)
    if setup.fsdp is not None and setup.fsdp.cpu_ram_efficient_loading and len(classes[0]) > 1:
        classes = [[0], classes[0][1:], *classes[1:]]
    return classes


@functools.lru_cache(maxsize=16)
def _dim0_sizes(model, lora_rank: int, lora_targets, peft_config: str | None = None) -> frozenset[int]:
    """Every trained model's parameter's dim 0: the model built on the meta device (no memory), with peft's
    adapters when LoRA is on (their rank and targets decide their shapes; the Trainer's: its LoraConfig's)."""
    import json

    import torch

    from llmsim.enums import Attention
    from llmsim.inputs.spec import TrainSetup
    from llmsim.model.step import add_peft
    from llmsim.model.trace import hf_builder

    # eager attention: every model type has it, and the attention changes no parameter
    setup = TrainSetup(1, 1, attention=Attention.EAGER, lora_rank=lora_rank, lora_targets=lora_targets)
    with torch.device("meta"):
        built = model.factory_callable() if model.factory is not None else hf_builder(model, setup, model.hf_config())()
        if peft_config:
            from llmsim.inputs.hf import lora_config
            from llmsim.model.trainer_trace import _peft_model

            built = _peft_model(built, lora_config(json.loads(peft_config)))
        elif lora_rank:
            built = add_peft(built, setup)
    return frozenset(p.shape[0] if p.dim() else 1 for p in built.parameters())
