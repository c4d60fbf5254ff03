#!/usr/bin/env bash
# setup_env.sh: install the project without touching a torch, megatron-core or transformer-engine
# that is installed (NGC containers ship them); on a bare machine install the tested releases for
# this Python (decided from package metadata: python -m orchestration.setup_env --dry-run shows how).
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
"$PYTHON" -m orchestration.setup_env
"$PYTHON" -m pip install -q -e "$REPO_ROOT[test,hf]"
