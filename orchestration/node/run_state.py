"""The run_state files and the one vocabulary of run states.

    $ARTIFACT_ROOT/run_state/<run>_node<N>.plan.json   the node's plan, for its supervisor
    $ARTIFACT_ROOT/run_state/<run>_node<N>.exit.json   how the node's run ended (NodeExit)
    $ARTIFACT_ROOT/run_state/<run>_node<N>.heartbeat   rewritten by the node's supervisor while it lives (attempt, state)
    $ARTIFACT_ROOT/run_state/<run>_failure.txt         the current attempt's first failure (first writer wins)
    $ARTIFACT_ROOT/run_state/<run>.save_request        save a checkpoint at the next step and end (preempted)
    $ARTIFACT_ROOT/run_state/<prefix>.sweep.json       a ZeRO sweep in progress (SweepRecord); <prefix>.sweep.stop
    (the attempts' files: orchestration/node/attempts.py)

This module owns them: every write is atomic (a reader never sees half a file:
megatron_ext/run_spec/json_files.py), every state a
status, a sweep, a comparison or a supervisor names is a :class:`RunState`. Side effects: those
files.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext.run_spec.json_files import read_json, write_json_atomic
from megatron_ext.run_spec.run_paths import RunPaths

HEARTBEAT_S = 2.0
"""How often a node's supervisor touches its heartbeat."""
NODE_LOST_S = 20.0
"""A peer whose heartbeat is this old is taken as lost (its machine, or its supervisor, is gone)."""


class RunState(str, enum.Enum):
    """Where a node's run (or a whole run, or a sweep's stage) stands."""

    NOT_STARTED = "not started"
    RUNNING = "running"
    RESTARTING = "restarting"
    """Between two attempts: torchrun ended, the next one starts after the backoff."""
    FINISHED = "finished"
    """torchrun exited 0: every iteration done."""
    FAILED = "failed"
    HUNG = "hung"
    """A rank made no progress within its phase's limit; every rank's stack was dumped."""
    PREEMPTED = "preempted"
    """Saved a checkpoint on request (SIGUSR1: a preemption or a time limit, or stop --save) and ended."""
    GAVE_UP = "gave up"
    """The restart breaker: attempts in a row that made no progress (no new checkpoint)."""
    STOPPED = "stopped"
    """Stopped on request, or because another node failed."""

    def __str__(self) -> str:
        return self.value

    @property
    def ended(self) -> bool:
        return self not in (RunState.NOT_STARTED, RunState.RUNNING, RunState.RESTARTING)

    @property
    def failed(self) -> bool:
        """Ended without finishing, and not because someone asked (failed, hung, gave up)."""
        return self in (RunState.FAILED, RunState.HUNG, RunState.GAVE_UP)


def tail(path: Path, lines: int, max_bytes: int = 65536) -> str:
    """The last ``lines`` lines of a (log) file, reading at most its last ``max_bytes``."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            text = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# -- a node's end ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeExit:
    """``run_state/<run>_node<N>.exit.json``, written by the node's supervisor."""

    node_rank: int
    state: RunState
    """finished, failed or stopped."""
    exit_code: int | None
    signal: str | None
    reason: str
    ended_at: float


def write_exit(paths: RunPaths, ended: NodeExit) -> None:
    write_json_atomic(paths.node_exit_file(ended.node_rank), {**asdict(ended), "state": ended.state.value})


def read_exit(paths: RunPaths, node_rank: int) -> NodeExit | None:
    raw = read_json(paths.node_exit_file(node_rank))
    try:
        return NodeExit(**{**raw, "state": RunState(raw["state"])}) if isinstance(raw, dict) else None
    except (TypeError, KeyError, ValueError):
        return None


# -- the supervisor's heartbeat, the run's failure, the node's plan ------------------------------

@dataclass(frozen=True)
class Heartbeat:
    """``<run>_node<N>.heartbeat``: the supervisor's attempt and what it is doing."""

    attempt: int
    state: RunState
    at: float


def write_heartbeat(paths: RunPaths, node_rank: int, attempt: int, state: RunState) -> None:
    write_json_atomic(paths.node_heartbeat_file(node_rank), {"attempt": attempt, "state": state.value, "at": time.time()})


