"""gloo's worker thread can hold a collective's tensors a moment past the call or the wait; NCCL's work drops them at
the wait. Measured runs wait for that moment (`settled`), so a CPU row is what a GPU run holds. Instrument only: the
measured recipes wrap torch.distributed's collectives with it."""
from __future__ import annotations

import time

RELEASE_TIMEOUT_S = 60.0  # how long a settled collective waits for gloo's worker to let its tensors go


def settled(real, seconds: float, wait_async: bool = False, at_wait: bool = False):
    """`real` (a torch.distributed collective), waited for, then held until gloo's worker thread has let its tensors
    go (`released`), then `seconds` of sleep (for the works issued before it). An asynchronous call
    (`async_op=True`) returns at once, unless `wait_async`: then its work is waited for and released as it is
    issued, and the caller gets a completed work in its place (its own wait returns at once; it holds the tensors
    it passed, as it would hold them with NCCL's work). With `at_wait` an asynchronous call's work is returned
    whose wait also sleeps `seconds` before it returns (`_SettlingWork`): the caller still holds the work, whose
    tensors gloo's worker lets go meanwhile, and drops them where it would drop NCCL's, after the wait."""
    def call(*args, **kwargs):
        asynchronous = bool(kwargs.get("async_op"))
        if asynchronous and not wait_async:
            work = real(*args, **kwargs)
            return _SettlingWork(work, seconds) if at_wait and work is not None else work
        tensors = _tensors(args, kwargs)
        before = _use_counts(tensors)
        work = real(*args, **kwargs)
        if work is not None:
            work.wait()
        del work
        released(tensors, before, getattr(real, "__name__", "a collective"))
        time.sleep(seconds)
        return _completed_work() if asynchronous else None
    return call


class _SettlingWork:
    """An asynchronous collective's work whose `wait` gives gloo's worker thread `seconds` to drop its own reference
    to the work (and so to its tensors) before the caller goes on; everything else is the work's."""

    def __init__(self, work, seconds: float) -> None:
        self._work, self._seconds = work, seconds

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        time.sleep(self._seconds)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def released(tensors, before: list[int], name: str, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """Wait until no storage of `tensors` is referenced more often than `before` (their use counts before the
    collective): gloo's work holds its inputs and outputs (and the views and copies it made of them) until its
    worker thread drops the work, some time after the wait returns, later still when that thread is starved of a
    core (a fresh Trainer FSDP run on 2 cores under load: one rank 102,528 B over, an all-gather's buffer alive
    into the backward). A work never let go is an error, not a row."""
    deadline = time.monotonic() + timeout_s
    while any(now > then for now, then in zip(_use_counts(tensors), before)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gloo's worker still holds {name}'s tensors {timeout_s:.0f} s after its wait")
        time.sleep(0.0002)


def _tensors(args, kwargs) -> list:
    """The distinct storages' tensors among a collective's arguments (lists of tensors flattened)."""
    import torch

    tensors = {}
    for value in (*args, *kwargs.values()):
        for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(tensor, torch.Tensor):
                tensors.setdefault(tensor.untyped_storage()._cdata, tensor)
    return list(tensors.values())


def _use_counts(tensors) -> list[int]:
    import torch

    return [torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) for tensor in tensors]


def _completed_work():
    import torch
    from torch._C._distributed_c10d import _create_work_from_future

    future = torch.futures.Future()
    future.set_result(None)
    return _create_work_from_future(future)


SETTLE_S = 0.01  # what the from-pretrained and Trainer recipes give gloo's worker thread after a collective: 2 ms,
# enough with a core a process, was not always enough with 4 ranks on 2 cores (from_pretrained_recipe._settled_waits)

# FSDP2's collectives (torch 2.13's _fsdp_collectives: all_gather_single, reduce_scatter_single; all_gather_into_tensor
# is what FSDP2 called before, kept for it): its asynchronous all-gathers waited for and released as issued, the
# synchronous reduce-scatters and all-reduces (gradient clipping's norm, the loss) released after their wait
FSDP2_COLLECTIVES = (("all_reduce", False), ("all_gather_single", True), ("all_gather_into_tensor", True),
                     ("reduce_scatter_single", True))


def settled_collectives(collectives=FSDP2_COLLECTIVES, seconds: float = SETTLE_S, also_in=()):
    """An ExitStack that patches each `(name, wait_async)` collective of torch.distributed with `settled`, and the
    same name in each module of `also_in` that imported it by name (transformers' expert parallelism does)."""
    import contextlib
    from unittest import mock

    import torch.distributed as dist

    stack = contextlib.ExitStack()
    for name, wait_async in collectives:
        for module in (dist, *also_in):
            if hasattr(module, name):
                stack.enter_context(mock.patch.object(module, name, settled(getattr(module, name), seconds,
                                                                            wait_async)))
    return stack
