"""Files a reader never sees half of: the atomic write (tmp file + rename) of every record file
(run_state, ranks' progress, checkpoint markers and checksums, trackers), and the JSON read.

On a cluster's shared file system another node's reader may still see a torn or missing file
(sshfs and NFS cache names and attributes; a file replaced by rename can come back half-read): a
reader that must act on the content uses :func:`read_json_settled`, which retries.

    python -c "from megatron_ext.host.json_files import write_json_atomic; help(write_json_atomic)"

Shared by both programs: the node side's run_state files (orchestration/node/run_state.py), a
run's own records under its run directory (the W&B identity, megatron_ext/run_spec/wandb_run.py),
and the checkpoints' markers and records (megatron_ext/training/checkpoint.py, run_spec/checksums.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

SHARE_CACHE_S = 60.0
"""How late another machine's write may show on a shared file system: NFS caches attributes and
names for up to 60 s (``acregmax``, ``acdirmax``), sshfs for 20 s. A wait that reads another
machine's record allows for at least this much, on the reader's own monotonic clock."""
SETTLE_S = SHARE_CACHE_S + 30.0
"""How long a reader that needs a file waits for it to appear whole: the share's cache time and
half a minute more (a writer that is itself slow to start)."""


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` replaced in one step (tmp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, raw: Any) -> None:
    write_text_atomic(path, json.dumps(raw, indent=1))


def read_json(path: Path) -> Any | None:
    """The JSON in ``path``; None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_json_settled(path: Path, wait_s: float = SETTLE_S, poll_s: float = 0.5) -> Any | None:
    """The JSON in ``path``, read again while it is missing or torn, for up to ``wait_s``; None after."""
    deadline = time.monotonic() + wait_s
    while True:
        raw = read_json(path)
        if raw is not None or time.monotonic() >= deadline:
            return raw
        time.sleep(poll_s)
