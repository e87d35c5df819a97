"""Local processes, a Dask cluster and the collector: `in_processes` fans work out to a process pool (stages,
ranks, a sweep's combinations, `size`'s layouts) or, given a scheduler's address, to the workers of a running Dask
cluster (`on_cluster`); `collector_paused` keeps Python's cyclic collector off during a prediction.

Why Dask's `distributed` and not Ray: the work is a list of independent Python calls whose arguments pickle (what
the process pool already sends), which `Client.map` takes as it is; `distributed` is pure Python (a few MB beside
dask, no daemon of its own), a cluster is `dask scheduler` plus `dask worker ADDRESS` on any machine with this
Python environment (or dask-jobqueue's and dask-kubernetes' deployments), and a `LocalCluster` runs the same code
path in a test. Ray would bring its own runtime (a raylet and a GCS per node, a wheel of some 70 MB) for a job
that needs no actors, object store or scheduling beyond a map."""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from llmsim.errors import InputError, one_line

CONNECT_TIMEOUT_S = 10  # how long `on_cluster` tries to reach the scheduler before it gives up


def in_processes(function, items: list, jobs: int, progress: bool, unit: str, chunksize: int = 1,
                 forked: bool = False, cluster: str | None = None) -> list:
    """`[function(item) for item in items]`, in `jobs` local processes (here with one), with a progress bar;
    `forked`: the processes are forks of this one, whatever the platform's default (they inherit its state);
    `cluster`: a Dask scheduler's address, whose workers run the items instead (`on_cluster`)."""
    import multiprocessing

    from tqdm import tqdm

    if cluster is not None:
        return on_cluster(function, items, cluster, progress, unit, chunksize)
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


def as_done_in_processes(function, items: list, jobs: int) -> Iterator[tuple[int, object]]:
    """`(i, function(items[i]))` for every item, as each comes back from `jobs` local processes (here, in order,
    with one): the caller works on what is back while the processes go on. Items are handed out in their order,
    so put first what the caller can use soonest."""
    from concurrent.futures import as_completed

    if jobs < 1:
        raise InputError(f"jobs({jobs}) must be >= 1")
    if jobs == 1:
        yield from ((index, function(item)) for index, item in enumerate(items))
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(function, item): index for index, item in enumerate(items)}
        for future in as_completed(futures):
            yield futures[future], future.result()


def on_cluster(function, items: list, address: str, progress: bool, unit: str, chunksize: int = 1) -> list:
    """`[function(item) for item in items]` on the workers of the Dask cluster whose scheduler is at `address`
    (`tcp://HOST:8786`), `chunksize` items a task, in order, with a progress bar. Every worker must have the
    TRACED_PACKAGES installed here, at the same versions (checked first); a worker with several threads runs one
    item at a time (`_alone`: a trace patches modules of transformers and torch for its duration)."""
    import functools

    from tqdm import tqdm

    try:
        from distributed import Client
    except ImportError as exc:
        raise InputError("--cluster needs Dask's distributed on this machine and the workers (pip install "
                         "'llmsim[cluster]'); without --cluster the work runs in local processes") from exc
    _check_reachable(address)  # before any Client: one that fails to start waits 20 s at exit to close
    try:
        client = Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise _unreachable(address, exc) from exc
    with client:
        _check_workers(client, address)
        batches = [items[start:start + chunksize] for start in range(0, len(items), chunksize)]
        futures = client.map(functools.partial(_alone, function), batches, pure=False)
        results = []
        with tqdm(total=len(items), disable=not progress, unit=unit) as bar:
            for future in futures:  # in order: the bar moves as the earliest task not yet in comes back
                results += future.result()
                bar.update(len(results) - bar.n)
        return results


# what a prediction depends on besides its inputs: a worker with another of these traces another step
TRACED_PACKAGES = ("llmsim", "torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "trl")


def _check_reachable(address: str) -> None:
    import socket

    from distributed.comm.addressing import get_address_host_port

    try:
        host, port = get_address_host_port(address)
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:  # a malformed address, nothing listening, no route
        raise _unreachable(address, exc) from exc


def _unreachable(address: str, exc: BaseException) -> InputError:
    return InputError(f"cannot reach a Dask scheduler at cluster({address}): {one_line(exc)}; valid: the address a "
                      "running `dask scheduler` prints (tcp://HOST:8786), or no --cluster for local processes")


def _check_workers(client, address: str) -> None:
    versions = client.run(installed_versions)  # on every worker
    if not versions:
        raise InputError(f"the Dask scheduler at cluster({address}) has no workers; start some with "
                         f"`dask worker {address}` where this llmsim is installed")
    here = package_versions()
    for worker, theirs in sorted(versions.items()):
        if differ := [f"{name} {theirs[name]} (here {here[name]})" for name in TRACED_PACKAGES
                      if theirs[name] != here[name]]:
            raise InputError(f"Dask worker {worker} of cluster({address}) runs {', '.join(differ)}; every worker "
                             "needs the packages a prediction traces as installed here")


def package_versions() -> dict[str, str | None]:
    """What the workers must have: this process's `installed_versions`."""
    return installed_versions()


def installed_versions() -> dict[str, str | None]:
    """The installed version of each of TRACED_PACKAGES (None where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in TRACED_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


_ONE_AT_A_TIME = threading.Lock()


def _alone(function, batch: list) -> list:
    with _ONE_AT_A_TIME, _profiler_paused():
        return [function(item) for item in batch]


@contextlib.contextmanager
def _profiler_paused():
    """The Dask worker's sampling profiler stopped meanwhile. Every 10 ms it takes the running threads' frames
    (`Worker.trigger_profile`: `sys._current_frames()`) and reads their source lines (`profile.info_frame`,
    linecache: files read from disk in a cold worker); a function of the trace that returns while its frame is
    held keeps its local tensors alive until the profiler lets go, so a free lands later in the step than it does
    anywhere else, and on the worker's event loop thread (seen there: the frees of the LM head's logits as
    `trigger_profile` returned). GPT-2's predictions on a worker came out up to 10 MiB off the local ones in about 1
    run of 10, some timelines differing without the peak in more. Outside a worker, or with its profiler off,
    nothing to do."""
    try:
        from distributed import get_worker
        from distributed.utils import sync

        worker = get_worker()
    except (ImportError, ValueError):  # not in a Dask worker's task
        yield
        return
    profiler = worker.periodic_callbacks.get("profile")
    if profiler is None:  # started with distributed.worker.profile.enabled false
        yield
        return

    async def stop() -> bool:  # on the worker's event loop, where the profiler runs: none is under way after it
        running = profiler.is_running()
        profiler.stop()
        return running

    async def start() -> None:
        profiler.start()

    # both on the loop and waited for: a restart left queued there would run after the next item's check
    running = sync(worker.loop, stop)
    try:
        yield
    finally:
        if running:
            sync(worker.loop, start)


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
