#!/usr/bin/env bash
# start_training.sh MODEL DATA RUN: start a run on this machine in the background (NODE_RANK from the environment)
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration start "$@" --this-node
