"""llmsim's Python API: one setup predicted for three GPUs (python examples/predict_api.py)."""
import llmsim

for gpu in ("a100-40gb", "a100-80gb", "h200"):
    p = llmsim.predict("llama-2-7b", seq_len=2048, micro_batch=1, precision="bf16", grad_ckpt=True, gpu=gpu)
    r = p.ranks[0]                                   # one process: one rank
    print(f"{gpu}: device total {r.device_total_bytes / 2**30:.2f} GiB, fits {r.fits}, peak in the {r.peak.phase}")
print({k: round(v / 2**30, 2) for k, v in r.peak.breakdown_bytes.items()})   # GiB by category at the peak
