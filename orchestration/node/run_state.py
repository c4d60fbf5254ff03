"""The run_state files and the one vocabulary of run states.

    $ARTIFACT_ROOT/run_state/<run>_node<N>.plan.json   the node's plan, for its supervisor
    $ARTIFACT_ROOT/run_state/<run>_node<N>.exit.json   how the node's run ended (NodeExit)
    $ARTIFACT_ROOT/run_state/<run>_node<N>.heartbeat   rewritten by the node's supervisor while it lives (attempt, state, beat)
    $ARTIFACT_ROOT/run_state/<run>_failure.txt         node 0's record of the attempt's first failure
    $ARTIFACT_ROOT/run_state/<run>_attempts.json       the ledger (node 0's): every attempt, why it ended, its checkpoints
    $ARTIFACT_ROOT/run_state/<run>_node<N>.pid         the node's torchrun and supervisor (PidRecord)

Records, each with one writer, for ``status`` and people: the nodes agree on nothing through them
(orchestration/node/board.py: node 0's coordination store). This module owns them: every write
is atomic (a reader on the same machine never sees half a file:
megatron_ext/host/json_files.py), every state a status, a sweep, a comparison or a
supervisor names is a :class:`RunState`. The node side writes them and resets its own (a node its
exit record and heartbeat when it starts; node 0 the run's failure and attempt files,
:func:`reset_run_files`); the launcher only reads them (the readers here, and
:func:`wait_until_started`). Side effects: those files.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from megatron_ext.run_spec.convert import structure, unstructure
from megatron_ext.host.json_files import read_json, write_json_atomic, write_text_atomic
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node.failure import FailureKind  # the ledger's failure kinds: the launcher reads them from here

HEARTBEAT_S = 2.0
"""How often a node's supervisor rewrites its heartbeat record (for ``status`` and a start's wait; the
nodes judge each other by their beats on the board, orchestration/node/liveness.py)."""
RECORD_WRITE_S = 10.0
"""A heartbeat record's write that has not returned in this long counts as the share failing."""


class RunState(str, enum.Enum):
    """Where a node's run (or a whole run, or a sweep's stage) stands."""

    NOT_STARTED = "not started"
    RUNNING = "running"
    RESTARTING = "restarting"
    """Between two attempts: torchrun ended, the next one starts after the backoff."""
    JOINING = "joining"
    """A node brought back to a run going on without it (NNODES=MIN:MAX): its supervisor waits for
    node 0 to take it at the next restart."""
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
    """Stopped on request (a node's attempt also ends so when another node failed; the run's end,
    every node's exit record, is node 0's decision)."""
    LOST = "lost"
    """A node left out of the run after its machine or its supervisor was gone (NNODES=MIN:MAX): the
    others went on without it."""
    LEFT_OUT = "left out"
    """A node node 0 left out of the run on the evidence against it (NNODES=MIN:MAX; a hang's
    suspect twice in a row, its GPU health, a slow rank: orchestration/node/exclusion.py): its part
    ended, the others went on without it; ``rejoin`` brings it back."""

    def __str__(self) -> str:
        return self.value

    @property
    def ended(self) -> bool:
        return self not in (RunState.NOT_STARTED, RunState.RUNNING, RunState.RESTARTING, RunState.JOINING)

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
    except OSError:  # missing; or on a share that fails (the heartbeat record's probe says so, once)
        return ""
    return "\n".join(text.splitlines()[-lines:])


# -- a node's end ---------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class NodeExit:
    """``run_state/<run>_node<N>.exit.json``, written by the node's supervisor."""

    node_rank: int
    state: RunState
    """finished, failed or stopped."""
    exit_code: int | None
    signal: str | None
    reason: str
    ended_at: float
    run_id: str = ""
    """The start this end belongs to."""


def write_exit(paths: RunPaths, ended: NodeExit) -> None:
    write_json_atomic(paths.node_exit_file(ended.node_rank), unstructure(ended))


def read_exit(paths: RunPaths, node_rank: int, run_id: str | None = None) -> NodeExit | None:
    """How the node's run ended (of the start ``run_id`` when given), or None."""
    raw = read_json(paths.node_exit_file(node_rank))
    try:
        ended = structure(NodeExit, raw) if raw is not None else None
    except ValueError:
        return None
    return ended if ended is None or run_id is None or ended.run_id == run_id else None


# -- the supervisor's heartbeat, the run's failure, the node's plan ------------------------------

@dataclass(frozen=True)
class Heartbeat:
    """``<run>_node<N>.heartbeat``: the supervisor's attempt and what it is doing."""

    attempt: int
    state: RunState
    beat: int = 0
    """How many times the supervisor has written this record: one more at every write (every
    :data:`HEARTBEAT_S`). A reader on another machine judges the writer alive by this number
    changing on the reader's own clock; the record holds no clock of the writer's."""
    run_id: str = ""
    doing: str = ""
    """A long step before torchrun starts, and how far it is (``verifying the checkpoint of iteration
    8: 40.0 of 115.0 GB read``); empty otherwise. A start waiting on the node names it."""


