#!/usr/bin/env bash
# import_megatron_args.sh FILE... --model-out M.yaml --data-out D.yaml: Megatron-LM argument files -> a model preset and a data set
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration import-megatron-args "$@"
