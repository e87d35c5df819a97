"""The prediction figure: the stacked timeline adds up to the rank's live bytes, and the PNG is written."""
from llmsim.app.cli import main
from llmsim.sim.pipeline import predict
from llmsim.app.plots import _envelope, category_timeline
from llmsim.inputs.spec import TrainSetup, load_model_spec
from llmsim.inputs.zoo import shrink


def test_category_timeline_adds_up_and_the_envelope_keeps_the_peak():
    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 512, 4))
    rank = predict(spec, TrainSetup(1, 32)).ranks[0]
    live = category_timeline(rank.timeline)
    total = live.sum(axis=1)
    assert (total.to_numpy() == rank.timeline["delta_bytes"].cumsum().to_numpy()).all()
    assert total.max() == rank.peak_allocated_bytes
    assert int(total.to_numpy().argmax()) in _envelope(total, 50)


def test_predict_writes_the_figure(tmp_path):
    out = tmp_path / "fig.png"
    argv = ["predict", "--model", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4",
            "--set", "vocab_size=512", "--seq-len", "32", "--micro-batch", "1", "--strategy", "ddp",
            "--world-size", "2", "--plot", str(out)]
    assert main(argv) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sizing_heatmap_is_written(tmp_path):
    import pandas as pd

    from llmsim.app.plots import sizing_heatmap

    frame = pd.DataFrame({"layout": ["single", "ddp", "zero3", "ddp", "zero3"], "gpus": [1, 2, 2, 4, 4],
                          "largest_micro_batch": [0, 0, 3, 0, 7]})
    out = sizing_heatmap(frame, "test", tmp_path / "size.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_on_a_gpu_the_figure_draws_reserved_whose_top_is_the_predicted_reserved_peak(tmp_path):
    from llmsim.app.plots import prediction_figure, reserved_curve
    from llmsim.inputs.gpus import load_gpu

    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 512, 4))
    prediction = predict(spec, TrainSetup(2, 64), gpu=load_gpu("a100-40gb"))
    rank = prediction.deciding_rank
    timeline = rank.timeline.reset_index(drop=True)
    every = list(range(len(timeline)))
    curve = reserved_curve(timeline, prediction.gpu, prediction.alloc_conf, every)
    assert curve.max() == rank.peak_reserved_bytes  # the verdict's own replay (it fits: unbounded)
    sparse = reserved_curve(timeline, prediction.gpu, prediction.alloc_conf, every[::97] + [every[-1]])
    assert sparse.max() == rank.peak_reserved_bytes  # windows keep the spikes between drawn points
    out = prediction_figure(prediction, tmp_path / "gpu.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
