#!/usr/bin/env bash
# The GPU check on a lent GPU machine, one release per call (tests/gpu/gpu_check.py says what it runs):
#   here first:  python3 tests/gpu/prepare_device_check.py   # copies the wheels into .whl/, prints carry, kind, commands
#   there:       [DEVICE_CHECK_LIMIT_S=300] bash tests/gpu/device_check.sh [--megatron-core V] [--budget-s S] [--only ROW,...] [--dry-run]
# DEVICE_CHECK_LIMIT_S: the wall-time limit of this check; its budget (setup and rows) is 40 s less
# (gpu_check.STOP_MARGIN_S). Its preflight takes seconds and names everything missing (python3, a CUDA
# device, megatron-core or its carried wheel, disk) before any row starts; each row's line goes to
# $OUT/gpu_check-<release>.txt as it ends.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
command -v python3 >/dev/null || { echo "device check: missing: python3" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
limit=${DEVICE_CHECK_LIMIT_S:-300}
[[ $limit =~ ^[0-9]+$ && $limit -gt 60 ]] || { echo "device check: DEVICE_CHECK_LIMIT_S=$limit must be seconds > 60" >&2; exit 2; }
exec timeout --kill-after 15 "$limit" python3 tests/gpu/gpu_check.py --budget-s $((limit - 40)) "$@"
