#!/usr/bin/env bash
# The second environment CI tests in: Python 3.12 with megatron-core 0.19.2, built by the project's
# own setup (training_scripts/setup_env.sh decides what to install from package metadata). On 3.12
# `pip install torch==2.13.0` takes the registry's CUDA build (about 4.7 GB; it runs on CPU): a
# fresh build takes about 3 minutes here, so it is kept between runs on one machine, as a CI cache
# is: in $LAUNCHER_CI_CACHE (default ~/.cache/megatron-zero-launcher), under a key made of the
# interpreter's version and the files that decide what is installed; .venv-py312 is then a link to
# it. Anything else (a new machine, another key) builds afresh; LAUNCHER_CI_CACHE=none never links.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 2>/dev/null | sort -V | tail -1)"
if [ -z "$PY312" ] && python3.12 -c pass 2>/dev/null; then PY312="$(command -v python3.12)"; fi
[ -n "$PY312" ] || { echo "error: no Python 3.12 (pyenv's versions/3.12*, or python3.12); install one" >&2; exit 1; }
CACHE="${LAUNCHER_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-zero-launcher}"
if [ -L .venv-py312 ] && [ ! -e .venv-py312 ]; then rm .venv-py312; fi  # a link to a cache since removed
if [ ! -e .venv-py312 ] && [ "$CACHE" != none ]; then
  KEY="$( { "$PY312" -VV; cat pyproject.toml training_scripts/setup_env.sh orchestration/setup_env.py; } | sha256sum | cut -c1-16)"
  mkdir -p "$CACHE"
  [ -x "$CACHE/venv-py312-$KEY/bin/python" ] || { rm -rf "$CACHE/venv-py312-$KEY"; "$PY312" -m venv "$CACHE/venv-py312-$KEY"; }
  ln -s "$CACHE/venv-py312-$KEY" .venv-py312
fi
[ -x .venv-py312/bin/python ] || "$PY312" -m venv .venv-py312
LAUNCHER_PYTHON="$PWD/.venv-py312/bin/python" bash training_scripts/setup_env.sh
