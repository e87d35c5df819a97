"""Pipeline parallelism with torch.distributed.pipelining: one stage per rank, GPipe or 1F1B; or several stages per
rank under interleaved 1F1B, looped BFS and the zero-bubble schedules.

The canonical PP step (what `--pp N` predicts and what a measured PP rank runs), for stage s of N:

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=...)          # no memory
    cut(model, s, N)            # the stage's layers; the other modules become nn.Identity (no parameters)
    [tensor parallel: transformers' TP plan over the stage's TP group]
    every parameter and buffer -> torch.empty_like(..., device="cpu"); model.init_weights()
    model.to(bf16); model.train(); activation checkpointing         # as the canonical step
    model.forward = stage forward: ids -> hidden (first), hidden -> hidden, hidden -> logits (last)
    stage = PipelineStage(model, s, N, cpu, input_args=..., output_args=...)   # shapes given: no inference
    schedule = ScheduleGPipe | Schedule1F1B(stage, n_microbatches, loss_fn=model.loss_function)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, vocab, (micro_batch * n_microbatches, seq_len))
    3 times: schedule.step(x) | schedule.step() | schedule.step(target=x, losses=[]);
             opt.step(); opt.zero_grad(set_to_none=True)

The cut follows transformers' own rule and plan (transformers/distributed/pipeline_parallel.py):
`layer_range_for_rank` gives stage s the layers [start, end), the remainder one each to the first stages;
the modules the config's `base_model_pp_plan` lists before the layers (the embedding, GPT-NeoX's embedding
dropout) stay on the first stage, those after them (the final norm) and the LM head (the model's `_pp_plan`)
on the last (a tied embedding stays on the last stage too, as transformers keeps it there to tie the head).
A user-given split (`--pp-split`) replaces the rule. `loss_fn` is transformers' own causal-LM loss
(`model.loss_function`: logits upcast to fp32, labels shifted), so the last stage computes the loss the
single-process step computes inside the forward.
`schedule.step` keeps torch's default `return_outputs=True`: the last stage concatenates the micro-batches'
logits into one tensor, as every caller that does not turn it off gets.

Several stages a rank (`ScheduleInterleaved1F1B`, Megatron's virtual pipeline; `ScheduleLoopedBFS`; the zero-bubble
schedules): the model is cut into pp x stages_per_rank stages as above (`layer_range` over that many), and rank r
holds stages r, r + pp, r + 2 pp, ... (`rank_stages`: torch's looped schedules map stage s to rank s % pp), or r and
2 pp - 1 - r under ZBV and DualPipeV (a V). Each is its own cut model, with its own PipelineStage (and its own
DistributedDataParallel or fully_shard); one AdamW steps all of the rank's parameters, as one optimizer over a list
of modules does in a plain script; `Schedule...(stages, n_microbatches, loss_fn)`, whose `step` gets the batch on the
rank with stage 0 and the labels on the rank with the last stage (rank 0 both in a V).

The predictor runs this under FakeTensorMode on a fake process group whose rank is the stage's: the
sends and receives allocate their buffers as the real ones do and move no data.
"""
from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from llmsim.errors import InputError


class Schedule(str, Enum):
    GPIPE = "gpipe"  # torch.distributed.pipelining.ScheduleGPipe: all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: warm-up forwards, then one forward / one backward
    # ScheduleInterleaved1F1B: several stages per rank (TrainSetup.stages_per_rank), stage s on rank s % pp
    INTERLEAVED_1F1B = "interleaved-1f1b"
    # ScheduleLoopedBFS: the same stages per rank, each rank running every ready micro-batch of its earliest stage
    LOOPED_BFS = "looped-bfs"
    # the zero-bubble schedules split each backward into the input's gradient and, later, the weights'
    INTERLEAVED_ZERO_BUBBLE = "interleaved-zero-bubble"  # ScheduleInterleavedZeroBubble (ZB1P), looped stages
    ZBV_ZERO_BUBBLE = "zbv-zero-bubble"  # ScheduleZBVZeroBubble: 2 stages a rank placed in a V
    DUALPIPEV = "dualpipev"  # ScheduleDualPipeV (DeepSeek's DualPipe, V placement): 2 stages a rank

    @property
    def schedule_class(self):
        from torch.distributed import pipelining

        return getattr(pipelining, {
            Schedule.GPIPE: "ScheduleGPipe", Schedule.ONE_F_ONE_B: "Schedule1F1B",
            Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B", Schedule.LOOPED_BFS: "ScheduleLoopedBFS",
            Schedule.INTERLEAVED_ZERO_BUBBLE: "ScheduleInterleavedZeroBubble",
            Schedule.ZBV_ZERO_BUBBLE: "ScheduleZBVZeroBubble", Schedule.DUALPIPEV: "ScheduleDualPipeV"}[self])

    @property
    def multi_stage(self) -> bool:
        """Whether the schedule takes a list of stages per rank (torch's PipelineScheduleMulti)."""
        return self not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)

    @property
    def v_shaped(self) -> bool:
        """Whether torch places the stages in a V (`generate_stage_to_rank_mapping(style="v")`): rank r holds stages
        r and 2 pp - 1 - r, so the last rank holds the middle two and rank 0 the first and the last."""
        return self in (Schedule.ZBV_ZERO_BUBBLE, Schedule.DUALPIPEV)

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as the input's gradient, then the weights' (zero bubble)."""
        return self in (Schedule.INTERLEAVED_ZERO_BUBBLE, Schedule.ZBV_ZERO_BUBBLE, Schedule.DUALPIPEV)


def rank_stages(rank: int, pp: int, stages_per_rank: int, schedule: Schedule = Schedule.ONE_F_ONE_B) -> list[int]:
    """The stages rank `rank` of `pp` holds: itself under one stage per rank; r, r + pp, ... under a looped
    schedule (torch's `stage_index_to_group_rank`: stage s on rank s % pp); r and 2 pp - 1 - r in a V."""
    if schedule.v_shaped:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank)]


