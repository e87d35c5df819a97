"""The CPU standing in for both sides of a ZeRO-Offload run: which storages a GPU run would hold on the host.

On a GPU DeepSpeed's optimizer offload keeps the fp32 master partition, its gradient, the optimizer states and a
few staging buffers on the host (`self.device = 'cpu'` when offloading, deepspeed/runtime/zero/stage_1_and_2.py and
stage3.py; ZeRO-3's parameter offload its parameters' partitions too, `remote_device`) and everything else on the
accelerator (`get_accelerator().current_device_name()`). On this CPU both names are
"cpu", so a real run cannot tell them apart, and the moves between them behave differently: `t.to("cpu")` of a
tensor already on the CPU returns the tensor itself, where the GPU run copies it across.

`HostMemory` makes the measured run hold and move what a GPU run would, through DeepSpeed's own code:
- the optimizer's host name is replaced by `HOST`, a "cpu" string that remembers it names the host (it compares
  equal to "cpu", so DeepSpeed's `self.device == 'cpu'` branches are unchanged);
- a torch function given `HOST` as its device makes host storages (`torch.zeros(n, device=HOST)`,
  `t.to(HOST)`), and a host tensor's `.device` is `HOST_DEVICE`, so `torch.full(n, device=t.device)` is one too;
- a `.to()` or `.cpu()` that crosses between the host and the device always copies, as it does on a GPU
  (`copy=True`: the CPU would otherwise alias);
- any other op's new storages are on the host when its tensor inputs are (AdamW stepping the host partition:
  its states and temporaries), on the device otherwise. A 0-d tensor beside a device tensor does not make the
  op a host op (CUDA takes CPU scalars).
DeepSpeed's gradient hooks run under the first mode too (the autograd engine drops torch function modes).
Everything else -- default-device factories included -- is the device, as in every other CPU run llmsim measures.
At the end the host storages are labelled `Category.HOST_OFFLOAD`, which the rows report apart from the device
peak (`llmsim.model.offload.split_host`).

What it cannot show: on a GPU `get_accelerator().pin_memory(t)` returns a page-locked *copy* of `t`; DeepSpeed's
CPU accelerator returns `t`, so the measured host bytes are those of the unpinned path (see the strategy module).
"""
from __future__ import annotations

import contextlib
import inspect
from unittest import mock

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmsim.enums import Category
from llmsim.model.tracker import StorageTracker, _storages

_TO = {torch.Tensor.to}
_CPU_DEVICE = torch.device("cpu")
_CPU = {torch.Tensor.cpu}
_PIN, _IS_PINNED = torch.Tensor.pin_memory, torch.Tensor.is_pinned
_DEEPCOPY = torch.Tensor.__deepcopy__


class HostDevice(str):
    """"cpu", naming the host of an offloading run (not the CPU standing in for the accelerator)."""

    __slots__ = ()


HOST = HostDevice("cpu")
# what `t.device` answers for a host tensor `t`: the CPU with an index, which torch accepts and keeps in a
# factory's arguments, so `torch.full(n, device=t.device)` (DeepSpeed's host staging buffers) is known to be the host.
# Not an index a process names the CPU by: accelerate's distributed CPU state is `cpu:<local rank>`
HOST_DEVICE = torch.device("cpu", 99)  # (a device index is an int8: 255 would be no index, plain "cpu")
_DEVICE_GETTER = inspect.getattr_static(torch.Tensor, "device")


def _is_host_name(device) -> bool:
    return isinstance(device, HostDevice) or (isinstance(device, torch.device) and device == HOST_DEVICE)


def _is_meta_name(device) -> bool:
    return device is not None and not isinstance(device, HostDevice) and torch.device(device).type == "meta"


def _to_target(args, kwargs):
    """The device a `Tensor.to(...)` call names (None when it names only a dtype)."""
    device = kwargs.get("device")
    if device is None:
        for arg in args[1:]:
            if isinstance(arg, (str, torch.device)):
                return arg
            if isinstance(arg, torch.Tensor):  # .to(other): other's device and dtype
                return arg.device
    return device


