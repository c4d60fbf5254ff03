#!/usr/bin/env bash
# check_checkpoints.sh RUN [--sizes]: every checkpoint of RUN, verified or damaged (and which file)
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration check-checkpoints "$@"
