#!/usr/bin/env bash
# The packages experiments/gpu_validation.py needs on this workplace's H200 image (python 3.12, torch 2.11+cu130,
# transformers 5.17, peft, no liger-kernel or bitsandbytes), unzipped into .whl/site and packed as .whl/site.tar.gz
# for `carry` (see its docstring): liger-kernel 0.8.5 (pure Python + Triton), peft 0.21.2, transformers 5.24.0 and
# accelerate 1.16.0 (the versions the CPU rows and the predictions use) and bitsandbytes 0.50.2 with only its
# CUDA 13 library (the wheel holds one per CUDA release: 43 MB -> 13 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/site
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl liger-kernel==0.8.5 bitsandbytes==0.50.2 peft==0.21.2 \
    transformers==5.24.0 accelerate==1.16.0
for wheel in .whl/*.whl; do python3 -m zipfile -e "$wheel" .whl/site; done
find .whl/site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*cuda130*' -delete
du -sh .whl/site
tar czf .whl/site.tar.gz -C .whl site  # what travels (carry .whl/site.tar.gz; 16 MB, the unpacked folder is 74 MB)
