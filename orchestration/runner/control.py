"""A started run: stop it, ask how it stands, wait until it has ended.

    python -m orchestration stop demo                 # every node (HOSTS, else the hosts its start recorded)
    DRY_RUN=1 python -m orchestration stop demo       # what each node would signal; signals nothing
    python -m orchestration status demo

:func:`stop_run` and :func:`collect_status` return typed results the CLI prints and the sweep
reads; :func:`wait_until_ended` is the one wait for a run's end (``start --wait``, batch jobs,
``stop --save``, every stage of a sweep). A run submitted as a Slurm batch job is cancelled /
asked through Slurm; ``stop PREFIX`` of a live ZeRO sweep asks the sweep to stop and stops its
current stage. Side effects: the node commands, Slurm's commands, the save request and the
sweep's stop file.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from megatron_ext.run_spec.errors import EXIT_GAVE_UP, EXIT_NODE_FAILED, EXIT_OK, EXIT_PREEMPTED, Outcome
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster import slurm
from orchestration.cluster.backends import CancelledStep, backend_for, lost_node, lost_nodes, statuses_from_records, this_start_run_id
from orchestration.cluster.fanout import NodeResult
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import AttemptRecord, RunState, read_heartbeat, read_ledger
from orchestration.node.wire import DEFAULT_STOP_GRACE_S, NodeStatus, NodeTarget, SaveAsked, SaveRequest, StopResult, node_call
from orchestration.runner.nodes import Nodes, nodes_of_run
from orchestration.runner.record_beats import RECORD_SILENCE_S, RecordBeats
from orchestration.runner.sweep_state import SweepRecord, read_sweep_record, request_sweep_stop

EXIT_RECORD_WAIT_S = 10.0
"""After torchrun is gone on every node, how long to wait for the supervisors' records of how it ended."""


def batch_job_of(launch: LaunchEnv, run: str, only_this_node: bool) -> str | None:
    """The Slurm batch job ``submit`` recorded for ``run``, when this command is not inside it."""
    job = None if only_this_node or launch.hosts_explicit else slurm.recorded_job(RunPaths(launch.artifact_root, run))
    return job if job and job != launch.slurm_job_id else None


# -- stop -----------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class StopOutcome(Outcome):
    run: str
    dry_run: bool
    job: str | None = None
    """The batch job cancelled (or that would be)."""
    job_state: str | None = None
    sweep: SweepRecord | None = None
    """``run`` is a live ZeRO sweep's PREFIX: asked to stop (``stage`` is its current stage's stop)."""
    stage: "StopOutcome | None" = None
    nodes: tuple[NodeResult, ...] = ()
    """Every node's StopResult (StopPreview in a dry run)."""
    cancelled_steps: tuple[CancelledStep, ...] = ()

    @property
    def ok(self) -> bool:
        if self.job:
            return self.dry_run or self.job_state in (*slurm.TERMINAL_STATES, "UNKNOWN")
        if self.stage is not None:
            return self.stage.ok
        return all(r.ok for r in self.nodes) and all(r.value.ok for r in self.nodes if isinstance(r.value, StopResult))


def stop_run(launch: LaunchEnv, run: str, only_this_node: bool = False, grace_s: float = DEFAULT_STOP_GRACE_S,
             dry_run: bool = False) -> StopOutcome:
    """Stop ``run`` everywhere it lives (or say what would be signalled, with ``dry_run``)."""
    job = batch_job_of(launch, run, only_this_node)
    if job:  # a batch job: Slurm ends every step of it (SIGTERM, then SIGKILL after KillWait)
        return StopOutcome(run=run, dry_run=dry_run, job=job, job_state=None if dry_run else slurm.cancel(job))
    sweep = read_sweep_record(launch.artifact_root, run)
    if sweep is not None and not sweep.ended:
        if not dry_run:
            request_sweep_stop(launch.artifact_root, run, f"stop {run}")
        stage = stop_run(launch, sweep.current_run, only_this_node, grace_s, dry_run) if sweep.current_run else None
        return StopOutcome(run=run, dry_run=dry_run, sweep=sweep, stage=stage)
    nodes = nodes_of_run(launch, run, only_this_node)
    results, cancelled = backend_for(launch, nodes).stop(launch, run, nodes, grace_s, dry_run)
    return StopOutcome(run=run, dry_run=dry_run, nodes=tuple(results), cancelled_steps=tuple(cancelled))


