#!/usr/bin/env bash
# setup_env.sh: install the project without touching a torch, megatron-core or transformer-engine
# that already imports (NGC containers ship them); on a bare machine install the tested pins.
source "$(dirname "${BASH_SOURCE[0]}")/_entry.sh"
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q "torch==2.13.0"
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
  # --no-deps: its torch requirement must not replace a container's torch build.
  "$PYTHON" -m pip install -q --no-deps "megatron-core==0.16.1"
  "$PYTHON" -m pip install -q "packaging>=24.2"
fi
"$PYTHON" -m pip install -q -e "$REPO_ROOT[test,hf]"
