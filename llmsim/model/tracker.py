"""Exact per-process tensor memory: every storage allocation, free and resize, tagged with where it happened.

The same tracker measures real runs (tier 1/2 oracles) and traces fake-tensor runs (the predictor), so the
two count the same bytes by construction. It mirrors `torch.distributed._tools.mem_tracker.MemTracker`:
a `TorchDispatchMode` that keeps a weakref on every `UntypedStorage` it sees (the weakref callback is the
free), patches `UntypedStorage.resize_` (used by FSDP and DeepSpeed to release storage in place) and
flattens traceable wrapper subclasses such as DTensor into their local tensors.

Every event carries (step, phase, block, module): `block` is the index of the repeated decoder layer the
event belongs to, which is what lets the timeline stage replicate one traced layer to any depth.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from llmsim.enums import Category, Phase

_PRIM_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
NO_BLOCK = -1  # events outside the repeated decoder layers (embeddings, final norm, LM head, loss)
GRAD_READY = -1  # serial of a zero-byte marker row: the gradient of `tensor` has just been accumulated
# Serials of zero-byte marker rows where DeepSpeed ZeRO-3's hooks on module `tensor` run (traced only when the
# layout needs them; deepspeed/runtime/zero/parameter_offload.py, `_register_deepspeed_module`): before and
# after its forward (also in a checkpointed recompute), before its backward and after it.
FORWARD_PRE, FORWARD_POST, BACKWARD_PRE, BACKWARD_POST = -2, -3, -4, -5
MODULE_MARKERS = (FORWARD_PRE, FORWARD_POST, BACKWARD_PRE, BACKWARD_POST)
TIED = -6  # serial of a zero-byte build row: parameter `module` is the same Parameter as `tensor` (tied weights)
# Serials of zero-byte rows: a thread's first cuBLAS call (`module` "cublas") or first cuBLASLt one ("cublaslt"). On
# a GPU, torch allocates that thread's handle's workspace there through the caching allocator, kept to the end of
# the process (aten/src/ATen/cuda/CublasHandlePool.cpp, keyed by handle and stream): the forward's thread and the
# autograd engine's device thread (the backward, and a checkpointed recompute inside it) each have their own, so a
# training step holds two cuBLAS workspaces, and two cuBLASLt ones where an addmm with a 1-D bias ran in both
# (CUDABlas.cpp `gemm_and_bias`, the path `addmm_out_cuda_impl` takes for it). llmsim/sim/replay.py gives a GPU
# prediction's rows their bytes (GpuProfile); the CPU has no workspace.
CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE = -7, -8
WORKSPACE_MARKERS = {"cublas": CUBLAS_WORKSPACE, "cublaslt": CUBLASLT_WORKSPACE}
_WORKSPACE_SERIALS = frozenset(WORKSPACE_MARKERS.values())
_BLAS_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default, torch.ops.aten.addbmm.default, torch.ops.aten.addmv.default,
             torch.ops.aten.mv.default}
_LT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# `tensor`: the labelled name of what the storage holds (a parameter's FQN, also for its gradient), or "".
TIMELINE_COLUMNS = ["step", "phase", "block", "module", "serial", "delta_bytes", "category", "tensor"]
# A pipeline stage's timeline attrs: its schedule's chunk calls, (kind "F"/"B", micro-batch, step, first row, end row)
CHUNKS = "chunks"


class Chunks(tuple):
    """The CHUNKS attr's value: a tuple that a deep copy returns as it is. pandas deep-copies a frame's attrs into
    every frame and column derived from it; walking a pipeline stage's hundreds of chunk tuples at each was 14 % of
    `size`'s evaluation of a 64-stage pipeline of Llama-2-70B."""

    def __deepcopy__(self, memo):
        return self  # immutable: nothing to copy


@dataclass
class _Live:
    serial: int
    nbytes: int
    block: int
    module: str


