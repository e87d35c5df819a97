"""The DeepSpeed script as a user writes it, the code the measured runs execute (llmsim/measure/dist_worker.py) and,
under DeepSpeed's AutoTP, the code the trace runs too (llmsim/model/trace.py, `trace_ds_autotp`):

    model = AutoModelForCausalLM.from_config(config, ...)        # zero.Init around it under ZeRO-3
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=AdamW(model.parameters()), config=ds_config)
    for step in range(steps):
        loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()

With `"tensor_parallel": {"autotp_size": N}` in the JSON, `deepspeed.initialize` shards the model's linear layers
over N ranks itself (DeepSpeed's AutoTP training: engine.py `_configure_tensor_parallel`, the model's own TP plan
where transformers gives one, else AutoTP's parser) and runs ZeRO over the data-parallel ranks (world / N). Nothing
of that is llmsim's: the trace runs DeepSpeed's code on fake tensors (`autotp_patches`)."""
from __future__ import annotations

import contextlib
import json

import torch

from llmsim.enums import Category, Phase
from llmsim.inputs.dsconfig import autotp_size
from llmsim.model.ds_pipe import MAX_TRACED_RANKS, label_engine
from llmsim.model.host_memory import HostMemory, optimizer_offload
from llmsim.model.losses import compute_loss, install_loss
from llmsim.model.offload import offloading
from llmsim.model.step import (LayerHooks, add_peft, enable_checkpointing, import_peft, make_optimizer, optimizer_class,
                               uses_peft)
from llmsim.model.tracker import StorageTracker


def build_causal_lm(config_json: str, attention: str, build_bf16: bool = False):
    """`AutoModelForCausalLM.from_config` in fp32 (or bf16, as from_pretrained(dtype=torch.bfloat16) builds it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(config_json))
    dtype = torch.bfloat16 if build_bf16 else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)


def run_deepspeed(config_json: str, ds_config: dict, setup, tracker: StorageTracker, settled=None):
    """The script above under `tracker`, with the canonical step's levers as a DeepSpeed script pulls them: the loss
    lever patches the model's forward and peft wraps it before `deepspeed.initialize`, checkpointing (with its
    offload) is enabled on the base model, and the engine's forward takes the lever's arguments
    (llmsim/model/losses.py, `compute_loss`). `settled`: a context the measured run enters around it (gloo's
    collectives given time to let go). Returns the step's StepInfo."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    import_peft(setup)
    optimizer_class(setup.optimizer)  # imported before the step, as a training script does
    placed = HostMemory(tracker).active_host_build() if autotp_size(ds_config) > 1 else \
        optimizer_offload(tracker, ds_config)  # AutoTP (which takes no offload): the model built on the host
    with tracker, offloading(tracker, setup.ckpt_offload), placed, settled or contextlib.nullcontext():
        keep_alive = HfDeepSpeedConfig(ds_config) if stage == 3 else None  # zero.Init inside from_config
        base = model = build_causal_lm(config_json, setup.attention.value, setup.build_bf16)
        hooks = LayerHooks(tracker, model, None)
        model.train()
        install_loss(base, setup)
        vocab_size = base.get_input_embeddings().num_embeddings  # before peft wraps it (trainable tokens)
        if uses_peft(setup):  # as a Trainer script does: get_peft_model outside zero.Init, then initialize
            model = add_peft(model, setup)
            hooks.adopt_new_parameters()
        if setup.grad_ckpt:
            enable_checkpointing(base, setup.ckpt_every, setup.ckpt_offload)
        # the client optimizer, built as the canonical step builds it (torch.optim.AdamW unless --optimizer,
        # with --foreach / --fused)
        optimizer = None if "optimizer" in ds_config else make_optimizer(model.parameters(), setup)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        hooks.label_model()  # AutoTP's shards replace the parameters it split: named as their modules
        label_engine(engine, tracker)
        batch = torch.randint(0, vocab_size, (setup.micro_batch, setup.seq_len))
        tracker.label([batch], Category.INPUT)
        for step in range(setup.steps):
            for _ in range(setup.grad_accum):  # gradient_accumulation_steps micro-steps, each ending in step()
                tracker.set_phase(step, Phase.FORWARD)
                loss = compute_loss(engine, batch, setup)
                tracker.set_phase(step, Phase.BACKWARD)
                hooks.enter_backward()
                engine.backward(loss)  # divides the loss by gradient_accumulation_steps itself
                if engine.is_gradient_accumulation_boundary():  # else step() only counts the micro-step
                    tracker.set_phase(step, Phase.OPTIMIZER)
                engine.step()
                label_engine(engine, tracker)
        tracker.finish()
    del keep_alive
    return hooks.info(vocab_size)


