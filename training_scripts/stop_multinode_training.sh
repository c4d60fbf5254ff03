#!/usr/bin/env bash
# stop_multinode_training.sh RUN: stop a run on every node in HOSTS/HOSTFILE
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration stop "$@"
