"""Can one fake-tensor trace answer every micro-batch? A shrunk Llama's forward and loss backward under
FakeTensorMode with a ShapeEnv, the input ids' batch dimension dynamic (a SymInt), and a dispatch mode that reads
each output's storage bytes (as llmsim's tracker does): which bytes stay formulas of the batch, and where the
batch is specialized (the ShapeEnv's guards, with the Python frame that asked for a concrete size).

Run: python experiments/explore_symbolic_batch.py [--no-mode]  (--no-mode: without the dispatch mode; a few
seconds; output in experiments/explore_symbolic_batch.out)"""
import contextlib
import sys
import traceback
import warnings

import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

warnings.filterwarnings("ignore")
config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=1000, attn_implementation="sdpa")
with torch.device("meta"):
    model = LlamaForCausalLM(config)

env = ShapeEnv()
guards: list[tuple[str, str]] = []
_guarded = ShapeEnv._maybe_guard_rel


def guarded(self, expr):
    frames = [f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
              for frame in traceback.extract_stack() if "transformers/" in frame.filename]
    guards.append((str(expr), frames[-1] if frames else "(torch)"))
    return _guarded(self, expr)


ShapeEnv._maybe_guard_rel = guarded
events: list[tuple[str, object]] = []


class StorageBytes(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        events.extend((str(func), t.untyped_storage().nbytes()) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor))
        return out


mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
ids = torch.zeros(3, 128, dtype=torch.long)
with mode:
    model = model.to_empty(device="cpu")
    ids = mode.from_tensor(ids, source=ConstantSource("input_ids"), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    print(f"input ids: {tuple(ids.shape)}")
    with contextlib.nullcontext() if "--no-mode" in sys.argv[1:] else StorageBytes():
        out = model(input_ids=ids)
        symbolic_logits = not isinstance(out.logits.shape[0], int) and not out.logits.shape[0].node.is_constant()
        print(f"after the forward (no labels): logits {tuple(out.logits.shape)}, guards {len(guards)}")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
symbolic = [bytes_ for _, bytes_ in events if isinstance(bytes_, torch.SymInt)]
print(f"{len(events)} storage outputs, {len(symbolic)} of them SymInts")
print("guards on the batch (expression, the transformers frame that asked):")
for expr, where in guards:
    print(f"  {expr}: {where}")
