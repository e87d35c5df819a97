"""Validate llmsim on your own GPU job: a `transformers.TrainerCallback` that writes the job's real peaks, with
the inputs llmsim needs to predict it, as a row `llmsim validate` re-predicts.

    from llmsim.measure.recorder import MemoryRecorder
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[MemoryRecorder("gpu-rows.csv")])
    trainer.train()                                   # then: llmsim validate gpu-rows.csv

The row (tier 4) holds, per rank: `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` since the
process started (so from `from_pretrained` on, as llmsim's Trainer recipe counts: put nothing else on the GPU
first), the device's used memory (`torch.cuda.mem_get_info`: total - free; the most seen at a step's end), the
model's config (written beside the CSV when it is not a zoo name or a path you give), the TrainingArguments
fields that differ from their defaults, the LoraConfig when the model is a peft model, the weights' dtype, the
longest sequence a forward saw, the GPU (the profile whose device name torch reports, or `gpu=`) and the
versions. A recorder never stops the job: what it cannot read it leaves empty, and `validate` refuses such a row
with one line.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path

from transformers import TrainerCallback, TrainingArguments


class CudaReadings:
    """What the recorder reads of the device (a test hands it other readings)."""

    def device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name()

    def peaks(self) -> tuple[int, int]:
        import torch

        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    def used(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free


class MemoryRecorder(TrainerCallback):
    """`out`: the CSV to append the row to; `model`: a zoo name or a config.json path for llmsim to load (default:
    the model's own config, written beside the CSV); `gpu`: the llmsim GPU profile (default: the one whose device
    name torch reports); `kbit_prep`: for a bitsandbytes-quantized model, whether the script called peft's
    prepare_model_for_kbit_training (the model does not say; left unsaid, `validate` refuses the row)."""

    def __init__(self, out: str | Path = "llmsim-gpu-rows.csv", model: str | None = None, gpu: str | None = None,
                 readings: CudaReadings | None = None, kbit_prep: bool | None = None) -> None:
        self.out, self.model_name, self.gpu, self.kbit_prep = Path(out), model, gpu, kbit_prep
        self.readings = readings or CudaReadings()
        self.seq_len = 0
        self.lengths: set[int] = set()
        self.used = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model
        model.register_forward_pre_hook(self._saw_batch, with_kwargs=True)

    def _saw_batch(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and getattr(ids, "ndim", 0) == 2:
            self.lengths.add(int(ids.shape[1]))
            self.seq_len = max(self.seq_len, int(ids.shape[1]))

    def on_step_end(self, args, state, control, **kwargs):
        self.used = max(self.used, self.readings.used())

    def on_train_end(self, args, state, control, **kwargs):
        from llmsim.inputs.gpus import gpu_names, load_gpu
        from llmsim.measure.runs import append_rows, environment, library_versions

        allocated, reserved = self.readings.peaks()
        self.used = max(self.used, self.readings.used())
        device = self.readings.device_name()
        gpu = self.gpu or next((name for name in gpu_names() if load_gpu(name).device_name == device), device)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        row = {"tier": 4, "recipe": "hf-trainer", "model": self.model_name or self._config_file(base.config),
               "overrides": "{}", "seq_len": self.seq_len, "seq_lens_seen": ",".join(map(str, sorted(self.lengths))),
               "training_args": json.dumps(_changed_fields(args), sort_keys=True, default=str),
               "peft_config": _peft_fields(self.model),
               **_loading(base, self.kbit_prep),
               "attention": getattr(base.config, "_attn_implementation", "") or "",
               "micro_batch": args.per_device_train_batch_size, "grad_accum": args.gradient_accumulation_steps,
               "grad_ckpt": bool(args.gradient_checkpointing),
               "strategy": "deepspeed" if args.deepspeed else "single" if args.world_size == 1 else "ddp",
               "world_size": args.world_size,
               "rank": args.process_index, "gpu": gpu, "device": "cuda", "peak_allocated_bytes": allocated,
               "peak_reserved_bytes": reserved, "device_total_bytes": self.used, **environment(), **library_versions(),
               "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        out = self.out if args.world_size == 1 else self.out.with_name(f"{self.out.stem}.rank{args.process_index}"
                                                                            f"{self.out.suffix}")
        append_rows([row], out)

    def _config_file(self, config) -> str:
        """The model's config as a file the row names; without the `quantization_config` from_pretrained put there
        (the row's own column carries it, and a config that keeps it reads as a pre-quantized checkpoint)."""
        fields = json.loads(config.to_json_string())
        fields.pop("quantization_config", None)
        text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
        folder = self.out.with_name(f"{self.out.stem}-configs")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{config.model_type}-{hashlib.sha1(text.encode()).hexdigest()[:10]}.json"
        path.write_text(text)
        return str(path)


def _loading(base, kbit_prep: bool | None) -> dict:
    """from_pretrained's dtype and quantization_config as the model holds them. A quantized model's parameters do
    not tell the loaded dtype (its linear weights are packed, and prepare_model_for_kbit_training upcasts the
    rest): transformers keeps it in `config.dtype`."""
    quantization = getattr(base.config, "quantization_config", None)
    if quantization is None:
        return {"dtype": str(next(base.parameters()).dtype).removeprefix("torch."), "quantization_config": "",
                "kbit_prep": ""}
    fields = quantization.to_dict() if hasattr(quantization, "to_dict") else dict(quantization)
    return {"dtype": str(base.config.dtype).removeprefix("torch."),
            "quantization_config": json.dumps(fields, sort_keys=True, default=lambda v: getattr(v, "value", str(v))),
            "kbit_prep": "" if kbit_prep is None else bool(kbit_prep)}


def _changed_fields(args: TrainingArguments) -> dict:
    """The TrainingArguments fields the job set: those that differ from a default TrainingArguments'; a DeepSpeed
    config given as a path is recorded as its JSON, which travels with the row."""
    default = TrainingArguments(output_dir=args.output_dir).to_dict()
    fields = {key: value for key, value in args.to_dict().items() if default.get(key) != value}
    if isinstance(fields.get("deepspeed"), str) and Path(fields["deepspeed"]).is_file():
        fields["deepspeed"] = json.loads(Path(fields["deepspeed"]).read_text())
    return fields


def _peft_fields(model) -> str:
    configs = getattr(model, "peft_config", None)
    if not configs:
        return ""
    config = configs.get("default", next(iter(configs.values())))
    # peft's own serialization, as save_pretrained writes adapter_config.json (sets as lists, enums by value)
    return json.dumps(config.to_dict(), sort_keys=True,
                      default=lambda v: sorted(v) if isinstance(v, set) else getattr(v, "value", str(v)))
