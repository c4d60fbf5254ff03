#!/usr/bin/env bash
# The GPU check on a lent GPU machine, one command (tests/gpu/gpu_check.py says what it runs):
#   here first:  python3 tests/gpu/prepare_device_check.py   # copies the wheel into .whl/, prints carry + command
#   there:       bash tests/gpu/device_check.sh [--budget-s S] [--only ROW,...] [--dry-run]
# Its preflight takes seconds and names everything missing (python3, a CUDA device, megatron-core or
# its carried wheel, disk) before any row starts; each row's line goes to $OUT/gpu_check.txt as it ends.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
command -v python3 >/dev/null || { echo "device check: missing: python3" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout --kill-after 15 510 python3 tests/gpu/gpu_check.py "$@"
