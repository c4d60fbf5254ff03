"""Seeing another machine's files through a cluster's shared file system: late, bounded.

    python -c "from megatron_ext.run_spec.shared_fs import wait_for_files; help(wait_for_files)"

A name another client created can stay unseen on this one for as long as its cache holds the
directory (NFS: ``acdirmax`` 60 s; sshfs: 20 s). Where a rank was told over the network that a file
exists (rank 0 announced the data cache it prepared, or the checkpoint the ranks resume), it waits
here for the file to show, a bounded time, and then names the file and the likely cause instead of
failing on a missing path. Reads the file system and the monotonic clock only.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Iterable

from megatron_ext.run_spec.errors import UserError

class NotVisibleHere(UserError):
    """A file this process was told exists does not show on its machine: said by the rank that waited."""

    local = True


SHARED_FS_LAG_S = 120.0
"""How long a file another node wrote may take to show here: twice NFS's longest attribute cache
(``acdirmax=60``), six times sshfs's name cache (20 s)."""


def wait_for_files(paths: Iterable[Path], wait_s: float, what: str, poll_s: float = 1.0) -> float:
    """Wait until every one of ``paths`` exists on this machine, for up to ``wait_s`` of its own
    monotonic clock; the seconds waited. A path still missing then is :class:`NotVisibleHere`,
    naming it and ``what`` it belongs to."""
    paths = list(paths)
    started = time.monotonic()
    while True:
        missing = [p for p in paths if not p.exists()]
        waited = time.monotonic() - started
        if not missing:
            return waited
        if waited >= wait_s:
            raise NotVisibleHere(
                f"{missing[0]} ({what}) does not show on {socket.gethostname()} after {waited:.0f} s, though "
                f"another process wrote it{f' (and {len(missing) - 1} more files)' if len(missing) > 1 else ''}: "
                "this machine does not see that folder as the machine that wrote it does; check that "
                "ARTIFACT_ROOT is one shared file system, mounted at the same path on every node, and that its "
                "client caches hold names for less than a minute (NFS actimeo, sshfs dcache_timeout)")
        time.sleep(poll_s)


def wait_until_gone(paths: Iterable[Path], wait_s: float, poll_s: float = 1.0) -> tuple[float, list[Path]]:
    """Wait until none of ``paths`` shows on this machine, for up to ``wait_s`` of its own monotonic
    clock: (the seconds waited, those still showing then). For a name another machine removed or
    renamed that this one read recently: its client may show the old entry for as long as it caches
    names (sshfs 20 s, NFS up to ``acdirmax``), and a file created under the same name meanwhile is
    opened through that stale entry (sshfs: an open without O_CREAT, ENOENT on the server)."""
    paths = list(paths)
    started = time.monotonic()
    while True:
        showing = still_showing(paths)
        waited = time.monotonic() - started
        if not showing or waited >= wait_s:
            return waited, showing
        time.sleep(poll_s)


def still_showing(paths: Iterable[Path]) -> list[Path]:
    """Those of ``paths`` this machine's view still shows (a link or a name counts as it is)."""
    return [p for p in paths if os.path.lexists(p)]
