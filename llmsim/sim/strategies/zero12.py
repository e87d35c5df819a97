"""DeepSpeed ZeRO stages 1 and 2 (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeed 0.19), client AdamW.

Per rank, on top of the single-process forward and backward:
- initialize: the parameters are copied into one flat buffer of F = ceil(N / (2W)) * 2W elements
  (`nccl_start_alignment_factor` 2; padding at the end) while the originals still exist, then the
  originals are freed (`_update_model_bit16_weights`); the rank's fp32 master partition of P = F / W
  elements is a separate copy (`.clone().to(fp32)`; in bf16 through a bf16 clone); `initialize_optimizer_states`
  allocates and drops a zero fp32 gradient of P elements. Adam's states come lazily at the first step.
- backward: the first gradient hook allocates the reduction buffer of `reduce_bucket_size` elements (two with
  `overlap_comm`), freed at the end of every backward. Stage 2 copies each gradient into it as autograd
  produces it (the autograd storage is freed at once); stage 1 keeps the full gradients until the end of
  backward and then does the same in parameter order. A bucket is flushed when it would overflow: its
  all-reduce flattens a copy of it, then the slices of this rank's partition are copied into
  `grads_in_partition` (the whole numel of every parameter overlapping the partition), allocated at the first
  such copy. A gradient larger than the bucket bypasses it and is reduced alone.
- step: the gradient norm upcasts each slice to float64 one at a time; the partition's gradients are flattened
  (P elements, then converted to fp32 in bf16), `grads_in_partition` is freed, AdamW updates the flat fp32
  partition (single-tensor path on CPU: states 2 * P fp32 at the first step, `sqrt` and `denom` temporaries of
  P fp32 each), the fp32 gradient is freed and the parameters are all-gathered in place into the flat buffer.
  Another client optimizer (SGD, Adafactor, bitsandbytes...) runs its own step on the flat partition: a vector
  (llmsim/sim/strategies/flat_optimizer.py).
Gradient accumulation (gradient_accumulation_steps n; engine.step() steps at every n-th micro-step): stage 1 keeps
the gradients on the parameters until the boundary (autograd accumulates into them, as in one process) and the
buffers the window's first hook allocated until the boundary's epilogue; stage 2 reduces every backward and sets
every `.grad` to None after it, so each later micro-step's gradients are new storages (the trace names them,
TrainSetup.label_micro_grads) and its epilogue allocates a second `grads_in_partition`, adds it into the first
(kept alive in `all_grad_tensors`) and frees it; the partition is padded at the boundary only
(`independent_gradient_partition_epilogue`, `get_flat_partition`).
Each of the optimizer's param groups is flattened, partitioned and stepped apart (`Groups`): the canonical step's
AdamW has one, the HF Trainer's two (weight decay, then biases and norms without: zero_common.optimizer_groups), so
under the Trainer each rank's partition is its slice of each group's buffer, with a master, padding, flattened
gradient and optimizer step per group, and one `grads_in_partition` over them all.
The batch is made after `deepspeed.initialize` returns, so initialize's events go before the build's input row.
With LoRA the optimizer's groups keep only the parameters that require grad (`is_optimized_parameter`): the
adapters alone are flattened, partitioned, bucketed and stepped; the frozen base keeps its own storage. The engine
casts every parameter, the adapters too, to bf16 after get_peft_model (`_cast_module_mixed_precision`; the trace
runs that cast, TrainSetup.cast_after_peft).
Issue 5's loss levers and checkpoint offload (measured in data/measurements/tier2_levers_zero_cpu.csv) change the
single-process forward and backward that every rank keeps, not DeepSpeed's part: Liger's fused linear
cross-entropy makes the LM head's weight gradient in the forward and hands that storage to autograd in the
backward, where the gradient hook buckets and frees it like any other (a gradient row of the forward is one of the
rows a rank acts on); TRL's chunked NLL makes it in its own backward; save_on_cpu's host copies of the
checkpointed inputs are host memory, reported apart on every rank.

Every rank from one walk. Two ranks' walks differ only where the rank's partition decides: where
`grads_in_partition` is made (the first flushed bucket holding one of its slices) and its size, under stage 1
whether an extra-large gradient is freed at its flush (the rank's) or with the others at the end of the backward,
the padding at the boundary, and the gradient norm's float64 copy of each slice. `_Template` walks the step once
for no rank in particular and leaves a mark at each of those places; `_Ranks` resolves a rank's marks (a few
hundred), inserts its events there, moves the serials of the strategy's later allocations up by the allocations it
added before them, and splices its peak into the template's running sums (by category too), without building
its timeline (`LazyRanks.events`); the timeline is built when asked for. Llama-2-70B, bf16, checkpointing, 1,024
ranks: 0.1-0.3 ms a rank, against 35-48 ms for a rank's own walk. `walk_rank`, that own walk, stays the reference
(tests/test_zero12_ranks.py) and the fallback where the template cannot stand for every rank (`_Diverges`: a row
that touches an extra-large gradient after its stage-1 flush; no traced step has one).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from llmsim.enums import Category, Device, Optimizer, Phase, Precision
from llmsim.model.offload import HOST_CATEGORIES
from llmsim.sim.peaks import Peak
from llmsim.model.step import uses_peft
from llmsim.sim.strategies.events import (LazyRanks, RankEvents, Spliced, live_at_end_of_build, per_timeline,
                                     trainable_names)
from llmsim.sim.strategies.flat_optimizer import FlatOptimizer
from llmsim.model.tracker import GRAD_READY, NO_BLOCK
from llmsim.sim.strategies.zero_common import (FP32_BYTES, FP64_BYTES, EventWriter, Param, construct_optimizer,
                                           host_buffer, rank_writer, optimizer_groups, optimizer_of, parameters,
                                           rows_of, step_optimizer, own_runs, torch_fused, walk_phases, frame_of)

# Where a gradient's storage is made: in the backward, or in the forward by a loss that computes the LM head's
# weight gradient there (Liger's fused linear cross-entropy keeps it for the backward, which hands it to autograd)
GRADIENT_PHASES = (Phase.FORWARD.value, Phase.BACKWARD.value)
# the values `_row` compares every row with (an enum's `.value` is a property lookup)
_BUILD, _INPUT, _GRADIENT = Phase.BUILD.value, Category.INPUT.value, Category.GRADIENT.value
NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: the flat buffer is padded to a multiple of 2 * world size
SCALAR_FP32_BYTES = 4  # a 0-d fp32 tensor


@dataclass(frozen=True)
class Partitioning:
    params: list[Param]
    offsets: list[int]
    flat_numel: int
    partition_numel: int

    @property
    def index(self) -> dict[str, int]:
        return self._index

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {p.name: i for i, p in enumerate(self.params)})

    @classmethod
    def of(cls, params: list[Param], world_size: int) -> "Partitioning":
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel
        alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
        flat = math.ceil(total / alignment) * alignment
        return cls(params, offsets, flat, flat // world_size)

    def partition_ids(self, name: str) -> list[int]:
        """Partitions a parameter's slices fall in, by offset (`param_to_partition_ids`)."""
        index = self.index[name]
        first, last = self.offsets[index], self.offsets[index] + self.params[index].numel - 1
        return list(range(first // self.partition_numel, last // self.partition_numel + 1))

    def slices(self, rank: int) -> dict[str, int]:
        """Parameter name -> numel of its slice inside `rank`'s partition."""
        lo, hi = rank * self.partition_numel, (rank + 1) * self.partition_numel
        out = {}
        for p, off in zip(self.params, self.offsets):
            overlap = min(off + p.numel, hi) - max(off, lo)
            if overlap > 0:
                out[p.name] = overlap
        return out


@dataclass(frozen=True)
class Groups:
    """The optimizer's param groups as DeepSpeed keeps them (`bit16_groups`): each flattened into a buffer of its
    own and partitioned over the ranks (`parts`, one Partitioning each, in the order the group is flattened:
    `round_robin_gradients` reorders it), and the parameters group by group in model order (`order`: what stage
    1's end-of-backward reduction walks). A parameter is in one group; a rank's partition is its slice of every
    group's buffer."""

    parts: tuple[Partitioning, ...]
    order: tuple[Param, ...]

    @classmethod
    def of(cls, groups: list[list[Param]], world_size: int, round_robin_gradients: bool) -> "Groups":
        flattened = [round_robin(group, world_size) if round_robin_gradients else group for group in groups]
        return cls(tuple(Partitioning.of(group, world_size) for group in flattened),
                   tuple(p for group in groups for p in group))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_part_of", {p.name: part for part in self.parts for p in part.params})

    @property
    def params(self) -> list[Param]:
        return [p for part in self.parts for p in part.params]

    def partition_ids(self, name: str) -> list[int]:
        return self._part_of[name].partition_ids(name)

    def group_slices(self, rank: int) -> list[dict[str, int]]:
        return [part.slices(rank) for part in self.parts]

    def slices(self, rank: int) -> dict[str, int]:
        """Parameter name -> numel of its slice in `rank`'s partitions, group by group."""
        return {name: numel for sliced in self.group_slices(rank) for name, numel in sliced.items()}


@dataclass
class _Backward:
    """The reduction state of one backward pass."""

    buffers: list[int] = field(default_factory=list)  # serials of the ipg buffers
    bucket: list[str] = field(default_factory=list)
    elements: int = 0
    extra_large: str | None = None
    gip: int | None = None  # serial of grads_in_partition
    grads: dict[str, tuple[int, int]] = field(default_factory=dict)  # param -> (serial, bytes) still alive


class _Rank:
    def __init__(self, timeline: pd.DataFrame, rows: list[tuple], layout, setup, rank: int, own) -> None:
        self.zero = layout.deepspeed.zero()
        self.stage = layout.deepspeed.stage
        self.elem = 2 if setup.precision is Precision.BF16 else FP32_BYTES
        trainable = _trainable(parameters(timeline, self.elem), timeline, setup)
        self.groups = Groups.of(optimizer_groups(trainable, timeline), layout.world_size,
                                bool(self.zero.round_robin_gradients))
        self.partitions = [part.partition_numel for part in self.groups.parts]  # P per group
        self.numel = {p.name: p.numel for p in self.groups.params}
        self.offload = layout.deepspeed.offloads_optimizer  # ZeRO-Offload: the optimizer on the host
        # offload's host buffers are pinned copies: pin_memory, on a GPU (DeepSpeed's CPU accelerator pins nothing)
        self.pins = (self.offload and bool(self.zero.offload_optimizer.pin_memory)
                     and setup.device is Device.CUDA)
        self.accumulators: set[str] = set()  # offload, stage 2: the host gradient accumulators made so far
        self.mine_by_group = self.groups.group_slices(rank)
        self.mine = {name: numel for sliced in self.mine_by_group for name, numel in sliced.items()}
        self.gip_bytes = sum(self.numel[name] for name in self.mine) * self.elem
        self.rank = rank
        self.optimizer, self.foreach = optimizer_of(layout.deepspeed, setup)
        self.fused = torch_fused(layout.deepspeed, setup)
        # another client optimizer: its own step on the flat fp32 partition (llmsim/sim/strategies/flat_optimizer.py)
        self.client = (FlatOptimizer(setup.optimizer, self.partitions, setup.steps, self.foreach, self.fused)
                       if self.optimizer == "client" and setup.optimizer is not Optimizer.ADAMW else None)
        self.timeline = timeline
        self.rows = rows
        self.own = own  # the rows `_row` acts on (the backward's gradients, the batch), the client optimizer's left out
        self.w = rank_writer(timeline, setup)
        self.bw = _Backward()
        self.grad_accum = setup.grad_accum
        self.micro = 0  # the micro-step of the optimizer step whose backward runs (engine.micro_steps % n)
        self.initialized = False
        self.norms: list[int] = []  # offload: the per-parameter gradient norms kept until the step (0-d f64, device)
        self.global_norm: int | None = None  # offload: the last step's global norm (0-d fp32, host)
        self.staging: tuple[int, int] | None = None  # offload, pinned: a staging buffer's pageable original
        self.padding: list[tuple[int, int] | None] = []  # each group's padding at the boundary (`_pad`)
        self.gip: int | None = None  # the window's grads_in_partition, kept to the step
        # the last group with slices in this rank's partition: its release frees grads_in_partition
        self.last_gip_group = max((g for g, mine in enumerate(self.mine_by_group) if mine), default=None)
        live = live_at_end_of_build(timeline, Category.PARAMETER)
        storage = {name: (int(serial), int(nbytes)) for serial, nbytes, name in
                   zip(live.index, live["nbytes"], live["name"])}
        # each group's parameters' own storages, which its flattening frees
        self.group_storages = [[storage[p.name] for p in part.params] for part in self.groups.parts]

    # ---- initialize --------------------------------------------------------------------------------
    def initialize(self) -> None:
        """Group by group: the flat buffer, the originals freed, the fp32 master partition (under offload its host
        side, `_offload_group`); then `initialize_optimizer_states`' zero fp32 gradient of every group's partition,
        all made and then all dropped (under offload, `_initialize_offload`: kept on the host)."""
        construct_optimizer(self.w, self.optimizer)
        for part, storages in zip(self.groups.parts, self.group_storages):
            if part.flat_numel:
                self.w.alloc(part.flat_numel * self.elem, Category.PARAMETER)
            for serial, nbytes in storages:
                self.w.free(serial, nbytes, Category.PARAMETER)
            if self.offload:
                self._offload_group(part.partition_numel)
            elif self.elem != FP32_BYTES:
                clone = self.w.alloc(part.partition_numel * self.elem, Category.TEMPORARY)
                self.w.alloc(part.partition_numel * FP32_BYTES, Category.MASTER_WEIGHTS)
                self.w.free(clone, part.partition_numel * self.elem, Category.TEMPORARY)
            else:
                self.w.alloc(part.partition_numel * FP32_BYTES, Category.MASTER_WEIGHTS)
        if self.offload:
            self._initialize_offload()
            return
        zeros = [self.w.alloc(p * FP32_BYTES, Category.TEMPORARY) for p in self.partitions]
        for serial, p in zip(zeros, self.partitions):
            self.w.free(serial, p * FP32_BYTES, Category.TEMPORARY)

    def _offload_group(self, p: int) -> None:
        """A group's host side of ZeRO-Offload, made in the group's turn: the master partition, a host copy of a
        device clone, and a host staging buffer for the updated bf16/fp32 partition. With pin_memory on a GPU each
        host buffer is pinned as it is made (`get_accelerator().pin_memory(t)` is a pinned copy, the pageable one
        freed as its name is rebound); the staging buffer's pageable original lives in a local name until the next
        group's replaces it, the last until `__init__` returns (on the CPU pin_memory returns `t`: the rows measure
        the unpinned path)."""
        clone = self.w.alloc(p * self.elem, Category.TEMPORARY)
        host_buffer(self.w, p * FP32_BYTES, self.pins)  # the master partition
        self.w.free(clone, p * self.elem, Category.TEMPORARY)
        staging = self.w.alloc(p * self.elem, Category.HOST_OFFLOAD)
        if self.pins:  # its pinned copy; the pageable one lives on in a local name
            self.w.alloc(p * self.elem, Category.HOST_OFFLOAD)
            if self.staging is not None:
                self.w.free(*self.staging, Category.HOST_OFFLOAD)
            self.staging = (staging, p * self.elem)

    def _initialize_offload(self) -> None:
        """After the groups: `temp_grad_buffer_for_cpu_offload` (the largest parameter's numel, on the host, never
        read) and `temp_grad_buffer_for_gpu_offload` (the same on the device, for accumulation); each group's
        master partition's fp32 `.grad` on the host, kept (`initialize_optimizer_states`); the last staging buffer's
        pageable original freed as `__init__` returns."""
        largest = max(self.numel.values())
        host_buffer(self.w, largest * self.elem, self.pins)
        self.w.alloc(largest * self.elem, Category.REDUCE_BUCKET)
        for p in self.partitions:
            host_buffer(self.w, p * FP32_BYTES, self.pins)
        if self.staging is not None:  # `__init__` returns
            self.w.free(*self.staging, Category.HOST_OFFLOAD)
            self.staging = None

    def _initialize_once(self) -> None:
        if not self.initialized:
            self.initialized = True
            self.initialize()

    # ---- backward ----------------------------------------------------------------------------------
    def on_gradient(self, name: str) -> None:
        """`process_gradients`: the first hook of a backward sets up the buckets."""
        if not self.bw.buffers:
            count = 2 if self.zero.overlap_comm else 1
            self.bw.buffers = [self.w.alloc(self.zero.reduce_bucket_size * self.elem, Category.REDUCE_BUCKET)
                               for _ in range(count)]
        if self.stage == 2 or (self.zero.overlap_comm and self.boundary):  # `reduce_ready_partitions_and_...`
            self.reduce(name)

    @property
    def boundary(self) -> bool:
        """`engine.is_gradient_accumulation_boundary`: the last micro-step of an optimizer step."""
        return self.micro == self.grad_accum - 1

    def reduce(self, name: str) -> None:
        """`reduce_independent_p_g_buckets_and_remove_grads`."""
        numel = self.numel[name]
        if self.bw.elements + numel > self.zero.reduce_bucket_size:
            self.flush()
        if numel > self.zero.reduce_bucket_size:
            self.bw.extra_large = name
            if self.offload:  # `_offload_gradient_safety_enabled`: the gradient is cloned into its own storage
                serial, nbytes = self.bw.grads.pop(name)
                self.bw.grads[name] = (self.w.alloc(nbytes, Category.GRADIENT), nbytes)
                self.w.free(serial, nbytes, Category.GRADIENT)
        else:  # copied into the contiguous buffer: the autograd storage is freed
            self._free_grad(name)
        self.bw.bucket.append(name)
        self.bw.elements += numel

    def flush(self) -> None:
        """`reduce_ipg_grads`: all-reduce a flattened copy, keep this rank's slices."""
        if not self.bw.bucket:
            return
        if self._slice_runs(self.bw.bucket) > 1:  # one slice is all-reduced in place, no copy
            copy_bytes = self.bw.elements * self.elem
            copy = self.w.alloc(copy_bytes, Category.TEMPORARY)
            self.w.free(copy, copy_bytes, Category.TEMPORARY)
        self._keep_slices()
        self.bw.bucket, self.bw.elements, self.bw.extra_large = [], 0, None

    def _keep_slices(self) -> None:
        """The bucket's slices of this rank's partition go into `grads_in_partition`, made at the first of them
        (under offload, to the host: `_offload_slice`)."""
        for name in self.bw.bucket:
            if name in self.mine:
                if self.offload:
                    self._offload_slice(name)
                elif self.bw.gip is None:
                    self.bw.gip = self.w.alloc(self.gip_bytes, Category.GRADIENT)
            if name == self.bw.extra_large and (name in self.mine or self.stage == 2):
                self._free_grad(name)  # copied (`p.grad = None` after it), or cleared when not ours

    def _offload_slice(self, name: str) -> None:
        """`copy_grads_in_partition` under offload for a parameter in this rank's partition. Stage 2 off the
        boundary or past its first micro-step (`micro_step_id > 0`) accumulates on the host: the parameter's whole
        gradient into a host buffer of its own, made the first time and kept (`async_accumulate_grad_in_cpu_via_gpu`).
        At the boundary the slice's norm (a float64 copy, and its 0-d norm kept until the step) and, in bf16, an fp32
        copy of the slice, which goes to the host `.grad`."""
        if self.stage == 2 and (self.micro > 0 or not self.boundary) and name not in self.accumulators:
            self.accumulators.add(name)
            host_buffer(self.w, self.numel[name] * self.elem, self.pins)
        if not self.boundary:
            return
        numel = self.mine[name]
        upcast = self.w.alloc(numel * FP64_BYTES, Category.TEMPORARY)
        self.norms.append(self.w.alloc(FP64_BYTES, Category.GRADIENT))
        self.w.free(upcast, numel * FP64_BYTES, Category.TEMPORARY)
        if self.elem != FP32_BYTES:
            fp32 = self.w.alloc(numel * FP32_BYTES, Category.TEMPORARY)
            self.w.free(fp32, numel * FP32_BYTES, Category.TEMPORARY)

    def _slice_runs(self, bucket: list[str]) -> int:
        """`average_tensor` sends a bucket as one slice per run of consecutive same-partition pieces;
        `allreduce_bucket` flattens them into a copy only when there is more than one
        (torch's `_flatten_dense_tensors` returns a view of a single tensor)."""
        runs, previous = 0, None
        for name in bucket:
            for partition in self.groups.partition_ids(name):
                if partition != previous:
                    runs += 1
                previous = partition
        return runs

    def _free_grad(self, name: str) -> None:
        serial, nbytes = self.bw.grads.pop(name)
        self.w.free(serial, nbytes, Category.GRADIENT)

    def end_backward(self) -> None:
        """`engine.allreduce_gradients`. Stage 1 reduces at the accumulation boundary only: before it the
        gradients stay on the parameters (autograd accumulates into them) and the buffers the first hook made
        stay allocated. Stage 2 reduces every micro-step (`independent_gradient_partition_epilogue`): the first
        micro-step's `grads_in_partition` lives on in `all_grad_tensors` until the step, each later one's is added
        into it and freed as the epilogue returns; every `param.grad` is set to None."""
        if self.stage == 1 and not self.boundary:
            return
        if self.stage == 1 and not self.zero.overlap_comm:  # engine.allreduce_gradients -> reduce_gradients, in
            for p in self.groups.order:                        # parameter order (with overlap_comm the hooks did)
                if p.name in self.bw.grads:
                    self.reduce(p.name)
        self.flush()
        self._free_other_grads()
        for serial in self.bw.buffers:
            self.w.free(serial, self.zero.reduce_bucket_size * self.elem, Category.REDUCE_BUCKET)
        if self.offload:  # no grads_in_partition: the slices went to the host
            self.bw = _Backward()
            return
        if self.boundary:  # get_flat_partition pads the partition at the boundary
            self._pad()
        self._keep_gip(self.micro == 0 or self.stage == 1)
        self.bw = _Backward()

    def _free_other_grads(self) -> None:
        for name in list(self.bw.grads):  # gradients of other ranks' partitions are cleared
            self._free_grad(name)

    def _pad(self) -> None:
        """Each group's partition padded (`get_flat_partition`), group by group."""
        self.padding = []
        for p, mine in zip(self.partitions, self.mine_by_group):
            padding = (p - sum(mine.values())) * self.elem
            self.padding.append((self.w.alloc(padding, Category.GRADIENT), padding) if padding else None)

    def _keep_gip(self, first: bool) -> None:
        """The window's first reduction (`first`) keeps its `grads_in_partition`; a later one's is added into it
        and freed."""
        if first:
            self.gip = self.bw.gip
        elif self.bw.gip is not None:
            self.w.free(self.bw.gip, self.gip_bytes, Category.GRADIENT)

    # ---- step ----------------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """The norm over every group's slices, then group by group: its partition's gradients flattened (P, then
        converted to fp32 in bf16), its gradients and padding freed (`grads_in_partition`, one buffer for every
        group, with the last group that has slices here), the optimizer's step on its fp32 partition, the fp32
        gradient freed."""
        if self.offload:
            self._offload_step(step)
            return
        self._upcast_slices()
        for g, p in enumerate(self.partitions):
            flat_grad = self.w.alloc(p * self.elem, Category.GRADIENT) if p else None
            if self.elem != FP32_BYTES and p:  # .to(fp32) of the flattened bf16 gradients
                fp32_grad = self.w.alloc(p * FP32_BYTES, Category.GRADIENT)
                self.w.free(flat_grad, p * self.elem, Category.GRADIENT)
                flat_grad = fp32_grad
            self._free_partition_grads(g)
            if self.client is not None:
                self.client.step(self.w, step, g)
            elif p:
                step_optimizer(self.w, [p], step == 0, self.foreach, self.optimizer, self.fused)
            if flat_grad is not None:
                self.w.free(flat_grad, p * FP32_BYTES, Category.GRADIENT)

    def _offload_step(self, step: int) -> None:
        """The step on the host: the global norm from the kept per-parameter norms (a 0-d fp32 for the step, and
        one kept as the global norm until the next step's replaces it), then group by group clipping in place and
        the optimizer on the group's host partition and its host `.grad`, the update copied into the device
        partition; the per-parameter norms are dropped (`reset_cpu_buffers`) and everything all-gathered in
        place."""
        local = self.w.alloc(SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        kept = self.w.alloc(SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        for p in self.partitions:
            if p:  # host tensors: torch's for-loop AdamW (foreach is for accelerator tensors)
                step_optimizer(self.w, [p], step == 0, False, self.optimizer, self.fused, on_host=True)
        for serial in self.norms:
            self.w.free(serial, FP64_BYTES, Category.GRADIENT)
        self.norms = []
        self.w.free(local, SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        if self.global_norm is not None:
            self.w.free(self.global_norm, SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        self.global_norm = kept

    def _upcast_slices(self) -> None:
        for numel in self.mine.values():  # get_grad_norm_direct: g.to(float64) per slice, group by group
            upcast = self.w.alloc(numel * FP64_BYTES, Category.TEMPORARY)
            self.w.free(upcast, numel * FP64_BYTES, Category.TEMPORARY)

    def _free_partition_grads(self, group: int) -> None:
        """A group's gradients freed once flattened: its padding, and with the last group that has slices here the
        `grads_in_partition` buffer they all viewed."""
        if group == self.last_gip_group and self.gip is not None:
            self.w.free(self.gip, self.gip_bytes, Category.GRADIENT)
        if self.padding and self.padding[group] is not None:
            self.w.free(*self.padding[group], Category.GRADIENT)

    # ---- the walk --------------------------------------------------------------------------------------
    def run(self) -> pd.DataFrame:
        self.walk()
        return self.w.frame(self.timeline)

    def walk(self) -> None:
        walk_phases(self.rows, self._row, self._leave, self.w, self.own)

    def _row(self, row: tuple) -> None:
        if row[1] == _BUILD and row[6] == _INPUT:
            self.w.step, self.w.phase = row[0], row[1]
            self._initialize_once()  # the batch is made after deepspeed.initialize returns
            self.w.keep(row)
            return
        if row[6] == _GRADIENT and row[1] in GRADIENT_PHASES:
            self._gradient_row(row)
        else:
            self.w.keep(row)

    def _gradient_row(self, row: tuple) -> None:
        name, serial, delta = row[7], int(row[4]), int(row[5])
        if serial == GRAD_READY:  # DeepSpeed's post-accumulate-grad hook runs here
            self.on_gradient(name)
        elif delta > 0:
            self.w.keep(row)
            self.bw.grads[name] = (serial, delta)
        elif name in self.bw.grads and self.bw.grads[name][0] == serial:
            if self.micro > 0:  # a later micro-step's own gradient (TrainSetup.label_micro_grads), which the trace
                return          # adds into `.grad` and drops: under ZeRO-2, whose epilogue set `.grad` to None,
                                # autograd keeps it as `.grad` and the reduction frees it
            self.w.keep(row)  # autograd replaced the gradient storage itself
            del self.bw.grads[name]

    def _leave(self, step: int, phase: str) -> None:
        self.w.step, self.w.phase = step, phase
        if phase == Phase.BUILD.value:
            self._initialize_once()
        elif phase == Phase.BACKWARD.value:
            self.end_backward()
            self.micro += 1
        elif phase == Phase.OPTIMIZER.value:
            self.step(step)
            self.micro = 0


def round_robin(params: list[Param], world_size: int) -> list[Param]:
    """`round_robin_gradients`: the order DeepSpeed flattens (and so partitions) a group's parameters in,
    `_round_robin_reorder` (stage_1_and_2.py): the i-th parameter goes to list i % W, and the lists follow each
    other, so consecutive gradients of the backward belong to different ranks' partitions. The partitions'
    parameters are in this order (`round_robin_bit16_groups`); stage 1's end-of-backward reduction still walks
    the group in model order (`reduce_gradients` walks `bit16_groups`: Groups.order)."""
    return [p for first in range(world_size) for p in params[first::world_size]]


def _trainable(params: list[Param], timeline: pd.DataFrame, setup) -> list[Param]:
    """The parameters DeepSpeed flattens and partitions: those the optimizer owns (`is_optimized_parameter`:
    requires_grad). With peft (LoRA, trainable tokens) the frozen base keeps its own storage, outside the flat
    buffer, with no gradient hook, bucket slot, master weights or optimizer state; the adapters, a modules_to_save
    copy and trainable tokens' delta are flattened alone."""
    if not uses_peft(setup):
        return params
    names = trainable_names(timeline)
    return [p for p in params if p.name in names]


def plan(timeline: pd.DataFrame, layout, setup) -> LazyRanks:
    """Every rank's timeline, built when asked: from one template walk (`_Ranks`), or, where the template cannot
    stand for every rank (`_Diverges`), by walking the rank itself (`walk_rank`, the reference)."""
    rows, own = _walk_inputs(timeline)
    if layout.deepspeed.offloads_optimizer:  # every rank by its own walk (the template's marks are the device's only)
        return LazyRanks(layout.world_size, lambda rank: walk_rank(timeline, layout, setup, rank))
    try:
        ranks = _Ranks(timeline, rows, layout, setup, own)
    except _Diverges:
        return LazyRanks(layout.world_size, lambda rank: walk_rank(timeline, layout, setup, rank))
    return LazyRanks(layout.world_size, ranks.frame, ranks.events)


def walk_rank(timeline: pd.DataFrame, layout, setup, rank: int) -> pd.DataFrame:
    """`rank`'s timeline by a walk of its own over the whole step: the reference the template's ranks equal."""
    rows, own = _walk_inputs(timeline)
    return _Rank(timeline, rows, layout, setup, rank, own).run()


@per_timeline
def _walk_inputs(timeline: pd.DataFrame) -> tuple[list[tuple], list[tuple[int, int, int]]]:
    """The timeline's rows and the runs a rank's walk acts on (`own_runs`), the same for every layout and rank."""
    rows = rows_of(timeline)
    phase, category = timeline["phase"], timeline["category"]
    own = ((phase.isin(GRADIENT_PHASES) & (category == Category.GRADIENT.value))
           | ((phase == Phase.BUILD.value) & (category == Category.INPUT.value))).to_numpy()
    return rows, own_runs(rows, own, (phase == Phase.OPTIMIZER.value).to_numpy())


# ---- every rank from one walk ------------------------------------------------------------------------------
# What a rank's partition decides, left by the template walk as a mark where the rank's own walk would act:
_GIP = "gip"  # a flushed bucket (its names): allocate grads_in_partition if one is the rank's, none yet
_XL_MINE = "xl mine"  # stage 1, a gradient larger than the bucket: freed at its flush if it is the rank's
_XL_OTHER = "xl other"  # ... else with the other ranks' gradients at the end of the backward
_PAD = "pad"  # the boundary pads the partition, if the rank's slices do not fill it
_KEEP_GIP = "keep gip"  # the end of a reduction: keep (the window's first) or free its grads_in_partition
_UPCASTS = "upcasts"  # the gradient norm's float64 copy of each slice
_FREE_GIP = "free gip"  # the step frees grads_in_partition and the padding


class _Diverges(Exception):
    """The template's walk cannot stand for every rank (a rank's own walk would act on a row the template left
    to a mark): its ranks are walked one by one."""


@dataclass
class _MarkingWriter(EventWriter):
    """An EventWriter that also records marks: (position in `order`, `next_serial`, step, phase, kind, args)."""

    marks: list[tuple] = field(default_factory=list)

    def mark(self, kind: str, *args) -> None:
        self.marks.append((len(self.order), self.next_serial, self.step, self.phase, kind, args))


class _Template(_Rank):
    """The walk of no rank in particular: each event a rank's partition decides is a mark (see the kinds above),
    resolved per rank by `_Ranks`; everything else is every rank's. Serials are those of a rank whose marks add
    nothing (a rank's allocations at its marks shift the later ones)."""

    def __init__(self, timeline: pd.DataFrame, rows: list[tuple], layout, setup, own) -> None:
        super().__init__(timeline, rows, layout, setup, 0, own)
        w = self.w
        self.w = _MarkingWriter(w.next_serial, module=w.module, steps_on_host=w.steps_on_host)
        self.mine = self.mine_by_group = self.gip_bytes = self.last_gip_group = None  # no rank's: marks
        self.pending: set[str] = set()  # stage 1: extra-large gradients flushed in this backward (_XL_MINE)

    def _gradient_row(self, row: tuple) -> None:
        if row[7] in self.pending:  # a rank whose slice it holds has freed it: its walk differs from here on
            raise _Diverges(row[7])
        super()._gradient_row(row)

    def reduce(self, name: str) -> None:
        if name in self.pending:
            raise _Diverges(name)
        super().reduce(name)

    def _keep_slices(self) -> None:
        self.w.mark(_GIP, frozenset(self.bw.bucket))
        name = self.bw.extra_large  # a bucket with one is that gradient alone (`reduce` flushes around it)
        if name is None:
            return
        if self.stage == 2:
            self._free_grad(name)
        else:
            self.w.mark(_XL_MINE, name, *self.bw.grads[name])
            self.pending.add(name)

    def _free_other_grads(self) -> None:
        for name in list(self.bw.grads):
            if name in self.pending:
                self.w.mark(_XL_OTHER, name, *self.bw.grads.pop(name))
            else:
                self._free_grad(name)
        self.pending.clear()

    def _pad(self) -> None:
        self.w.mark(_PAD)

    def _keep_gip(self, first: bool) -> None:
        self.w.mark(_KEEP_GIP, first)

    def _upcast_slices(self) -> None:
        self.w.mark(_UPCASTS)

    def _free_partition_grads(self, group: int) -> None:
        self.w.mark(_FREE_GIP, group)


def _own_key(position: int, made: int) -> int:
    """The `Spliced` key of the `made`-th storage a rank allocates at template position `position`: the same in
    every rank that makes it, apart from every serial the template names (those count up from 0)."""
    return _OWN_KEYS + (position << 20) + made


_OWN_KEYS = 1 << 52
_NAMED = (1 << 20) - 1  # `made` of a storage named at a position rather than made there (apart from those made there)
_CATEGORIES = [category.value for category in Category]
_CATEGORY_CODES = {value: code for code, value in enumerate(_CATEGORIES)}
_HOST_CODES = sorted(_CATEGORY_CODES[value] for value in HOST_CATEGORIES)


@per_timeline
def _source_arrays(timeline: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(serial, delta bytes, category code) of every row of the traced timeline."""
    return (timeline["serial"].to_numpy(dtype=np.int64), timeline["delta_bytes"].to_numpy(dtype=np.int64),
            timeline["category"].map(_CATEGORY_CODES).to_numpy(dtype=np.int64))


@dataclass
class _Inserted:
    """A rank's own events at the template's marks, in order: where they go (`position` in the template's
    `order`), and `allocs`, the template serial before which each allocation the rank adds was made."""

    position: list[int] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)
    allocs: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # each row's storage in `Spliced` (`_own_key`; unshifted serials)


class _Ranks:
    """Every rank's timeline and peak from the template (`_Template`): its entries, with the rank's events inserted
    where its marks are and the serials of the template's own allocations shifted by the allocations the rank
    added before them. A rank costs its marks (a few hundred) and a few array operations, not a walk."""

    def __init__(self, timeline: pd.DataFrame, rows: list[tuple], layout, setup, own) -> None:
        template = _Template(timeline, rows, layout, setup, own)
        self.first_serial = template.w.next_serial  # the serials the strategy makes start here
        template.walk()
        w = template.w
        self.timeline, self.groups, self.elem, self.numel = timeline, template.groups, template.elem, template.numel
        self.partitions = template.partitions
        self.module, self.marks, self.rows, self.timeline_rows = w.module, w.marks, w.rows, rows
        self.order = np.asarray(w.order, dtype=np.int64)
        ends, end = [], None  # each mark's next _KEEP_GIP position (a position where a rank allocates nothing)
        for mark in reversed(self.marks):
            end = mark[0] if mark[4] == _KEEP_GIP else end
            ends.append(end)
        self.backward_ends = ends[::-1]
        # A rank makes a backward's grads_in_partition at the first flush holding one of its slices: by backward
        # (the marks up to a _KEEP_GIP), the first _GIP mark of each name. The other marks every rank reads.
        self.first_gip: list[dict[str, int]] = [{}]
        self.other_marks = []
        for index, mark in enumerate(self.marks):
            if mark[4] == _GIP:
                for name in mark[5][0]:
                    self.first_gip[-1].setdefault(name, index)
            else:
                self.other_marks.append(index)
                if mark[4] == _KEEP_GIP:
                    self.first_gip.append({})
        self.ends = [[off + p.numel for p, off in zip(part.params, part.offsets)] for part in self.groups.parts]
        source, own_rows = _source_arrays(timeline), ~(self.order >= 0)
        columns = []
        for column, values in zip(source, ([r[4] for r in w.rows], [r[5] for r in w.rows],
                                           [_CATEGORY_CODES[r[6]] for r in w.rows])):
            entries = np.empty(len(self.order), dtype=np.int64)
            entries[~own_rows] = column[self.order[~own_rows]]
            entries[own_rows] = np.asarray(values, dtype=np.int64)[-1 - self.order[own_rows]]
            columns.append(entries)
        serial, delta, code = columns
        host = np.isin(code, _HOST_CODES)
        self.peak_host_bytes = int(np.cumsum(delta[host]).max()) if host.any() else 0
        device = ~host
        self.entry = np.flatnonzero(device)  # the template position of each device entry
        self.device_before = np.concatenate(([0], np.cumsum(device)))  # device entries before a template position
        self.serial, self.delta = serial[device], delta[device]
        self.live = np.cumsum(self.delta)
        codes = code[device]
        self.codes = np.unique(codes)
        self.by_category = np.cumsum(np.where(codes[None, :] == self.codes[:, None], self.delta[None, :], 0), axis=1)

    def group_slices(self, rank: int) -> list[dict[str, int]]:
        """`Groups.group_slices(rank)` by bisection of each group's parameters' offsets."""
        out = []
        for part, ends in zip(self.groups.parts, self.ends):
            lo, hi = rank * part.partition_numel, (rank + 1) * part.partition_numel
            sliced = {}
            for index in range(bisect.bisect_right(ends, lo), bisect.bisect_left(part.offsets, hi)):
                overlap = min(ends[index], hi) - max(part.offsets[index], lo)
                if overlap > 0:
                    sliced[part.params[index].name] = overlap
            out.append(sliced)
        return out

    def slices(self, rank: int) -> dict[str, int]:
        return {name: numel for sliced in self.group_slices(rank) for name, numel in sliced.items()}

    def _inserted(self, rank: int) -> _Inserted:
        """The rank's events at the template's marks: what `_Rank`'s methods the template replaces would add."""
        by_group = self.group_slices(rank)
        mine = {name: numel for sliced in by_group for name, numel in sliced.items()}
        gip_bytes = sum(self.numel[name] for name in mine) * self.elem
        padding_bytes = [(p - sum(sliced.values())) * self.elem for p, sliced in zip(self.partitions, by_group)]
        last_gip_group = max((g for g, sliced in enumerate(by_group) if sliced), default=None)
        out = _Inserted()
        gradient, temporary = Category.GRADIENT.value, Category.TEMPORARY.value
        bw_gip = gip = None
        padding: list = []

        made: dict[int, int] = {}  # allocations made at each position so far

        def emit(position, step, phase, storage, delta, category):
            if delta:
                out.position.append(position)
                out.rows.append((step, phase, NO_BLOCK, self.module, storage[0], delta, category, ""))
                out.keys.append(storage[1])

        def alloc(position, before, step, phase, nbytes, category, named=None):
            """(serial, key) of a new storage of the rank's: keyed by where it is made, or at `named`."""
            serial = before + len(out.allocs)
            out.allocs.append(before)
            if named is None:
                made[position] = made.get(position, 0) + 1
            storage = (serial, _own_key(position, made[position] - 1) if named is None else _own_key(named, _NAMED))
            emit(position, step, phase, storage, nbytes, category)
            return storage

        gips = [min(first[name] for name in mine if name in first) for first in self.first_gip
                if not first.keys().isdisjoint(mine)]  # the _GIP mark where each backward makes it
        for index in sorted(self.other_marks + gips):
            position, before, step, phase, kind, args = self.marks[index]
            if kind == _GIP:  # named where its backward ends, whichever flush makes it (ranks that make it at
                # different flushes free it alike)
                bw_gip = alloc(position, before, step, phase, gip_bytes, gradient, self.backward_ends[index])
            elif kind == _XL_MINE or kind == _XL_OTHER:
                name, serial, nbytes = args
                if (name in mine) == (kind == _XL_MINE):
                    emit(position, step, phase, (self._shift(serial, out.allocs), serial), -nbytes, gradient)
            elif kind == _PAD:
                padding = [alloc(position, before, step, phase, nbytes, gradient) if nbytes else None
                           for nbytes in padding_bytes]
            elif kind == _KEEP_GIP:
                if args[0]:
                    gip = bw_gip
                elif bw_gip is not None:
                    emit(position, step, phase, bw_gip, -gip_bytes, gradient)
                bw_gip = None
            elif kind == _UPCASTS:
                for numel in mine.values():
                    upcast = alloc(position, before, step, phase, numel * FP64_BYTES, temporary)
                    emit(position, step, phase, upcast, -numel * FP64_BYTES, temporary)
            elif kind == _FREE_GIP:
                group = args[0]
                if group == last_gip_group and gip is not None:
                    emit(position, step, phase, gip, -gip_bytes, gradient)
                if padding and padding[group] is not None:
                    emit(position, step, phase, padding[group], -padding_bytes[group], gradient)
        return out

    def _shift(self, serial: int, allocs: list[int]) -> int:
        """A serial of the template in a rank: the template's own allocations move up by the rank's before them."""
        return serial + bisect.bisect_right(allocs, serial) if serial >= self.first_serial else serial

    def frame(self, rank: int) -> pd.DataFrame:
        """The rank's whole timeline (host events included), as its own walk (`walk_rank`) builds it."""
        inserted = self._inserted(rank)
        rows = [row if row[4] < self.first_serial else row[:4] + (self._shift(row[4], inserted.allocs),) + row[5:]
                for row in self.rows]
        at = np.asarray(inserted.position, dtype=np.int64)
        order = np.insert(self.order, at, -1 - len(rows) - np.arange(len(at), dtype=np.int64))
        return frame_of(self.timeline, order, rows + inserted.rows)

    def events(self, rank: int) -> RankEvents:
        """The rank's peak (`peaks.replay` of its device timeline) and its device events for the allocator model."""
        inserted = self._inserted(rank)
        at = self.device_before[np.asarray(inserted.position, dtype=np.int64)]  # all on the device
        deltas = np.asarray([row[5] for row in inserted.rows], dtype=np.int64)
        peak = self._peak(inserted, at, deltas)

        def spliced() -> Spliced:  # the template's serials unshifted: the rank's own storages have keys apart
            return Spliced(self.serial, self.delta, at, np.asarray(inserted.keys, dtype=np.int64), deltas)
        return RankEvents(peak, self.peak_host_bytes, spliced)

    def _peak(self, inserted: _Inserted, at: np.ndarray, deltas: np.ndarray) -> Peak:
        """`peaks.replay` with the inserted events spliced into the template's running sums: the highest live
        bytes, the first event to reach them, and the bytes by category there."""
        n, best, where = len(self.live), None, None  # where: ("template", device entry) or ("inserted", j)
        offset, start = 0, 0
        for j in range(len(at) + 1):
            stop = int(at[j]) if j < len(at) else n
            if stop > start:  # template entries [start, stop) with the rank's inserted bytes before them
                e = start + int(np.argmax(self.live[start:stop]))
                if best is None or self.live[e] + offset > best:
                    best, where = int(self.live[e]) + offset, ("template", e, j)
            start = max(start, stop)
            if j < len(at):
                offset += int(deltas[j])
                live = (int(self.live[stop - 1]) if stop else 0) + offset
                if best is None or live > best:
                    best, where = live, ("inserted", j, j + 1)
        kind, index, count = where
        through = index if kind == "template" else int(at[index]) - 1  # the template's device entries up to it
        totals = dict.fromkeys(_CATEGORY_CODES, 0)
        if through >= 0:
            for code, cumulative in zip(self.codes, self.by_category[:, through]):
                totals[_CATEGORIES[code]] += int(cumulative)
        for row in inserted.rows[:count]:
            totals[row[6]] += row[5]
        breakdown = {value: total for value, total in totals.items() if total}
        if kind == "template":
            position = int(self.order[self.entry[index]])
            row = self.timeline_rows[position] if position >= 0 else self.rows[-1 - position]
            event = index + count
        else:
            row, event = inserted.rows[index], int(at[index]) + index
        return Peak(best, event, int(row[0]), str(row[1]), str(row[3]), breakdown)
