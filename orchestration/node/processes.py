"""This node's processes: start a run detached, record it, find it again, stop it.

Side effects (this module, the supervisor and :mod:`orchestration.cluster.fanout` are the ones
that touch processes): spawns torchrun in a new session, writes/removes pid files, reads ``/proc``, sends
signals. Never by name or pattern: a process is ours when the pid file's pid still has the
recorded start time and run id, or when its environment carries this run's tags.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from orchestration.node.node_plan import DEFAULT_STOP_GRACE_S, NODE_TAG, RUN_ID_TAG, RUN_TAG
from megatron_ext.run_spec.json_files import read_json, write_json_atomic

SWEEP_KILL_AFTER_S = 5.0


@dataclass(frozen=True)
class PidRecord:
    """The pid file's JSON: everything stop needs to recognise the run's processes."""

    run: str
    run_id: str
    node_rank: int
    host: str
    hostname: str
    pid: int
    pgid: int
    start_time: int
    """Process start time in clock ticks since boot (/proc/PID/stat field 22)."""
    argv: list[str]
    log_path: str
    started_at: float
    supervisor_pid: int | None = None
    """The node's supervisor (orchestration/node/supervisor.py), torchrun's parent in the same process group."""
    slurm_step: str | None = None
    """JOB.STEP when the node runs as a task of a Slurm step (the srun transport)."""
    supervisor_start_time: int | None = None
    """The supervisor's start time (clock ticks since boot): it outlives torchrun between attempts."""


def write_pid_file(path: Path, record: PidRecord) -> None:
    write_json_atomic(path, asdict(record))


def read_pid_file(path: Path) -> PidRecord | None:
    raw = read_json(path)
    try:
        return PidRecord(**raw) if isinstance(raw, dict) else None
    except TypeError:
        return None


def process_start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has ended
        return None
    return int(fields[19])


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (/proc/PID/stat field 4), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


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


def record_is_alive(record: PidRecord) -> bool:
    """The recorded process still runs, is the one we started, and carries the run id."""
    if process_start_time(record.pid) != record.start_time:
        return False
    return process_environ(record.pid).get(RUN_ID_TAG) == record.run_id


def supervisor_is_alive(record: PidRecord) -> bool:
    """The node's supervisor still runs (it may be between two attempts, with no torchrun)."""
    return bool(record.supervisor_pid and record.supervisor_start_time
                and pid_is_alive(record.supervisor_pid, record.supervisor_start_time)
                and process_environ(record.supervisor_pid).get(RUN_ID_TAG) == record.run_id)


def tagged_processes(run: str, node_rank: int) -> Iterator[int]:
    """Pids of every live process whose environment carries this run and node rank."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        env = process_environ(pid)
        if env.get(RUN_TAG) == run and env.get(NODE_TAG) == str(node_rank) and process_start_time(pid) is not None:
            yield pid


def start_detached(argv: Sequence[str], env: dict[str, str], cwd: str, log_path: Path) -> subprocess.Popen:
    """Start ``argv`` in its own session (no controlling terminal: an ssh hang-up cannot reach
    it), stdin from /dev/null, stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(
            list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )


def new_record(run: str, run_id: str, node_rank: int, host: str, proc: subprocess.Popen, argv: Sequence[str],
               log_path: Path, supervisor_pid: int | None = None, slurm_step: str | None = None) -> PidRecord:
    return PidRecord(
        run=run, run_id=run_id, node_rank=node_rank, host=host, hostname=socket.gethostname(),
        pid=proc.pid, pgid=os.getpgid(proc.pid), start_time=process_start_time(proc.pid) or 0,
        argv=list(argv), log_path=str(log_path), started_at=time.time(), supervisor_pid=supervisor_pid,
        slurm_step=slurm_step, supervisor_start_time=process_start_time(supervisor_pid) if supervisor_pid else None,
    )


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _wait_until_gone(run: str, node_rank: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = list(tagged_processes(run, node_rank))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


@dataclass(frozen=True)
class StopResult:
    """What a stop did on one node (``node-stop``'s answer)."""

    node_rank: int
    host: str
    was_running: bool
    """The recorded process was alive and ours."""
    signalled_group: int | None
    """The process group SIGTERMed (None: only torchrun, or nothing)."""
    swept: list[int] = field(default_factory=list)
    """Leftover tagged processes SIGTERMed after the grace."""
    killed: list[int] = field(default_factory=list)
    """Those SIGKILLed after SWEEP_KILL_AFTER_S more."""
    left: list[int] = field(default_factory=list)
    """Still alive after all that."""

    @property
    def ok(self) -> bool:
        return not self.left


@dataclass(frozen=True)
class StopPreview:
    """What a stop would signal on one node (``node-stop --dry-run``'s answer); signals nothing."""

    node_rank: int
    host: str
    recorded_pid: int | None
    """torchrun's pid from the pid file (None: no pid file)."""
    recorded_alive: bool
    """That process still runs and is the one started (start time and run id)."""
    group: int | None
    """The process group a stop would SIGTERM (only when the recorded process is alive)."""
    tagged: list[int] = field(default_factory=list)
    """Every live process carrying the run's and node's tags: what the sweep after the grace would reach."""
    grace_s: float = DEFAULT_STOP_GRACE_S


def preview_stop(run: str, node_rank: int, host: str, pid_path: Path, grace_s: float = DEFAULT_STOP_GRACE_S) -> StopPreview:
    record = read_pid_file(pid_path)
    alive = record is not None and (record_is_alive(record) or supervisor_is_alive(record))
    return StopPreview(node_rank, host, record.pid if record else None, alive, record.pgid if alive else None,
                       sorted(tagged_processes(run, node_rank)), grace_s)


def stop_run(run: str, node_rank: int, host: str, pid_path: Path, grace_s: float = DEFAULT_STOP_GRACE_S,
             signal_group: bool = True) -> StopResult:
    """SIGTERM the recorded group (torchrun and the node's supervisor; or, from the supervisor
    itself, torchrun alone, keeping the pid file for its next attempt), wait, then SIGTERM/SIGKILL
    every process still tagged (never the caller)."""
    record = read_pid_file(pid_path)
    if signal_group:
        alive = record is not None and (record_is_alive(record) or supervisor_is_alive(record))
    else:
        alive = record is not None and record_is_alive(record)
    group = None
    if alive:
        try:
            if signal_group:
                os.killpg(record.pgid, signal.SIGTERM)
                group = record.pgid
            else:
                os.kill(record.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    left = _wait_until_gone(run, node_rank, grace_s if alive else 0.0)
    swept = [pid for pid in left if _signal(pid, signal.SIGTERM)]
    left = _wait_until_gone(run, node_rank, SWEEP_KILL_AFTER_S if swept else 0.0)
    killed = [pid for pid in left if _signal(pid, signal.SIGKILL)]
    left = _wait_until_gone(run, node_rank, 2.0 if killed else 0.0)
    if not left and signal_group:
        pid_path.unlink(missing_ok=True)
    return StopResult(node_rank, host, alive, group, swept, killed, left)


def port_is_free(port: int) -> bool:
    """Whether torchrun's store could listen on ``port`` here (all addresses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