@contextlib.contextmanager
def autotp_patches():
    """What a fake-tensor trace of `run_deepspeed` under AutoTP needs answered, each as the real run has it:
    - the engine's device mesh of (data-parallel, tensor-parallel) ranks (`groups._init_tp_mesh_device`) is made
      outside the fake mode, as llmsim's own meshes are (`tensor_parallel.parallel_mesh`): DeviceMesh finds this
      rank's groups by comparing a tensor of ranks, which a fake tensor cannot answer (its rank tensor, a few bytes,
      is host memory on a GPU);
    - the check DeepSpeed hooks before the first forward (`check_dataloader_inputs_same_across_ranks`: tensor-
      parallel rank 0 pickles the batch and broadcasts it, the others unpickle and compare) is not run: pickling a
      fake tensor fails, and its answer, that every rank of the TP group has the same batch, is the traced script's
      by construction. Its transient bytes (the pickled batch, its size, the other ranks' copy of the batch) are
      not traced: they are freed before the embedding runs, when a rank holds its parameters, optimizer and batch
      and nothing else, so no peak falls there;
    - with a head tied to the embedding, the vocabulary-parallel loss checks the TP group's shard bounds by value
      (deepspeed/sequence/cross_entropy.py, `_validate_vocab_shard_bounds`: an all-gather of each rank's bounds,
      read back with `.tolist()`): its tensors are made and gathered as there, and the global vocabulary it returns
      is the TP degree times this rank's shard (`checked_setup` refuses a vocabulary the degree does not divide,
      which DeepSpeed refuses too)."""
    from unittest import mock

    import torch.distributed.device_mesh as device_mesh
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    made = device_mesh.init_device_mesh

    def init_device_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return made(*args, **kwargs)

    configure = DeepSpeedEngine._configure_tensor_parallel_states

    def without_input_check(self, model):
        configure(self, model)
        if getattr(self, "first_dataloader_check", None) is not None:
            self.first_dataloader_check.remove()
            self.first_dataloader_check = None

    def vocab_shard_bounds(local_vocab_size, vocab_start_index, vocab_end_index, tp_group, device):
        import torch.distributed as dist

        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        if tp == 1:
            return bounds(local_vocab_size, vocab_start_index, vocab_end_index, tp_group, device)
        local = torch.tensor([vocab_start_index, vocab_end_index, local_vocab_size], dtype=torch.long, device=device)
        gathered = torch.empty(tp * local.numel(), dtype=local.dtype, device=device)
        dist.all_gather_into_tensor(gathered, local, group=tp_group)
        return tp * local_vocab_size

    from deepspeed.sequence import cross_entropy

    bounds = cross_entropy._validate_vocab_shard_bounds
    with mock.patch.object(device_mesh, "init_device_mesh", init_device_mesh), \
            mock.patch.object(DeepSpeedEngine, "_configure_tensor_parallel_states", without_input_check), \
            mock.patch.object(cross_entropy, "_validate_vocab_shard_bounds", vocab_shard_bounds):
        yield

# What the deepspeed-autotp recipe was measured without: each is refused with it (setup field, its default, the flag)
_NOT_TAKEN = (("lora_rank", 0, "--lora-rank"), ("quant", None, "--quant"), ("ckpt_offload", False, "--ckpt-offload"),
              ("load_dtype", None, "--dtype"), ("lora_targets", None, "--lora-targets"))


