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