# -- status ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class StatusReport(Outcome):
    run: str
    nodes: tuple[NodeResult[NodeStatus], ...]
    job: str | None = None
    job_state: str | None = None
    attempts: tuple[AttemptRecord, ...] = ()
    """The ledger: every attempt of this run and how it ended."""
    max_attempts: int | None = None
    """1 + MAX_RESTARTS (from the first attempt of this start)."""

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.nodes)

    @property
    def failure(self) -> str | None:
        """The run's first failure (node 0's failure file: the first the board holds)."""
        return next((r.value.run_failure for r in self.nodes if r.ok and r.value.run_failure), None)


def node_statuses(launch: LaunchEnv, run: str, nodes: Sequence[tuple[int, str]], seq_length: int | None) -> list[NodeResult[NodeStatus]]:
    """Every node's status, as the backend reaches it (cluster/backends.py)."""
    return backend_for(launch, nodes).status(launch, run, nodes, seq_length)


def collect_status(launch: LaunchEnv, run: str, only_this_node: bool = False) -> StatusReport:
    paths = RunPaths(launch.artifact_root, run)
    resolved = read_resolved(paths.params_path)
    seq = resolved.params.training.seq_length if resolved else None
    ledger = tuple(read_ledger(paths))
    this_start = [r for r in ledger if resolved and r.run_id == resolved.runtime.run_id]
    rejoins = sum(1 for r in this_start[:-1] if r.state == RunState.PREEMPTED)  # saved for nodes back: not restarts
    max_attempts = (this_start[0].attempt + resolved.params.training.resilience.max_restarts + rejoins) if this_start else None
    job = batch_job_of(launch, run, only_this_node)
    if job:  # a batch job, seen from outside it: its state, and each node from the shared run_state files
        state = slurm.job_state(job)
        hosts = resolved.runtime.hosts if resolved and state != "PENDING" else ()
        nodes = statuses_from_records(launch, run, list(enumerate(hosts)), seq)
        return StatusReport(run=run, nodes=tuple(nodes), job=job, job_state=state, attempts=ledger, max_attempts=max_attempts)
    nodes = nodes_of_run(launch, run, only_this_node)
    lost = lost_nodes(paths, this_start)  # not asked: their machines are gone
    asked = {r.node_rank: r for r in node_statuses(launch, run, [(k, h) for k, h in nodes if k not in lost], seq)}
    results = tuple(asked.get(k) or lost_node(k, h, lost[k]) for k, h in nodes)
    return StatusReport(run=run, nodes=results, attempts=ledger, max_attempts=max_attempts)


# -- the end --------------------------------------------------------------------------------------

Statuses = Mapping[int, "NodeStatus | None"]


@dataclass(frozen=True)
class RunEnd:
    """How a run ended on every node (None: a node that gave no status)."""

    statuses: dict[int, NodeStatus | None] = field(default_factory=dict)
    silent: tuple[int, ...] = ()
    """Nodes whose supervisor's heartbeat record stopped changing, with no exit record (records-only
    backends: record_beats.py): the run was stopped from here."""

    @property
    def states(self) -> set[RunState | None]:
        return {s.state if s else None for s in self.statuses.values()}

    def describe(self) -> str:
        states = ", ".join(f"node{rank} {s.state if s else 'unreachable'}" for rank, s in sorted(self.statuses.items()))
        return "; ".join([states, *(s.exit for rank, s in sorted(self.statuses.items()) if rank in self.silent and s and s.exit)])

    @property
    def exit_code(self) -> int:
        """A waited-for run's exit code: 0 finished everywhere, 3 saved and ended on request
        (preempted), 93 the restart breaker gave up, else 1. A node left out on the evidence against it
        (never node 0) ended its part early: the run's end is the others'."""
        states = self.states - {RunState.LEFT_OUT}
        if states == {RunState.FINISHED}:
            return EXIT_OK
        if states == {RunState.PREEMPTED}:
            return EXIT_PREEMPTED
        return EXIT_GAVE_UP if RunState.GAVE_UP in states else EXIT_NODE_FAILED


