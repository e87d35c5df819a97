"""`sweep` and `size` on the workers of a Dask cluster (`--cluster ADDRESS`, llmsim/sim/processes.py): a
LocalCluster of one worker process with two threads (so that two items run in one process) gives the tables the
local run gives; a scheduler that cannot be reached, or workers with other packages, is one line and status 2."""
import json

import pandas as pd
import pytest

from llmsim.app.cli import main
from llmsim.app.size import size
from llmsim.app.sweep import sweep
from llmsim.inputs.gpus import GpuProfile
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink
from llmsim.sim import processes

distributed = pytest.importorskip("distributed")

MiB = 2**20
TINY_GPU = GpuProfile("tiny", "test card", "9.0", 120 * MiB, 40 * MiB, 1 * MiB, "test")  # as tests/test_size.py's


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None,
                                  silence_logs=40) as local:
        yield local.scheduler_address


def test_a_sweep_on_the_cluster_is_the_local_sweep(cluster):
    configs = [{"model": "gpt2", "seq_len": 64, "micro_batch": batch, "precision": precision}
               for batch, precision in ((1, "bf16"), (2, "fp32"), (0, "bf16"))]
    here = sweep(configs, jobs=1, progress=False)
    there = sweep(configs, progress=False, cluster=cluster)
    pd.testing.assert_frame_equal(here, there)
    assert (there["error"] != "").sum() == 1  # micro-batch 0, rejected there as here


def test_a_prediction_on_a_worker_pauses_its_profiler(cluster):
    """Dask's sampling profiler holds a worker thread's frames, and with them a returning function's tensors, a
    moment longer (processes._profiler_paused): a prediction there runs with it stopped, and it runs again after."""
    def running(dask_worker=None):
        from distributed import get_worker

        return (dask_worker or get_worker()).periodic_callbacks["profile"].is_running()

    with distributed.Client(cluster, set_as_default=False) as client:
        assert list(client.run(running).values()) == [True]
        # items one after another on the worker's two threads: each finds it stopped, the one before it restarted
        assert client.gather(client.map(processes._alone, [lambda _: running()] * 6, [[0]] * 6, pure=False)) \
            == [[False]] * 6
        assert list(client.run(running).values()) == [True]


@pytest.mark.slow  # 22 s here; the sweep above runs the same path by default
def test_size_on_the_cluster_is_the_local_table(cluster):
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    families = ("single", "zero", "pp")
    here = size(spec, TrainSetup(1, 512), TINY_GPU, max_gpus=2, max_micro_batch=4, families=families)
    there = size(spec, TrainSetup(1, 512), TINY_GPU, max_gpus=2, max_micro_batch=4, families=families,
                 cluster=cluster)
    assert here["fits"].any() and {"single", "pp", "zero3"} <= set(here["layout"])
    pd.testing.assert_frame_equal(here, there)


@pytest.mark.parametrize("command", ["sweep", "size"])
def test_an_unreachable_scheduler_is_one_line_and_status_2(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(processes, "CONNECT_TIMEOUT_S", 1)
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"model": "gpt2", "seq_len": 64, "micro_batch": 1}))
    argv = {"sweep": ["sweep", str(grid), "--out", str(tmp_path / "x.csv")],
            "size": ["size", "--model", "gpt2", "--seq-len", "64", "--gpu", "h100-80gb", "--max-gpus", "2"]}[command]
    assert main([*argv, "--cluster", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cluster(tcp://127.0.0.1:9)" in err and "dask scheduler" in err


def test_workers_with_other_packages_are_refused_by_name(cluster, monkeypatch, capsys):
    here = processes.package_versions()
    monkeypatch.setattr(processes, "package_versions", lambda: {**here, "transformers": "0.0.1"})
    with pytest.raises(processes.InputError, match=r"runs transformers .* \(here 0\.0\.1\)"):
        processes.on_cluster(len, [[1]], cluster, progress=False, unit="item")