def write_heartbeat(paths: RunPaths, node_rank: int, attempt: int, state: RunState, run_id: str = "", beat: int = 0,
                    doing: str = "") -> None:
    write_json_atomic(paths.node_heartbeat_file(node_rank), unstructure(Heartbeat(attempt, state, beat, run_id, doing)))


def read_heartbeat(paths: RunPaths, node_rank: int) -> Heartbeat | None:
    raw = read_json(paths.node_heartbeat_file(node_rank))
    try:
        return structure(Heartbeat, raw) if raw is not None else None
    except ValueError:
        return None


def write_failure(paths: RunPaths, text: str) -> None:
    """Node 0's record of the current attempt's first failure (agreed through the store:
    orchestration/node/board.py); node 0 is its only writer."""
    write_text_atomic(paths.failure_file, text)


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


def write_plan_file(paths: RunPaths, node_rank: int, plan_json: str) -> Path:
    """The node's plan for its supervisor (node-start writes it; under srun the launcher does: the
    step's tasks read it)."""
    plan_file = paths.node_plan_file(node_rank)
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(plan_json)
    return plan_file


def reset_node_files(paths: RunPaths, node_rank: int) -> None:
    """A node's start: what the node's last start left (exit record, heartbeat, pid file) goes.
    Its processes are gone by then (node-start refuses a live one); a node brought back to the
    same start (``rejoin``) would otherwise be taken as started by its old pid file, of the same
    run id."""
    for stale in (paths.node_exit_file(node_rank), paths.node_heartbeat_file(node_rank), paths.node_pid_file(node_rank)):
        stale.unlink(missing_ok=True)


def reset_run_files(paths: RunPaths, keep_ledger: bool) -> None:
    """Node 0's start: no failure or attempt files of an earlier start (the ledger is
    kept only for a requeued batch job, which continues its attempts)."""
    clear_failure(paths)
    for path in paths.run_state_dir.glob(f"{paths.run}_a*.*"):
        if path.name[len(paths.run) + 2:].split(".", 1)[0].isdigit():
            path.unlink(missing_ok=True)
    if not keep_ledger:
        paths.attempts_file.unlink(missing_ok=True)
        for mark in paths.run_state_dir.glob(f"{paths.run}.batch_signal.*"):
            mark.unlink(missing_ok=True)


# -- the pid file -------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PidRecord:
    """``<run>_node<N>.pid``: everything stop needs to recognise the run's processes on the node."""

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
    write_json_atomic(path, unstructure(record))


def read_pid_file(path: Path) -> PidRecord | None:
    raw = read_json(path)
    try:
        return structure(PidRecord, raw) if raw is not None else None
    except ValueError:
        return None


def stop_command(run: str, multinode: bool) -> str:
    """The stop script for a live run, started on one node (``--this-node``) or on every node."""
    return f"{'stop_multinode_training.sh' if multinode else 'stop_training.sh'} {run}"


@dataclass(frozen=True)
class StartWait:
    """How a node's start turned out: its torchrun's record, or how it ended."""

    record: PidRecord | None
    ended: NodeExit | None
    timed_out: bool = False
    doing: str = ""
    """What the node's supervisor last said it was doing before torchrun (its heartbeat record)."""

    @property
    def started(self) -> bool:
        return self.record is not None and not (self.ended is not None and self.ended.state.failed)


def wait_until_started(paths: RunPaths, node_rank: int, pid_path: Path, run_id: str, alive: Callable[[], bool],
                       timeout_s: float, settle_s: float = 0.0, poll_s: float = 0.1) -> StartWait:
    """Until the node's torchrun of start ``run_id`` runs (its pid file) and has for ``settle_s``,
    or the node's start ended (its exit record, or ``alive()`` false: the supervisor or the srun
    step is gone), or ``timeout_s`` passed without a sign of a step under way: the one wait for a
    start (node-start, the srun start). A supervisor that takes long before torchrun (node 0 reading
    a large checkpoint through before it chooses, the others waiting for that choice) says so in its
    heartbeat record of this start (``doing``) and keeps the record's counter moving: the wait goes
    on as long as it does, ``timeout_s`` running from the last such beat. Timed by this machine's
    monotonic clock only (the counter changing, never a clock of the writer's); a caller reading
    another machine's records (the srun start) gives a ``timeout_s`` that allows for the share's cache."""
    t0 = time.monotonic()
    record, beat, beat_at, doing = None, None, t0, ""
    while True:
        if record is None:
            found = read_pid_file(pid_path)
            record = found if found is not None and found.run_id == run_id else None
        heartbeat = read_heartbeat(paths, node_rank)
        if heartbeat is not None and heartbeat.run_id == run_id and heartbeat.beat != beat:
            beat, doing = heartbeat.beat, heartbeat.doing
            if doing:  # a step before torchrun, under way
                beat_at = time.monotonic()
        ended = read_exit(paths, node_rank, run_id)
        now = time.monotonic()
        if (ended is not None and ended.state.failed) or not alive():
            return StartWait(record, ended, doing=doing)
        if record is not None and now - t0 >= settle_s:
            return StartWait(record, ended)
        if now - max(t0, beat_at) > timeout_s:
            return StartWait(record, ended, timed_out=True, doing=doing)
        time.sleep(poll_s)


