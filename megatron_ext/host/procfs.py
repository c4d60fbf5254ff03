"""A process's identity from ``/proc``: its start time, parent and environment.

    python -c "import os; from megatron_ext.host.procfs import process_start_time; print(process_start_time(os.getpid()))"

How the launcher, the node side and the tests recognise a process they recorded (pid plus start
time: a pid reused by another process has another start time) and the processes carrying a run's
tags, never by name. Reads ``/proc``; nothing else.

Not psutil (a requirement, for megatron-core's checkpoint writer): a recorded start time must
compare equal days later, from another process. /proc's is an integer of clock ticks since boot;
psutil's ``create_time()`` is seconds since the epoch, that tick count plus the boot time it reads
from /proc/stat, which the kernel derives from the wall clock and which moves when NTP steps it.
The parent and the environment are two short reads of the same files; one way to read a process.
"""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on, None when the process is gone. The command name
    (field 2) may hold spaces and parentheses: the split is after the last ')'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return stat[stat.rindex(")") + 2:].split()


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22); None when it is gone."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":  # a zombie has ended
        return None
    return int(fields[19])


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (/proc/PID/stat field 4), None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def process_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def pid_is_alive(pid: int, start_time: int) -> bool:
    """``pid`` still runs and is the process that had ``start_time``."""
    return process_start_time(pid) == start_time
