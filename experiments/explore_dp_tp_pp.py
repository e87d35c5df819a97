"""Does torch 2.13 run DP x TP x PP, and with which data parallelism? Each rank of a (dp, pp, tp) mesh builds a
2-layer MLP stage, shards it over tp (parallelize_module: ColwiseParallel / RowwiseParallel, DTensor parameters),
wraps each layer and the stage for data parallelism over dp, and runs 2 steps of Schedule1F1B (as many micro-batches
as stages) with AdamW; CPU, gloo.

Data parallelism (argv[4]): `replicate` -- torch.distributed._composable.replicate_with_fsdp.replicate, DDP's
replication built on FSDP2's machinery, which takes TP's DTensor parameters (torch's DistributedDataParallel does
not) -- or `fully_shard` (FSDP2, torchtitan's 3-D layout).
Run: torchrun --nproc_per_node 8 experiments/explore_dp_tp_pp.py 2 2 2 replicate   (dp pp tp, then the wrap)
Output of both wraps at 2 x 2 x 2 and of replicate at 2 x 1 x 2: experiments/explore_dp_tp_pp.out"""
import sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

dp, pp, tp = (int(x) for x in sys.argv[1:4])
wrap = {"replicate": replicate, "fully_shard": fully_shard}[sys.argv[4]]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
stage_index = mesh["pp"].get_local_rank()

class Block(nn.Module):
    def __init__(self):
        super().__init__(); self.up = nn.Linear(64, 256); self.down = nn.Linear(256, 64)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Stage(nn.Module):
    def __init__(self):
        super().__init__(); self.layers = nn.ModuleList([Block(), Block()])
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

torch.manual_seed(0)
model = Stage()
for layer in model.layers:
    parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
for layer in model.layers:
    wrap(layer, mesh=mesh["dp"])
wrap(model, mesh=mesh["dp"])
local = [tuple(p.to_local().shape) for p in list(model.parameters())[:2]]  # the first layer's up projection
kinds = sorted({type(p).__name__ for p in model.parameters()})
x = torch.randn(2, 64, requires_grad=stage_index > 0)
stage = PipelineStage(model, stage_index, pp, torch.device("cpu"), input_args=x, output_args=torch.randn(2, 64, requires_grad=True),
                      group=mesh["pp"].get_group())
loss_fn = lambda out, target: ((out - target) ** 2).mean()
schedule = Schedule1F1B(stage, pp, loss_fn=loss_fn)
opt = torch.optim.AdamW(model.parameters())
batch = torch.randn(2 * pp, 64)
for step in range(2):
    if pp == 1:
        schedule.step(batch, target=batch, losses=[])
    elif stage_index == 0:
        schedule.step(batch)
    elif stage_index == pp - 1:
        losses = []
        schedule.step(target=batch, losses=losses)
    else:
        schedule.step()
    opt.step(); opt.zero_grad()
sys.stdout.write(f"rank {rank} ({sys.argv[4]}, dp {dp} x pp {pp} x tp {tp}): stage {stage_index}, parameters "
                 f"{kinds}, local up-projection weight and bias {local}, ran 2 steps\n")
sys.stdout.flush()
dist.destroy_process_group()