# -- the ledger -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class AttemptRecord:
    """One attempt in the ledger."""

    attempt: int
    run_id: str
    """The start it belongs to (a requeued batch job is another start of the same run)."""
    started_at: float
    checkpoint_at_start: int | None
    ended_at: float | None = None
    state: RunState | None = None
    reason: str | None = None
    failure_kind: FailureKind | None = None
    """The kind of the failure that ended it (None: no failure, or a ledger written before the kind was kept)."""
    checkpoint_at_end: int | None = None
    nodes: tuple[int, ...] = ()
    """The nodes (ranks in the start's plan) the attempt ran on; empty: every node."""
    lost: tuple[int, ...] = ()
    """Nodes lost during the attempt (left out from the next one on)."""
    joined: tuple[int, ...] = ()
    """Nodes that came back at this attempt's start (lost earlier, brought back: ``rejoin``)."""
    suspects: tuple[int, ...] = ()
    """Nodes the attempt's evidence named as its cause (a hang's suspects, the node whose own failure
    ended it): the same node in attempts in a row is left out (orchestration/node/exclusion.py)."""
    excluded: tuple[int, ...] = ()
    """Nodes left out after this attempt on the evidence against them (left out from the next one on)."""
    exclusion: str = ""
    """Why, and evidence not acted on (node 0 named, RESTART_EXCLUDE=0): node 0's words."""

    @property
    def made_progress(self) -> bool:
        return self.checkpoint_at_end is not None and (self.checkpoint_at_start is None
                                                       or self.checkpoint_at_end > self.checkpoint_at_start)


def read_ledger(paths: RunPaths) -> list[AttemptRecord]:
    raw = read_json(paths.attempts_file)
    out = []
    for item in raw if isinstance(raw, list) else []:
        try:
            out.append(structure(AttemptRecord, item))
        except ValueError:  # a record of another checkout's making: left out
            continue
    return out


def write_ledger(paths: RunPaths, records: Sequence[AttemptRecord]) -> None:
    write_json_atomic(paths.attempts_file, [unstructure(r) for r in records])


def begin_attempt(paths: RunPaths, attempt: int, run_id: str, checkpoint: int | None, nodes: Sequence[int] = (),
                  joined: Sequence[int] = ()) -> None:
    """Node 0: attempt ``attempt`` starts now on ``nodes`` (``joined``: those of them back from a
    loss), with ``checkpoint`` the latest complete one."""
    records = [r for r in read_ledger(paths) if r.attempt != attempt]
    write_ledger(paths, [*records, AttemptRecord(attempt=attempt, run_id=run_id, started_at=time.time(), checkpoint_at_start=checkpoint,
                                                 nodes=tuple(nodes), joined=tuple(joined))])


def end_attempt(paths: RunPaths, attempt: int, state: RunState, reason: str, checkpoint: int | None,
                lost: Sequence[int] = (), suspects: Sequence[int] = (), excluded: Sequence[int] = (),
                exclusion: str = "", failure_kind: FailureKind | None = None) -> list[AttemptRecord]:
    """Node 0: attempt ``attempt`` ended so (``lost``: nodes lost in it; ``suspects``: the nodes its
    evidence named; ``excluded``: left out after it, ``exclusion`` why; ``failure_kind``: what failed,
    kept by a later call without one); the ledger as it now stands."""
    records = [replace(r, ended_at=time.time(), state=state, reason=reason, checkpoint_at_end=checkpoint,
                       failure_kind=failure_kind or r.failure_kind,
                       lost=tuple(lost) or r.lost, suspects=tuple(suspects) or r.suspects,
                       excluded=tuple(excluded) or r.excluded, exclusion=exclusion or r.exclusion)
               if r.attempt == attempt else r for r in read_ledger(paths)]
    write_ledger(paths, records)
    return records


def left_out_nodes(this_start: Sequence[AttemptRecord]) -> dict[int, str]:
    """The nodes a start's attempts went on without and did not take back (left out on the
    evidence against them, or lost), each with why: what ``rejoin`` says and a requeued Slurm job
    excludes (``--exclude``)."""
    out: dict[int, str] = {}
    for record in this_start:
        out = {n: why for n, why in out.items() if n not in record.nodes}
        out.update({n: f"lost in attempt {record.attempt}" for n in record.lost})
        out.update({n: f"left out after attempt {record.attempt}: {record.exclusion}" for n in record.excluded})
    return out


def first_attempt(paths: RunPaths, continue_ledger: bool) -> int:
    """The attempt a start begins with: 1, or after the ledger's last (a requeued batch job)."""
    records = read_ledger(paths) if continue_ledger else []
    return max((r.attempt for r in records), default=0) + 1


