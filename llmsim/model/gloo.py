"""gloo's worker thread can hold a collective's tensors a moment past the call or the wait; NCCL's work drops them at
the wait. Measured runs give it that moment (`settled`), so a CPU row is what a GPU run holds. Instrument only: the
measured recipes wrap torch.distributed's collectives with it."""
from __future__ import annotations

import time


def settled(real, seconds: float, wait_async: bool = False):
    """`real` (a torch.distributed collective) followed by `seconds` of sleep when it ran synchronously. An
    asynchronous call (`async_op=True`) returns at once, unless `wait_async`: then its work is waited for as it is
    issued, and the sleep follows (the caller still holds its tensors until its own wait)."""
    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        if kwargs.get("async_op"):
            if not wait_async:
                return out
            if out is not None:
                out.wait()
        time.sleep(seconds)
        return out
    return call


SETTLE_S = 0.01  # what the from-pretrained and Trainer recipes give gloo's worker thread after a collective: 2 ms,
# enough with a core a process, was not always enough with 4 ranks on 2 cores (from_pretrained_recipe._settled_waits)

# FSDP2's collectives: its asynchronous all-gathers and reduce-scatters waited for as issued (FSDP2 keeps its own
# references until its own wait), the synchronous all-reduce (gradient clipping's norm, the loss) slept after
FSDP2_COLLECTIVES = (("all_reduce", False), ("all_gather_into_tensor", True), ("reduce_scatter_single", True))


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
