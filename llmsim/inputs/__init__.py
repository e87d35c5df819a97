"""Floor 1, the inputs: what the user gives, read with the ecosystem's own classes. A model (a zoo name or an HF
config, `spec`, `zoo`), a DeepSpeed JSON (`dsconfig`), TrainingArguments and LoraConfig files (`hf`), a GPU
profile (`gpus`). Imports nothing of llmsim above `errors` and `enums`."""
