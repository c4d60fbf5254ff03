#!/usr/bin/env bash
# preflight_training.sh MODEL DATA RUN: the start's checks on every node in HOSTS/HOSTFILE, one table of every problem; nothing starts
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration preflight "$@"
