"""This node's processes: start a run detached, record it, find it again, stop it.

The mechanics every node-side module that touches processes uses (node-start, the supervisor, the
watchdog): spawns in a new session, reads ``/proc``, sends signals, writes and removes the pid file
(its format: :class:`~orchestration.node.run_state.PidRecord`). Never by name or pattern: a process
is ours when the pid file's pid still has the recorded start time and run id, or when its
environment carries this run's tags. Side effects: processes, the pid file, ``/proc``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Sequence

from megatron_ext.host.procfs import parent_pid, pid_is_alive, process_environ, process_start_time  # noqa: F401
from orchestration.node.run_state import PidRecord, read_pid_file
from orchestration.node.wire import (ARTIFACT_ROOT_ENV, DEFAULT_STOP_GRACE_S, NODE_TAG, RUN_ID_TAG, RUN_TAG, NodePlan,
                                     NodeTarget, SaveAsked, StopPreview, StopResult)

SWEEP_KILL_AFTER_S = 5.0


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


def tagged_processes(run: str, node_rank: int, artifact_root: str | None = None) -> Iterator[int]:
    """Pids of every live process whose environment carries this run and node rank (and, given,
    this artifact root: two runs of one name under two roots on one machine are two runs)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        env = process_environ(pid)
        if (env.get(RUN_TAG) == run and env.get(NODE_TAG) == str(node_rank)
                and (artifact_root is None or env.get(ARTIFACT_ROOT_ENV) == artifact_root)
                and process_start_time(pid) is not None):
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


def new_record(plan: NodePlan, pid: int, argv: Sequence[str], slurm_step: str | None = None) -> PidRecord:
    """The pid file's record of ``pid`` (torchrun; or a rejoining node's supervisor itself, until
    its first attempt), written by the node's supervisor (this process)."""
    return PidRecord(
        run=plan.run, run_id=plan.run_id, node_rank=plan.node_rank, host=plan.host, hostname=socket.gethostname(),
        pid=pid, pgid=os.getpgid(pid), start_time=process_start_time(pid) or 0, argv=list(argv), log_path=plan.log_path,
        started_at=time.time(), supervisor_pid=os.getpid(), slurm_step=slurm_step, supervisor_start_time=process_start_time(os.getpid()),
    )


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def pid_path(target: NodeTarget) -> Path:
    return target.paths.node_pid_file(target.node_rank)


def _wait_until_gone(target: NodeTarget, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = list(tagged_processes(target.run, target.node_rank, str(target.artifact_root)))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def preview_stop(target: NodeTarget, grace_s: float = DEFAULT_STOP_GRACE_S) -> StopPreview:
    record = read_pid_file(pid_path(target))
    alive = record is not None and (record_is_alive(record) or supervisor_is_alive(record))
    return StopPreview(node_rank=target.node_rank, host=target.host, recorded_pid=record.pid if record else None,
                       recorded_alive=alive, group=record.pgid if alive else None, grace_s=grace_s,
                       tagged=sorted(tagged_processes(target.run, target.node_rank, str(target.artifact_root))))


def stop_node(target: NodeTarget, grace_s: float = DEFAULT_STOP_GRACE_S, signal_group: bool = True,
              record: PidRecord | None = None) -> StopResult:
    """SIGTERM the recorded group (torchrun and the node's supervisor; or, from the supervisor
    itself, torchrun alone, keeping the pid file for its next attempt), wait, then SIGTERM/SIGKILL
    every process still tagged (never the caller). ``record``: the supervisor's own record of its
    torchrun (default: the pid file's; the supervisor does not read the share to stop its own)."""
    record = record if record is not None else read_pid_file(pid_path(target))
    if record is not None and os.getpid() in (record.pid, record.pgid if signal_group else None):
        record = None  # a supervisor's own record (a node joining, before its first attempt): never the caller
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
    left = _wait_until_gone(target, grace_s if alive else 0.0)
    swept = [pid for pid in left if _signal(pid, signal.SIGTERM)]
    left = _wait_until_gone(target, SWEEP_KILL_AFTER_S if swept else 0.0)
    killed = [pid for pid in left if _signal(pid, signal.SIGKILL)]
    left = _wait_until_gone(target, 2.0 if killed else 0.0)
    if not left and signal_group:
        pid_path(target).unlink(missing_ok=True)
    return StopResult(node_rank=target.node_rank, host=target.host, was_running=alive, signalled_group=group, swept=swept,
                      killed=killed, left=left)


def ask_to_save(target: NodeTarget) -> SaveAsked:
    """SIGUSR1 to the node's supervisor, if the pid file's is alive and ours: it asks every node,
    over the board, to save at the next step and end."""
    record = read_pid_file(pid_path(target))
    asked = record is not None and supervisor_is_alive(record) and _signal(record.supervisor_pid, signal.SIGUSR1)
    return SaveAsked(target.node_rank, target.host, record.supervisor_pid if asked else None)


def port_is_free(port: int) -> bool:
    """Whether torchrun's store could listen on ``port`` here (all addresses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
