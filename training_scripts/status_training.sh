#!/usr/bin/env bash
# status_training.sh RUN: per node alive, pid, last iteration, tokens/s, last log line
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration status "$@"
