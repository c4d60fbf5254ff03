#!/usr/bin/env bash
# logs_training.sh RUN [-f] [--node N] [--rank R] [--since T] [--grep P] [-n N]: every node's log merged in time order
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration logs "$@"
