"""Expert parallelism as transformers runs it: does a rank's peak depend on the routing? (measured, not modelled)

`from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2, ep_size=2))` on 2 ranks (torchrun, gloo):
attention sharded by transformers' TP plan, each rank holding half of every layer's experts, tokens exchanged with
all-to-all in training (transformers/distributed/expert_parallel.py, AllToAllEP: each rank of the TP group keeps
half of the batch's tokens and sends every (token, expert) pair to the expert's rank, so how many rows a rank's
experts run on is the routing's). A small Mixtral (8 experts, top-2), fp32, AdamW, 2 steps, the exact tracker in
every rank from before from_pretrained. Routings forced on every MoE layer as in experiments/moe_routing.py
(balanced, collapsed onto experts 0 and 1 -- both on rank 0 --, random), and the router's own.

Run: python experiments/moe_ep_routing.py > experiments/moe_ep_routing.out
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROUTINGS = ["balanced", "collapsed", "random", "router"]
MICRO_BATCH, SEQ_LEN, STEPS = 4, 256, 2
CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 128,
          "intermediate_size": 224, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def worker(checkpoint: str, routing: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from moe_routing import forced_indices, train

    from llmsim.model.tracker import StorageTracker

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    tokens, top_k, experts = MICRO_BATCH * SEQ_LEN, CONFIG["num_experts_per_tok"], CONFIG["num_local_experts"]
    forced = None if routing == "router" else forced_indices(routing, tokens, top_k, experts)
    batch = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ_LEN))

    tracker = StorageTracker()
    with tracker:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_size=2, ep_size=2))
        train(model, batch, forced, STEPS)
    peak = int(tracker.timeline()["delta_bytes"].cumsum().max())
    print(json.dumps({"rank": dist.get_rank(), "routing": routing, "peak": peak}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG)).save_pretrained(directory)
        print(f"Mixtral shape {json.dumps({k: CONFIG[k] for k in ('hidden_size', 'num_hidden_layers')})}, 8 experts, "
              f"top-2, micro-batch {MICRO_BATCH}, seq {SEQ_LEN}, fp32, AdamW, {STEPS} steps; DistributedConfig("
              "tp_size=2, ep_size=2); peak allocated bytes per rank (llmsim's exact tracker)")
        results = {}
        for routing in ROUTINGS:
            done = subprocess.run(["torchrun", "--nproc_per_node", "2", __file__, "--worker", directory, routing],
                                  capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            if len(rows) != 2:
                print(f"{routing}: failed\n{done.stderr[-2000:]}")
                return 1
            results[routing] = {row["rank"]: row["peak"] for row in rows}
            print(f"{routing:10} rank 0 {results[routing][0]:>13,}   rank 1 {results[routing][1]:>13,}", flush=True)
        low = min(min(r.values()) for r in results.values())
        high = max(max(r.values()) for r in results.values())
        print(f"spread over routings and ranks: {100 * (high - low) / low:.2f} %")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