def optimizer_offload(tracker: StorageTracker, ds_config: dict | str | None):
    """The measured run's context: `HostMemory(tracker).active(...)` where its DeepSpeed JSON (a dict, a path, or
    None) offloads the optimizer to the CPU, or ZeRO-3's parameters, else nothing."""
    import json
    from pathlib import Path

    if isinstance(ds_config, (str, Path)):
        ds_config = json.loads(Path(ds_config).read_text())
    zero = (ds_config or {}).get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    stage3 = int(zero.get("stage", 0)) == 3
    param_device = (zero.get("offload_param") or {}).get("device", "none") if stage3 else "none"
    if offload.get("device", "none") == "none" and param_device == "none":
        return contextlib.nullcontext()
    if stage3:  # the optimizer or the parameters (or both) on the host
        return HostMemory(tracker).active_stage3(param_device != "none", swap=offload.get("device") == "nvme",
                                                 swap_params=param_device == "nvme")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return HostMemory(tracker).active((DeepSpeedZeroOptimizer,))


def fsdp_offload(tracker: StorageTracker, fsdp):
    """The step's context for FSDP2 settings `fsdp` (llmsim.inputs.spec.FsdpSetup or None): with offload
    (CPUOffloadPolicy) or a model loaded on the host (init "host": the HF Trainer's FSDP on a GPU) the CPU standing
    in for the host and the device (`HostMemory.active_fsdp`), in a measured run and in the trace alike; else
    nothing."""
    if fsdp is None or not (fsdp.offload or fsdp.init == "host"):
        return contextlib.nullcontext()
    return HostMemory(tracker).active_fsdp(offload=fsdp.offload, host_build=fsdp.init == "host")


