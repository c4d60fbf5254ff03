#!/usr/bin/env bash
# device_check.sh: the GPU check as one command for a lent GPU machine (Python 3.12, torch, no
# megatron-core and no transformer-engine there). When megatron-core does not import, it installs a
# megatron-core 0.16.1 wheel for Python 3.12 from .whl/, shared/wheels/ or $WHEEL_DIR (or,
# on the developer machine beforehand: `echo /.whl/ >> .git/info/exclude` and
# `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#  --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1`, then carry `.whl`).
# Runs tests/gpu/gpu_check.py: throughput per stage, then resume at stages 1, 3, 0, 2, a NaN step,
# the stage-2 all-gather count; each line as it finishes; a 450 s budget cuts the tail (a lent
# machine gives 15 minutes in all, start-up included); the table also goes to $OUT/gpu_check.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  for dir in .whl shared/wheels ${WHEEL_DIR:+"$WHEEL_DIR"}; do
    wheel=$(compgen -G "$dir/megatron_core-0.16.1-cp312-*.whl" | head -1 || true)
    if [ -n "$wheel" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheel"
      export PYTHONPATH="/tmp/site:$PYTHONPATH"
      break
    fi
  done
fi
python3 -c "import torch, megatron.core; assert torch.cuda.is_available(), 'no CUDA device'"
nvidia-smi -L || true
PYTHONUNBUFFERED=1 timeout 480 python3 tests/gpu/gpu_check.py --budget-s 450 2>&1 | tee "${OUT:-/tmp}/gpu_check_log.txt"
