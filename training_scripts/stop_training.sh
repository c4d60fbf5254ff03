#!/usr/bin/env bash
# stop_training.sh RUN: stop the run on this machine
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration stop "$@" --this-node