def read_heartbeat(paths: RunPaths, node_rank: int) -> Heartbeat | None:
    raw = read_json(paths.node_heartbeat_file(node_rank))
    try:
        return Heartbeat(int(raw["attempt"]), RunState(raw["state"]), float(raw["at"])) if isinstance(raw, dict) else None
    except (KeyError, ValueError, TypeError):
        return None


def heartbeat_age_s(paths: RunPaths, node_rank: int, now: float | None = None) -> float | None:
    """Seconds since the node's supervisor last beat; None when it never did."""
    try:
        return (time.time() if now is None else now) - paths.node_heartbeat_file(node_rank).stat().st_mtime
    except FileNotFoundError:
        return None


def claim_failure(paths: RunPaths, text: str) -> bool:
    """Write the run's failure file unless another node already did (the first failure wins)."""
    paths.failure_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(paths.failure_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return True


def read_failure(paths: RunPaths) -> str | None:
    """The failure file's first line (what failed first), or None."""
    try:
        lines = paths.failure_file.read_text().splitlines()
    except FileNotFoundError:
        return None
    return lines[0] if lines else None


def clear_failure(paths: RunPaths) -> None:
    """A new attempt begins without the last one's failure."""
    paths.failure_file.unlink(missing_ok=True)


def request_save(paths: RunPaths, why: str) -> None:
    """Ask every node of the run to save a checkpoint at the next step and end as preempted."""
    write_json_atomic(paths.save_request_file, {"why": why, "at": time.time()})


def read_save_request(paths: RunPaths) -> str | None:
    raw = read_json(paths.save_request_file)
    return str(raw.get("why") or "save requested") if isinstance(raw, dict) else None


def write_plan_file(paths: RunPaths, node_rank: int, plan_json: str, pid_path: Path) -> Path:
    """The node's plan for its supervisor, after removing what the node's last start left
    (exit record, heartbeat, pid file); both the ssh and the srun start use it."""
    for stale in (paths.node_exit_file(node_rank), paths.node_heartbeat_file(node_rank), pid_path):
        stale.unlink(missing_ok=True)
    plan_file = paths.node_plan_file(node_rank)
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(plan_json)
    return plan_file


# -- a sweep in progress -----------------------------------------------------------------------

@dataclass(frozen=True)
class SweepRecord:
    """``run_state/<prefix>.sweep.json``: written by a sweep when it starts, before each stage and
    when it ends. ``stop PREFIX`` writes ``<prefix>.sweep.stop`` (a file of its own, so the two
    writers never overwrite each other) and stops the current stage; the sweep checks for it
    before each stage, after each start and at every poll, so a sweep is stoppable at any moment."""

    prefix: str
    pid: int
    """The sweep's process, on the machine where it was given (``hostname``)."""
    start_time: int
    """The sweep process's start time (clock ticks since boot), to recognise it."""
    hostname: str
    stages: tuple[int, ...]
    current_run: str | None = None
    """The stage run now starting or running (None before the first and after the last)."""
    ended: bool = False


def _sweep_file(root: Path, prefix: str, suffix: str) -> Path:
    return RunPaths(root, prefix).run_state_dir / f"{prefix}.{suffix}"


def write_sweep_record(root: Path, record: SweepRecord) -> None:
    write_json_atomic(_sweep_file(root, record.prefix, "sweep.json"), asdict(record))


def read_sweep_record(root: Path, prefix: str) -> SweepRecord | None:
    raw = read_json(_sweep_file(root, prefix, "sweep.json"))
    try:
        return SweepRecord(**{**raw, "stages": tuple(raw["stages"])}) if isinstance(raw, dict) else None
    except (TypeError, KeyError):
        return None


def request_sweep_stop(root: Path, prefix: str, why: str) -> None:
    path = _sweep_file(root, prefix, "sweep.stop")
    if not path.exists():
        path.write_text(why)


def sweep_stop_request(root: Path, prefix: str) -> str | None:
    """Why ``stop PREFIX`` asked the sweep to stop, or None."""
    try:
        return _sweep_file(root, prefix, "sweep.stop").read_text().strip() or "stop requested"
    except FileNotFoundError:
        return None


def clear_sweep_stop(root: Path, prefix: str) -> None:
    _sweep_file(root, prefix, "sweep.stop").unlink(missing_ok=True)
