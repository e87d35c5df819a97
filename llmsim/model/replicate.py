"""Data parallelism over tensor-parallel shards: torch's `replicate` (DDP's replication on FSDP2's machinery).

torch's DistributedDataParallel takes no DTensor parameter (its constructor's broadcast has no sharding strategy,
torch 2.13), so a model sharded by transformers' TP plan cannot be wrapped in it. torch 2.13's
`torch.distributed._composable.replicate_with_fsdp.replicate` can: it is FSDP2's `fully_shard` with a replicate
mesh (DDPMeshInfo), each parameter a DTensor replicated over the data-parallel group (the TP shard kept whole), each
wrapped module's gradients all-reduced after its backward, and it runs under torch's pipeline schedules
(experiments/explore_dp_tp_pp.py). The canonical DDP x TP (x PP) step applies it as torchtitan's
`apply_replicate_to_model` does, and as llmsim's FSDP2 step applies `fully_shard`: on each decoder layer, then on
the whole (stage's) model, over the mesh's "dp" dimension, after the precision cast and checkpointing, before the
optimizer. `replicate_with_fsdp` is a private module of torch (its path may change); the docs say so.

The predictor runs `replicate` itself under FakeTensorMode, as one rank of a fake process group of the layout's
world size (llmsim/model/trace.py): the gradients' all-reduce buffers, their casts and copies are FSDP2's own code.
"""
from __future__ import annotations

from torch import nn


def replicate_model(model: nn.Module, mesh) -> nn.Module:
    """`replicate` on each decoder layer, then on the whole model, over `mesh` (1-D: the data-parallel ranks);
    returns the model."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    from llmsim.model.step import find_blocks

    _, blocks = find_blocks(model, None)
    for layer in blocks:
        replicate(layer, mesh=mesh)
    replicate(model, mesh=mesh)
    return model