def on_autotp(setup, layout):
    """`setup` as DeepSpeed's AutoTP training runs it over `layout` (strategy deepspeed, a JSON with autotp_size > 1):
    the deepspeed-autotp recipe, the traced rank 0 of the world; the CLI and `llmsim validate` both build it here."""
    from dataclasses import replace

    from llmsim.enums import Recipe
    from llmsim.inputs.spec import DsAutoTpSetup

    return replace(setup, recipe=Recipe.DEEPSPEED_AUTOTP, tp=layout.deepspeed.autotp_size,
                   ds_autotp=DsAutoTpSetup(layout.deepspeed.config_json, layout.world_size, 0))


def checked_setup(spec, setup, layout):
    """What the deepspeed-autotp recipe models, one line of InputError for the rest; the setup its traces run."""
    from llmsim.enums import Loss, Optimizer
    from llmsim.errors import InputError
    from llmsim.inputs.spec import check_fits_positions, resolve_attention

    tp, world = setup.tp, layout.world_size
    if layout.tp > 1 or layout.pp > 1:
        raise InputError(f"--tp/--pp with DeepSpeed's AutoTP (tensor_parallel.autotp_size {tp}): the JSON's "
                         "autotp_size is the tensor-parallel degree, and DeepSpeed's pipeline engine does not take "
                         "AutoTP; modelled: --world-size alone (dp = world-size / autotp_size)")
    if world % tp:
        valid = [d for d in range(2, world + 1) if world % d == 0]
        raise InputError(f"tensor_parallel.autotp_size({tp}) does not divide world-size({world}); valid autotp "
                         f"sizes: {', '.join(map(str, valid)) or 'none (world-size 1)'}")
    if world > MAX_TRACED_RANKS:
        raise InputError(f"DeepSpeed's AutoTP is traced rank by rank (each rank's shards and ZeRO partition are its "
                         f"own): world-size({world}) is more than the {MAX_TRACED_RANKS} llmsim traces")
    hf = spec.hf_config()
    if getattr(hf, "tie_word_embeddings", False) and int(hf.vocab_size) % tp:
        raise InputError(f"a head tied to the embedding with vocab_size({hf.vocab_size}) that "
                         f"tensor_parallel.autotp_size({tp}) does not divide: DeepSpeed's vocabulary-parallel loss "
                         "refuses uneven shards ('Explicit vocabulary shard bounds are required'); modelled: a "
                         "vocabulary the degree divides")
    config = layout.deepspeed
    if config.stage == 3:
        raise InputError("ZeRO stage 3 with tensor_parallel.autotp_size is not modelled yet; modelled: stages 0, 1 "
                         "and 2 (those DeepSpeed's AutoTP training tutorial pairs it with)")
    if config.offloads_optimizer or config.offloads_params:
        raise InputError("zero_optimization offload with tensor_parallel.autotp_size is not modelled yet; modelled: "
                         "AutoTP with ZeRO-0/1/2 on the device")
    for name, default, flag in _NOT_TAKEN:
        if getattr(setup, name) != default:
            raise InputError(f"{flag} with DeepSpeed's AutoTP is not modelled yet (the deepspeed-autotp recipe trains "
                             "the whole model, sharded by DeepSpeed)")
    if setup.optimizer is not Optimizer.ADAMW:
        raise InputError(f"--optimizer {setup.optimizer.value} with DeepSpeed's AutoTP is not modelled yet; modelled: "
                         "adamw (the client torch.optim.AdamW, or the JSON's \"optimizer\" section)")
    if setup.loss is not Loss.HF:
        raise InputError(f"--loss {setup.loss.value} with DeepSpeed's AutoTP is not modelled yet; modelled: hf "
                         "(transformers' loss on the LM head's output)")
    setup = resolve_attention(spec, setup)
    check_fits_positions(spec, setup)
    return setup
