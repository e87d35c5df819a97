"""Does a MoE model's peak memory depend on the routing? Measured per experts implementation.

For four families (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss; small real shapes from `llmsim.inputs.zoo.shrink`),
each of transformers' experts implementations that runs for training on the CPU (`grouped_mm`, the default;
`eager`, the per-expert loop; `batched_mm`) and three routings forced on every MoE layer, a real fp32 training
run (from_config, AdamW, 2 steps) is measured with llmsim's exact tracker:
- balanced: token t's j-th choice is expert (t * top_k + j) mod E (every expert the same number of rows);
- collapsed: every token to experts 0 .. top_k-1 (the worst imbalance top-k allows);
- random: distinct experts drawn uniformly per token (seeded).
The routing is forced by a forward pre-hook on each experts module that hands it, in place of the router's
`top_k_index`, an index tensor made before the measured region (the hook allocates nothing; the router's own
indices stay alive as they would). The router, its
weights and everything else run as transformers runs them.
llmsim's prediction (the default implementation, grouped_mm) is printed beside the measured peaks.

Run: python experiments/moe_routing.py > experiments/moe_routing.out
"""
from __future__ import annotations

import gc
import sys

import torch

from llmsim.inputs.spec import TrainSetup, load_model_spec, num_experts
from llmsim.inputs.zoo import shrink
from llmsim.model.tracker import StorageTracker
from llmsim.sim.pipeline import predict

FAMILIES = ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b"]
IMPLEMENTATIONS = ["grouped_mm", "eager", "batched_mm"]
ROUTINGS = ["balanced", "collapsed", "random"]
ROUTER = "router"  # no hook: the router's own choice (the run llmsim predicts)
MICRO_BATCH, SEQ_LEN, STEPS = 2, 128, 2


def forced_indices(routing: str, tokens: int, top_k: int, experts: int) -> torch.Tensor:
    if routing == "balanced":
        flat = torch.arange(tokens * top_k) % experts
        return flat.view(tokens, top_k)
    if routing == "collapsed":
        return torch.arange(top_k).expand(tokens, top_k).clone()
    generator = torch.Generator().manual_seed(0)
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])


def measure(spec, implementation: str, routing: str) -> int:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = spec.hf_config()
    tokens = MICRO_BATCH * SEQ_LEN
    top_k = int(config.num_experts_per_tok)
    experts_count = num_experts(config)
    forced = None if routing == ROUTER else forced_indices(routing, tokens, top_k, experts_count)
    batch = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ_LEN))

    tracker = StorageTracker()
    with tracker:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation=implementation)
        train(model, batch, forced)
    live = tracker.timeline()["delta_bytes"].cumsum()
    del model
    gc.collect()
    return int(live.max())


def train(model, batch: torch.Tensor, forced: torch.Tensor | None, steps: int = STEPS) -> None:
    """`steps` AdamW steps; with `forced`, every experts module is handed it in place of the router's
    `top_k_index` (made before the measured region: the hook allocates nothing)."""
    if forced is not None:
        hooked = [m.register_forward_pre_hook(lambda module, args: (args[0], forced, *args[2:]))
                  for name, m in model.named_modules() if name.endswith("mlp.experts")]
        assert hooked, "no experts module found"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss


def main() -> int:
    print(f"micro-batch {MICRO_BATCH}, seq {SEQ_LEN}, fp32, AdamW, {STEPS} steps; peak allocated bytes "
          f"(llmsim's exact tracker); torch {torch.__version__}")
    print(f"{'model':<16} {'implementation':<12} " + " ".join(f"{r:>13}" for r in ROUTINGS)
          + f" {'spread':>8} {ROUTER:>13} {'llmsim':>13} {'error':>7}")
    for family in FAMILIES:
        spec = load_model_spec(family, shrink(family, 128, 3, 1024, 4))
        predicted = None
        for implementation in IMPLEMENTATIONS:
            peaks = [measure(spec, implementation, routing) for routing in ROUTINGS]
            spread = (max(peaks) - min(peaks)) / min(peaks)
            routed = measure(spec, implementation, ROUTER)
            column = f"{'-':>13} {'-':>7}"
            if implementation == "grouped_mm":  # transformers' default: what llmsim traces
                setup = TrainSetup(MICRO_BATCH, SEQ_LEN, steps=STEPS)
                predicted = predict(spec, setup).ranks[0].peak_allocated_bytes
                column = f"{predicted:>13,} {100 * (predicted / routed - 1):>+6.2f}%"
            print(f"{family:<16} {implementation:<12} " + " ".join(f"{p:>13,}" for p in peaks)
                  + f" {100 * spread:>7.2f}% {routed:>13,} {column}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
