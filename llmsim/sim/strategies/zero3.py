"""DeepSpeed ZeRO stage 3 (deepspeed/runtime/zero/stage3.py, partitioned_param_coordinator.py,
partition_parameters.py, DeepSpeed 0.19), client AdamW.

The single-process trace, run with ZeRO-3's module hooks mirrored (llmsim/model/zero3_hooks.py), holds the forward and
backward with a marker wherever DeepSpeed fetches or releases a module's parameters. Per rank this replays:
- `zero.Init`: each parameter is built whole, its partition of ceil(n / W) elements kept, the whole freed;
- initialize: the partitions are copied into one flat buffer (`defragment`); an fp32 master copy per sub-group
  (`sub_group_size`); a dropped zero fp32 gradient of the largest sub-group; the reduction bucket of
  `reduce_bucket_size` elements, kept for the whole run when `contiguous_gradients`; the flat gradient-partition
  buffer, kept; each parameter gathered and released once while the gradient hooks are registered;
- the parameter coordinator: iteration 1 records the module trace, fetching a module's own parameters before
  it runs and releasing all of them after; from iteration 2 it prefetches along the trace
  (`stage3_prefetch_bucket_size`, bounded by `stage3_max_live_parameters`), and keeps a parameter gathered when
  it is used again within `stage3_max_reuse_distance` elements or already prefetched for a later use;
  parameters of at most `stage3_param_persistence_threshold` elements stay gathered from the end of a step to
  the start of the next. One parameter is gathered into a buffer of ceil(n / W) * W elements; several into one
  flat buffer of W * sum(ceil(n_i / W)) elements, from which each is copied out (`torch.cat`) when first waited
  for, the flat buffer living until the last of them is waited for;
- backward: each gradient is copied into the bucket (its own storage freed) unless it does not fit; a full
  bucket is reduce-scattered through a padded `torch.cat` copy (none for a single tensor divisible by W), the
  rank's slices copied into the gradient partitions and the gradients dropped;
- step: every gathered parameter released; the norm upcasts each gradient partition to float64 one at a time;
  per sub-group the partitions are flattened (then converted to fp32 in bf16), AdamW updates the fp32 master
  (states at the first step), the fp32 gradient is freed; the persistent parameters are gathered again. Another
  client optimizer runs its own step on each sub-group's fp32 vector (llmsim/sim/strategies/flat_optimizer.py).
With LoRA (peft's get_peft_model after the zero.Init build): the frozen base is partitioned and gathered like
any parameter but has no gradient hook, bucket slot, fp32 master, gradient partition or optimizer state (the
trainable groups are filtered, `is_optimized_parameter`), and its partitions stay out of the defragmented flat
buffer; the adapters are created whole (fp32) and partitioned by `_convert_to_zero_parameters` at initialize.
Gradient accumulation (gradient_accumulation_steps n): every micro-step's backward reduces as above into the same
gradient-partition buffer (`partition_grads`: copied at the first micro-step, added into in place after it) and
sets `.grad` to None, so each later backward makes its gradients anew, as the first does (the trace names them,
TrainSetup.label_micro_grads); the coordinator's `reset_step` runs at every forward; the step runs at the n-th.
With the optimizer offloaded to "nvme" (ZeRO-Infinity's optimizer swapper, docs/nvme-offload.md) the CPU offload
walk holds, besides, the swapper's pinned pool, leaves out the swapped sub-groups' masters and fp32 gradients, keeps
the backward's fp32 gradient partitions the swapper does not write until the step, and drops step 0's states once
written. With the parameters offloaded to "nvme" (the parameter swapper, docs/nvme-offload.md section 0b) zero.Init
makes the swapper's pinned pool first and writes each partition of 1 MiB or more to a file instead of holding it;
initialize reads the trainable ones within `max_in_cpu` back into the flat host buffer; LoRA's frozen base and the
sub-groups past `max_in_cpu` are read into the pool's slots at each fetch, held until released (DeepSpeed asserts
where a step holds more than `buffer_count`), the latter with an unpinned fp32 master and a write-back buffer.
With the parameters offloaded and the optimizer not, the partitions are the host's and the rest the device's (the
master made from the host buffer, each step's update copied back into it).
On one rank DeepSpeed gathers nothing (`_no_gather_coalesced`): the parameters are their partitions.
"""
from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass, field

import pandas as pd

from llmsim.enums import Category, Device, Optimizer, Phase, Precision
from llmsim.errors import InputError
from llmsim.model.step import ROOT_MODULE
from llmsim.sim.strategies.events import per_timeline, trainable_names
from llmsim.sim.strategies.flat_optimizer import FlatOptimizer
from llmsim.sim.strategies.zero3_resize import MAX_TERMS, Program, Recorder, Sized, World, grouped_sub_group_ends
from llmsim.sim.strategies.zero_common import (FP32_BYTES, FP64_BYTES, construct_optimizer, host_buffer,
                                           optimizer_groups, optimizer_of, rank_writer,
                                           own_runs, parameters, rows_of, step_optimizer, torch_fused,
                                           walk_phases)
from llmsim.model.tracker import BACKWARD_POST, BACKWARD_PRE, FORWARD_POST, FORWARD_PRE, GRAD_READY, TIED

NOT_AVAILABLE, INFLIGHT, AVAILABLE = "not_available", "inflight", "available"  # ZeroParamStatus
# the values `_row` compares every row with (an enum's `.value` is a property lookup)
_BUILD, _BACKWARD = Phase.BUILD.value, Phase.BACKWARD.value
_PARAMETER, _GRADIENT = Category.PARAMETER.value, Category.GRADIENT.value
GATHERED = Category.ALLGATHER_BUFFER
NORM_CHUNK = 250_000_000  # `_constant_buffered_norm2`'s buffer_size: its float64 copy, this many elements at a time
SCALAR_FP32_BYTES = 4  # a 0-d fp32 tensor
INT64_BYTES, FP16_BYTES = 8, 2


@dataclass(eq=False)
class _Param:
    ds_id: int
    name: str
    numel: int
    partition: int  # ceil(numel / W)
    persist: bool
    status: str = NOT_AVAILABLE
    storage: tuple[int, int] | None = None  # (serial, bytes) of the gathered data
    active: set = field(default_factory=set)  # ds_active_sub_modules
    elem: int = FP32_BYTES  # bytes per element of the parameter (its partition, its gathered copy)
    frozen: bool = False  # requires_grad False (LoRA's base): no gradient hook, bucket slot, master or state
    adapter: bool = False  # a LoRA adapter: built by get_peft_model after zero.Init, whole until initialize


@dataclass(eq=False)
class _Handle:
    """A pending all-gather: one parameter (its buffer is its storage) or several (`flats`: one flat buffer per
    dtype, `_all_gather_coalesced` grouping them with `sort_dtypes`)."""

    params: list[_Param]
    flats: list[tuple[int, int]] = field(default_factory=list)
    coalesced: bool = False
    complete: bool = False
    inputs: list[tuple[int, int]] = field(default_factory=list)  # parameter offload: the input's device copy


