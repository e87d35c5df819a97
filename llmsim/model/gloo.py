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
