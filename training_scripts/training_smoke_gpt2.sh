#!/usr/bin/env bash
# Per-node training entry, in the foreground: GPT-2 small on the gpt2_smoke data set.
# training_smoke_gpt2.sh [RUN]  (NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT,
# ZERO_STAGE from the environment; one-node defaults)
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration train gpt2 gpt2_smoke "$@"
