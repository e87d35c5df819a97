"""The measured recipes' settle (llmsim/model/gloo.py): a collective's call returns only once the tensors it was
given are referenced no more than before it, as NCCL's work holds none past the wait."""
import threading

import pytest
import torch

from llmsim.model.gloo import released, settled


def _held_by_a_worker(seconds: float, held: list):
    """A stand-in collective whose 'worker thread' keeps its tensors `seconds` past the call (gloo's can)."""
    def collective(output, input, async_op=False):
        held.extend([output.view(-1), input[:1]])  # a work holds its tensors and views of them
        threading.Timer(seconds, held.clear).start()
        return None
    return collective


def test_a_settled_collective_returns_once_its_worker_lets_go():
    held = []
    output, input = torch.zeros(8), torch.ones(16)
    settled(_held_by_a_worker(0.2, held), 0.0)(output, input)
    assert held == []


def test_an_asynchronous_collective_is_waited_for_and_a_completed_work_returned():
    held = []
    work = settled(_held_by_a_worker(0.2, held), 0.0, wait_async=True)(torch.zeros(8), torch.ones(16), async_op=True)
    assert held == [] and work.is_completed()
    work.wait()


def test_a_work_never_let_go_is_an_error():
    keep = torch.ones(4)
    alias = keep.view(2, 2)  # noqa: F841  (a reference the 'worker' never drops)
    with pytest.raises(RuntimeError, match="still holds all_reduce's tensors"):
        released([keep], [torch._C._storage_Use_Count(keep.untyped_storage()._cdata) - 1], "all_reduce",
                 timeout_s=0.05)
