"""The measured-run launcher (llmsim/measure/launch.py): a run past its timeout leaves no rank behind."""
import os
import time

import pytest

from llmsim.measure import launch


def test_a_timed_out_run_leaves_no_rank_running(tmp_path, monkeypatch):
    """torch's elastic agent starts each rank in a session of its own: killing torchrun's process group alone left
    the ranks sleeping, reparented to init."""
    (tmp_path / "sleeper.py").write_text("import os, sys, time\n"
                                         "open(os.path.join(sys.argv[2], f'pid{os.environ[\"RANK\"]}'), 'w')"
                                         ".write(str(os.getpid()))\n"
                                         "time.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = tmp_path / "out"
    begin = time.monotonic()
    with pytest.raises(launch.LaunchFailure, match="timed out after 20 s"):
        launch.torchrun("sleeper", {}, 2, out, timeout_s=20)
    assert time.monotonic() - begin < 60  # left running, the ranks held torchrun's output pipe open for 600 s
    pids = [int((out / f"pid{rank}").read_text()) for rank in range(2)]  # both ranks had started
    time.sleep(0.5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", f"rank pid {pid} still runs"


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_a_run_waiting_on_a_stale_jit_build_lock_names_it(tmp_path, monkeypatch):
    """A DeepSpeed op build killed midway leaves torch's FileBaton lock behind; a later run that loads the op waits
    on it (FileBaton.wait) until the timeout, which then names the lock."""
    extensions = tmp_path / "extensions"
    (extensions / "async_io").mkdir(parents=True)
    (extensions / "async_io" / "lock").touch()  # what a killed build leaves
    (tmp_path / "waiter.py").write_text("import os\nfrom torch.utils.file_baton import FileBaton\n"
                                        "baton = FileBaton(os.path.join(os.environ['TORCH_EXTENSIONS_DIR'], "
                                        "'async_io', 'lock'))\n"
                                        "baton.try_acquire() or baton.wait()\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    with pytest.raises(launch.LaunchFailure, match=f"lock {extensions / 'async_io' / 'lock'} is there"):
        launch.torchrun("waiter", {}, 1, tmp_path / "out", timeout_s=12)
    assert launch.jit_build_locks() == [extensions / "async_io" / "lock"]
    (extensions / "async_io" / "lock").unlink()
    assert launch.jit_build_locks() == []


def _fake_op_builders(tmp_path, monkeypatch, body: str) -> None:
    """A `deepspeed.ops.op_builder` whose FakeBuilder().load() runs `body` (the real op builds for minutes)."""
    package = tmp_path / "fake" / "deepspeed" / "ops" / "op_builder"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("import os, time\n"
                                         "class FakeBuilder:\n"
                                         "    def load(self, verbose=True):\n"
                                         f"        {body}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'fake'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.delenv("MAX_JOBS", raising=False)


def test_an_op_is_built_once_with_the_cpus_this_process_has(tmp_path, monkeypatch):
    """ninja runs `-j MAX_JOBS` where torch finds it set: the build gets the CPUs this process may run on."""
    _fake_op_builders(tmp_path, monkeypatch, f"open({str(tmp_path / 'jobs')!r}, 'w').write(os.environ['MAX_JOBS'])")
    launch.build_op("FakeBuilder", timeout_s=60)
    assert (tmp_path / "jobs").read_text() == str(len(os.sched_getaffinity(0)))


def test_a_failed_or_hung_op_build_says_so_with_its_output(tmp_path, monkeypatch):
    _fake_op_builders(tmp_path, monkeypatch, "print('ninja: build stopped: subcommand failed.'); raise SystemExit(1)")
    with pytest.raises(launch.LaunchFailure, match="FakeBuilder op failed .exit 1.:\nninja: build stopped"):
        launch.build_op("FakeBuilder", timeout_s=60)
    _fake_op_builders(tmp_path / "hung", monkeypatch,
                      "print('[1/12] c++ -c py_ds_aio.cpp', flush=True); time.sleep(600)")
    begin = time.monotonic()
    with pytest.raises(launch.LaunchFailure, match=r"FakeBuilder op timed out after 5 s.*:\n\[1/12\] c\+\+"):
        launch.build_op("FakeBuilder", timeout_s=5)
    assert time.monotonic() - begin < 30