def wait_until_ended(launch: LaunchEnv, run: str, nodes: Nodes, seq_length: int | None = None, poll_s: float | None = None,
                     timeout_s: float | None = None, on_poll: Callable[[Statuses, float], None] | None = None,
                     unreachable_s: float | None = None) -> RunEnd | None:
    """Until the run has ended on every node: torchrun gone and each supervisor's record of how
    (finished, failed, stopped, ...) written, or EXIT_RECORD_WAIT_S after torchrun went. None after
    ``timeout_s``. ``on_poll(statuses, elapsed_s)`` sees every poll (progress lines; it may raise to
    stop waiting). Each node's supervisor stops its node when another fails or goes silent; a node
    that answers no status for ``unreachable_s`` gets the run stopped from here.

    Where the statuses come from the nodes' records (``Backend.records_only``: inside a Slurm
    allocation) a node has ended only by its exit record of this start, or once its heartbeat
    record's counter has not changed for ``launch.record_silence_s`` (RECORD_SILENCE_S) by this
    machine's clock: failed, its supervisor gone without a record; what it left is stopped from here."""
    t0 = time.monotonic()
    backend = backend_for(launch, nodes)
    poll_s = backend.poll_s(nodes) if poll_s is None else poll_s
    paths = RunPaths(launch.artifact_root, run)
    beats = RecordBeats(run_id=this_start_run_id(paths), since=t0,
                        silence_s=launch.record_silence_s or RECORD_SILENCE_S) if backend.records_only else None
    gone_since = unknown_since = None
    while True:
        results = node_statuses(launch, run, nodes, seq_length)
        statuses = {r.node_rank: r.value if r.ok else None for r in results}
        now = time.monotonic()
        silent: tuple[int, ...] = ()
        if beats is not None:  # another machine's records: ended by its exit record, or its counter still
            for rank, _ in nodes:
                beats.observe(rank, read_heartbeat(paths, rank), now)
            statuses, silent = beats.judge(statuses, now)
        if on_poll is not None:
            on_poll(statuses, now - t0)
        known = [s for s in statuses.values() if s is not None]
        gone = len(known) == len(statuses) and not any(s.alive for s in known)
        gone_since = (gone_since or now) if gone else None
        if gone and (all(s.exit for s in known) or now - gone_since > EXIT_RECORD_WAIT_S):
            if silent:  # its torchrun and ranks may outlive it: stopped from here, by their records and tags
                stop_run(launch, run)
            return RunEnd(statuses, silent=silent)
        unknown_since = (unknown_since or now) if len(known) < len(statuses) else None
        if unreachable_s is not None and unknown_since and now - unknown_since > unreachable_s:
            missing = tuple(rank for rank, s in statuses.items() if s is None)
            stop_run(launch, run)
            after = {r.node_rank: r.value if r.ok else None for r in node_statuses(launch, run, nodes, seq_length)}
            return RunEnd({**after, **{rank: None for rank in missing}})
        if timeout_s is not None and now - t0 > timeout_s:
            return None
        time.sleep(poll_s)


@dataclass(kw_only=True)
class SaveSignal:
    """While a start waits: SIGUSR1 to it, or the batch shell's mark file (``sbatch
    --signal=B:USR1@...`` before the time limit, or a preemption), asks every node to save and end
    (:func:`ask_to_save`, at the next poll: nothing is sent from inside the signal handler); a
    batch job is then requeued."""

    launch: LaunchEnv
    run: str
    nodes: Nodes
    mark: Path | None = None
    """The file the batch shell's trap writes on SIGUSR1."""
    received: bool = False
    sent: bool = False

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "received", True))

    def poll(self, statuses: Statuses | None = None, elapsed_s: float = 0.0) -> None:  # noqa: ARG002 (the interface's signature)
        if not self.received and self.mark is not None and self.mark.exists():
            self.received = True
        if self.received and not self.sent:  # asked again at the next poll until a supervisor has it
            self.sent = any(r.ok and r.value.ok for r in ask_to_save(self.launch, self.run, self.nodes))


def ask_to_save(launch: LaunchEnv, run: str, nodes: Nodes) -> list[NodeResult[SaveAsked]]:
    """Every node's supervisor asked (``node-save``: SIGUSR1) to have every node save at the next
    step and end: one that answers passes it on to all over the board."""
    return backend_for(launch, nodes).call(
        launch, nodes, lambda rank, host: node_call(SaveRequest(NodeTarget(run, rank, host, launch.artifact_root))), SaveAsked)


def save_and_wait(launch: LaunchEnv, run: str, only_this_node: bool, timeout_s: float) -> RunEnd | None:
    """``stop --save``: ask every node to save at the next step and end; wait for their ends."""
    nodes = nodes_of_run(launch, run, only_this_node)
    ask_to_save(launch, run, nodes)
    return wait_until_ended(launch, run, nodes, timeout_s=timeout_s)
