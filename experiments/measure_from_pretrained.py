"""Tensor and expert parallelism as users run them: `from_pretrained(tp_plan="auto")`, and for MoE models
`from_pretrained(distributed_config=DistributedConfig(tp_size=2, ep_size=2))`, then a plain AdamW loop
(llmsim/model/from_pretrained_recipe.py, `llmsim measure --recipe from-pretrained`), on 2 ranks (torchrun, gloo,
each wait settled as NCCL releases at the wait, the exact tracker in every rank from before from_pretrained).

- data/measurements/tier2_tp_from_pretrained_cpu.csv: dense models at TP 2 (Llama-2, Llama-3.1, Mistral, Qwen2.5),
  fp32 and bf16 loads, against `llmsim predict --tp 2` (whose build is transformers' own TP plan on the meta
  device, then init_weights: tensor_parallel.py).
- data/measurements/tier2_moe_ep_cpu.csv: MoE models at TP 2 x EP 2 (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE,
  DeepSeek-V2, gpt-oss), each with the routing forced balanced (against the balanced prediction), collapsed onto
  experts 0..k-1 (EP rank 0's: rank 0 against the worst-routing prediction, rank 1 under it) and the router's own
  (every rank at or under the worst-routing bound). `routing_check` in each row says which.
- data/measurements/tier2_fsdp_from_pretrained_cpu.csv (`--only fsdp`): FSDP2 as transformers applies it,
  `from_pretrained(distributed_config=DistributedConfig(fsdp_size=N[, fsdp_mixed_precision=True]))`, 2 and 4 ranks,
  and FSDP2 x TP (`DistributedConfig(tp_size=2, fsdp_size=2)`, 4 ranks), against `--strategy fsdp --fsdp-wrap
  transformers [--tp 2]`.
- HELDOUT (`--heldout`, data/measurements/tier2_from_pretrained_heldout_cpu.csv): shapes and families none of the
  runs above has, each predicted (printed first) with llmsim's code fixed, then measured (`--heldout --only fsdp`:
  the FSDP2 ones, experiments/measure_from_pretrained_heldout_fsdp.out).

`--unsettled` measures a dense TP run and a collapsed EP run each three times without the settle (gloo's own timing)
beside the settled rows, and writes nothing: whether gloo's worker thread holding a collective's buffers past the
wait moves these peaks (experiments/measure_from_pretrained_unsettled.out).

Run: python experiments/measure_from_pretrained.py [--heldout | --unsettled] > experiments/measure_from_pretrained_*.out
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MEASUREMENTS = Path(__file__).resolve().parent.parent / "data" / "measurements"
TP_OUT, EP_OUT = MEASUREMENTS / "tier2_tp_from_pretrained_cpu.csv", MEASUREMENTS / "tier2_moe_ep_cpu.csv"
HELDOUT_OUT = MEASUREMENTS / "tier2_from_pretrained_heldout_cpu.csv"
FSDP_OUT = MEASUREMENTS / "tier2_fsdp_from_pretrained_cpu.csv"
DENSE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": False}
MOE_SHAPES = {"mixtral-8x7b": (128, 4, 1000, 8), "qwen3-30b-a3b": (128, 4, 1000, 16),
              "olmoe-1b-7b": (96, 4, 1200, 4), "qwen2-57b-a14b": (112, 4, 900, 28),
              "deepseek-v2-lite": (128, 3, 1000, 4), "gpt-oss-20b": (128, 4, 1000, 16),
              "deepseek-v3": (128, 5, 1000, 4), "qwen3-235b-a22b": (128, 5, 800, 32)}
# (model, overrides or MoE shape key, micro-batch, seq, precision flags, routing or None for a dense run)
TP_RUNS = [
    ("llama-2-7b", {**DENSE, "num_key_value_heads": 4}, 2, 64, ["--dtype", "float32"]),
    ("llama-3.1-8b", DENSE, 2, 128, ["--dtype", "bfloat16"]),
    ("mistral-7b", DENSE, 4, 64, ["--dtype", "float32"]),
    ("qwen2.5-7b", {**DENSE, "num_attention_heads": 8, "num_key_value_heads": 4}, 2, 64, ["--dtype", "float32"]),
    ("qwen2.5-0.5b", {**DENSE, "num_attention_heads": 8, "num_key_value_heads": 4}, 2, 96,
     ["--dtype", "bfloat16"]),
    ("llama-2-13b", {**DENSE, "num_hidden_layers": 4, "num_key_value_heads": 4}, 3, 80, ["--dtype", "float32"]),
    # tied embeddings: from_pretrained builds untied, shards, loads, then ties the LM head to the embedding
    ("qwen2.5-0.5b", {**DENSE, "tie_word_embeddings": True}, 2, 64, ["--dtype", "float32"]),
    ("qwen2.5-1.5b", {**DENSE, "tie_word_embeddings": True, "num_hidden_layers": 4}, 3, 48, ["--dtype", "bfloat16"]),
    # uneven shards: DTensor splits the MLP width and the vocabulary as torch.chunk does (ceil first)
    ("mistral-7b", {**DENSE, "intermediate_size": 251}, 2, 64, ["--dtype", "float32"]),
    ("llama-2-7b", {**DENSE, "num_key_value_heads": 4, "vocab_size": 1001}, 2, 64, ["--dtype", "float32"]),
    ("llama-3.1-8b", {**DENSE, "num_key_value_heads": 4, "intermediate_size": 250, "vocab_size": 1002}, 2, 48,
     ["--dtype", "bfloat16", "--tp", "4"]),
]
# FSDP2 as transformers applies it: from_pretrained(distributed_config=DistributedConfig(fsdp_size=N[,
# fsdp_mixed_precision=True])), the model's own FSDP plan (embedding and layers resharded, the final norm and the LM
# head one group kept gathered, then the root), against `--strategy fsdp --fsdp-wrap transformers`
FSDP = ["--tp", "1", "--strategy", "fsdp", "--fsdp-wrap", "transformers"]
FSDP_TP = ["--tp", "2", "--strategy", "fsdp", "--fsdp-wrap", "transformers"]
MIXED = ["--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype", "fp32"]
FSDP_RUNS = [
    ("llama-2-7b", {**DENSE, "num_key_value_heads": 4}, 2, 64, [*FSDP, "--world-size", "2", "--dtype", "float32"]),
    ("llama-3.1-8b", DENSE, 2, 96, [*FSDP, "--world-size", "2", "--dtype", "bfloat16"]),
    ("mistral-7b", DENSE, 2, 64, [*FSDP, *MIXED, "--world-size", "2", "--dtype", "float32"]),
    ("qwen2.5-0.5b", {**DENSE, "tie_word_embeddings": True}, 2, 64, [*FSDP, "--world-size", "2", "--dtype",
                                                                     "float32"]),
    ("qwen2.5-7b", {**DENSE, "intermediate_size": 250, "vocab_size": 1002}, 2, 48,
     [*FSDP, "--world-size", "4", "--dtype", "float32"]),  # dim 0 of 250 and 1002 over 4 ranks: uneven shards
    ("llama-2-13b", {**DENSE, "num_hidden_layers": 4, "num_key_value_heads": 4}, 3, 48,
     [*FSDP, *MIXED, "--world-size", "4", "--dtype", "float32"]),
    ("mixtral-8x7b", "moe", 2, 64, [*FSDP, "--world-size", "2", "--dtype", "float32"]),
    # FSDP2 x TP: DistributedConfig(tp_size=2, fsdp_size=2) on 4 ranks, TP innermost
    ("llama-2-7b", {**DENSE, "num_key_value_heads": 4}, 2, 64, [*FSDP_TP, "--world-size", "4", "--dtype", "float32"]),
    ("mistral-7b", DENSE, 2, 64, [*FSDP_TP, *MIXED, "--world-size", "4", "--dtype", "float32"]),
    ("qwen2.5-0.5b", {**DENSE, "tie_word_embeddings": True}, 2, 48, [*FSDP_TP, "--world-size", "4", "--dtype",
                                                                     "bfloat16"]),
    ("mixtral-8x7b", "moe", 2, 64, [*FSDP_TP, "--world-size", "4", "--dtype", "float32"]),
]
EP_RUNS = [(model, routing, precision)
           for model in ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "qwen2-57b-a14b", "deepseek-v2-lite",
                         "gpt-oss-20b")
           for routing, precision in (("balanced", "fp32"), ("collapsed", "fp32"), ("router", "fp32"),
                                      ("balanced", "bf16"))]
EP_BATCH = (4, 128)  # micro-batch, seq: 512 tokens, 1024 (token, slot) pairs, 128 per expert when balanced
HELDOUT_TP = [("llama-3.1-70b", {**DENSE, "num_hidden_layers": 5, "hidden_size": 192, "num_attention_heads": 6,
                                "num_key_value_heads": 2, "intermediate_size": 320}, 3, 80, ["--dtype", "bfloat16"])]
HELDOUT_EP = [("deepseek-v3", "balanced", "bf16"), ("qwen3-235b-a22b", "collapsed", "fp32"),
              ("mixtral-8x7b", "router", "bf16")]
# FSDP2 held out (`--heldout --only fsdp`): shapes and combinations none of FSDP_RUNS has, each predicted first
HELDOUT_FSDP = [
    ("qwen2.5-7b", {**DENSE, "num_hidden_layers": 5, "hidden_size": 96, "num_attention_heads": 6,
                    "num_key_value_heads": 2, "intermediate_size": 200}, 3, 40,
     [*FSDP, "--world-size", "2", "--dtype", "bfloat16"]),
    ("llama-3.1-8b", {**DENSE, "num_key_value_heads": 4, "intermediate_size": 192}, 2, 56,
     [*FSDP_TP, *MIXED, "--world-size", "4", "--dtype", "float32"]),
    ("olmoe-1b-7b", "moe", 2, 48, [*FSDP, *MIXED, "--world-size", "2", "--dtype", "float32"]),
]


def _command(verb: str, model: str, overrides: dict, micro_batch: int, seq_len: int, flags: list[str]) -> list[str]:
    tp = [] if "--tp" in flags else ["--tp", "2"]
    command = [sys.executable, "-m", "llmsim.app.cli", verb, "--model", model, "--micro-batch", str(micro_batch),
               "--seq-len", str(seq_len), *tp, *flags]
    for key, value in overrides.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    return command


def _ep(model: str, routing: str, precision: str) -> tuple[list, list[str]]:
    from llmsim.inputs.zoo import shrink

    flags = ["--ep", "2", "--dtype", "bfloat16" if precision == "bf16" else "float32"]
    return [model, shrink(model, *MOE_SHAPES[model]), *EP_BATCH], flags + ["--routing", routing]


def predicted(args: list, flags: list[str]) -> str:
    """llmsim's prediction per rank (and the worst routing's bound), before the run is measured."""
    flags = [f if f != "router" else "balanced" for f in flags]
    done = subprocess.run(_command("predict", *args, flags) + ["--format", "json"], capture_output=True, text=True)
    if done.returncode:
        return "refused: " + done.stderr.strip()[-300:]
    result = json.loads(done.stdout)
    text = "predicted " + " | ".join(f"rank {r['rank']}: {r['peak_allocated_bytes']:,} B" for r in result["ranks"])
    if result.get("routing_bound"):
        text += " | worst routing " + " | ".join(f"{r['peak_allocated_bytes']:,} B" for r in result["routing_bound"])
    return text


def measure(args: list, flags: list[str], out: Path) -> int:
    done = subprocess.run(_command("measure", *args, flags) + ["--recipe", "from-pretrained", "--out", str(out)],
                          capture_output=True, text=True)
    last = " | ".join((done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-2:])
    print(f"{args[0]:16} {args[2]}x{args[3]} {' '.join(flags):52} -> {last}", flush=True)
    return done.returncode


def unsettled() -> int:
    from llmsim.inputs.spec import TrainSetup, load_model_spec
    from llmsim.inputs.zoo import shrink
    from llmsim.measure.runs import measure_from_pretrained
    from llmsim.sim.strategies import Layout

    cases = [("mistral-7b", DENSE, TrainSetup(4, 64, load_dtype="float32"), Layout(world_size=2, tp=2), None),
             ("mixtral-8x7b", shrink("mixtral-8x7b", *MOE_SHAPES["mixtral-8x7b"]),
              TrainSetup(*EP_BATCH, ep=2, routing="collapsed", load_dtype="float32"),
              Layout(world_size=2, tp=2, ep=2), "collapsed")]
    for model, overrides, setup, layout, routing in cases:
        spec = load_model_spec(model, overrides)
        for settle in (True, False, False, False):
            rows = measure_from_pretrained(spec, setup, layout, routing, gloo_settle=settle)
            print(f"{model:14} {'settled  ' if settle else 'unsettled'} " +
                  " | ".join(f"rank {r['rank']}: {r['peak_allocated_bytes']:,} B" for r in rows), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heldout", action="store_true", help="the HELDOUT runs, each predicted first")
    parser.add_argument("--only", choices=["tp", "ep", "fsdp"], default=None)
    parser.add_argument("--unsettled", action="store_true", help="gloo's own timing, three repeats, nothing written")
    options = parser.parse_args()
    if options.unsettled:
        return unsettled()
    tp_runs, ep_runs = (HELDOUT_TP, HELDOUT_EP) if options.heldout else (TP_RUNS, EP_RUNS)
    failures = 0
    for model, overrides, micro_batch, seq_len, flags in tp_runs if options.only in (None, "tp") else []:
        case = [model, overrides, micro_batch, seq_len]
        if options.heldout:
            print(f"{model:16} {predicted(case, flags)}", flush=True)
        failures += measure(case, flags, HELDOUT_OUT if options.heldout else TP_OUT) != 0
    for model, overrides, micro_batch, seq_len, flags in ((HELDOUT_FSDP if options.heldout else FSDP_RUNS)
                                                          if options.only == "fsdp" else []):
        if overrides == "moe":
            from llmsim.inputs.zoo import shrink

            overrides = shrink(model, *MOE_SHAPES[model])
        case = [model, overrides, micro_batch, seq_len]
        if options.heldout:
            print(f"{model:16} {predicted(case, flags)}", flush=True)
        failures += measure(case, flags, HELDOUT_OUT if options.heldout else FSDP_OUT) != 0
    for model, routing, precision in ep_runs if options.only not in ("tp", "fsdp") else []:
        case, flags = _ep(model, routing, precision)
        if options.heldout:
            print(f"{model:16} {routing:9} {precision} {predicted(case, flags)}", flush=True)
        failures += measure(case, flags, HELDOUT_OUT if options.heldout else EP_OUT) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
