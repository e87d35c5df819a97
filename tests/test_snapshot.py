"""`llmsim predict --snapshot`: the predicted step as a PyTorch memory snapshot, read back with torch's own reader
(torch.cuda._memory_viz), whose running total of allocations reaches the predicted peak."""
import pickle

from torch.cuda import _memory_viz

from llmsim.app.cli import main
from llmsim.sim.peaks import replay

GPT2_TINY = ["--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4", "--set", "vocab_size=1000"]


def test_a_snapshot_reads_back_in_torchs_reader_and_peaks_at_the_prediction(tmp_path, capsys):
    import llmsim

    path = tmp_path / "step.pickle"
    argv = ["predict", "--model", "gpt2", *GPT2_TINY, "--seq-len", "32", "--micro-batch", "2", "--grad-ckpt"]
    assert main([*argv, "--snapshot", str(path)]) == 0
    assert f"snapshot of rank 0: {path}" in capsys.readouterr().out
    data = pickle.loads(path.read_bytes())
    text = _memory_viz.trace(data)  # torch's reader walks every entry
    events = data["device_traces"][0]
    assert text.startswith("Device 0") and f"{len(events)} entries" in text
    assert "<html" in _memory_viz.trace_plot(data).lower()  # the visualizer's page embeds it
    live, peak, sizes = 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            assert e["addr"] not in sizes
            sizes[e["addr"]] = e["size"]
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= sizes.pop(e["addr"])
    prediction = llmsim.predict("gpt2", seq_len=32, micro_batch=2, grad_ckpt=True,
                                set={"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000})
    assert peak == replay(prediction.ranks[0].timeline).allocated_bytes == prediction.peak_allocated_bytes
    assert live == int(prediction.ranks[0].timeline["delta_bytes"].sum())  # what outlives the step, as predicted
    assert any("wte.weight" in e["frames"][0]["name"] for e in events)


def test_a_gpu_snapshot_holds_the_workspaces_and_reaches_the_rounded_peak(tmp_path):
    """On a GPU each thread's cuBLAS (and, for GPT-2's Conv1D addmm with its 1-D bias, cuBLASLt) workspace is an
    allocation kept to the end; with every block rounded up to 512 bytes, as the caching allocator counts
    max_memory_allocated, the running total reaches the predicted peak."""
    import llmsim
    from llmsim.model.tracker import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE

    path = tmp_path / "step.pickle"
    argv = ["predict", "--model", "gpt2", *GPT2_TINY, "--seq-len", "32", "--micro-batch", "2", "--gpu", "h100-80gb"]
    assert main([*argv, "--snapshot", str(path)]) == 0
    events = pickle.loads(path.read_bytes())["device_traces"][0]
    prediction = llmsim.predict("gpt2", seq_len=32, micro_batch=2, gpu="h100-80gb",
                                set={"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000})
    timeline = prediction.deciding_rank.timeline
    # cuBLAS: the forward's thread and autograd's; cuBLASLt: the forward's only (no addmm with a bias in the backward)
    for marker, name, size, count in (
            (CUBLAS_WORKSPACE, "cuBLAS workspace", prediction.gpu.cublas_workspace_bytes, 2),
            (CUBLASLT_WORKSPACE, "cuBLASLt workspace", prediction.gpu.cublaslt_workspace_bytes, 1)):
        made = [e for e in events if e["action"] == "alloc" and e["frames"][0]["name"].startswith(name + " ")]
        assert len(made) == int((timeline["serial"] == marker).sum()) == count
        assert {e["size"] for e in made} == {size}
        assert not any(e["action"] == "free_completed" and e["addr"] in {m["addr"] for m in made} for e in events)
    live, peak, sizes = 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            sizes[e["addr"]] = max(-(-e["size"] // 512) * 512, 512)
            live += sizes[e["addr"]]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= sizes.pop(e["addr"])
    assert peak == prediction.peak_allocated_bytes