class HostMemory:
    """Tracks which of the tracker's storages a GPU run would hold on the host (see the module docstring)."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.host: set[int] = set()  # serials of host storages
        self.plain_devices = 0  # inside DeepSpeedCPUAdam.step (`_plain_devices`): host tensors answer "cpu"
        self.pinned: set[int] | None = None  # serials of page-locked host storages, where pinning is followed
        self.loaded_shards_to_host = False  # inside accelerate's fsdp2_load_full_state_dict(cpu_offload=True)

    # ---- storages ---------------------------------------------------------------------------------------
    def _serials(self, value) -> list[int]:
        found = []
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                for storage in _storages(leaf):
                    live = self.tracker._live.get(storage._cdata)
                    if live is not None:
                        found.append(live.serial)
        return found

    def is_host(self, tensor: torch.Tensor) -> bool:
        serials = self._serials(tensor)
        return bool(serials) and all(s in self.host for s in serials)

    def _place(self, out, since: int, on_host: bool) -> None:
        for serial in self._serials(out):
            if serial >= since:
                (self.host.add if on_host else self.host.discard)(serial)

    def inputs_on_host(self, args, kwargs) -> bool:
        """An op runs on the host when a tensor input is there and no input of more than one element is on the
        device."""
        host = device = False
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                serials = self._serials(leaf)
                if not serials:
                    continue
                if all(s in self.host for s in serials):
                    host = True
                elif leaf.dim() > 0:
                    device = True
        return host and not device

    # ---- the run ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self, optimizer_classes: tuple[type, ...] = ()):
        """While the run goes: `HOST` for each offloading optimizer's host name, the two modes, and the labels at
        the end."""
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        patches = [mock.patch.object(cls, "device", _host_name_property(), create=True) for cls in optimizer_classes]
        patches.append(mock.patch.object(torch.Tensor, "register_post_accumulate_grad_hook",
                                         self._placing_hooks(torch.Tensor.register_post_accumulate_grad_hook)))
        patches.append(mock.patch.object(DeepSpeedCPUAdam, "step", self._plain_devices(DeepSpeedCPUAdam.step)))
        with self._modes(patches):
            yield self

    @contextlib.contextmanager
    def active_fsdp(self, offload: bool = True, host_build: bool = False):
        """`active` for FSDP2's `CPUOffloadPolicy` (torch/distributed/fsdp/_fully_shard; `offload`) and for a model
        loaded on the host (`host_build`: the HF Trainer's FSDP on a GPU, which leaves the model where
        from_pretrained loaded it): when accelerate's `fsdp2_prepare_model` starts, every storage then live is the
        host's (the loaded model, the dataset), accelerate's fp32 upcast is made from host tensors (the host's), and
        `fully_shard`'s `_move_states_to_device` copies each unit's parameters and buffers to the device
        (`tensor.to(device)` of a host tensor: a crossing), where FSDP2 shards them. What `offload` names:
        - the host: each parameter's padded shard, `.cpu()` in `FSDPParam._init_sharded_param` (and what
          `to_empty(device=HOST)` materialises on a meta-built model), and each sharded gradient, which
          `foreach_reduce` copies there with `.to(torch.device("cpu"))` -- on this CPU the mesh's device is "cpu"
          too, so `_fsdp_collectives` is given a `torch` whose `device("cpu")` is `HOST_DEVICE`;
        - the device: each all-gather's input, `sharded_param_data.to(self.device)` (a copy across);
        - AdamW then steps host parameters with host gradients: its states and temporaries are the host's.
        FSDP2's pre- and post-backward run from the autograd engine, without the caller's torch function modes:
        they run under `_Place` here, as DeepSpeed's gradient hooks do. Pinning is followed as on a GPU
        (CPUOffloadPolicy's default `pin_memory=True`): `t.pin_memory()` of a host tensor is a new page-locked copy
        (the CPU without an accelerator cannot pin: here a host copy, known as pinned), `t.is_pinned()` answers
        for it, so FSDP2's lazy init keeps a pinned shard as it does on a GPU."""
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        patches = [mock.patch.object(FSDPParamGroup, "pre_backward", _placed(self, FSDPParamGroup.pre_backward)),
                   mock.patch.object(FSDPParamGroup, "post_backward", _placed(self, FSDPParamGroup.post_backward))]
        if offload:
            self.pinned = set()
            patches.append(mock.patch.object(_fsdp_collectives, "torch", _TorchNamingTheHost()))
            patches.append(self._loaded_shards_to_the_host())
        if host_build:
            from accelerate import accelerator
            from accelerate.utils import fsdp_utils

            from torch.distributed.fsdp._fully_shard import _fsdp_init

            move, memory = _fsdp_init._move_states_to_device, self
            from_the_host = self._live_on_the_host(fsdp_utils.fsdp2_prepare_model)

            def to_the_device(params, buffers, device):
                # what `_move_states_to_device` does for a tensor not on the mesh's device, decided here by where
                # the storage is (a fake tensor's `.device` is its own property, out of the torch function mode's
                # reach): a host tensor's `.to(device)` is a crossing, a copy on the device
                for tensor in (*params, *buffers):
                    if memory.is_host(tensor):
                        tensor.data = tensor.to(device)
                return move(params, buffers, device)

            patches += [mock.patch.object(module, "fsdp2_prepare_model", from_the_host)
                        for module in (fsdp_utils, accelerator)]
            patches.append(mock.patch.object(_fsdp_init, "_move_states_to_device", to_the_device))
        with self._modes(patches):
            yield self

    @contextlib.contextmanager
    def active_host_build(self):
        """The DeepSpeed script on a GPU with AutoTP: its model is built where `from_pretrained` and `from_config`
        build without a device, the host, so every storage live when `deepspeed.initialize` makes its engine is the
        host's. AutoTP's shards (module_inject/layers.py `move`: `tensor.to(get_accelerator().current_device_name(),
        copy=True)`) and the engine's `module.to(self.device)` (`_configure_distributed_model`) are crossings,
        copies on the device, and what the engine casts before that move (bf16) it casts on the host."""
        from deepspeed.runtime.engine import DeepSpeedEngine

        initialized = self._live_on_the_host(DeepSpeedEngine.__init__)
        with self._modes([mock.patch.object(DeepSpeedEngine, "__init__", initialized)]):
            yield self

    def _live_on_the_host(self, fn):
        """`fn`, where every storage live as it is called is the host's: a model built or loaded on the host before
        the library call that moves it (accelerate's FSDP2 preparation, DeepSpeed's engine)."""
        memory = self

        def from_the_host(*args, **kwargs):
            memory.host.update(live.serial for live in memory.tracker._live.values())
            return fn(*args, **kwargs)
        return from_the_host

    def _loaded_shards_to_the_host(self):
        """accelerate's `fsdp2_load_full_state_dict(..., cpu_offload=True)` (cpu_ram_efficient_loading with
        CPUOffloadPolicy) moves each loaded shard, a DTensor, to the host with a literal `tensor.to("cpu")`, in the
        loop where "cpu" is also the mesh's device on this CPU: while it runs, that move of a DTensor names the host."""
        from accelerate.utils import fsdp_utils

        load, memory = fsdp_utils.fsdp2_load_full_state_dict, self

        def loading(*args, cpu_offload: bool = False, **kwargs):
            memory.loaded_shards_to_host = cpu_offload
            try:
                return load(*args, cpu_offload=cpu_offload, **kwargs)
            finally:
                memory.loaded_shards_to_host = False

        return mock.patch.object(fsdp_utils, "fsdp2_load_full_state_dict", loading)

    @contextlib.contextmanager
    def _modes(self, patches):
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            stack.enter_context(_Propagate(self))
            stack.enter_context(_Place(self))
            yield self
        self.label()

    @contextlib.contextmanager
    def active_stage3(self, params: bool = False, swap: bool = False, swap_params: bool = False):
        """`active` for ZeRO-3's optimizer offload (deepspeed/runtime/zero/stage3.py): its host name is
        `self.device` (set to `OffloadDeviceEnum.cpu` when `offload_optimizer`), and `subgroup_to_device` names
        the host with a literal 'cpu' (the fp32 master partitions and their gradients); the accelerator's
        `on_accelerator` answers False for a host tensor, as a GPU's does (`partition_grads` then accumulates
        through a device copy, as on a GPU); the gradient epilogue, which the autograd engine runs as a queued
        callback without the caller's torch function modes, runs under `_Place` as the gradient hooks do.
        With `params` (offload_param): zero.Init's `remote_device` names the host (each parameter's partition),
        the trainable partitions' flat buffer (`_create_param_groups_fp16_flat_cpu_memory`, a `torch.empty` with
        no device) is the host's, and the coordinator's fetches and releases run under `_Place` too (in the
        backward the autograd engine runs them), so each all-gather copies its host input to the device.
        With `swap` (offload_optimizer "nvme": ZeRO-Infinity's optimizer swapper) the swapper's page-locked buffers
        are the host's: `aio_handle.new_cpu_locked_tensor` allocates them in C++ (posix_memalign + mlock) and hands
        them to torch with `from_blob`, which no op makes; what DeepSpeed then computes on views of them (the master
        partition, AdamW's states and temporaries) follows them to the host.
        With `swap_params` (offload_param "nvme": the parameter swapper) everything the swapper makes when zero.Init
        creates it is the host's (its pool: a `torch.empty(..., device="cpu")` then the page-locked tensor that
        replaces it; `invalid_buffer`, a default-device tensor, the CPU on a GPU), and so is what it makes where a
        sub-group is past max_in_cpu (`reserve_partitioned_swap_space`: a `torch.zeros(1, device="cpu")` example and
        a page-locked buffer); and the partitions under the swap threshold, which `_partition_param` makes on
        `OffloadDeviceEnum.cpu` where `remote_device` is nvme, are."""
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.partition_parameters import Init
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

        accelerator = get_accelerator()
        on_accelerator = accelerator.on_accelerator
        memory = self

        def on_host(real):
            def call(optimizer, *args, **kwargs):
                since = memory.tracker._next_serial
                out = real(optimizer, *args, **kwargs)
                memory._place(optimizer.param_groups_fp16_flat_cpu_memory, since, True)
                return out
            return call

        patches = [mock.patch.object(Stage3, "device", _host_name_property("offload_optimizer"), create=True),
                   mock.patch.object(Stage3, "subgroup_to_device", _host_map_property(), create=True),
                   mock.patch.object(accelerator, "on_accelerator",
                                     lambda tensor: not memory.is_host(tensor) and on_accelerator(tensor)),
                   mock.patch.object(Stage3, "independent_gradient_partition_epilogue",
                                     _placed(self, Stage3.independent_gradient_partition_epilogue))]
        if params:
            patches += [mock.patch.object(Init, "remote_device", _host_name_property(None), create=True),
                        mock.patch.object(Stage3, "_create_param_groups_fp16_flat_cpu_memory",
                                          on_host(Stage3._create_param_groups_fp16_flat_cpu_memory)),
                        mock.patch.object(Coordinator, "fetch_sub_module", _placed(self, Coordinator.fetch_sub_module)),
                        mock.patch.object(Coordinator, "release_sub_module",
                                          _placed(self, Coordinator.release_sub_module))]
        if swap:
            from deepspeed.runtime.swap_tensor import partitioned_optimizer_swapper, pipelined_optimizer_swapper
            patches += [mock.patch.object(module, "AsyncIOBuilder", _LockedOnHost(self, module.AsyncIOBuilder))
                        for module in (partitioned_optimizer_swapper, pipelined_optimizer_swapper)]
        if swap_params:
            from deepspeed.runtime.swap_tensor import partitioned_param_swapper
            from deepspeed.runtime.zero import partition_parameters

            swapper = partitioned_param_swapper.AsyncPartitionedParameterSwapper
            patches += [mock.patch.object(partitioned_param_swapper, "AsyncIOBuilder",
                                          _LockedOnHost(self, partitioned_param_swapper.AsyncIOBuilder)),
                        mock.patch.object(swapper, "__init__", _made_on_host(self, swapper.__init__)),
                        mock.patch.object(swapper, "reserve_partitioned_swap_space",
                                          _made_on_host(self, swapper.reserve_partitioned_swap_space)),
                        mock.patch.object(partition_parameters, "OffloadDeviceEnum",
                                          _OffloadDevicesNamingTheHost(partition_parameters.OffloadDeviceEnum))]
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            yield stack.enter_context(self.active())

    def _placing_hooks(self, register):
        """`Tensor.register_post_accumulate_grad_hook` whose hooks run under `_Place`: the autograd engine calls
        them without the caller's torch function modes (dispatch modes it keeps), and DeepSpeed's gradient hooks
        make host buffers (the accumulation buffers, `accumulated_grads_in_cpu`)."""
        def register_placed(tensor, hook):
            return register(tensor, _placed(self, hook))
        return register_placed

    def _plain_devices(self, step):
        """DeepSpeedCPUAdam.step with `t.device` answering plain "cpu" for host tensors: it asserts
        `p.device == torch.device('cpu')` of the host partition it steps (on a GPU run that partition is on the
        CPU, as asserted); its states (`zeros_like` of that partition) are still the host's, made from a host
        input."""
        memory = self

        def call(*args, **kwargs):
            memory.plain_devices += 1
            try:
                return step(*args, **kwargs)
            finally:
                memory.plain_devices -= 1
        return call

    def label(self) -> None:
        for serial in self.host:
            self.tracker._labels[serial] = Category.HOST_OFFLOAD


class _LockedOnHost:
    """DeepSpeed's `AsyncIOBuilder` whose aio handles' `new_cpu_locked_tensor` buffers are counted from the call on
    (`StorageTracker.adopt`) and are the host's; the rest of the handle is DeepSpeed's (the reads and writes go to
    the files under nvme_path)."""

    def __init__(self, memory: HostMemory, builder) -> None:
        self.memory, self.builder = memory, builder

    def __call__(self, *args, **kwargs):
        memory, builder = self.memory, self.builder(*args, **kwargs)

        class Op:
            def __init__(self, op) -> None:
                self.op = op

            def __getattr__(self, name):
                return getattr(self.op, name)

            def aio_handle(self, *args, **kwargs):
                return _Handle(memory, self.op.aio_handle(*args, **kwargs))

        class Builder:
            def __getattr__(self, name):
                return getattr(builder, name)

            def load(self, *args, **kwargs):
                return Op(builder.load(*args, **kwargs))

        return Builder()


class _Handle:
    def __init__(self, memory: HostMemory, handle) -> None:
        self.memory, self.handle = memory, handle

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def new_cpu_locked_tensor(self, numel, example):
        tensor = self.handle.new_cpu_locked_tensor(numel, example)
        self.memory.tracker.adopt([tensor])
        self.memory.host.update(self.memory._serials(tensor))
        return tensor


class _TorchNamingTheHost:
    """`torch` for a module whose `torch.device("cpu")` names the host (FSDP2's gradient offload): that call is
    `HOST_DEVICE`; everything else is torch's."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def device(*args, **kwargs):
        if args == ("cpu",) and not kwargs:
            return HOST_DEVICE
        return torch.device(*args, **kwargs)


class _OffloadDevicesNamingTheHost:
    """DeepSpeed's `OffloadDeviceEnum` whose `cpu` is `HOST` (a "cpu" string, equal to the enum's): zero.Init
    makes a partition under the parameter swapper's threshold on `OffloadDeviceEnum.cpu`, the host on a GPU."""

    def __init__(self, enum) -> None:
        self.enum = enum

    def __getattr__(self, name):
        return HOST if name == "cpu" else getattr(self.enum, name)


