"""What `predict --suggest`'s pipeline split does, step by step (llmsim/sim/partition.py): for each job, every
stage's need, the line the search starts from (what the stage needs besides its layers, and what each of its layers
holds at its peak), each split it tries with every stage's predicted need, and the split it offers. The jobs are the
ones the closing note of 2026-12-06 quotes.

Run: python experiments/explore_pp_split.py  (about a minute on 2 cores; output in experiments/explore_pp_split.out)"""
from llmsim.app import advice
from llmsim.app.options import build_parser, inputs
from llmsim.inputs.gpus import load_gpu
from llmsim.sim import partition
from llmsim.sim.pipeline import predict

JOBS = [  # (predict's flags, GPU, margin %)
    ("--model llama-2-7b --seq-len 4096 --micro-batch 1 --precision bf16 --pp 4 --schedule 1f1b --microbatches 8",
     "a100-40gb", 15),
    ("--model llama-3.1-8b --seq-len 4096 --micro-batch 1 --precision bf16 --pp 4 --schedule 1f1b --microbatches 4",
     "a100-40gb", 5),
    ("--model llama-2-70b --seq-len 4096 --micro-batch 1 --precision bf16 --pp 4 --tp 4 --schedule 1f1b "
     "--microbatches 8", "h100-80gb", 5),
]
GiB = 2 ** 30


def gib(values) -> str:
    return " / ".join(f"{value / GiB:.2f}" for value in values)


def main() -> None:
    searched = partition.rebalanced

    def shown(split, needed, lines, predicted):
        print(f"  split {','.join(map(str, split))}: needs {gib(needed)} GiB")
        print(f"  lines: besides the layers {gib(line.fixed_bytes for line in lines)} GiB; "
              f"a layer {gib(line.per_layer_bytes for line in lines)} GiB")

        def each(trial):
            trial_needed = predicted(trial)
            print(f"  tried {','.join(map(str, trial))}: needs {gib(trial_needed)} GiB")
            return trial_needed
        return searched(split, needed, lines, each)
    partition.rebalanced = shown
    for flags, gpu_name, margin in JOBS:
        print(f"llmsim predict {flags} --gpu {gpu_name} --margin {margin}")
        spec, setup, layout = inputs(build_parser().parse_args(["predict", *flags.split()]))
        gpu = load_gpu(gpu_name, margin / 100)
        given = predict(spec, setup, layout, gpu)
        print(f"  verdict {given.verdict}")
        offered = advice._split_suggestion(spec, setup, layout, gpu, given.alloc_conf, given)
        print(f"  offered: {offered.change}, needs {offered.needed_bytes / GiB:.2f} GiB, {offered.verdict}"
              if offered is not None else "  offered: none")


if __name__ == "__main__":
    main()
