"""Local processes and the collector: `in_processes` fans work out to a process pool (stages, ranks, a sweep's
combinations, `size`'s layouts), `collector_paused` keeps Python's cyclic collector off during a prediction."""
from __future__ import annotations

import contextlib
import gc
from concurrent.futures import ProcessPoolExecutor

from llmsim.errors import InputError


def in_processes(function, items: list, jobs: int, progress: bool, unit: str, chunksize: int = 1,
                 forked: bool = False) -> list:
    """`[function(item) for item in items]`, in `jobs` local processes (here with one), with a progress bar;
    `forked`: the processes are forks of this one, whatever the platform's default (they inherit its state)."""
    import multiprocessing

    from tqdm import tqdm

    if jobs < 1:
        raise InputError(f"jobs({jobs}) must be >= 1")
    context = multiprocessing.get_context("fork") if forked else None
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context) if jobs > 1 else contextlib.nullcontext()
    with pool, tqdm(total=len(items), disable=not progress, unit=unit) as bar:
        results = []
        for result in pool.map(function, items, chunksize=chunksize) if jobs > 1 else map(function, items):
            results.append(result)
            bar.update()
    return results


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off, for a prediction: a trace, its expansion and a strategy's walk make
    enough lasting containers (rows, frames, states) to set off a full collection, which walks every object in
    the process, torch's and transformers' included (0.2-0.27 s at 70B, against a cold prediction of 0.8 s).
    Refcounting frees what holds no cycle as before; what does (the fake model the trace drops) waits for the
    next collection after the prediction, which finds it among the young objects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
