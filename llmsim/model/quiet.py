"""Third-party noise silenced at llmsim's edges (the CLI, `llmsim.predict`, and the fresh processes `validate`
spawns): advice the libraries print for training scripts, not about the user's job."""
from __future__ import annotations


def quiet_libraries() -> None:
    """transformers, peft, DeepSpeed and bitsandbytes log advice meant for training scripts; the CLI prints its
    own report."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")
    # peft's all-linear on a MoE model adds the experts as target_parameters with rank/alpha patterns of its own,
    # and warns that the patterns match no targeted module: peft's bookkeeping, not the user's configuration
    warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match",
                            category=RuntimeWarning)
    # bitsandbytes' paged optimizers on the CPU ("falling back to non-paged"): what the CPU rows measure anyway
    warnings.filterwarnings("ignore", category=UserWarning, module="bitsandbytes")
    # the Trainer counts the embeddings an 8-bit optimizer skips by data_ptr(), which a traced fake tensor warns of
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    # FSDP2's meta-device build initialises its sharded DTensors on a CPU mesh (the trace's): DTensor warns that
    # its random ops may not be complete there; the values are never read, the bytes are the same
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    # FSDP2 warns (torch 2.13, _fsdp_state.py) when a wrapped module returns a view, for scripts that would then
    # change it in place; transformers' FSDP plan (--fsdp-wrap transformers) wraps modules that do: 4 lines a trace
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # bitsandbytes' CPU backend warns on import that an optional kernel package is missing (its fallback is the
    # kernel a CPU run takes either way): not a word about the user's job
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
