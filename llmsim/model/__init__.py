"""Floor 2, the model side: what is traced and what is measured. The recipes (llmsim's canonical loop `step`, the
HF Trainer run `trainer_recipe`), the fake-tensor trace of either (`trace`, `trainer_trace`), the exact storage
tracker, and what the traced step is built from: kernels' workspaces, losses, quantized bases, checkpoint
offload, transformers' TP plan, pipeline stages, ZeRO-3 hooks. Imports the inputs floor, never the simulation."""
