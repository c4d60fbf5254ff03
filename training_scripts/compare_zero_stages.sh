#!/usr/bin/env bash
# compare_zero_stages.sh MODEL DATA PREFIX: train under each ZeRO stage (STAGES=0,1,2,3) as PREFIX_z<stage>, one after another, then compare
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
exec "$PYTHON" -m orchestration sweep "$@"
