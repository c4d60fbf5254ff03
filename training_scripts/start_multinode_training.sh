#!/usr/bin/env bash
# start_multinode_training.sh MODEL DATA RUN: from node 0, start a run on every node in HOSTS/HOSTFILE
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration start "$@"