def _made_on_host(memory: HostMemory, function):
    """`function` whose every storage, kept or freed before it returns, is the host's."""
    def call(*args, **kwargs):
        since = memory.tracker._next_serial
        try:
            return function(*args, **kwargs)
        finally:
            memory.host.update(range(since, memory.tracker._next_serial))
    return call


def _placed(memory: HostMemory, function):
    """`function` run under `_Place`: for what the autograd engine calls without the caller's torch function modes
    (gradient hooks, queued callbacks, autograd Functions' backward)."""
    def call(*args, **kwargs):
        with _Place(memory):
            return function(*args, **kwargs)
    return call


def _host_name_property(offloading: str | None = "cpu_offload") -> property:
    """`self.device` of an offloading ZeRO optimizer: `HOST` where DeepSpeed stores the string 'cpu' and the
    optimizer's `offloading` flag is set (stage_1_and_2.py's `cpu_offload`, stage3.py's `offload_optimizer`; None:
    any 'cpu', as zero.Init's `remote_device`, which is the local device unless it offloads)."""

    def get(self):
        return self.__dict__["_llmsim_device"]

    def set_(self, value):
        hosts = isinstance(value, str) and value == "cpu" and (offloading is None or getattr(self, offloading, False))
        self.__dict__["_llmsim_device"] = HOST if hosts else value

    return property(get, set_)


