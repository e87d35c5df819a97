#!/usr/bin/env bash
# The one call a lent H200 gets (device `run`, carry .whl/site.tar.gz from experiments/gpu_wheels.sh, timeout_s 590):
# the versions, then the Trainer's jobs through the ecosystem's entry points (experiments/gpu_trainer.py), then the
# canonical step's matrix (experiments/gpu_validation.py) in the time left; everything lands in $OUT as it ends.
#     bash experiments/gpu_run.sh            # TRAINER_DEADLINE (s, default 230) and TOTAL (s, default 470): the
#                                            # last start of a Trainer job, of a kit run, counted from the start
set -uo pipefail
: "${OUT:?OUT: the folder whose files come back}"
begin=$SECONDS
mkdir -p /tmp/site && tar xzf .whl/site.tar.gz -C /tmp || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch, transformers, peft, accelerate, bitsandbytes, triton
print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'peft',
      peft.__version__, 'accelerate', accelerate.__version__, 'bnb', bitsandbytes.__version__, 'triton',
      triton.__version__, torch.cuda.get_device_name())"
    python3 experiments/gpu_trainer.py --out "$OUT" --deadline "${TRAINER_DEADLINE:-230}"
    python3 experiments/gpu_validation.py --out "$OUT" --deadline $(( ${TOTAL:-470} - (SECONDS - begin) ))
    echo "done in $(( SECONDS - begin )) s"
} 2>&1 | tee "$OUT/log.txt"
