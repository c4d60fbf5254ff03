"""How the launcher reaches a run's nodes: one class per backend, each with torchx's verbs (a
``Scheduler``'s ``dryrun`` / ``schedule`` / ``describe`` / ``cancel``): :meth:`~Backend.plan`
(one node command's argv, pure), ``start``, ``status`` and ``stop``.

    HOSTS=node0,node1 SSH_OPTS="-F cluster.cfg" python -m orchestration status demo

- :class:`ThisMachine`: every node is this machine; a node command is answered in the launcher's
  own process (no interpreter, no connection);
- :class:`Ssh`: ``ssh HOST -- 'cd CWD && exec env K=V ... ARGV'`` (this machine's nodes as above);
- :class:`DockerExec`: ``docker exec`` into CONTAINER_NAME, here or over ssh;
- :class:`Srun`: inside a Slurm allocation; the start is one srun step (a task per node), a status
  is read from the nodes' records, a stop also cancels the step of a node srun cannot reach.

:func:`backend_for` picks one. Argv lists are built with ``shlex.quote``; ``env`` (the forwarded
variables) goes into the argv, secrets never do: they travel on the command's standard input, which
ssh and ``docker exec -i`` pass on (``stdin=True`` asks for ``-i``), or in srun's inherited
environment. Side effects: the node commands, the srun step, scancel.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from typing import ClassVar, Mapping, NamedTuple, Sequence

from megatron_ext.host.json_files import SETTLE_S, SHARE_CACHE_S
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster import slurm
from orchestration.cluster.fanout import DEFAULT_NODE_TIMEOUT_S, NodeResult, call_nodes
from orchestration.launch_env import DEFAULT_SSH_CONNECT_TIMEOUT_S, LOCAL_HOSTS, LaunchEnv
from orchestration.node.local import answer_here
from orchestration.node.run_state import (AttemptRecord, RunState, read_exit, read_heartbeat, read_ledger, read_pid_file,
                                          wait_until_started, write_plan_file)
from orchestration.node.wire import (DEFAULT_STOP_GRACE_S, NodePlan, NodeStarted, NodeStatus, NodeTarget, StatusRequest,
                                     StopPreview, StopRequest, StopResult, decode_payload, node_call, start_call)

Nodes = Sequence[tuple[int, str]]
STATUS_TIMEOUT_S = 60.0
LOCAL_POLL_S = 1.0
REMOTE_POLL_S = 5.0
SRUN_START_SLACK_S = 30.0
"""The srun step's tasks placed and their Python started (beyond the waits :func:`srun_start_timeout_s` names)."""
CancelledStep = NamedTuple("CancelledStep", [("node_rank", int), ("host", str), ("step", str)])
"""A node srun could not reach at a stop, and its Slurm step (JOB.STEP), cancelled instead (:meth:`Srun.stop`)."""


def remote_shell_command(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """One quoted shell line: ``cd CWD && exec env K=V ... ARGV`` (for ssh)."""
    assignments = [f"{k}={v}" for k, v in env.items()]
    return f"cd {shlex.quote(cwd)} && exec env " + " ".join(shlex.quote(a) for a in [*assignments, *argv])


SSH_ALIVE = ("-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4")
"""A connection whose other end has not answered for a minute ends (a node cut off): a node command
without a deadline of its own (``node-start``, which waits as long as its supervisor makes progress)
never waits on a dead link."""


def ssh_argv(options: Sequence[str], host: str, line: str) -> list[str]:
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={DEFAULT_SSH_CONNECT_TIMEOUT_S}", *SSH_ALIVE, *options,
            host, "--", line]


def docker_exec_argv(container: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool) -> list[str]:
    flags: list[str] = [*(["-i"] if stdin else []), "-w", cwd]
    for k, v in env.items():
        flags += ["-e", f"{k}={v}"]
    return ["docker", "exec", *flags, container, *argv]