class _HostMap(dict):
    """ZeRO-3's `subgroup_to_device`: each sub-group's 'cpu' stored as `HOST`."""

    def __setitem__(self, key, value):
        super().__setitem__(key, HOST if value == "cpu" else value)


def _host_map_property() -> property:
    def get(self):
        return self.__dict__["_llmsim_subgroup_to_device"]

    def set_(self, value):
        mapped = _HostMap()
        for key, device in dict(value).items():
            mapped[key] = device
        self.__dict__["_llmsim_subgroup_to_device"] = mapped

    return property(get, set_)


class _Place(TorchFunctionMode):
    """Storages made by a call that names `HOST`, and copies across the host/device boundary."""

    def __init__(self, memory: HostMemory) -> None:
        super().__init__()
        self.memory = memory

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is _DEVICE_GETTER:  # `t.device`
            out = func(*args, **kwargs)
            host = out.type == "cpu" and not self.memory.plain_devices and self.memory.is_host(args[0])
            return HOST_DEVICE if host else out
        since = self.memory.tracker._next_serial
        if self.memory.pinned is not None and (func is _PIN or func is _IS_PINNED):
            source = args[0]
            serials = self.memory._serials(source)
            pinned = bool(serials) and all(s in self.memory.pinned for s in serials)
            if func is _IS_PINNED:
                return pinned
            if pinned:  # already page-locked: torch returns the tensor itself
                return source
            out = source.clone()
            self.memory._place(out, since, True)
            self.memory.pinned.update(s for s in self.memory._serials(out) if s >= since)
            return out
        if func is _DEEPCOPY:  # `copy.deepcopy` copies the storage itself (no op whose inputs are on the host):
            out = func(*args, **kwargs)  # a host tensor's copy is the host's (accelerate's non-persistent buffers)
            if self.memory.is_host(args[0]):
                self.memory._place(out, since, True)
            return out
        if func in _TO or func in _CPU:
            source = args[0]
            target = HOST if func in _CPU else _to_target(args, kwargs)
            if self.memory.loaded_shards_to_host and isinstance(source, DTensor) and target in ("cpu", _CPU_DEVICE):
                target = HOST  # accelerate's loaded shard moved to the host (`_loaded_shards_to_the_host`)
            if _is_meta_name(target):  # no memory on either side (accelerate's `model.to("meta")`): not a crossing
                return func(*args, **kwargs)
            if target is not None and isinstance(source, torch.Tensor) and self.memory._serials(source):
                to_host = _is_host_name(target)
                if to_host != self.memory.is_host(source):  # a crossing: a GPU copies, the CPU would alias
                    out = source.to(torch.device("cpu"), *_dtype_args(args, kwargs), copy=True,
                                    non_blocking=kwargs.get("non_blocking", False))
                    self.memory._place(out, since, to_host)
                    return out
            out = func(*args, **kwargs)
            if target is not None:
                self.memory._place(out, since, _is_host_name(target))
            return out
        out = func(*args, **kwargs)
        if any(_is_host_name(a) for a in tree_leaves((args, kwargs)) if isinstance(a, (str, torch.device))):
            self.memory._place(out, since, True)
        return out


def _dtype_args(args, kwargs) -> tuple:
    """The dtype a `.to(...)` call asks for, as a positional argument list for `.to(device, dtype)`."""
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
        if dtype is None:
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            dtype = other.dtype if other is not None else None
    return (dtype,) if dtype is not None else ()


class _Propagate(TorchDispatchMode):
    """An op's new storages are on the host when its inputs are."""

    def __init__(self, memory: HostMemory) -> None:
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        since = self.memory.tracker._next_serial
        on_host = self.memory.inputs_on_host(args, kwargs)
        out = func(*args, **kwargs)
        if on_host:
            self.memory._place(out, since, True)
        return out
