#!/usr/bin/env bash
# rejoin_multinode_training.sh RUN NODE_RANK [--host HOST]: bring a repaired (or replacement) node
# back to a run that went on without it (NNODES=MIN:MAX); node 0 takes it at its next restart
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration rejoin "$@"
