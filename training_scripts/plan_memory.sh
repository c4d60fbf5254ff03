#!/usr/bin/env bash
# plan_memory.sh MODEL [DATA]: memory and data-parallel traffic per GPU for each ZeRO stage, on paper (NNODES x NPROC_PER_NODE GPUs)
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration plan-memory "$@"
