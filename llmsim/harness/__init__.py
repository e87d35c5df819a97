"""Measured recipes: users' jobs run through the ecosystem's own entry points, under the storage tracker.

Each recipe here calls the libraries the way a training script does (`from_pretrained`, `get_peft_model`,
`Trainer(...).train()`), from a checkpoint written before the measured region opens. Nothing of the
predictor's loop is imported (tests/test_harness.py checks): only the instrument (`llmsim.tracker`) and the
vocabulary it records in (`llmsim.enums`). These rows prove the product; the canonical step's prove the simulator.
"""
