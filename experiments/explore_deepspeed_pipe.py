"""Does DeepSpeed's pipeline engine run on this CPU (gloo), and with which ZeRO stages? (issue 23: "ZeRO x PP where
DeepSpeed's PipelineModule runs on CPU".) A minimal PipelineModule of LayerSpecs (an embedding, 4 Linear+ReLU
blocks, a head; cross-entropy loss), `deepspeed.initialize` -> PipelineEngine, two `train_batch` calls of 4
micro-batches each. No prediction is made here: llmsim does not model DeepSpeed's pipeline engine yet.

Env: ZS (ZeRO stage), DT (fp32 | bf16), PP (stages; the data-parallel degree is WORLD_SIZE / PP), STEPS (2),
DESTROY (1: end with deepspeed.comm's barrier and destroy_process_group; without it the process sometimes aborted
at exit, "terminate called without an active exception", after the steps had run).
Run: torchrun --nproc_per_node 4 experiments/explore_deepspeed_pipe.py  (ZS=1 PP=2: ZeRO-1 over dp 2 x pp 2)
Output of the runs committed: experiments/explore_deepspeed_pipe.out."""
import os, torch, torch.nn as nn, deepspeed
from deepspeed.pipe import PipelineModule, LayerSpec
ZS=int(os.environ.get("ZS","0")); DT=os.environ.get("DT","fp32"); PP=int(os.environ.get("PP","2"))
H=64; V=100; MB=2; GAS=4; SEQ=8
class Emb(nn.Module):
    def __init__(s): super().__init__(); s.e=nn.Embedding(V,H)
    def forward(s,x): return s.e(x)
class Block(nn.Module):
    def __init__(s): super().__init__(); s.l=nn.Linear(H,H)
    def forward(s,x): return torch.relu(s.l(x))
class Head(nn.Module):
    def __init__(s): super().__init__(); s.l=nn.Linear(H,V)
    def forward(s,x): return s.l(x)
def loss_fn(logits, labels): return nn.functional.cross_entropy(logits.float().view(-1,V), labels.view(-1))
deepspeed.init_distributed(dist_backend="gloo")
layers=[LayerSpec(Emb)]+[LayerSpec(Block) for _ in range(4)]+[LayerSpec(Head)]
model=PipelineModule(layers=layers, loss_fn=loss_fn, num_stages=PP, partition_method="uniform")
ws=int(os.environ["WORLD_SIZE"]); dp=ws//PP
cfg={"train_micro_batch_size_per_gpu":MB,"gradient_accumulation_steps":GAS,"train_batch_size":MB*GAS*dp,
     "optimizer":{"type":"AdamW","params":{"lr":1e-3}},"zero_optimization":{"stage":ZS},
     "steps_per_print":1,"wall_clock_breakdown":False}
if DT=="bf16": cfg["bf16"]={"enabled":True}
eng,_,_,_=deepspeed.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters() if p.requires_grad])
r=int(os.environ["RANK"])
print(f"rank{r} stage={eng.stage_id} dp={eng.dp_world_size} opt={type(eng.optimizer).__name__} "
      f"basic={type(eng.basic_optimizer).__name__ if hasattr(eng,'basic_optimizer') else None} nparams={sum(p.numel() for p in eng.module.parameters())}", flush=True)
g=torch.Generator().manual_seed(0)
def it():
    while True:
        x=torch.randint(0,V,(MB,SEQ),generator=g); yield (x, x.clone())
d=it()
for s in range(int(os.environ.get("STEPS","2"))):
    loss=eng.train_batch(d)
    print(f"rank{r} step{s} loss={loss.item():.4f} num_pipe_buffers={eng.num_pipe_buffers}", flush=True)
import time
print(f"rank{r} DONE t={time.time():.1f}", flush=True)
if os.environ.get("DESTROY","1")=="1":
    import deepspeed.comm as dc; dc.barrier(); dc.destroy_process_group(); print(f"rank{r} destroyed t={time.time():.1f}", flush=True)
