"""Launch a measured multi-process canonical step (tier 2) with torchrun, and never hang.

Every rank runs `llmsim.measure.dist_worker` under the storage tracker. A run that crashes or passes its timeout
is killed as a process group and reported as a failure; it never leaves processes behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 900


@dataclass(frozen=True)
class RankResult:
    rank: int
    peak_allocated_bytes: int
    peak_phase: str
    peak_step: int
    peak_layer: str
    breakdown_bytes: dict
    peak_host_bytes: int = 0  # host memory: checkpoint inputs offloaded by save_on_cpu (--ckpt-offload)


class LaunchFailure(RuntimeError):
    """A measured run that crashed or timed out; the message holds the tail of its output."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_with_descendants(pid: int) -> None:
    """SIGKILL `pid`'s process group and each descendant's: torch's elastic agent starts every rank in a session of
    its own (SubprocessHandler, `start_new_session=True`), which killing torchrun's group alone leaves running."""
    groups, todo, seen = {pid}, [pid], set()
    while todo:  # the process tree as it is now, from /proc (every thread's children)
        parent = todo.pop()
        seen.add(parent)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += [child for child in children if child not in seen]
    for child in seen:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(child))
    for group in groups - {os.getpgrp()}:  # never this process's own
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)


def jit_build_locks() -> list[Path]:
    """The `lock` files in torch's JIT extension folders (torch.utils.cpp_extension._get_build_directory's root:
    $TORCH_EXTENSIONS_DIR, else torch's cache folder's torch_extensions/<python>_<accelerator>/<op>). torch's
    FileBaton holds one while an op (DeepSpeed's CPU Adam, shm comm, async_io) builds and waits while one exists:
    a build killed midway leaves it, and every later run that loads the op waits on it until its timeout."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    folders = [Path(root)] if root else list(Path(get_default_build_root()).glob("*"))
    return sorted(lock for folder in folders for lock in folder.glob("*/lock"))


def _build_env() -> dict:
    """The environment a JIT op build runs in: torch's cpp_extension hands MAX_JOBS to ninja as `-j`; unset, ninja
    starts CPUs + 2 compilers of about 1 GB each (DeepSpeed's async_io: 12 files including torch's headers), so it
    is held to the CPUs this process may run on."""
    return {"MAX_JOBS": str(len(os.sched_getaffinity(0))), **os.environ}


def build_op(builder: str, timeout_s: int = DEFAULT_TIMEOUT_S) -> None:
    """JIT-build DeepSpeed's op `builder` (an `op_builder` class name, e.g. "AsyncIOBuilder") once, in a process of
    its own, before a measured run loads it: its ranks then load the cached op instead of one building while the
    others wait on torch's FileBaton lock inside the run's timeout. A build that fails or passes `timeout_s` raises
    LaunchFailure with its output's tail (and a lock it left). Already built: a second or so."""
    code = (f"from deepspeed.ops.op_builder import {builder}\n"
            f"{builder}().load(verbose=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_build_env(), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_with_descendants(proc.pid)
        output, _ = proc.communicate()
        locks = jit_build_locks()
        raise LaunchFailure(f"building DeepSpeed's {builder} op timed out after {timeout_s} s" + (
            f" (lock {', '.join(map(str, locks))} left: remove it if no build is running)" if locks else "") +
            ":\n" + "\n".join(output.strip().splitlines()[-15:])) from None
    if proc.returncode != 0:
        raise LaunchFailure(f"building DeepSpeed's {builder} op failed (exit {proc.returncode}):\n" +
                            "\n".join(output.strip().splitlines()[-15:]))


def torchrun(module: str, job: dict, world_size: int, out: Path, timeout_s: int = DEFAULT_TIMEOUT_S,
             accelerate_config: Path | None = None) -> None:
    """`torchrun --nproc_per_node world_size -m module JOB OUT`: every rank reads the job and writes its results under
    `out`. A crash or a timeout kills the process group and raises LaunchFailure. `accelerate_config`: launched as
    `accelerate launch --config_file FILE -m module JOB OUT` instead (its num_processes ranks, through torchrun, with
    the variables accelerate's launcher sets)."""
    out.mkdir(parents=True, exist_ok=True)
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job))
    launcher = ([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
                 "--main_process_port", str(_free_port())] if accelerate_config is not None else
                [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
                 f"--master_port={_free_port()}"])
    command = [*launcher, "-m", module, str(job_path), str(out)]
    env = {**_build_env(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_with_descendants(proc.pid)
        proc.communicate()
        locks = jit_build_locks()
        raise LaunchFailure(f"measured run timed out after {timeout_s} s" + (
            f"; torch's JIT build lock {', '.join(map(str, locks))} is there: a build killed while it held it (an "
            "interrupted DeepSpeed op build) leaves it, and every later build of that op waits on it for good; "
            "remove it if no build is running" if locks else "")) from None
    if proc.returncode != 0:
        lines = output.strip().splitlines()
        ranks = [line for line in lines if line.startswith("[rank")]  # a rank's traceback says why, torchrun's not
        tail = "\n".join((ranks or lines)[-15:])
        raise LaunchFailure(f"measured run failed (exit {proc.returncode}):\n{tail}")


def run_ranks(job: dict, world_size: int, timeout_s: int = DEFAULT_TIMEOUT_S,
              keep: Path | None = None) -> list[RankResult]:
    """Run `job` on `world_size` local ranks; return one result per rank, in rank order."""
    with tempfile.TemporaryDirectory(prefix="llmsim-") as tmp:
        out = keep or Path(tmp)
        torchrun("llmsim.measure.dist_worker", job, world_size, out, timeout_s)
        results = []
        for rank in range(world_size):
            data = json.loads((out / f"rank{rank}.json").read_text())
            results.append(RankResult(**data))
        return results