def _locals(tensor: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors a wrapper subclass (DTensor: its local shard) is made of; the tensor itself otherwise."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        for name in inner_names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # DTensor also names its device mesh
                yield from _locals(inner)
    else:
        yield tensor


def _lt_addmm(func, args, kwargs) -> bool:
    """Whether CUDA's addmm takes cuBLASLt (`gemm_and_bias`, aten/src/ATen/native/cuda/Blas.cpp): a contiguous 1-D
    bias as wide as the product, beta 1, fp32/fp16/bf16, both matrices' sides over 1."""
    if func is not torch.ops.aten.addmm.default or len(args) < 3:
        return False
    bias, mat1, mat2 = args[:3]
    return (bias.dim() == 1 and mat1.dim() == 2 and mat2.dim() == 2 and bias.shape[0] == mat2.shape[1]
            and bias.dtype in _LT_DTYPES and kwargs.get("beta", 1) == 1 and bias.is_contiguous()
            and min(*mat1.shape, *mat2.shape) > 1)


def _storages(tensor: torch.Tensor) -> Iterable[torch.UntypedStorage]:
    for local in _locals(tensor):
        yield local.untyped_storage()


class StorageTracker(TorchDispatchMode):
    """Records the allocation timeline of everything run under it.

    The caller moves the context forward with `set_phase`, and `attach` installs the module hooks that
    set `block` and `module` in the forward and the backward. In the build and optimizer phases, where no
    module runs, an op belongs to the block of the parameter (or its gradient or state) it works on.
    """

    def __init__(self) -> None:
        super().__init__()
        self._rows: list[tuple] = []
        self._live: dict[int, _Live] = {}
        self._alloc_row: dict[int, int] = {}  # serial -> row of its allocation
        self._alloc_phase: dict[int, tuple[int, Phase]] = {}
        self._serial_block: dict[int, int] = {}
        self._serial_name: dict[int, str] = {}
        self._labels: dict[int, Category] = {}
        self._phase_end: dict[tuple[int, Phase], int] = {}
        self._next_serial = 0
        self._finished = False
        self.step = 0
        self.phase = Phase.BUILD
        self.block = NO_BLOCK
        self.module = ""
        self.frees_by_owner = True
        self._tied_rows: dict[int, str] = {}  # row -> the parameter a TIED row's alias is
        self._loading = False  # inside `loading_checkpoint`
        self._copied: set[int] = set()  # serials counted by `adopt_loaded` at their tensors' bytes
        self._excluded: list[torch.UntypedStorage] = []  # the instrument's own tensors (`exclude`)
        self.chunks: list[tuple[str, int, int, int, int]] = []  # a pipeline stage's chunk calls (CHUNKS)
        self._blas: set[tuple[bool, str]] = set()  # (on autograd's thread, "cublas"/"cublaslt"): marked

    # ---- the context ---------------------------------------------------------------------------------
    def set_phase(self, step: int, phase: Phase) -> None:
        self._phase_end[(self.step, self.phase)] = len(self._rows)
        self.step, self.phase, self.block, self.module = step, phase, NO_BLOCK, ""
        self.frees_by_owner = phase is Phase.BUILD

    def finish(self) -> None:
        """The step is over: what dies afterwards (the model, the optimizer, the last loss, as the training
        function returns) is teardown, not part of the step, and is not recorded."""
        self._phase_end[(self.step, self.phase)] = len(self._rows)
        self._finished = True

    def label(self, tensors: Iterable[torch.Tensor], category: Category, names: Iterable[str] | None = None,
              blocks: Iterable[int] | None = None, retag: bool = False) -> None:
        """Name what live storages hold and which layer owns them. With `retag`, their allocations move
        to that layer too (parameters built by `from_config` are only known to belong to a layer once
        the model exists)."""
        tensors = list(tensors)
        names = list(names) if names is not None else [None] * len(tensors)
        blocks = list(blocks) if blocks is not None else [None] * len(tensors)
        for tensor, name, block in zip(tensors, names, blocks):
            for storage in _storages(tensor):
                live = self._live.get(storage._cdata)
                if live is None:
                    continue
                self._labels[live.serial] = category
                if name is not None:
                    self._serial_name[live.serial] = name
                if block is not None:
                    self._serial_block[live.serial] = block
                if block is not None and retag:
                    live.block = block
                    row = self._rows[self._alloc_row[live.serial]]
                    self._rows[self._alloc_row[live.serial]] = (row[0], row[1], block, name, *row[4:])

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count, from now on, storages that no op produced: a checkpoint's tensors that `from_pretrained` keeps
        as safetensors memory-maps them (file pages on the CPU; on a GPU they are copied to the device as they load).
        Storages already seen are left alone."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            for storage in _storages(tensor):
                if storage._cdata not in self._live:
                    self._allocate(storage, storage._cdata, storage.nbytes(), self.block, self.module)

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages: the measurement's own inputs made before the run (a forced routing
        handed to the experts in place of the router's), not the job's memory."""
        for tensor in tensors:
            self._excluded.extend(_storages(tensor))

    @contextlib.contextmanager
    def loading_checkpoint(self):
        """Around `from_pretrained`: a view of a storage this tracker has not seen is memory the run did not
        allocate -- on the CPU, the safetensors file mapping that a loaded tensor (or its TP shard, a slice of it)
        still points into -- and is not counted there; `adopt_loaded` counts what the device holds of it."""
        self._loading = True
        try:
            yield
        finally:
            self._loading = False

    def adopt_loaded(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the loaded tensors that still point into the checkpoint's file mapping as what a GPU holds of
        them: the copy `tensor.to(device)` makes in transformers' loader (core_model_loading, sharding_utils
        `shard_tensor`: `source[slices].to(device=device, dtype=dtype)`), the tensor's own bytes -- for a TP
        shard, the shard, not the whole checkpoint tensor it slices. Such a storage is not resized later by
        what its size says (it is the file's)."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            for local in _locals(tensor):
                storage, nbytes = local.untyped_storage(), local.numel() * local.element_size()
                live = self._live.get(storage._cdata)
                if live is None:
                    self._allocate(storage, storage._cdata, nbytes, self.block, self.module)
                    self._copied.add(self._live[storage._cdata].serial)
                elif live.serial in self._copied:  # a second tensor in the same file storage: its own copy too
                    self._rows.append((self.step, self.phase, self.block, self.module, live.serial, nbytes))
                    live.nbytes += nbytes

    def mark_grad_ready(self, name: str) -> None:
        """A zero-byte row at the moment autograd has accumulated `name`'s gradient: where DeepSpeed's
        and DDP's gradient hooks (`register_post_accumulate_grad_hook`) run."""
        self._rows.append((self.step, self.phase, self.block, name, GRAD_READY, 0))

    def mark_module(self, marker: int, module: str, block: int) -> None:
        """A zero-byte row where a ZeRO-3 module hook runs (`marker`: one of MODULE_MARKERS)."""
        self._rows.append((self.step, self.phase, block, module, marker, 0))

    def mark_tied(self, alias: str, name: str, block: int) -> None:
        """A zero-byte row saying that parameter FQN `alias` is the parameter labelled `name`."""
        self._tied_rows[len(self._rows)] = name
        self._rows.append((self.step, self.phase, block, alias, TIED, 0))

    # ---- the dispatch mode -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and isinstance(args[0], FakeTensor):
            # what FakeTensorMode answers (fake_tensor.py, `_device_handler`), without its dispatch: C++ asks a fake
            # tensor's device on most ops (the autograd engine, linear), 60 % of a trace's dispatches; no storage.
            if self.phase in (Phase.BUILD, Phase.OPTIMIZER):
                self._op_blocks(args)  # as for any op there: its tensor's layer becomes the current one
            return _META if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        out = func(*args, **(kwargs or {}))
        if self._loading and func.is_view:  # a view of what exists already: no allocation (`loading_checkpoint`)
            return out
        op_blocks = self._op_blocks(args) if self.phase in (Phase.BUILD, Phase.OPTIMIZER) else None
        if not isinstance(op_blocks, list) and self.phase in (Phase.BUILD, Phase.OPTIMIZER):
            op_blocks = self._mixed_list_blocks(args, out) or op_blocks
        if isinstance(op_blocks, list) and isinstance(out, (list, tuple)) and len(out) == len(op_blocks):
            for tensor, (block, name) in zip(out, op_blocks):  # a foreach op: output i follows input i
                self._see(tensor, block, name)
        else:
            block, name = op_blocks if isinstance(op_blocks, tuple) else (self.block, self.module)
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._see(leaf, block, name)
        if func in _BLAS_OPS:  # after its output, as CUDA allocates them (measured on an H200)
            self._blas_call(func, args, kwargs or {})
        return out

    def _blas_call(self, func, args, kwargs) -> None:
        """Mark the thread's first cuBLAS call and first cuBLASLt one (WORKSPACE_MARKERS), after the op's output as
        CUDA allocates them: the backward runs on autograd's thread. A cuBLASLt call takes the thread's cuBLAS handle
        too, which allocates the cuBLAS workspace first (measured on an H200: 33,554,432 B, then 1,048,576 B)."""
        thread = self.phase is Phase.BACKWARD
        for kind in ("cublas", "cublaslt") if _lt_addmm(func, args, kwargs) else ("cublas",):
            if (thread, kind) not in self._blas:
                self._blas.add((thread, kind))
                self._rows.append((self.step, self.phase, self.block, kind, WORKSPACE_MARKERS[kind], 0))

    def _op_blocks(self, args) -> list[tuple[int, str]] | tuple[int, str] | None:
        first = args[0] if args else None
        if isinstance(first, (list, tuple)) and first and isinstance(first[0], torch.Tensor):
            found = [self._block_of(t) for t in first]
            if all(f is not None for f in found):
                self.block, self.module = found[-1]
                return found  # type: ignore[return-value]
        for leaf in tree_leaves(args):
            if isinstance(leaf, torch.Tensor):
                found = self._block_of(leaf)
                if found is not None:
                    self.block, self.module = found
                    return found
        return None

    def _mixed_list_blocks(self, args, out) -> list[tuple[int, str]] | None:
        """A foreach op over a list that mixes layers' tensors with others (the embedding's, the final norm's,
        the LM head's: AdamW's foreach path steps them all in one list): output i follows input i, a layer's
        output in its layer's block, the others in none."""
        first = args[0] if args else None
        if not (isinstance(first, (list, tuple)) and first and isinstance(out, (list, tuple))
                and len(out) == len(first) and all(isinstance(t, torch.Tensor) for t in first)):
            return None
        found = [self._block_of(t) for t in first]
        if not any(f is not None for f in found):
            return None
        return [f if f is not None else (NO_BLOCK, self.module) for f in found]

    def _block_of(self, tensor: torch.Tensor) -> tuple[int, str] | None:
        for storage in _storages(tensor):
            live = self._live.get(storage._cdata)
            if live is not None and live.serial in self._serial_block:
                return self._serial_block[live.serial], self._serial_name.get(live.serial, "")
        return None

    def _see(self, tensor: torch.Tensor, block: int, name: str) -> None:
        if tensor.device.type == "meta":  # shape-only tensors (DeepSpeed keeps some) hold no memory; a
            return  # FakeTensor reports its fake device here, so fake runs are still counted
        for storage in _storages(tensor):
            key = storage._cdata
            if self._excluded and any(key == excluded._cdata for excluded in self._excluded):
                continue
            nbytes = storage.nbytes()
            live = self._live.get(key)
            if live is None:
                self._allocate(storage, key, nbytes, block, name)
            elif live.nbytes != nbytes and live.serial not in self._copied:
                self._resize(live, nbytes)

    def _allocate(self, storage, key: int, nbytes: int, block: int, name: str) -> None:
        serial = self._next_serial
        self._next_serial += 1
        live = _Live(serial, nbytes, block, name)
        self._live[key] = live
        self._alloc_row[serial] = len(self._rows)
        self._alloc_phase[serial] = (self.step, self.phase)
        if self.phase in (Phase.BUILD, Phase.OPTIMIZER) and block != NO_BLOCK:
            self._serial_block[serial] = block
            self._serial_name[serial] = name
        self._rows.append((self.step, self.phase, block, name, serial, nbytes))
        weakref.finalize(storage, self._free, key, serial)

    def _free(self, key: int, serial: int) -> None:
        live = self._live.get(key)
        if live is None or live.serial != serial or self._finished:
            return
        del self._live[key]
        # A free belongs to the running layer: layer i's backward frees what layer i-1 saved, and the
        # optimizer's update of layer i's first parameter frees the temporary of layer i-1's last one.
        # Where frees come in bulk with no layer running -- the build, autocast dropping its weight-cast
        # cache when the forward returns, zero_grad -- the caller sets `frees_by_owner`: a free then
        # belongs to the layer that allocated it.
        block, name = (live.block, live.module) if self.frees_by_owner else (self.block, self.module)
        self._rows.append((self.step, self.phase, block, name, serial, -live.nbytes))

    def _resize(self, live: _Live, nbytes: int) -> None:
        self._rows.append((self.step, self.phase, self.block, self.module, live.serial, nbytes - live.nbytes))
        live.nbytes = nbytes

    @staticmethod
    def active() -> StorageTracker | None:
        """The tracker on the current dispatch-mode stack (None where none runs)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        return next((mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, StorageTracker)), None)

    @contextlib.contextmanager
    def in_layer(self, block: int, module: str):
        """The tracker's layer is `block` (module `module`) meanwhile: work a wrapper does for every layer at once,
        outside any layer's call, counted as each layer's own."""
        before = self.block, self.module
        self.block, self.module = block, module
        try:
            yield
        finally:
            self.block, self.module = before

    def __enter__(self):
        _ResizeWatch.enter(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ResizeWatch.exit(self)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        live = self._live.get(storage._cdata)
        if live is not None and live.nbytes != storage.nbytes() and live.serial not in self._copied:
            self._resize(live, storage.nbytes())

    # ---- the result ------------------------------------------------------------------------------------
    def timeline(self) -> pd.DataFrame:
        """One row per event, in execution order; `category` resolved now that every label is known."""
        frame = pd.DataFrame(self._rows, columns=TIMELINE_COLUMNS[:-2])
        free_rows = {row[4]: i for i, row in enumerate(self._rows) if row[5] < 0}
        # a storage's category and name, once per storage (a pipeline stage's replayed micro-batches make many rows)
        storages, each = np.unique(frame["serial"].to_numpy(), return_inverse=True)
        storages = storages.tolist()
        frame["category"] = np.array([self._category(s, free_rows) for s in storages], dtype=object)[each]
        frame["tensor"] = np.array([self._serial_name.get(s, "") if s in self._labels else "" for s in storages],
                                   dtype=object)[each]
        markers = (frame["serial"] < 0).to_numpy()
        frame.loc[markers, "tensor"] = frame.loc[markers, "module"]
        for row, name in self._tied_rows.items():
            frame.loc[row, "tensor"] = name
        # from the rows' Phase members, not the frame's column: pandas 3 with pyarrow stores a str subclass as str
        frame["phase"] = [row[1].value for row in self._rows]
        if self.chunks:
            frame.attrs[CHUNKS] = Chunks(self.chunks)
        return frame

    def _category(self, serial: int, free_rows: dict[int, int]) -> str:
        if serial == GRAD_READY:
            return Category.GRADIENT.value
        if serial in _WORKSPACE_SERIALS:  # no bytes here; a GPU prediction gives them the workspace's
            return Category.WORKSPACE.value
        if serial < 0:  # a module marker: no bytes
            return Category.PARAMETER.value
        label = self._labels.get(serial)
        if label is not None:
            return label.value
        step, phase = self._alloc_phase[serial]
        if phase is Phase.FORWARD and self._outlives(serial, step, phase, free_rows):
            return Category.ACTIVATION.value
        return Category.TEMPORARY.value

    def _outlives(self, serial: int, step: int, phase: Phase, free_rows: dict[int, int]) -> bool:
        end = self._phase_end.get((step, phase), len(self._rows))
        return free_rows.get(serial, len(self._rows)) >= end


class _ResizeWatch:
    """`UntypedStorage.resize_` (FSDP and DeepSpeed release and refill storage in place with it; no dispatch mode
    sees it) patched once for the process while any tracker is entered, telling every entered tracker, whichever
    thread resizes (a backward hook runs on autograd's device thread on a GPU). One patch and a list of trackers, not
    a patch per tracker that restores "the original" it saw: trackers entered and left in another order (two
    threads of a Dask worker) would leave a finished tracker's patch in place or a live one's removed."""

    _lock = threading.Lock()
    _trackers: list[StorageTracker] = []  # each entry of a tracker (one can be entered again inside itself)
    _original = None

    @classmethod
    def enter(cls, tracker: StorageTracker) -> None:
        with cls._lock:
            if not cls._trackers:
                cls._original = torch.UntypedStorage.resize_
                torch.UntypedStorage.resize_ = cls._resize
            cls._trackers.append(tracker)

    @classmethod
    def exit(cls, tracker: StorageTracker) -> None:
        with cls._lock:
            cls._trackers.remove(tracker)
            if not cls._trackers:
                torch.UntypedStorage.resize_ = cls._original

    @staticmethod
    def _resize(storage, size):
        result = _ResizeWatch._original(storage, size)
        for tracker in dict.fromkeys(_ResizeWatch._trackers):  # each once
            tracker._resized(storage)
        return result
