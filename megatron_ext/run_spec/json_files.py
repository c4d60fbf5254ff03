"""JSON files a reader never sees half of: the one atomic write (tmp file + rename) and its read.

    python -c "from megatron_ext.run_spec.json_files import write_json_atomic; help(write_json_atomic)"

Shared by both programs: the node side's run_state files (orchestration/node/run_state.py) and a
run's own records under its run directory (the W&B identity, megatron_ext/run_spec/wandb_run.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, raw: Any) -> None:
    """``path`` replaced in one step (tmp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    """The JSON in ``path``; None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