@dataclass(frozen=True)
class Backend:
    """What every backend does, and by default alike: each node command run on its node, every node
    at once (cluster/fanout.py); a backend says how a command reaches a host (:meth:`plan`)."""

    name: ClassVar[str]
    caller_sets_env: ClassVar[bool] = False
    """The caller applies ``env`` and ``cwd`` to the process it starts (else the argv carries them)."""
    fixed_nodes: ClassVar[bool] = False
    """The start runs on every node of an allocation at once: no node is left out or brought back."""
    records_only: ClassVar[bool] = False
    """A status is read from the nodes' records on the shared file system, not asked of each node."""

    def in_process(self, host: str) -> bool:  # noqa: ARG002 (the interface's signature)
        """The node command for ``host`` runs in the launcher's own process."""
        return False

    def plan(self, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:
        """What runs for a node command on ``host`` (its argv; with ``stdin``, the command reads it). Pure."""
        raise NotImplementedError

    def call(self, launch: LaunchEnv, nodes: Nodes, call_for, decode, timeout_s: float | None = DEFAULT_NODE_TIMEOUT_S) -> list:
        return call_nodes(self, launch, nodes, call_for, decode, timeout_s)

    def start(self, launch: LaunchEnv, plans: Sequence[NodePlan], paths: RunPaths) -> list[NodeResult[NodeStarted]]:
        """``node-start`` with each node's plan, every node of the first attempt at once; a node left
        out gets only its plan file (what ``rejoin`` sends it). No deadline here: each node's
        ``node-start`` waits as long as its supervisor names a step under way (node 0 reading a
        450 GB checkpoint, its share, before it chooses: minutes) and 31.5 s past its last sign
        (run_state.py ``wait_until_started``), and ssh ends a dead link (:data:`SSH_ALIVE`). A
        deadline of 120 s here ended a start over a 100 GB checkpoint (issue 54)."""
        by_rank = {p.node_rank: p for p in plans}
        first = set(plans[0].first_members) if plans and plans[0].first_members else set(by_rank)
        for p in plans:
            if p.node_rank not in first:
                write_plan_file(paths, p.node_rank, p.to_json())
        return self.call(launch, [(p.node_rank, p.host) for p in plans if p.node_rank in first],
                         lambda rank, host: start_call(by_rank[rank], launch.secrets), NodeStarted,  # noqa: ARG005 (the interface's signature)
                         timeout_s=None)

    def status(self, launch: LaunchEnv, run: str, nodes: Nodes, seq_length: int | None) -> list[NodeResult[NodeStatus]]:
        """Every node's status, asked of each node."""
        return self.call(launch, nodes, lambda rank, host: node_call(StatusRequest(NodeTarget(run, rank, host, launch.artifact_root),
                                                                                   seq_length)), NodeStatus, STATUS_TIMEOUT_S)

    def stop(self, launch: LaunchEnv, run: str, nodes: Nodes, grace_s: float = DEFAULT_STOP_GRACE_S,
             dry_run: bool = False) -> tuple[list[NodeResult], tuple[CancelledStep, ...]]:
        """``node-stop`` on every node at once (StopPreview each, in a dry run); (results, the steps cancelled for nodes not reached)."""
        return self.call(launch, nodes, lambda rank, host: node_call(StopRequest(NodeTarget(run, rank, host, launch.artifact_root),
                                                                                 grace_s, dry_run)),
                         StopPreview if dry_run else StopResult, timeout_s=grace_s + 60), ()

    def poll_s(self, nodes: Nodes) -> float:
        """How often a wait asks for statuses: every second where that costs no connection."""
        return LOCAL_POLL_S if all(self.in_process(host) for _, host in nodes) else REMOTE_POLL_S


@dataclass(frozen=True)
class ThisMachine(Backend):
    """Every node is this machine: each node command is a call in the launcher's own process."""

    name: ClassVar[str] = "this machine"
    caller_sets_env: ClassVar[bool] = True

    def in_process(self, host: str) -> bool:  # noqa: ARG002 (the interface's signature)
        return True

    def plan(self, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:  # noqa: ARG002 (the interface's signature)
        return list(argv)


@dataclass(frozen=True)
class Ssh(Backend):
    """``ssh HOST -- 'cd CWD && exec env K=V ... ARGV'`` with BatchMode and a connect timeout; a node
    that is this machine is answered in this process."""

    options: tuple[str, ...] = ()
    """SSH_OPTS: ``-F cfg``, ``-p 2222``, ..."""
    name: ClassVar[str] = "ssh"

    def in_process(self, host: str) -> bool:
        return host in LOCAL_HOSTS

    def plan(self, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:  # noqa: ARG002 (the interface's signature)
        return list(argv) if self.in_process(host) else ssh_argv(self.options, host, remote_shell_command(argv, env, cwd))


@dataclass(frozen=True)
class DockerExec(Backend):
    """``docker exec`` into ``container`` (``-i`` when the command reads its standard input), run here
    for this machine's nodes and over ssh for the others."""

    container: str = ""
    options: tuple[str, ...] = ()
    """SSH_OPTS, for the nodes reached over ssh."""
    name: ClassVar[str] = "docker exec"

    def plan(self, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:
        inner = docker_exec_argv(self.container, argv, env, cwd, stdin)
        return inner if host in LOCAL_HOSTS else ssh_argv(self.options, host, shlex.join(inner))


@dataclass(frozen=True)
class Srun(Backend):
    """Inside a Slurm allocation: a node command is one srun task on its node beside the steps
    running there (srun exports the caller's environment), in CONTAINER_NAME when set; the start is
    one srun step; a status is read from the nodes' records (no srun task per poll)."""

    job_id: str = ""
    container: str | None = None
    name: ClassVar[str] = "srun"
    caller_sets_env: ClassVar[bool] = True
    fixed_nodes: ClassVar[bool] = True
    records_only: ClassVar[bool] = True

    def plan(self, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:
        inner = docker_exec_argv(self.container, argv, env, cwd, stdin) if self.container else list(argv)
        return ["srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
                f"--chdir={cwd}", "--kill-on-bad-exit=1", "--quiet", *inner]

    def start(self, launch: LaunchEnv, plans: Sequence[NodePlan], paths: RunPaths) -> list[NodeResult[NodeStarted]]:
        """One srun step, a task per node, each the node's supervisor for the plan the launcher left in
        the node's plan file; the srun client runs detached here. A result per node once its torchrun
        runs (its pid file of this start, read here through the share), or the step ended, or the
        node's exit record of this start says it failed, or :func:`srun_start_timeout_s`."""
        for p in plans:
            write_plan_file(paths, p.node_rank, p.to_json())
        argv = slurm.srun_step_argv(self.job_id, len(plans), launch.python, launch.cwd, slurm.plan_file_pattern(paths))
        srun_log = paths.logs_dir / f"{paths.run}_srun.log"
        client = slurm.start_step(argv, launch.environ, launch.cwd, srun_log)
        timeout_s = max(map(srun_start_timeout_s, plans), default=0.0)
        deadline = time.monotonic() + timeout_s
        results = []
        for p in plans:
            wait = wait_until_started(paths, p.node_rank, p.pid_file, p.run_id, lambda: client.poll() is None,
                                      timeout_s=max(0.0, deadline - time.monotonic()))
            value, error = None, None
            if wait.started:
                r = wait.record
                value = NodeStarted(node_rank=p.node_rank, host=p.host, pid=r.pid, pgid=r.pgid, supervisor_pid=r.supervisor_pid or 0,
                                    log=p.log_path, run_id=p.run_id)
            else:
                ended = wait.ended or read_exit(paths, p.node_rank, p.run_id)
                why = ended.reason if ended else f"srun exited with {client.returncode}" if client.poll() is not None else \
                    f"no pid file of this start within {timeout_s:.0f} s (its supervisor neither started torchrun nor said why)"
                error = f"{why}; see {srun_log} and {p.log_path}"
            results.append(NodeResult(node_rank=p.node_rank, host=p.host, argv=argv, returncode=0 if value else 1, value=value,
                                      error=error, output=""))
        return results

    def status(self, launch: LaunchEnv, run: str, nodes: Nodes, seq_length: int | None) -> list[NodeResult[NodeStatus]]:
        return statuses_from_records(launch, run, nodes, seq_length)

    def stop(self, launch: LaunchEnv, run: str, nodes: Nodes, grace_s: float = DEFAULT_STOP_GRACE_S,
             dry_run: bool = False) -> tuple[list[NodeResult], tuple[CancelledStep, ...]]:
        """``node-stop`` as srun tasks; a node srun could not reach gets its step cancelled instead."""
        results, _ = super().stop(launch, run, nodes, grace_s, dry_run)
        paths, cancelled = RunPaths(launch.artifact_root, run), []
        for r in results if not dry_run else ():
            record = read_pid_file(paths.node_pid_file(r.node_rank))
            if not r.ok and record and record.slurm_step and slurm.cancel_step(record.slurm_step):
                cancelled.append(CancelledStep(r.node_rank, r.host, record.slurm_step))
        return results, tuple(cancelled)

    def poll_s(self, nodes: Nodes) -> float:  # noqa: ARG002 (the interface's signature)
        return LOCAL_POLL_S


def srun_start_timeout_s(plan: NodePlan) -> float:
    """How long the srun start waits, by this machine's clock, for the nodes' pid files of this
    start: each task's plan seen through the share (SETTLE_S), the supervisors meeting at node 0's
    store and (Megatron-LM) waiting for node 0's choice of checkpoint (``join_s`` each, their own
    deadlines), then the pid file seen here through the share (SHARE_CACHE_S), and
    SRUN_START_SLACK_S. A node that fails sooner says so (its exit record, or the step's end)."""
    waits = 2 if plan.checkpoint_choice is not None else 1
    return SETTLE_S + waits * plan.resilience.join_s + SHARE_CACHE_S + SRUN_START_SLACK_S


def backend_for(launch: LaunchEnv, nodes: Nodes = ()) -> Backend:
    """How this machine reaches ``nodes`` ((rank, host) pairs; default HOSTS): srun inside an
    allocation (LAUNCHER_TRANSPORT), else docker exec with CONTAINER_NAME, else this machine when
    every host is, else ssh."""
    hosts = [host for _, host in nodes] or launch.hosts
    if launch.use_srun:
        return Srun(job_id=launch.slurm_job_id or "", container=launch.container_name)
    if launch.container_name:
        return DockerExec(container=launch.container_name, options=launch.ssh_opts)
    if all(host in LOCAL_HOSTS for host in hosts):
        return ThisMachine()
    return Ssh(options=launch.ssh_opts)


# -- status from the records -----------------------------------------------------------------------

def statuses_from_records(launch: LaunchEnv, run: str, nodes: Nodes, seq_length: int | None) -> list[NodeResult[NodeStatus]]:
    """Every node's status read in this process from the shared run_state files of the run's latest
    start (alive = its supervisor's heartbeat record is there and its exit record is not; whether
    that record still changes, a wait judges: runner/record_beats.py); a node the ledger lost wrote
    none to say it ended: lost."""
    paths = RunPaths(launch.artifact_root, run)
    run_id = this_start_run_id(paths)
    lost = lost_nodes(paths, this_start_ledger(paths, run_id))
    results = []
    for rank, host in nodes:
        if rank in lost:
            results.append(lost_node(rank, host, lost[rank]))
            continue
        request = StatusRequest(NodeTarget(run, rank, host, launch.artifact_root), seq_length, by_heartbeat=True, run_id=run_id)
        code, line = answer_here(node_call(request), launch.environ)
        value = decode_payload(NodeStatus, json.loads(line)) if code == 0 else None
        results.append(NodeResult(node_rank=rank, host=host, argv=[], returncode=code, value=value,
                                  error=None if value else line, output=""))
    return results


def this_start_run_id(paths: RunPaths) -> str | None:
    """The run id of the run's latest start (its resolved parameters'), or None."""
    resolved = read_resolved(paths.params_path)
    return resolved.runtime.run_id if resolved else None


def this_start_ledger(paths: RunPaths, run_id: str | None = None) -> list[AttemptRecord]:
    """The ledger's attempts of the run's latest start (``run_id``, default its resolved parameters')."""
    run_id = run_id or this_start_run_id(paths)
    return [r for r in read_ledger(paths) if run_id and r.run_id == run_id]


def lost_nodes(paths: RunPaths, this_start: Sequence[AttemptRecord] | None = None) -> dict[int, AttemptRecord]:
    """The nodes the run lost and has not taken back (none of its later attempts ran on them),
    each with the attempt that lost it; a node brought back and ``joining`` (its heartbeat record
    says so) is not among them."""
    out: dict[int, AttemptRecord] = {}
    for record in this_start_ledger(paths) if this_start is None else this_start:
        out = {n: r for n, r in out.items() if n not in record.nodes}
        out.update({n: record for n in record.lost})
    joining = {n for n in out if (beat := read_heartbeat(paths, n)) and beat.state == RunState.JOINING}
    return {n: r for n, r in out.items() if n not in joining}


def lost_node(rank: int, host: str, record: AttemptRecord) -> NodeResult[NodeStatus]:
    """A node the ledger says was lost, as its status (no connection is tried)."""
    why = f"lost in attempt {record.attempt}: {record.reason or 'its machine or supervisor was gone'}"
    status = NodeStatus(node_rank=rank, host=host, alive=False, state=RunState.LOST, exit=why, run_failure=None, pid=None,
                        last_iteration=None, train_iters=None, tokens_per_s=None, last_line=why[:160], log="")
    return NodeResult(node_rank=rank, host=host, argv=[], returncode=0, value=status, error=None, output="")
