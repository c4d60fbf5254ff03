#!/usr/bin/env bash
# Per-node training entry, in the foreground: Qwen3-1.7B on the qwen3_1p7b_smoke data set.
# training_smoke_qwen3_1p7b.sh [RUN]  (NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR,
# MASTER_PORT, ZERO_STAGE from the environment; one-node defaults)
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration train qwen3_1p7b qwen3_1p7b_smoke "$@"