def layers_per_stage(num_stages: int, num_layers: int, split: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Each stage's number of layers: `split` when the user gives it, else transformers'
    `PipelineStage.layer_range_for_rank` (the remainder one each to the first stages)."""
    if split is not None:
        return split
    per_stage, remainder = divmod(num_layers, num_stages)
    return tuple(per_stage + (stage < remainder) for stage in range(num_stages))


def layer_range(stage: int, num_stages: int, num_layers: int,
                split: tuple[int, ...] | None = None) -> tuple[int, int]:
    """Stage `stage`'s layers [start, end) (`layers_per_stage`)."""
    counts = layers_per_stage(num_stages, num_layers, split)
    start = sum(counts[:stage])
    return start, start + counts[stage]


def check_pipeline(config, pp: int, n_microbatches: int, schedule: Schedule,
                   split: tuple[int, ...] | None = None, precision=None, stages_per_rank: int = 1) -> None:
    if schedule.multi_stage != (stages_per_rank > 1):
        raise InputError(f"schedule {schedule.value} runs one stage per rank: stages-per-rank({stages_per_rank}) "
                         "must be 1; several stages per rank run under schedule interleaved-1f1b, looped-bfs, "
                         "interleaved-zero-bubble, zbv-zero-bubble or dualpipev"
                         if not schedule.multi_stage else
                         f"schedule {schedule.value} runs several stages on each rank: stages-per-rank"
                         f"({stages_per_rank}) must be >= 2 (Megatron's virtual pipeline size)")
    if stages_per_rank > 1:
        _check_multi_stage(config, pp, n_microbatches, split, stages_per_rank, schedule)
    if split is not None and (len(split) != pp or min(split) < 1 or sum(split) != config.num_hidden_layers):
        raise InputError(f"pp-split({','.join(map(str, split))}) must give pp({pp}) stages of >= 1 layer summing to "
                         f"the number of layers({config.num_hidden_layers})")
    if pp == 1:
        return
    if precision is not None and precision.value == "fp16-autocast":
        raise InputError("precision fp16-autocast with pp > 1 is not modelled (torch's pipeline schedules take no "
                         "GradScaler); modelled with pp: fp32, bf16, fp16, bf16-autocast")
    if schedule is Schedule.ONE_F_ONE_B and n_microbatches < pp:
        raise InputError(f"schedule 1f1b needs microbatches({n_microbatches}) >= pp({pp}) (torch's Schedule1F1B); "
                         f"valid: microbatches >= {pp}, or schedule gpipe")
    layers = int(config.num_hidden_layers)
    if pp > layers:
        raise InputError(f"pp({pp}) is larger than the number of layers({layers}); valid pp: 1..{layers}")
    if not getattr(config, "base_model_pp_plan", None):
        raise InputError(f"model type {config.model_type!r} has no pipeline plan in transformers "
                         "(base_model_pp_plan); pp must be 1")


def _check_multi_stage(config, pp: int, n_microbatches: int, split, stages_per_rank: int,
                       schedule: Schedule) -> None:
    """What torch's multi-stage schedules and the cut into pp x stages_per_rank stages refuse, as one line each."""
    if pp < 2:
        raise InputError(f"schedule {schedule.value} needs a pipeline: pp({pp}) must be >= 2")
    stages, layers = pp * stages_per_rank, int(config.num_hidden_layers)
    if stages > layers:
        raise InputError(f"pp({pp}) x stages-per-rank({stages_per_rank}) = {stages} stages is more than the "
                         f"number of layers({layers}); valid stages-per-rank: 2..{max(layers // pp, 1)}")
    if split is not None:
        raise InputError(f"pp-split with schedule {schedule.value} is not modelled: its stages take transformers' "
                         "balanced split over pp x stages-per-rank stages")
    if schedule.v_shaped and stages_per_rank != 2:
        raise InputError(f"schedule {schedule.value} places exactly 2 stages on each rank (a V): stages-per-rank"
                         f"({stages_per_rank}) must be 2")
    if schedule is Schedule.DUALPIPEV and n_microbatches < 2 * pp:
        raise InputError(f"schedule dualpipev needs microbatches({n_microbatches}) >= its {2 * pp} stages (torch's "
                         f"ScheduleDualPipeV); valid: microbatches >= {2 * pp}")
    if schedule not in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZERO_BUBBLE):
        return
    rounds = max(1, n_microbatches // pp)  # torch's flexible interleaving: micro-batches in rounds of about pp
    if n_microbatches % rounds:
        valid = [n for n in range(1, 4 * pp + 1) if n % max(1, n // pp) == 0]
        raise InputError(f"schedule {schedule.value} runs microbatches({n_microbatches}) in {rounds} rounds of "
                         f"microbatches // pp({pp}), which must divide them (torch's {schedule.schedule_class.__name__}); "
                         f"valid up to {4 * pp}: {', '.join(map(str, valid))}")


def cut(model: nn.Module, stage: int, num_stages: int, keep: int | None = None,
        split: tuple[int, ...] | None = None) -> None:
    """Keep stage `stage`'s share of the model (module docstring); call it on the meta model. `keep` keeps only
    the first `keep` of the stage's layers (the predictor's reduced-depth trace, llmsim/model/trace.py)."""
    base = getattr(model, model.base_model_prefix)
    plan = list(base.config.base_model_pp_plan)
    layers_at = plan.index("layers")
    start, end = layer_range(stage, num_stages, len(base.layers), split)
    if keep is not None:
        end = min(end, start + keep)
    base.layers = nn.ModuleList(base.layers[start:end])
    base.config.num_hidden_layers = end - start  # the decoder loop runs `self.layers[:num_hidden_layers]`
    if getattr(base.config, "layer_types", None):
        base.config.layer_types = base.config.layer_types[start:end]
    last = stage == num_stages - 1
    tied = getattr(model.config, "tie_word_embeddings", False)
    if stage > 0:
        for name in plan[:layers_at]:
            if not (tied and last and name == plan[0]):  # transformers keeps a tied embedding on the last stage
                setattr(base, name, nn.Identity())
    if not last:
        for name in plan[layers_at + 1:]:
            setattr(base, name, nn.Identity())
        model.set_output_embeddings(nn.Identity())  # the `_pp_plan`'s LM head (GPT-NeoX calls it embed_out)
        if tied:  # no LM head here to tie to the embedding (transformers: `all_tied_weights_keys = {}`)
            model.all_tied_weights_keys = {}


def layers_prefix(config) -> str:
    """The FQN of the decoder layers that `cut` slices (`<base_model_prefix>.layers`, e.g. "model.layers"). A
    stage's model keeps its slice as a new ModuleList, so its trace names the stage's layers from 0: layer i of
    stage s is the model's layer `layer_range(s, ...)[0] + i`."""
    from transformers import AutoModelForCausalLM

    return f"{AutoModelForCausalLM._model_mapping[type(config)].base_model_prefix}.layers"


def stage_forward(model: nn.Module, stage: int, num_stages: int):
    """The forward torch's PipelineStage calls: one tensor in, one tensor out."""
    base = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    first, last = stage == 0, stage == num_stages - 1

    def forward(x: torch.Tensor) -> torch.Tensor:
        hidden = base(**({"input_ids": x} if first else {"inputs_embeds": x}), use_cache=False).last_hidden_state
        return head(hidden) if last else hidden
    return forward


def stage_io(stage: int, num_stages: int, micro_batch: int, seq_len: int, hidden: int, vocab: int,
             dtype: torch.dtype, logits_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of one micro-batch (meta tensors), so the stage needs no shape inference. The
    hidden states keep the weights' dtype (under autocast the residual stream stays fp32); the logits come out of
    the LM head in `logits_dtype` (autocast's)."""
    shape = (micro_batch, seq_len)
    x = (torch.empty(shape, dtype=torch.int64, device="meta") if stage == 0
         else torch.empty((*shape, hidden), dtype=dtype, device="meta", requires_grad=True))
    last = stage == num_stages - 1
    y = torch.empty((*shape, vocab if last else hidden), dtype=logits_dtype if last else dtype, device="meta",
                    requires_grad=True)  # the stage's gradients flow back through it
    return x, y
