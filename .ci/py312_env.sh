#!/usr/bin/env bash
# The second environment CI tests in: Python 3.12 with megatron-core 0.19.2, built by the project's
# own setup (training_scripts/setup_env.sh decides what to install from package metadata). On 3.12
# `pip install torch==2.13.0` takes the registry's CUDA build (about 4.7 GB; it runs on CPU); pip's
# cache makes later builds on the same machine quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 2>/dev/null | sort -V | tail -1)"
if [ -z "$PY312" ] && python3.12 -c pass 2>/dev/null; then PY312="$(command -v python3.12)"; fi
[ -n "$PY312" ] || { echo "error: no Python 3.12 (pyenv's versions/3.12*, or python3.12); install one" >&2; exit 1; }
[ -x .venv-py312/bin/python ] || "$PY312" -m venv .venv-py312
LAUNCHER_PYTHON="$PWD/.venv-py312/bin/python" bash training_scripts/setup_env.sh
