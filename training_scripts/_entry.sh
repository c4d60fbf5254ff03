# Sourced by the entry scripts: strict mode, the repository root, and the interpreter.
# (All logic and defaults live in Python: orchestration/ and megatron_ext/.)
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${LAUNCHER_PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
