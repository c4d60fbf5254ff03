#!/usr/bin/env bash
# compare_runs.sh RUN [RUN ...]: side-by-side speed, memory and loss
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration compare "$@"
