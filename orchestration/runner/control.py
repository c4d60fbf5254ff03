"""A started run: stop it, ask how it stands, wait for its end.

    python -m orchestration stop demo                 # every node (HOSTS, else the hosts its start recorded)
    DRY_RUN=1 python -m orchestration stop demo       # what each node would signal; signals nothing
    python -m orchestration status demo

:func:`stop_run` and :func:`collect_status` return typed results the CLI prints and the sweep
reads. A run submitted as a Slurm batch job is cancelled / asked through Slurm; ``stop PREFIX``
of a live ZeRO sweep asks the sweep to stop and stops its current stage. Side effects: the node
commands, Slurm's commands, the sweep's stop file.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster import slurm
from orchestration.cluster.fanout import NodeResult, call_nodes
from orchestration.cluster.transports import is_this_machine
from orchestration.launch_env import LaunchEnv
from orchestration.node import processes
from orchestration.node.attempts import AttemptRecord, read_ledger
from orchestration.node.commands import NodeStatus, node_status
from orchestration.node.node_plan import DEFAULT_STOP_GRACE_S, status_call, stop_call
from orchestration.node.processes import StopPreview, StopResult
from orchestration.node.run_state import (NodeExit, SweepRecord, read_exit, read_sweep_record, request_save,
                                          request_sweep_stop)

STATUS_TIMEOUT_S = 60.0


def this_node(launch: LaunchEnv) -> list[tuple[int, str]]:
    return [(launch.node_rank, "localhost")]


def start_nodes(launch: LaunchEnv, only_this_node: bool) -> list[tuple[int, str]]:
    """The nodes a start reaches: this one (``--this-node``), or every host."""
    return this_node(launch) if only_this_node else list(enumerate(launch.hosts))


def run_nodes(launch: LaunchEnv, run: str, only_this_node: bool) -> list[tuple[int, str]]:
    """The nodes a run lives on: HOSTS/HOSTFILE when given, else the hosts its start recorded."""
    if not only_this_node and not launch.hosts_explicit:
        resolved = read_resolved(RunPaths(launch.artifact_root, run).params_path)
        if resolved is not None:
            return list(enumerate(resolved.runtime.hosts))
    return start_nodes(launch, only_this_node)


def batch_job_of(launch: LaunchEnv, run: str, only_this_node: bool) -> str | None:
    """The Slurm batch job ``submit`` recorded for ``run``, when this command is not inside it."""
    job = None if only_this_node or launch.hosts_explicit else slurm.recorded_job(RunPaths(launch.artifact_root, run))
    return job if job and job != launch.slurm_job_id else None


# -- stop -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StopOutcome:
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
    cancelled_steps: tuple[tuple[int, str, str], ...] = ()
    """(node rank, host, JOB.STEP) cancelled for nodes srun could not reach."""

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
        return StopOutcome(run, dry_run, job=job, job_state=None if dry_run else slurm.cancel(job))
    sweep = read_sweep_record(launch.artifact_root, run)
    if sweep is not None and not sweep.ended:
        if not dry_run:
            request_sweep_stop(launch.artifact_root, run, f"stop {run}")
        stage = stop_run(launch, sweep.current_run, only_this_node, grace_s, dry_run) if sweep.current_run else None
        return StopOutcome(run, dry_run, sweep=sweep, stage=stage)
    results = call_nodes(launch, run_nodes(launch, run, only_this_node),
                         lambda rank, host: stop_call(run, rank, host, launch.artifact_root, grace_s, dry_run),
                         StopPreview if dry_run else StopResult, timeout_s=grace_s + 60)
    cancelled = []
    if launch.transport == "srun" and not dry_run:  # a node srun could not reach: cancel its step instead
        paths = RunPaths(launch.artifact_root, run)
        for r in results:
            record = processes.read_pid_file(paths.node_pid_file(r.node_rank))
            if not r.ok and record and record.slurm_step and slurm.cancel_step(record.slurm_step):
                cancelled.append((r.node_rank, r.host, record.slurm_step))
    return StopOutcome(run, dry_run, nodes=tuple(results), cancelled_steps=tuple(cancelled))


# -- status ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StatusReport:
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
        """The run's first failure (any node's failure file line)."""
        return next((r.value.run_failure for r in self.nodes if r.ok and r.value.run_failure), None)


def _local_result(rank: int, host: str, status: NodeStatus) -> NodeResult[NodeStatus]:
    return NodeResult(rank, host, [], 0, status, None, "")


def node_statuses(launch: LaunchEnv, run: str, nodes: Sequence[tuple[int, str]],
                  seq_length: int | None) -> list[NodeResult[NodeStatus]]:
    """Every node's status: in this process for this machine's nodes, else through the node command."""
    paths = RunPaths(launch.artifact_root, run)
    here = {rank: _local_result(rank, host, node_status(paths, rank, host, seq_length))
            for rank, host in nodes if is_this_machine(launch, host)}
    remote = [(rank, host) for rank, host in nodes if rank not in here]
    there = {r.node_rank: r for r in call_nodes(launch, remote, lambda rank, host: status_call(
        run, rank, host, launch.artifact_root, seq_length), NodeStatus, STATUS_TIMEOUT_S)} if remote else {}
    return [here.get(rank) or there[rank] for rank, _ in nodes]


def collect_status(launch: LaunchEnv, run: str, only_this_node: bool = False) -> StatusReport:
    paths = RunPaths(launch.artifact_root, run)
    resolved = read_resolved(paths.params_path)
    seq = resolved.params.training.seq_length if resolved else None
    ledger = tuple(read_ledger(paths))
    this_start = [r for r in ledger if resolved and r.run_id == resolved.runtime.run_id]
    max_attempts = (this_start[0].attempt + resolved.params.training.resilience.max_restarts) if this_start else None
    job = batch_job_of(launch, run, only_this_node)
    if job:  # a batch job, seen from outside it: its state, and each node from the shared run_state files
        state = slurm.job_state(job)
        hosts = resolved.runtime.hosts if resolved and state != "PENDING" else ()
        nodes = tuple(_local_result(rank, host, node_status(paths, rank, host, seq, by_heartbeat=True))
                      for rank, host in enumerate(hosts))
        return StatusReport(run, nodes, job, state, ledger, max_attempts)
    return StatusReport(run, tuple(node_statuses(launch, run, run_nodes(launch, run, only_this_node), seq)),
                        attempts=ledger, max_attempts=max_attempts)


# -- the end --------------------------------------------------------------------------------------

@dataclass
class SaveSignal:
    """While a start waits: SIGUSR1 to it, or the batch shell's mark file (``sbatch
    --signal=B:USR1@...`` before the time limit, or a preemption), asks every node to save and end;
    a batch job is then requeued."""

    paths: RunPaths
    mark: Path | None = None
    """The file the batch shell's trap writes on SIGUSR1."""
    received: bool = False

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, lambda signum, frame: self._request("SIGUSR1 to the waiting start"))

    def poll(self) -> None:
        if not self.received and self.mark is not None and self.mark.exists():
            self._request("SIGUSR1 to the batch job (its time limit or a preemption is near)")

    def _request(self, why: str) -> None:
        self.received = True
        request_save(self.paths, why)


def wait_for_end(paths: RunPaths, ranks: Sequence[int], poll_s: float = 2.0, timeout_s: float | None = None,
                 on_poll: Callable[[], None] | None = None) -> list[NodeExit] | None:
    """Block until every node recorded how it ended (``start --wait``, batch jobs, ``stop --save``);
    None after ``timeout_s``. ``on_poll`` runs at every poll."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if on_poll is not None:
            on_poll()
        ended = [read_exit(paths, rank) for rank in ranks]
        if all(ended):
            return ended
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def save_and_wait(launch: LaunchEnv, run: str, only_this_node: bool, timeout_s: float) -> list[NodeExit] | None:
    """``stop --save``: ask every node to save at the next step and end; wait for their ends."""
    paths = RunPaths(launch.artifact_root, run)
    request_save(paths, "stop --save")
    return wait_for_end(paths, [rank for rank, _ in run_nodes(launch, run, only_this_node)], 1.0, timeout_s)