class _Rank:
    """One rank's walk. `recording` (strategies/zero3_resize.py): W and the partitions are `World`/`Sized` values
    and the writer a `Recorder`, so that the events carry their sizes' formulas; the walk's decisions read W only
    through `int(...)`, where zero3_resize evaluates the same decision for another W."""

    def __init__(self, timeline: pd.DataFrame, rows: list[tuple], layout, setup, recording: bool = False,
                 rank: int = 0) -> None:
        self.zero = layout.deepspeed.zero()
        self.recording = recording
        self.rank = rank
        self.cuda = setup.device is Device.CUDA
        # ZeRO-Offload: the fp32 master, its gradient, the gradient partitions and AdamW on the host
        self.offload = layout.deepspeed.offloads_optimizer
        # offload's host buffers are pinned copies: pin_memory, on a GPU (DeepSpeed's CPU accelerator pins nothing)
        self.pins = self.offload and self.cuda and bool(self.zero.offload_optimizer.pin_memory)
        # parameter offload: every partition on the host (pinned copies on a GPU with its pin_memory), the trainable
        # ones in one host buffer that is pinned on a GPU whatever pin_memory says
        self.host_params = layout.deepspeed.offloads_params
        self.param_pins = self.host_params and self.cuda and bool(self.zero.offload_param.pin_memory)
        self.partition_category = Category.HOST_OFFLOAD if self.host_params else Category.PARAMETER
        self.swap = layout.deepspeed.swaps_optimizer  # offload_optimizer "nvme": the optimizer swapper
        self.swap_params = layout.deepspeed.swaps_params  # offload_param "nvme": the parameter swapper
        self.elem = 2 if setup.precision is Precision.BF16 else FP32_BYTES
        if self.swap or self.swap_params:
            from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES, MIN_AIO_BYTES

            aio = layout.deepspeed.aio()
            # both swappers: a tensor is swapped from max(1 MiB, aio.block_size) bytes on, in I/O-aligned lengths
            self.min_aio_bytes = max(MIN_AIO_BYTES, aio["block_size"])  # optimizer_utils.py, OptimizerSwapper
            self.alignment = AIO_ALIGNED_BYTES * aio["intra_op_parallelism"] // FP32_BYTES  # numel_alignment
            self.param_alignment = AIO_ALIGNED_BYTES * aio["intra_op_parallelism"] // self.elem
        if self.swap:
            self.buffer_count = self.zero.offload_optimizer.buffer_count
        self.retained: list[tuple[int, int, int]] = []  # swapper: this partition_grads' fp32 gradients, (serial,
        # bytes, sub-group)
        self.unswapped: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # kept to the step
        self.norms: list[int] = []  # offload: each gradient partition's 0-d fp64 norm (device), kept to the step
        self.global_norm: int | None = None  # offload: `_global_grad_norm` (0-d fp32, host), kept to the next step
        self.world = World(layout.world_size) if self.recording else layout.world_size
        self.optimizer, self.foreach = optimizer_of(layout.deepspeed, setup)
        self.fused = torch_fused(layout.deepspeed, setup)
        self.gloo = setup.device is Device.CPU  # the process group's backend: gloo on the CPU, NCCL on GPUs
        self.timeline = timeline
        self.rows = rows
        self.w = rank_writer(timeline, setup)
        if recording:
            self.w = Recorder(self.w.next_serial, self.w.module, self.w.steps_on_host)
        self.params = self._parameters(timeline, setup)
        self.trainable = [p for p in self.params if not p.frozen]
        self.micro = 0  # the micro-step of the optimizer step whose backward runs (gradient accumulation)
        self.grad_accum = setup.grad_accum
        self.by_name = {p.name: p for p in self.params}
        self.built = False  # zero.Init's partitions emitted (before the first adapter is created)
        self.whole: dict[str, tuple[int, int]] = {}  # adapter -> its whole storage until initialize partitions it
        self._mark_persistent()
        self.module_params: dict[str, list[_Param]] = collections.defaultdict(list)
        for p in self.params:
            self.module_params[_module_of(p.name)].append(p)
        self.sub_groups = self._sub_groups()
        self.group_of = {p: index for index, group in enumerate(self.sub_groups) for p in group}
        self.swapped = frozenset(index for index, group in enumerate(self.sub_groups)  # `_swappable`
                                 if self.swap and int(self._psum(group)) * FP32_BYTES >= self.min_aio_bytes)
        self.flat_sizes, self.past = self._flat_cpu_memory()
        # the partitions the parameter swapper reads from their files at each fetch: LoRA's frozen base and the
        # sub-groups past max_in_cpu (both of 1 MiB or more: the smaller ones stay in memory where zero.Init made them)
        self.in_files = frozenset(p for p in self.params if self._swaps_param(p)
                                  and (p.frozen or self.group_of.get(p) in self.past))
        if self.host_params and not self.offload and self.elem == FP32_BYTES:
            raise InputError("DeepSpeed config zero_optimization.offload_param without offload_optimizer in fp32 is "
                             "not modelled yet (no measured run of it; the bf16 ones are); modelled: bf16 "
                             "(\"bf16\": {\"enabled\": true}), or with offload_optimizer \"cpu\"")
        if self.swap_params:
            self._check_param_swapper(setup)
        # another client optimizer: its own step on each sub-group's fp32 partition (strategies/flat_optimizer.py)
        self.client = (FlatOptimizer(setup.optimizer, [self._psum(group) for group in self.sub_groups],
                                     setup.steps, self.foreach, self.fused)
                       if uses_flat_optimizer(layout, setup) else None)
        # coordinator state
        self.mode = "invalid"  # `_register_deepspeed_module` invalidates the trace; the first forward records
        self.module_order: list[str] = []
        self.param_order: list[tuple[_Param, int]] = []
        self.queue: collections.deque = collections.deque()
        self.most_recent: dict[_Param, int] = {}
        self.step_id = 0
        self.n_available = 0
        self.inflight: dict[_Param, _Handle] = {}
        self.release_cache: dict[tuple[str, int], set] = {}
        self.active_backward: dict[str, None] = {}
        # gradient state
        self.bucket: list[_Param] = []
        self.bucket_elements = 0
        self.in_bucket: set[str] = set()
        self.grads: dict[str, tuple[int, int]] = {}  # param -> autograd gradient storage still alive
        self.in_slots: set[_Param] = set()  # the parameter swapper's: partitions read into a slot of its pool
        self.slots_needed = 0  # the most slots held at once

    # ---- setup ---------------------------------------------------------------------------------------
    def _parameters(self, timeline: pd.DataFrame, setup) -> list[_Param]:
        """Every parameter in `model.parameters()` order (ds_id order: zero.Init numbers the base model's, and
        `_convert_to_zero_parameters` the adapters after them). With LoRA the parameters without a gradient are
        the frozen base; the adapters are fp32 whatever the base's dtype (peft's `autocast_adapter_dtype`, and
        `_cast_module_mixed_precision` leaves a zero.Init model's parameters alone)."""
        trainable = trainable_names(timeline) if setup.lora_rank else None
        params = []
        for i, p in enumerate(parameters(timeline, 1)):  # numel in bytes: the dtype is per parameter here
            adapter = trainable is not None and p.name in trainable
            # with parameter offload the adapters take the dtype of the host buffer initialize moves them into,
            # DeepSpeed's `self.dtype`: its optimizer's first parameter's. The canonical step's
            # AdamW(model.parameters()) and DeepSpeed's own optimizer over the module start with the base's
            # embedding, the model's dtype (the trace casts the adapters after get_peft_model, `cast_after_peft`);
            # the Trainer's holds the trainable parameters alone, LoRA's fp32 adapters first, and they stay fp32
            # (measured: trainer_offload_cpu.csv)
            elem = FP32_BYTES if adapter and not (self.host_params and setup.cast_after_peft) else self.elem
            traced = FP32_BYTES if adapter and not setup.cast_after_peft else self.elem
            numel = p.numel // traced
            partition = math.ceil(numel / int(self.world))
            if self.recording:
                partition = Sized(partition, ((i, 1),))
            params.append(_Param(i, p.name, numel, partition, False, elem=elem,
                                 frozen=trainable is not None and not adapter, adapter=adapter))
        return params

    def _psum(self, params: list[_Param], per_element: bool = False) -> int | Sized:
        """The sum of the partitions of `params` (in bytes with `per_element`: each partition x its elem)."""
        if self.recording:
            value = sum(int(p.partition) * (p.elem if per_element else 1) for p in params)
            return Sized(value, tuple((p.ds_id, p.elem if per_element else 1) for p in params))
        return sum(p.partition * p.elem for p in params) if per_element else sum(p.partition for p in params)

    def _mark_persistent(self) -> None:
        """parameter_offload.py, `mark_persistent_parameters`."""
        total = 0
        for p in self.params:
            if p.numel + total > self.zero.model_persistence_threshold:
                continue
            if p.numel <= self.zero.param_persistence_threshold:
                p.persist = True
                total += p.numel

    def _sub_groups(self) -> list[list[_Param]]:
        """stage3.py, `_create_fp16_sub_groups` within each of the optimizer's param groups
        (zero3_resize.grouped_sub_group_ends): the trainable parameters laid out group after group (one group for
        the canonical step; the Trainer's two, zero_common.optimizer_groups)."""
        groups = optimizer_groups(self.trainable, self.timeline)
        self.trainable = [p for group in groups for p in group]
        self.group_lengths = tuple(len(group) for group in groups)
        self.sub_group_ends = grouped_sub_group_ends([int(p.partition) for p in self.trainable],
                                                     self.zero.sub_group_size, self.group_lengths)
        starts = (0,) + self.sub_group_ends[:-1]
        return [self.trainable[start:end] for start, end in zip(starts, self.sub_group_ends)]

    def _largest(self) -> int | Sized:
        """The largest sub-group's partitions (`initialize_optimizer_states`' zero gradient)."""
        sums = [self._psum(group) for group in self.sub_groups]
        if self.recording:
            return Sized(max(int(n) for n in sums), (MAX_TERMS, tuple(n.formula[0] for n in sums)))
        return max(sums)

    def _flat_cpu_memory(self) -> tuple[list[int], frozenset[int]]:
        """Parameter offload's `_create_param_groups_fp16_flat_cpu_memory`: per optimizer param group a host buffer
        for its trainable partitions, in elements; with the parameter swapper only up to `offload_param.max_in_cpu`
        elements over the groups in order (`params_in_nvme_and_cpu`), a group with none left getting a one-element
        buffer (a group with no trainable parameter gets none), in DeepSpeed's `self.dtype`. And the sub-groups that
        get no view of it (`fp16_partitioned_groups_flat[i]` None: the first that does not fit and all after it in its
        group): their partitions stay where zero.Init left them."""
        if not self.host_params:
            return [], frozenset()
        limit = self.zero.offload_param.max_in_cpu if self.swap_params else math.inf
        sizes, past, aggregate, index, start = [], set(), 0, 0, 0
        for length in self.group_lengths:
            if not length:  # `_get_trainable_parameter_groups` drops a group with no trainable parameter
                continue
            total = int(self._psum(self.trainable[start:start + length]))
            size = total if aggregate + total <= limit else max(0, limit - aggregate)
            aggregate += total
            sizes.append(size)
            offset = 0
            while index < len(self.sub_groups) and (self.sub_group_ends[index - 1] if index else 0) < start + length:
                numel = int(self._psum(self.sub_groups[index]))
                if offset + numel > max(size, 1):  # the buffer's numel(): one for an empty group's
                    past.add(index)
                offset += numel
                index += 1
            start += length
        return sizes, frozenset(past)

    def _swappable(self, index: int) -> bool:
        """stage3.py `_swappable_optimizer_subgroup`: the sub-group's fp32 partition reaches the swapper's
        `min_aio_bytes` (1 MiB, or aio.block_size if larger)."""
        return index in self.swapped

    def _swap_pool(self) -> None:
        """`_configure_tensor_swapping`: PartitionedOptimizerSwapper's SwapBufferManager, `buffer_count` page-locked
        fp32 buffers of the largest sub-group's partition rounded up to the I/O alignment, zero-filled, for the
        whole run (swap_tensor/utils.py; `new_cpu_locked_tensor`: posix_memalign + mlock on the host, not torch's
        pinned allocator), made while a 1-element fp32 example lives."""
        numel = _io_aligned(int(self._largest()), self.alignment)
        example = self.w.alloc(SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        for _ in range(self.buffer_count):
            self.w.alloc(numel * FP32_BYTES, Category.HOST_OFFLOAD)
        self.w.free(example, SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        # what the step's swap-in takes (`swap_in_optimizer_state` asserts it gets them): the master and AdamW's
        # two states, plus the gradient
        if self.buffer_count < 4 and self.swapped:
            raise InputError(f"DeepSpeed config zero_optimization.offload_optimizer.buffer_count"
                             f"({self.buffer_count}) < 4: a swapped sub-group's step takes 4 swap buffers (the fp32 "
                             "master, exp_avg, exp_avg_sq and the gradient) and DeepSpeed fails at the second step; "
                             "valid: 4 or more")

    def _swaps_param(self, p: _Param) -> bool:
        """The parameter swapper's `swappable_tensor`: the partition, in the swapper's dtype (the model's), reaches
        `min_aio_bytes`."""
        return self.swap_params and int(p.partition) * self.elem >= self.min_aio_bytes

    def _check_param_swapper(self, setup) -> None:
        """What the parameter swapper is modelled for: the trainable partitions within `max_in_cpu` read back into
        the flat host buffer at initialize (`_move_to_flat_buffer`), after which they are parameter offload's; the
        rest (LoRA's frozen base, the sub-groups past max_in_cpu) read into the pool's slots at each fetch, without
        prefetching; and the configs DeepSpeed itself refuses."""
        config = self.zero.offload_param
        # where partitions are swapped in at each fetch, DeepSpeed 0.19.8's nvme prefetch swapped one in twice and
        # asserted in every run measured (experiments/explore_param_swap_fetch.out); without prefetch it ran
        if self.in_files and self.zero.prefetch_bucket_size > 0:
            past = sum(int(self._psum(self.sub_groups[index])) for index in self.past)
            which = (["LoRA's frozen base"] if any(p.frozen for p in self.in_files) else []) + (
                [f"the {past:,} trainable elements of the sub-groups past offload_param.max_in_cpu"
                 f"({config.max_in_cpu:,})"] if self.past else [])
            raise InputError("DeepSpeed config zero_optimization.offload_param.device \"nvme\" with "
                             f"stage3_prefetch_bucket_size({self.zero.prefetch_bucket_size:,}) is not modelled where "
                             f"partitions stay in their files ({' and '.join(which)}: those of 1 MiB or more come "
                             "through the swapper's pool at each fetch), and DeepSpeed 0.19.8 failed in every such run "
                             "measured (experiments/explore_param_swap_fetch.out); modelled: "
                             "stage3_prefetch_bucket_size 0, " + ("a max_in_cpu of this rank's "
                             f"{int(self._psum(self.trainable)):,} trainable elements or more, "
                             if self.past else "") + "or offload_param \"cpu\"")
        if any(p.adapter for index in self.past for p in self.sub_groups[index]):
            raise InputError(f"DeepSpeed config zero_optimization.offload_param.max_in_cpu({config.max_in_cpu:,}) "
                             "under this rank's LoRA adapter elements is not modelled: the adapters past it keep "
                             "their fp32 partitions (the host buffer is what casts them to the model's dtype), so the "
                             "forward would run them in fp32; modelled: a max_in_cpu of "
                             f"{int(self._psum(self.trainable)):,} or more (DeepSpeed's default is 1e9)")
        if any(p.persist for p in self.in_files) or any(p.adapter and self._swaps_param(p) for p in self.params):
            raise InputError("DeepSpeed config zero_optimization.offload_param.device \"nvme\" with a persistent "
                             "parameter's or a LoRA adapter's partition of 1 MiB or more (which the swapper would "
                             "write) is not modelled yet; modelled: those partitions under max(1 MiB, "
                             "aio.block_size)")
        swapped = [int(p.partition) for p in self.params if self._swaps_param(p)]
        if swapped and max(swapped) > config.buffer_size:
            raise InputError(f"DeepSpeed config zero_optimization.offload_param.buffer_size({config.buffer_size:,}) "
                             f"is under the largest partition the parameter swapper writes ({max(swapped):,} "
                             "elements): DeepSpeed fails at zero.Init (partitioned_param_swapper.py `get_buffer`); "
                             f"valid: {max(swapped):,} or more")
        if swapped and config.buffer_count < 1:
            raise InputError("DeepSpeed config zero_optimization.offload_param.buffer_count(0): each partition the "
                             "parameter swapper writes takes one of its buffers and DeepSpeed fails at zero.Init "
                             "without one; valid: 1 or more")

    def _param_pool(self) -> None:
        """zero.Init's `AsyncPartitionedParameterSwapper` (swap_tensor/partitioned_param_swapper.py): its pool,
        `buffer_count` buffers of `buffer_size` elements rounded up to the I/O alignment, in the model's dtype, a
        `torch.empty` on the host replaced by a page-locked tensor of its size (`new_cpu_locked_tensor`, made while
        the first lives), kept for the run; then `invalid_buffer`, `torch.tensor(1).half()` (a default-device
        tensor: the host on a GPU), which the swapped partitions point at until they are read back."""
        config = self.zero.offload_param
        nbytes = _io_aligned(int(config.buffer_size), self.param_alignment) * int(config.buffer_count) * self.elem
        empty = self.w.alloc(nbytes, Category.HOST_OFFLOAD)
        self.w.alloc(nbytes, Category.HOST_OFFLOAD)
        self.w.free(empty, nbytes, Category.HOST_OFFLOAD)
        scalar = self.w.alloc(INT64_BYTES, Category.HOST_OFFLOAD)
        self.w.alloc(FP16_BYTES, Category.HOST_OFFLOAD)
        self.w.free(scalar, INT64_BYTES, Category.HOST_OFFLOAD)

    def build(self) -> None:
        """`zero.Init`: each parameter of the base model allocated whole, partitioned, the whole freed. With the
        parameter swapper a partition it swaps is a slot of its pool, written to its file and released: no memory
        of its own (`_partition_param`)."""
        self.built = True
        self.ds_tensors: dict[_Param, tuple[int, int] | None] = {}
        if self.swap_params:
            self._param_pool()
        for p in self.params:
            if not p.adapter:
                whole = self.w.alloc(p.numel * p.elem, Category.TEMPORARY)
                self.ds_tensors[p] = self._partition(p)
                self.w.free(whole, p.numel * p.elem, Category.TEMPORARY)
        # a tied module (the LM head) made its own parameter in __init__, which zero.Init partitioned too, before
        # `tie_weights` replaced it by the embedding's and it was freed
        for name in _tied_in_build(self.timeline):
            if name in self.by_name:
                p = self.by_name[name]
                whole = self.w.alloc(p.numel * p.elem, Category.TEMPORARY)
                own = self._partition(p)
                self.w.free(whole, p.numel * p.elem, Category.TEMPORARY)
                if own is not None:
                    self.w.free(*own, self.partition_category)

    def _partition(self, p: _Param, elem: int | None = None) -> tuple[int, int] | None:
        """`_partition_param`'s `ds_tensor` (partition_parameters.py) in `elem`-byte elements (the parameter's
        own by default): on the device, or with parameter offload on the host (`remote_device`), where pin_memory
        on a GPU replaces it by a pinned copy; None where the parameter swapper writes it (a slot of its pool)."""
        if self._swaps_param(p):
            return None
        nbytes = p.partition * (elem or p.elem)
        if self.host_params:
            return host_buffer(self.w, nbytes, self.param_pins), nbytes
        return self.w.alloc(nbytes, Category.PARAMETER), nbytes

    def initialize(self) -> None:
        """DeepSpeedZeroOptimizer_Stage3.__init__ (after the basic optimizer is built)."""
        construct_optimizer(self.w, self.optimizer)
        for p in self.params:  # DeepSpeedZeRoOffload `_convert_to_zero_parameters`: the adapters partitioned
            if p.adapter:  # still fp32 here under parameter offload too: the host buffer casts them
                self.ds_tensors[p] = self._partition(p, FP32_BYTES)
                self.w.free(*self.whole.pop(p.name), Category.PARAMETER)
        total = self._psum(self.trainable)
        if self.offload:  # inf_or_nan_tracker: one bool, on the optimizer's device (the host)
            self.w.alloc(1, Category.HOST_OFFLOAD)
        self._defragment()
        if self.swap:
            self._swap_pool()
        unpinned = None  # `_create_fp32_partitions`' unpinned_fp32_buffer, where only that name holds it
        for index, group in enumerate(self.sub_groups):  # fp32 master: flat.to(fp32).clone()
            numel = self._psum(group)
            if index in self.past:  # past max_in_cpu: a `torch.empty` on the optimizer's device (the host, never
                # pinned) that the partitions are read into; the master itself, or for a swapped sub-group what
                # `initialize_parameters` writes to its file, alive until the name is bound again
                buffer = self.w.alloc(numel * FP32_BYTES, Category.HOST_OFFLOAD)
                self._read_through_slots(group)
                if unpinned is not None:
                    self.w.free(*unpinned, Category.HOST_OFFLOAD)
                unpinned = (buffer, numel * FP32_BYTES) if self._swappable(index) else None
                continue
            if self._swappable(index):  # `torch.empty(0)`: the master is in its file
                continue
            if self.offload:
                self._host_master(numel, group[0].elem)
            elif self.host_params:  # `flat.to(self.device, fp32)` from the host buffer, then its `.clone()`
                upcast = self.w.alloc(numel * FP32_BYTES, Category.TEMPORARY)
                self._host_staging(numel, group[0].elem)
                self.w.alloc(numel * FP32_BYTES, Category.MASTER_WEIGHTS)
                self.w.free(upcast, numel * FP32_BYTES, Category.TEMPORARY)
            elif group[0].elem != FP32_BYTES:
                upcast = self.w.alloc(numel * FP32_BYTES, Category.TEMPORARY)
                self.w.alloc(numel * FP32_BYTES, Category.MASTER_WEIGHTS)
                self.w.free(upcast, numel * FP32_BYTES, Category.TEMPORARY)
            else:
                self.w.alloc(numel * FP32_BYTES, Category.MASTER_WEIGHTS)
        for index in sorted(self.swapped - self.past):  # `initialize_parameters`: each swappable master written
            self._host_staging(self._psum(self.sub_groups[index]), self.sub_groups[index][0].elem)  # through the pool
        if unpinned is not None:  # `_create_fp32_partitions` returns
            self.w.free(*unpinned, Category.HOST_OFFLOAD)
        largest = self._largest() * FP32_BYTES
        # initialize_optimizer_states: a zero gradient of the largest sub-group, dropped; with offload on the host,
        # and each sub-group's fp32 gradient a host buffer of its own, kept; a swapped sub-group's `.grad` views the
        # zero gradient only until its swap-out sets it to None
        where = Category.HOST_OFFLOAD if self.offload else Category.TEMPORARY
        zeros = self.w.alloc(largest, where)
        if self.offload:
            for index, group in enumerate(self.sub_groups):
                if not self._swappable(index):
                    host_buffer(self.w, self._psum(group) * FP32_BYTES, self.pins)
        self.w.free(zeros, largest, where)
        if self.zero.contiguous_gradients:
            self.w.alloc(self.zero.reduce_bucket_size * self.elem, Category.REDUCE_BUCKET)
        if self.offload:  # grad_partitions_flat_buffer
            host_buffer(self.w, total * self.elem, self.pins)
        else:
            self.w.alloc(total * self.elem, Category.GRADIENT)
        for p in self.trainable:  # create_reduce_and_remove_grad_hooks: gather, register, partition
            nbytes = p.partition * self.world * p.elem
            self._read_through_slots([p])
            buffer = self.w.alloc(nbytes, GATHERED)
            self._from_host([p])  # _allgather_params_sequential's input, for the call
            self.w.free(buffer, nbytes, GATHERED)

    def _defragment(self) -> None:
        """zero/utils.py `defragment`: the trainable partitions moved into one flat buffer (`lp_param_buffer`; the
        frozen parameters' partitions stay where they are). On a GPU each partition is copied into a host buffer
        and freed, then the host buffer is copied back to the device; on the CPU the host buffer is the flat buffer
        itself (`.to("cpu")` returns it), allocated while the partitions still exist."""
        nbytes = self._psum(self.trainable, per_element=True)
        if self.host_params:  # _create_param_groups_fp16_flat_cpu_memory, then _move_to_flat_buffer
            elem = self.trainable[0].elem if self.trainable else self.elem  # DeepSpeed's `self.dtype`
            for size in self.flat_sizes:  # always pinned on a GPU: get_accelerator().pin_memory whatever
                if size:  # offload_param.pin_memory says; an empty one is `torch.empty(1)`, not pinned
                    host_buffer(self.w, size * elem, self.cuda)
                else:
                    self.w.alloc(elem, Category.HOST_OFFLOAD)
            for p in self.trainable:  # a swapped partition is read into it through a slot of the pool
                if self.group_of[p] not in self.past and (partition := self.ds_tensors.pop(p)) is not None:
                    self.w.free(*partition, Category.HOST_OFFLOAD)
            if self.past:
                self._reserve_partitioned_swap_space()
            return
        if not self.cuda:
            self.w.alloc(nbytes, Category.PARAMETER)
            for p in self.trainable:
                self.w.free(*self.ds_tensors.pop(p), Category.PARAMETER)
            return
        staging = self.w.alloc(nbytes, Category.HOST_OFFLOAD)
        for p in self.trainable:
            self.w.free(*self.ds_tensors.pop(p), Category.PARAMETER)
        self.w.alloc(nbytes, Category.PARAMETER)
        self.w.free(staging, nbytes, Category.HOST_OFFLOAD)

    def _reserve_partitioned_swap_space(self) -> None:
        """Where a sub-group is past max_in_cpu, the swapper's buffer for writing the step's updates back to the
        files (`reserve_partitioned_swap_space`), page-locked on the host for the run, in the model's dtype, made
        while a one-element example lives: sized for the largest sub-group (the first of the largest partitions), but
        from its parameters' whole `ds_numel`s, each rounded up to the I/O alignment: W times its partitions."""
        sums = [int(self._psum(group)) for group in self.sub_groups]
        largest = self.sub_groups[sums.index(max(sums))]
        nbytes = sum(_io_aligned(p.numel, self.param_alignment) for p in largest) * self.elem
        example = self.w.alloc(self.elem, Category.HOST_OFFLOAD)
        self.w.alloc(nbytes, Category.HOST_OFFLOAD)
        self.w.free(example, self.elem, Category.HOST_OFFLOAD)

    def _read_through_slots(self, params: list[_Param]) -> None:
        """Partitions read one at a time from their files into a slot of the pool and released
        (`_swap_in_sub_group_to_flat_buffer`, the grad hooks' gather at initialize): no memory of their own."""
        if any(p in self.in_files for p in params):
            self.slots_needed = max(self.slots_needed, len(self.in_slots) + 1)

    def _host_master(self, numel, elem: int) -> None:
        """Offload's fp32 master of a sub-group: `flat.to('cpu', dtype=fp32).clone()`, both on the host. On a GPU a
        copy that changes the dtype across devices converts on the host, from a host copy in the source dtype
        (none when the partitions are on the host already)."""
        converted = self.w.alloc(numel * FP32_BYTES, Category.HOST_OFFLOAD)
        self._host_staging(numel, elem)
        self.w.alloc(numel * FP32_BYTES, Category.HOST_OFFLOAD)
        self.w.free(converted, numel * FP32_BYTES, Category.HOST_OFFLOAD)

    def _host_staging(self, numel, elem: int) -> None:
        """A copy between the fp32 master (or a swap buffer) and the partition of the model's dtype, either way,
        where one is on the host and the other on the device (the master on the host under optimizer offload, the
        partition under parameter offload; neither or both: no crossing): on a GPU a copy across that changes the
        dtype converts on the host (ATen's `copy_kernel_cuda`, blocking: to the host, into a host copy in the source
        dtype; from it, the source converted there first), a host copy in the device side's dtype made and dropped;
        on the CPU it converts in place. `elem`: the partition's bytes an element."""
        if self.cuda and elem != FP32_BYTES and self.host_params != self.offload:
            nbytes = int(numel) * (elem if self.offload else FP32_BYTES)  # the partition's, or the master's
            staging = self.w.alloc(nbytes, Category.HOST_OFFLOAD)
            self.w.free(staging, nbytes, Category.HOST_OFFLOAD)

    # ---- gathering ---------------------------------------------------------------------------------------
    def _all_gather(self, params: list[_Param]) -> None:
        """partitioned_param_coordinator.py `__all_gather_params` -> partition_parameters.py `all_gather_coalesced`,
        which first swaps in the partitions still in their files (`_ensure_availability_of_partitioned_params`)."""
        params = [p for p in params if p.status == NOT_AVAILABLE]
        if not params:
            return
        self._swap_in(params)
        self.n_available += sum(p.numel for p in params)
        if self._alone():
            self._no_gather(params)
            return
        if len(params) == 1:  # _all_gather_sequential: the buffer is the parameter's data
            p = params[0]
            nbytes = p.partition * self.world * p.elem
            p.storage = (self.w.alloc(nbytes, GATHERED), nbytes)
            # with parameter offload, the all-gather's input is a device copy of the host partition, which the
            # collective's work holds until it is waited on
            handle = _Handle(params, inputs=self._from_host(params, keep=True))
        else:
            handle = _Handle(params, coalesced=True)
            for elem in sorted({p.elem for p in params}):  # sort_dtypes: by name, bfloat16 before float32
                group = [p for p in params if p.elem == elem]
                nbytes = self._psum(group) * self.world * elem
                handle.flats.append((self.w.alloc(nbytes, GATHERED), nbytes))
                self._from_host(group)  # `torch.cat([p.ds_tensor.to(device) ...], out=...)`: copies for the cat
        for p in params:
            p.status = INFLIGHT
            self.inflight[p] = handle

    def _alone(self) -> bool:
        """One rank: `all_gather_coalesced` and `_allgather_params_coalesced` gather nothing (`_no_gather_coalesced`);
        a walk at W = 1 is never recorded for other world sizes (`_resized`)."""
        return not self.recording and self.world == 1

    def _no_gather(self, params: list[_Param]) -> None:
        """`_no_gather_coalesced` (partition_parameters.py, NoGatherHandle/NoGatherCoalescedHandle): each parameter's
        data is its partition moved to the device, `ds_tensor.data.to(device)`: the partition itself, or with
        parameter offload a device copy of the host partition, the parameter's data until it is released."""
        handle = _Handle(params)
        for p in sorted(params, key=lambda q: q.ds_id):
            if self.host_params:
                nbytes = p.numel * p.elem
                p.storage = (self.w.alloc(nbytes, GATHERED), nbytes)
            p.status = INFLIGHT
            self.inflight[p] = handle

    def _from_host(self, params: list[_Param], keep: bool = False) -> list[tuple[int, int]]:
        """With parameter offload: each partition's device copy (`ds_tensor.to(device)`), made in `params`' order;
        freed at once unless `keep` (then returned, (serial, bytes) each)."""
        if not self.host_params:
            return []
        copies = [(self.w.alloc(int(p.partition) * p.elem, Category.TEMPORARY), int(p.partition) * p.elem)
                  for p in params]
        if keep:
            return copies
        for copy in copies:
            self.w.free(*copy, Category.TEMPORARY)
        return []

    def _wait(self, p: _Param) -> None:
        """Pop `p`'s handle and wait on it: a coalesced handle copies every parameter out of its flat buffer,
        which is freed once no parameter waits on it any more."""
        handle = self.inflight.pop(p)
        for copy in handle.inputs:  # the work lets go of its input
            self.w.free(*copy, Category.TEMPORARY)
        handle.inputs = []
        if not handle.complete:
            for q in handle.params:
                if handle.coalesced:
                    nbytes = q.numel * q.elem
                    q.storage = (self.w.alloc(nbytes, GATHERED), nbytes)
                q.status = AVAILABLE
            handle.complete = True
        if handle.flats and not any(h is handle for h in self.inflight.values()):
            for flat in handle.flats:
                self.w.free(*flat, GATHERED)
            handle.flats = []

    def _swap_in(self, params: list[_Param]) -> None:
        """The parameter swapper's `swap_in` of the partitions in files (`in_files`): each takes one of the
        pool's `buffer_count` slots (no memory of its own: the pool is there from zero.Init on) until the parameter
        is released; DeepSpeed asserts when there are fewer free slots than partitions to read."""
        files = [p for p in params if p in self.in_files]
        if not files:
            return
        self.in_slots.update(files)
        self.slots_needed = max(self.slots_needed, len(self.in_slots))

    def _check_slots(self) -> None:
        """After the walk: DeepSpeed asserts at the first fetch that finds fewer free slots than partitions to read
        (partitioned_param_swapper.py `swap_in`, "Not enough buffers"); the valid counts are those that cover the
        most slots the walk held at once."""
        count = int(self.zero.offload_param.buffer_count) if self.swap_params else 0
        if self.slots_needed > count:
            raise InputError(f"DeepSpeed config zero_optimization.offload_param.buffer_count({count}): the step holds "
                             f"up to {self.slots_needed} partitions read from their files in the pool's slots at "
                             "once (a parameter keeps its slot until it is released: stage3_max_reuse_distance keeps "
                             "one used again soon), and DeepSpeed fails at the first fetch that finds too few free "
                             f"(partitioned_param_swapper.py `swap_in`: \"Not enough buffers\"); valid: "
                             f"{self.slots_needed} or more")

    def _release_param(self, p: _Param) -> None:
        if p.status == AVAILABLE and not p.active:
            self.in_slots.discard(p)  # `remove_partition_and_release_buffers`: its slot back to the pool
            if p.storage is not None:  # one rank's no-gather: the partition itself, nothing to free
                self.w.free(*p.storage, GATHERED)
            p.storage = None
            p.status = NOT_AVAILABLE
            self.n_available -= p.numel

    def _clean_inflight(self) -> None:
        for p in list(self.inflight):
            self._wait(p)
            self._release_param(p)

    def reset_step(self) -> None:
        """`reset_step`, run by the root module's first forward pre-hook."""
        self._clean_inflight()
        if self.mode != "complete":
            if self.mode == "record":
                self._rank0_lists(len(self.module_order))
                self.param_order = [(p, step) for step, module in enumerate(self.module_order)
                                    for p in sorted(self._params_of(module), key=lambda q: q.ds_id)]
                self._rank0_lists(len(self.param_order), len(self.param_order))
                self.mode = "complete"
            else:
                self.mode = "record"
        self.queue = collections.deque(self.param_order)
        self.most_recent = collections.defaultdict(lambda: int(-1e10))
        self.step_id = 0
        self.n_available = 0

    def _rank0_lists(self, *lengths: int) -> None:
        """`assert_ints_same_as_other_ranks` on each recorded order (zero/utils.py): the list's length and then
        the list, broadcast as int64 device tensors and read back through `.cpu()`. Under offload the host copies
        are kept in the timeline (host memory; the transient device tensors are left out, as in every ZeRO-3
        walk)."""
        if not (self.offload or self.host_params):
            return
        for length in lengths:
            for nbytes in (8, 8 * length):
                self.w.free(self.w.alloc(nbytes, Category.HOST_OFFLOAD), nbytes, Category.HOST_OFFLOAD)

    def _params_of(self, module: str) -> list[_Param]:
        return self.module_params.get(module, [])

    def fetch(self, module: str, forward: bool) -> None:
        """`fetch_sub_module`."""
        if self.mode == "record":
            self.module_order.append(module)
        if not forward:
            self.active_backward[module] = None
        to_fetch = self._params_of(module)
        self._all_gather(to_fetch)
        for p in to_fetch:
            p.active.add(module)
            if p in self.inflight:
                self._wait(p)
        if self.mode == "complete":
            not_fetched = {p for p in to_fetch if self.most_recent[p] < self.step_id}
            discarded = set()
            while self.queue and len(discarded) < len(not_fetched):
                p, step = self.queue.popleft()
                self.most_recent[p] = step
                discarded.add(p)
            if self.zero.prefetch_bucket_size > 0:
                budget = min(self.zero.max_live_parameters - self.n_available, self.zero.prefetch_bucket_size)
                prefetch, numel = [], 0
                while self.queue and numel < budget:
                    p, step = self.queue.popleft()
                    do = p.status == NOT_AVAILABLE and p not in prefetch
                    self.most_recent[p] = max(self.most_recent[p], step)
                    if do:
                        prefetch.append(p)
                        numel += p.numel
                if numel > 0:
                    self._all_gather(prefetch)
        self.step_id += 1

    def _to_release(self, module: str) -> set:
        """`__params_to_release` (cached per module and step, as DeepSpeed's lru_cache does)."""
        key = (module, self.step_id)
        if key not in self.release_cache:
            candidates = {p for p in self._params_of(module) if not p.persist}
            candidates -= {p for p in self._params_of(module) if self.most_recent[p] > self.step_id}
            traversed = 0
            for later in self.module_order[self.step_id:]:
                if traversed >= self.zero.max_reuse_distance:
                    break
                for p in self._params_of(later):
                    candidates.discard(p)
                    traversed += p.numel
            self.release_cache[key] = candidates
        return self.release_cache[key]

    def release(self, module: str, forward: bool) -> None:
        """`release_sub_module`."""
        to_release = self._to_release(module) if self.mode == "complete" else set(self._params_of(module))
        if not forward:
            self.active_backward.pop(module, None)
        for p in self._params_of(module):
            p.active.discard(module)
            if p in to_release:
                self._release_param(p)

    def release_backward_leftovers(self) -> None:
        while self.active_backward:
            module, _ = self.active_backward.popitem()
            for p in self._params_of(module):
                p.active.discard(module)
                if not p.persist:
                    self._release_param(p)

    def release_all(self) -> None:
        """`release_and_reset_all` (`_partition_all_parameters`, at the start of the step)."""
        for p in self.params:
            if p in self.inflight:
                self._wait(p)
            p.active.clear()
            self._release_param(p)

    # ---- gradients ---------------------------------------------------------------------------------------
    def on_gradient(self, name: str) -> None:
        """`reduce_independent_p_g_buckets_and_remove_grads`."""
        p = self.by_name[name]
        if self.bucket_elements + p.numel > self.zero.reduce_bucket_size and self.bucket_elements > 0:
            self.flush()
        if self.zero.contiguous_gradients and self.bucket_elements + p.numel <= self.zero.reduce_bucket_size:
            self._free_grad(name)  # copied into the bucket; param.grad.data now views it
            self.in_bucket.add(name)
        self.bucket.append(p)
        self.bucket_elements += p.numel

    def flush(self) -> None:
        """`__reduce_and_partition_ipg_grads` -> `__avg_scatter_grads` -> `reduce_scatter_coalesced`."""
        if not self.bucket:
            return
        params = sorted(self.bucket, key=lambda q: q.ds_id)
        cat = None
        flat_bytes = self._psum(params) * self.world * self.elem
        if self.recording:  # the paddings and the torch.cat below, for every W
            cat = self.w.padded_cat([p.ds_id for p in params], self.elem, flat_bytes, Category.TEMPORARY)
        elif not (len(params) == 1 and params[0].numel % self.world == 0):
            paddings = [(self.w.alloc(nbytes, Category.TEMPORARY), nbytes)
                        for _, _, nbytes in sorted(self._paddings(params))]
            cat = (self.w.alloc(flat_bytes, Category.TEMPORARY), flat_bytes)
            for padding in paddings:
                self.w.free(*padding, Category.TEMPORARY)
        if self.gloo:  # ProcessGroupGloo's reduce_scatter_tensor reduces a clone of its input (NCCL does not)
            clone = self.w.alloc(flat_bytes, Category.TEMPORARY)
            self.w.free(clone, flat_bytes, Category.TEMPORARY)
        copy = None  # offload: the device copy of the last host gradient partition, alive to the loop's next one
        for p in params:  # partition_grads: param.grad = None
            if self.offload and p.partition * self.rank < p.numel:  # a partition with real data on this rank
                copy = self._offload_partition(p, copy)
            if p.name in self.in_bucket:
                self.in_bucket.discard(p.name)
            elif p.name in self.grads:
                self._free_grad(p.name)
        if copy is not None:  # partition_grads returns
            self._drop(copy)
        if self.retained:
            self._swap_out_gradients()
        if cat is not None:
            self.w.free(*cat, Category.TEMPORARY)
        self.bucket, self.bucket_elements = [], 0

    def _offload_partition(self, p: _Param, previous: tuple[int, int] | None) -> tuple[int, int]:
        """`partition_grads` under offload for one parameter: its host gradient partition is brought to the device
        (`grad_buffer.to(grad_partition.device)`, at the first micro-step after the copy into it; later, the copy
        the sum is made in, `cuda_grad_buffer`, which outlives the next parameter's); at the accumulation boundary
        its norm (a float64 copy, a 0-d kept to the step) and its fp32 copy into the host master's gradient.
        Returns the device copy, (serial, bytes)."""
        if previous is not None and self.micro == 0:  # `grad_buffer` rebound to the next host partition
            self._drop(previous)
            previous = None
        nbytes = int(p.partition) * self.elem
        copy = (self.w.alloc(nbytes, Category.TEMPORARY), nbytes)
        if previous is not None:  # `cuda_grad_buffer` rebound after the next copy is made
            self._drop(previous)
        if self.micro == self.grad_accum - 1:  # _offload_grad_partition_at_boundary
            chunk = min(int(p.partition), NORM_CHUNK) * FP64_BYTES  # _constant_buffered_norm2
            upcast = self.w.alloc(chunk, Category.TEMPORARY)
            self.w.free(upcast, chunk, Category.TEMPORARY)
            self.norms.append(self.w.alloc(FP64_BYTES, Category.GRADIENT))
            fp32_bytes = int(p.partition) * FP32_BYTES
            if self._swappable(self.group_of[p]):  # `grad_buffer.to(fp32)` collected for the swapper: the copy
                # itself in fp32 (`.to` of its own dtype returns it), else an fp32 copy of it
                fp32 = copy if self.elem == FP32_BYTES else (self.w.alloc(fp32_bytes, Category.TEMPORARY), fp32_bytes)
                self.retained.append((*fp32, self.group_of[p]))
            elif self.elem != FP32_BYTES:
                fp32 = self.w.alloc(fp32_bytes, Category.TEMPORARY)
                self.w.free(fp32, fp32_bytes, Category.TEMPORARY)
        return copy

    def _drop(self, copy: tuple[int, int]) -> None:
        """A device copy of a gradient partition let go, unless the swapper's list still holds it."""
        if not self.retained or copy[0] != self.retained[-1][0]:  # the list holds at most the latest copy
            self.w.free(*copy, Category.TEMPORARY)

    def _swap_out_gradients(self) -> None:
        """`_swap_out_offload_fp32_gradients` as partition_grads returns (optimizer_utils.py `_swap_out_gradients`):
        a gradient partition the swapper will write (>= min_aio_bytes) is copied into the pinned buffers and let go;
        a smaller one is kept in memory (`unswapped_gradients`) to the sub-group's step, and so is one whose length
        is not a multiple of the I/O alignment, whose remainder (`narrow`, a view) is kept the same way."""
        for serial, nbytes, index in self.retained:
            numel = nbytes // FP32_BYTES
            if numel * FP32_BYTES < self.min_aio_bytes or numel % self.alignment:
                self.unswapped[index].append((serial, nbytes))
            else:
                self.w.free(serial, nbytes, Category.TEMPORARY)
        self.retained = []

    def _paddings(self, params: list[_Param]):
        """(rank, index, bytes) of each zero padding `__avg_scatter_grads` allocates, rank by rank and parameter by
        parameter: rank r holds min(partition, numel - r * partition) real elements, so every rank from
        numel // partition on pads (the first of them by the remainder only). zero3_resize.Program._assemble
        generates the same, vectorised."""
        for index, p in enumerate(params):
            first, held = divmod(p.numel, p.partition)
            for rank in range(first, self.world):
                yield rank, index, (p.partition - (held if rank == first else 0)) * self.elem

    def _free_grad(self, name: str) -> None:
        serial, nbytes = self.grads.pop(name)
        self.w.free(serial, nbytes, Category.GRADIENT)

    # ---- step ------------------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        self.release_all()
        if self.offload:
            self._offload_step(step)
            self._post_step()
            return
        for p in self.trainable:  # get_grad_norm_direct: g.to(float64) per partition
            upcast = self.w.alloc(p.partition * FP64_BYTES, Category.TEMPORARY)
            self.w.free(upcast, p.partition * FP64_BYTES, Category.TEMPORARY)
        for index, group in enumerate(self.sub_groups):
            numel = self._psum(group)
            flat = self.w.alloc(numel * self.elem, Category.GRADIENT)
            if self.elem != FP32_BYTES:
                fp32 = self.w.alloc(numel * FP32_BYTES, Category.GRADIENT)
                self.w.free(flat, numel * self.elem, Category.GRADIENT)
                flat = fp32
            if self.client is not None:
                self.client.step(self.w, step, index)
            else:
                step_optimizer(self.w, [numel], step == 0, self.foreach, self.optimizer, self.fused)
            self._host_staging(numel, group[0].elem)  # the update copied into the partition (the host's, offloaded)
            self.w.free(flat, numel * FP32_BYTES, Category.GRADIENT)
        self._post_step()

    def _offload_step(self, step: int) -> None:
        """The step under offload: each sub-group's norm from the kept per-partition norms, returned to the host
        (`total_norm.cpu()`, a 0-d each), their combination (a 0-d) and `_global_grad_norm` (a 0-d, kept to the
        next step, whose engine holds it until that step returns); per sub-group the host gradient clipped in
        place, the client AdamW on the host master (torch's for-loop path: host tensors), the update copied into
        the bf16 partition: on a GPU, into the device partition through a host copy in bf16 (a copy that changes
        the dtype across devices converts on the host: ATen's `copy_kernel_cuda`); with parameter offload the
        partition is on the host (`param_groups_fp16_flat_cpu_memory`), where the copy converts in place."""
        scalars = [self.w.alloc(SCALAR_FP32_BYTES, Category.HOST_OFFLOAD) for _ in self.sub_groups]
        scalars.append(self._combine_grad_norm_groups(len(self.sub_groups)))
        self._invalid_test(1)  # is_invalid_grad_norm(scaled_global_grad_norm), freed at once
        kept = self.w.alloc(SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        for index, group in enumerate(self.sub_groups):
            numel = self._psum(group)
            swapped = self._swappable(index)
            states: list[tuple[int, int]] = []
            step_optimizer(self.w, [numel], step == 0, False, self.optimizer, self.fused, on_host=True,
                           states=states)
            self._host_staging(numel, self.elem)  # _reassign_or_swap_out_partitioned_parameters' copy_
            if swapped:  # `swap_out_optimizer_state`: step 0's states, made unpinned, written through the pool
                for state in states:  # and released (`.data = torch.Tensor()`); the kept gradients dropped
                    self.w.free(*state, Category.HOST_OFFLOAD)
                for gradient in self.unswapped.pop(index, []):
                    self.w.free(*gradient, Category.TEMPORARY)
        for serial in scalars:
            self.w.free(serial, SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        if self.global_norm is not None:  # the engine's copy of the last step's, replaced once the step returns
            self.w.free(self.global_norm, SCALAR_FP32_BYTES, Category.HOST_OFFLOAD)
        self.global_norm = kept

    def _combine_grad_norm_groups(self, n: int) -> int:
        """deepspeed/runtime/utils.py `combine_grad_norm_groups` over the n sub-groups' 0-d norms on the host:
        `torch.stack` (n fp32), the invalid test, `vector_norm`, `full_like` and `torch.where` (0-d each); returns the
        serial of `where`'s result, the step's scaled norm, the rest freed as it returns. Measured on a Trainer run
        with 19 sub-groups, where it set the host peak (experiments/measure_trainer_nvme_params.out)."""
        host = Category.HOST_OFFLOAD
        stacked = self.w.alloc(n * SCALAR_FP32_BYTES, host)
        invalid = self._invalid_test(n, keep=True)
        combined = self.w.alloc(SCALAR_FP32_BYTES, host)
        full = self.w.alloc(SCALAR_FP32_BYTES, host)
        result = self.w.alloc(SCALAR_FP32_BYTES, host)
        self.w.free(full, SCALAR_FP32_BYTES, host)
        self.w.free(stacked, n * SCALAR_FP32_BYTES, host)
        self.w.free(invalid, 1, host)
        self.w.free(combined, SCALAR_FP32_BYTES, host)
        return result

    def _invalid_test(self, n: int, keep: bool = False) -> int | None:
        """`(~torch.isfinite(x) | (x < 0)).any()` over n fp32 host values: ATen's `isfinite` is `(x == x) *
        (x.abs() != inf)`, built right operand first (n fp32, then n bools each); returns the 1-byte `.any()` with
        `keep`, else frees it."""
        host = Category.HOST_OFFLOAD
        absolute = self.w.alloc(n * SCALAR_FP32_BYTES, host)
        not_inf, same = self.w.alloc(n, host), self.w.alloc(n, host)
        finite = self.w.alloc(n, host)
        for serial in (same, not_inf):
            self.w.free(serial, n, host)
        self.w.free(absolute, n * SCALAR_FP32_BYTES, host)
        inverted = self.w.alloc(n, host)
        self.w.free(finite, n, host)
        negative = self.w.alloc(n, host)
        either = self.w.alloc(n, host)
        for serial in (inverted, negative):
            self.w.free(serial, n, host)
        found = self.w.alloc(1, host)
        self.w.free(either, n, host)
        if keep:
            return found
        self.w.free(found, 1, host)
        return None

    def _post_step(self) -> None:
        """`_post_step`: the offload's per-partition norms dropped (`reset_cpu_buffers`); the persistent parameters
        gathered again, one buffer each."""
        for serial in self.norms:
            self.w.free(serial, FP64_BYTES, Category.GRADIENT)
        self.norms = []
        persistent = [p for p in self.params if p.persist]  # _post_step: one buffer each
        if len(persistent) > 1 and self._alone():  # `_allgather_params_coalesced` at one rank gathers nothing
            self._no_gather(persistent)
            for p in persistent:
                self._wait(p)
            return
        # with parameter offload, several are gathered by `_allgather_params_coalesced`: every input's device copy
        # first, the buffers, the copies freed as it returns; one alone by `_allgather_params_sequential`
        copies = self._from_host(persistent, keep=True) if len(persistent) > 1 else []
        for p in persistent:
            nbytes = p.partition * self.world * p.elem
            p.storage = (self.w.alloc(nbytes, GATHERED), nbytes)
            p.status = AVAILABLE
            if len(persistent) == 1:
                self._from_host([p])
        for copy in copies:
            self.w.free(*copy, Category.TEMPORARY)

    # ---- the walk --------------------------------------------------------------------------------------
    def run(self) -> None:
        walk_phases(self.rows, self._row, self._leave, self.w, _runs(self.timeline))
        self._check_slots()

    def _row(self, row: tuple) -> None:
        self.w.step, self.w.phase = row[0], row[1]  # what a marker row makes DeepSpeed allocate happens here
        phase, serial, category, name = row[1], int(row[4]), row[6], row[7]
        if serial == TIED:
            module = self.module_params[_module_of(row[3])]
            if self.by_name[name] not in module:  # each module lists a parameter once (`iter_params`)
                module.append(self.by_name[name])
        elif serial == FORWARD_PRE:
            if name == ROOT_MODULE:
                self.reset_step()
            self.fetch(name, forward=True)
        elif serial == FORWARD_POST:
            self.release(name, forward=True)
        elif serial == BACKWARD_PRE:
            self.fetch(name, forward=False)
        elif serial == BACKWARD_POST:
            self.release(name, forward=False)
        elif serial == GRAD_READY:
            self.on_gradient(name)
        elif category == _PARAMETER and phase == _BUILD:
            self._build_row(row)
        elif category == _GRADIENT and phase == _BACKWARD:
            self._gradient_row(row)
        else:
            self.w.keep(row)

    def _build_row(self, row: tuple) -> None:
        """The single process's whole base parameters are dropped (zero.Init partitions them instead); an
        adapter, created whole by get_peft_model once zero.Init has run, is kept until initialize partitions it."""
        p = self.by_name.get(row[7])
        if p is None or not p.adapter:
            return
        if not self.built:
            self.build()
        self.w.keep(row)
        if int(row[5]) > 0:
            self.whole[p.name] = (int(row[4]), int(row[5]))

    def _gradient_row(self, row: tuple) -> None:
        name, serial, delta = row[7], int(row[4]), int(row[5])
        if delta > 0:
            self.w.keep(row)
            self.grads[name] = (serial, delta)
        elif name in self.grads and self.grads[name][0] == serial:
            if self.micro > 0:  # a later micro-step's own gradient (TrainSetup.label_micro_grads), which the trace
                return          # adds into `.grad` and drops: here `.grad` is None after every partition_grads, so
                                # autograd keeps it as `.grad` and the reduction frees it
            self.w.keep(row)  # autograd replaced the gradient storage itself
            del self.grads[name]

    def _leave(self, step: int, phase: str) -> None:
        self.w.step, self.w.phase = step, phase
        if phase == Phase.BUILD.value:
            if not self.built:
                self.build()
            self.initialize()
        elif phase == Phase.BACKWARD.value:
            self.flush()  # independent_gradient_partition_epilogue
            self.release_backward_leftovers()
            self.micro += 1
        elif phase == Phase.OPTIMIZER.value:
            self.step(step)
            self.micro = 0


@per_timeline
def _runs(t: pd.DataFrame) -> list[tuple[int, int, int]]:
    """The rows a ZeRO-3 rank acts on (markers, the build's parameters, the backward's gradients), those it copies
    and the client optimizer's, which it leaves out: the same for every layout of one traced timeline."""
    phase, category = t["phase"], t["category"]
    own = ((t["serial"] < 0)  # markers
           | ((category == Category.PARAMETER.value) & (phase == Phase.BUILD.value))
           | ((category == Category.GRADIENT.value) & (phase == Phase.BACKWARD.value))).to_numpy()
    dropped = (phase == Phase.OPTIMIZER.value).to_numpy()  # the client optimizer's rows
    return own_runs(rows_of(t), own, dropped)


@per_timeline
def _tied_in_build(t: pd.DataFrame) -> list[str]:
    """The parameters a module ties in the build (TIED markers), in timeline order."""
    return t.loc[(t["serial"] == TIED) & (t["phase"] == _BUILD), "tensor"].tolist()


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ROOT_MODULE


def plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    """Every rank runs the same events: partitions are ceil(n / W) elements everywhere (the last rank's
    padding included), so one timeline serves all ranks: the walk's (`walk`), evaluated from a program a walk of the
    same step and config recorded at a world size with the same sub-groups (zero3_resize.py), else recorded now; a
    client optimizer other than AdamW is walked every time."""
    if layout.deepspeed.offloads_optimizer or layout.deepspeed.offloads_params:
        return _offload_plan(timeline, layout, setup)
    # one rank gathers nothing (`_Rank._alone`): walked, never resized from a program of other world sizes
    alone = layout.world_size == 1
    shared = None if uses_flat_optimizer(layout, setup) or alone else _resized(timeline, layout, setup)
    if shared is None:
        shared = walk(timeline, layout, setup)
    return {rank: shared for rank in range(layout.world_size)}


def _offload_plan(timeline: pd.DataFrame, layout, setup) -> dict[int, pd.DataFrame]:
    """Under offload a rank brings only the gradient partitions that hold real data to the device (`partition_grads`'
    `contains_real_data`: the last ranks' partitions of a small parameter can be all padding): the ranks fall into
    classes of the same such partitions, and one rank of each class is walked."""
    rows = rows_of(timeline)
    first = _Rank(timeline, rows, layout, setup)  # rank 0, the first of its class
    classes: dict[tuple[bool, ...], list[int]] = {}
    for rank in range(layout.world_size):
        classes.setdefault(tuple(p.partition * rank < p.numel for p in first.trainable), []).append(rank)
    ranks = {}
    for members in classes.values():
        walker = first if members[0] == 0 else _Rank(timeline, rows, layout, setup, rank=members[0])
        walker.run()
        shared = walker.w.frame(timeline)
        ranks.update((rank, shared) for rank in members)
    return dict(sorted(ranks.items()))


SWAPPED_STATES = 2  # AdamW's and CPU Adam's exp_avg and exp_avg_sq (their `step` is too small to swap)


def nvme_bytes(timeline: pd.DataFrame, layout, setup) -> list[int]:
    """What each rank's swappers write under nvme_path/zero_stage_3: the optimizer swapper's (optimizer/rank<r>) per
    swapped sub-group its fp32 master and AdamW's two states, each its partition rounded up to the I/O alignment;
    and each gradient partition of 1 MiB or more of a parameter with data on that rank, its aligned part (the rest
    stays in memory) -- `<id>.tensor.swp`, `exp_avg-<id>...`, `<id>_gradient_<offset>_<length>...`
    (swap_tensor/optimizer_utils.py). The parameter swapper's (<dtype>params/rank<r>, `<ds_id>_param.tensor.swp`)
    each partition it swaps at zero.Init, rounded up to the alignment, on every rank (the tied module's own
    parameter too, made before `tie_weights` replaced it)."""
    rank = _Rank(timeline, [], layout, setup)
    params = 0
    if rank.swap_params:
        tied = [rank.by_name[name] for name in _tied_in_build(timeline) if name in rank.by_name]
        for p in [p for p in rank.params if not p.adapter] + tied:
            if rank._swaps_param(p):
                params += _io_aligned(p.partition, rank.param_alignment) * rank.elem
    if not rank.swap:
        return [params] * layout.world_size
    per_group = params
    for index in sorted(rank.swapped):
        numel = _io_aligned(int(rank._psum(rank.sub_groups[index])), rank.alignment)
        per_group += numel * FP32_BYTES * (1 + SWAPPED_STATES)
    nbytes = [per_group] * layout.world_size
    for index in rank.swapped:
        for p in rank.sub_groups[index]:
            if p.partition * FP32_BYTES < rank.min_aio_bytes:
                continue
            written = (p.partition - p.partition % rank.alignment) * FP32_BYTES
            for r in range(min(layout.world_size, math.ceil(p.numel / p.partition))):  # ranks with real data
                nbytes[r] += written
    return nbytes


def _io_aligned(numel: int, alignment: int) -> int:
    """`numel` rounded up to the swappers' I/O alignment (swap_tensor/utils.py and the swappers' own
    `_io_aligned_numel`): what a swap buffer or a file holds of it."""
    return numel + -numel % alignment


def walk(timeline: pd.DataFrame, layout, setup) -> pd.DataFrame:
    """A rank's timeline, walked event by event: the reference the recorded programs are checked against
    (tests/test_zero3_resize.py)."""
    rank = _Rank(timeline, rows_of(timeline), layout, setup)
    rank.run()
    return rank.w.frame(timeline)


def record(timeline: pd.DataFrame, layout, setup) -> Program:
    """The walk at `layout`'s world size, recorded for every world size with the same sub-groups."""
    rank = _Rank(timeline, rows_of(timeline), layout, setup, recording=True)
    rank.run()
    return Program(rank.w, timeline, [p.numel for p in rank.params], [p.ds_id for p in rank.trainable],
                   rank.zero.sub_group_size, rank.sub_group_ends, rank.group_lengths)


def uses_flat_optimizer(layout, setup) -> bool:
    """A client optimizer other than AdamW (strategies/flat_optimizer.py): its recorded step depends on the
    sub-groups' sizes in ways of its own (8-bit blocks, `min_8bit_size`), so it is walked at every W."""
    return layout.deepspeed.optimizer_kind == "client" and setup.optimizer is not Optimizer.ADAMW


PROGRAMS_PER_CONFIG = 4  # programs kept per step and config (one per set of sub-groups; 70B: ~11 MiB each)


def _resized(timeline: pd.DataFrame, layout, setup) -> pd.DataFrame:
    config = layout.deepspeed.config  # what the walk reads of it (`zero()`, `optimizer_of`, `torch_fused`)
    programs = _programs(timeline, json.dumps([config.get("zero_optimization"), config.get("optimizer")],
                                              sort_keys=True), setup)
    world = layout.world_size
    for index, program in enumerate(programs):
        if program.matches(world):
            programs.append(programs.pop(index))
            return program.frame(world)
    if len(programs) >= PROGRAMS_PER_CONFIG:
        programs.pop(0)
    programs.append(record(timeline, layout, setup))
    return programs[-1].frame(world)


@per_timeline(maxsize=4)
def _programs(timeline: pd.DataFrame, config: str, setup) -> list[Program]:
    """The programs recorded on `timeline` for one DeepSpeed config (its W-independent sections) and setup, most
    recently used last."""
    return []
