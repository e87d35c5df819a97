"""`size` against brute force: doubling-and-bisecting finds what trying every micro-batch finds."""
from llmsim.gpus import GpuProfile
from llmsim.size import candidates, fits, largest_micro_batch, size
from llmsim.spec import TrainSetup, load_model_spec
from llmsim.zoo import shrink

MiB = 1 << 20
TINY_GPU = GpuProfile("tiny", "test card", "9.0", 120 * MiB, 40 * MiB, 1 * MiB, "test")


def test_size_agrees_with_brute_force():
    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 2048, 4))
    setup = TrainSetup(1, 128)
    monotonic_cases = 0
    for candidate in candidates(spec, setup, max_gpus=2):
        found, _ = largest_micro_batch(spec, setup, candidate, TINY_GPU, max_micro_batch=24)
        fitting = [fits(spec, setup, candidate, mb, TINY_GPU)[0] for mb in range(1, 25)]
        if found == 0:
            assert not fitting[0]
        else:  # a micro-batch that fits, next to one that does not
            assert fitting[found - 1] and (found == 24 or not fitting[found])
        if fitting == sorted(fitting, reverse=True):  # monotonic: exactly the brute-force answer
            assert found == max([mb for mb, ok in zip(range(1, 25), fitting) if ok], default=0), candidate.name
            monotonic_cases += 0 < found < 24
    assert monotonic_cases >= 1  # the case bites: some micro-batches fit and some do not


def test_size_table_ranks_fitting_layouts_first():
    spec = load_model_spec("gpt2", shrink("gpt2", 64, 2, 2048, 4))
    frame = size(spec, TrainSetup(1, 128), TINY_GPU, max_gpus=2, max_micro_batch=8)
    assert set(frame["layout"]) == {"single", "ddp", "zero1", "zero2", "zero3"}
    assert list(frame["fits"]) == sorted(frame["fits"], reverse=True)


def test_size_bad_input_is_one_line(capsys):
    from llmsim.cli import main

    base = ["size", "--model", "gpt2", "--seq-len", "64"]
    assert main(base + ["--gpu", "b300"]) == 2
    assert "valid choices" in capsys.readouterr().err
    assert main(base + ["--gpu", "l4", "--max-gpus", "0"]) == 2
    assert "max-gpus(0)" in capsys.readouterr().err


def test_size_model_parallel_layouts_agree_with_brute_force():
    """TP and PP candidates exist where the model has transformers' plans, and bisecting finds what trying
    every micro-batch finds."""
    spec = load_model_spec("llama-2-7b", shrink("llama-2-7b", 64, 4, 2048, 4))
    setup = TrainSetup(1, 512)
    found_names = set()
    for candidate in candidates(spec, setup, max_gpus=2, families=("tp", "pp")):
        found_names.add(candidate.name)
        found, _ = largest_micro_batch(spec, setup, candidate, TINY_GPU, max_micro_batch=12)
        fitting = [fits(spec, setup, candidate, mb, TINY_GPU)[0] for mb in range(1, 13)]
        assert fitting == sorted(fitting, reverse=True), candidate.name  # live bytes grow with the micro-batch
        assert found == sum(fitting), candidate.name
        assert 0 < found < 12, candidate.name  # the case bites
    assert found_names == {"tp", "pp"}
