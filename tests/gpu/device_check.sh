#!/usr/bin/env bash
# device_check.sh: the GPU check as one command for a lent GPU machine (Python 3.12, torch, no
# megatron-core there). Beforehand, on the developer machine, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl megatron-core==0.16.1
# then run this script there with `.whl` carried. Writes the table to $OUT/gpu_check.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import torch, megatron.core; assert torch.cuda.is_available(), 'no CUDA device'"
nvidia-smi -L || true
PYTHONUNBUFFERED=1 timeout 480 python3 tests/gpu/test_gpu_stages.py 2>&1 | tee "${OUT:-/tmp}/gpu_check.txt"
