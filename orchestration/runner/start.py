"""Execute a start plan: preflight on every node, settle the port and interfaces, start every node
(ssh / docker exec, or one srun step inside a Slurm allocation), roll back on a failure.

    HOSTS=node0,node1 python -m orchestration start gpt_smoke smoke demo

:func:`start_run` takes the :class:`~orchestration.runner.start_plan.StartPlan` that
:func:`~orchestration.runner.start_plan.plan_start` built (and a dry run printed) and returns a
:class:`StartResult`; it prints nothing (the CLI does, the sweep reads the result). Side
effects: the node commands, the run's resolved-parameters file, the srun client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from megatron_ext.run_spec.resolved import write_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.wandb_run import WandbState, read_wandb_state, write_wandb_state
from orchestration.cluster import slurm
from orchestration.cluster.fanout import NodeResult, call_nodes
from orchestration.launch_env import LaunchEnv
from orchestration.node import processes
from orchestration.node.attempts import reset_attempts
from orchestration.node.commands import NodeStarted
from orchestration.node.node_plan import start_call, stop_call
from orchestration.node.processes import StopResult
from orchestration.node.run_state import clear_failure, read_exit, write_plan_file
from orchestration.runner.preflight import Preflight, run_preflight, settle_after_preflight
from orchestration.runner.start_plan import StartPlan

SRUN_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StartResult:
    plan: StartPlan
    """As executed: MASTER_PORT and the interfaces settled by the preflight."""
    launch: LaunchEnv
    preflight: Preflight
    notes: tuple[str, ...] = ()
    """What the preflight decided (port, interfaces)."""
    nodes: tuple[NodeResult[NodeStarted], ...] = ()
    """Every node's start (empty when the preflight refused)."""
    rolled_back: tuple[NodeResult[StopResult], ...] = ()
    """The nodes that did start and were stopped again because another did not."""

    @property
    def refused(self) -> bool:
        """The preflight found problems: nothing was started."""
        return bool(self.preflight.problems)

    @property
    def started(self) -> bool:
        return not self.refused and all(r.ok for r in self.nodes)

    def failure(self) -> str:
        """Why the start did not happen, in one line (the sweep's reason for a stage)."""
        if self.refused:
            return (f"preflight found {len(self.preflight.problems)} problem(s): "
                    + "; ".join(f"node{rank} {host}: {problem}" for rank, host, problem in self.preflight.problems))
        return "; ".join(r.describe_failure().replace("\n", " ") for r in self.nodes if not r.ok)


def start_run(launch: LaunchEnv, plan: StartPlan, nodes: Sequence[tuple[int, str]]) -> StartResult:
    """Preflight, then every node of ``plan`` started; on a partial start the started nodes are stopped."""
    preflight = run_preflight(launch, plan, nodes)
    if preflight.problems:
        return StartResult(plan, launch, preflight)
    launch, plan, notes = settle_after_preflight(launch, plan, preflight.reports)
    paths = RunPaths(launch.artifact_root, plan.run)
    write_resolved(paths.params_path, plan.resolved)
    wandb_id = plan.program.env.get("WANDB_RUN_ID") if plan.program else None  # Megatron-LM with WANDB_PROJECT
    if wandb_id and read_wandb_state(paths) is None:
        write_wandb_state(paths, WandbState(wandb_id))
    clear_failure(paths)  # a new start begins without the last one's failure and attempts
    reset_attempts(paths, keep_ledger=plan.continues_attempts)
    if launch.transport == "srun":
        results = start_srun_step(launch, plan, paths)
    else:
        by_rank = {p.node_rank: p for p in plan.nodes}
        results = call_nodes(launch, nodes, lambda rank, host: start_call(by_rank[rank], launch.secrets),
                             NodeStarted)
    rolled_back: list[NodeResult[StopResult]] = []
    if not all(r.ok for r in results):
        started = [(r.node_rank, r.host) for r in results if r.ok]
        if started:
            rolled_back = call_nodes(launch, started, lambda rank, host: stop_call(plan.run, rank, host, launch.artifact_root),
                                     StopResult)
    return StartResult(plan, launch, preflight, tuple(notes), tuple(results), tuple(rolled_back))


def start_srun_step(launch: LaunchEnv, plan: StartPlan, paths: RunPaths) -> list[NodeResult[NodeStarted]]:
    """Inside a Slurm allocation: one srun step, a task per node, each the node's supervisor; the
    srun client runs detached here. A result per node once its torchrun runs (or the step ended)."""
    for node_plan in plan.nodes:
        write_plan_file(paths, node_plan.node_rank, node_plan.to_json(), node_plan.pid_file)
    argv = slurm.srun_step_argv(launch.slurm_job_id, launch.nnodes, launch.python, launch.cwd,
                                slurm.plan_file_pattern(paths))
    srun_log = paths.logs_dir / f"{plan.run}_srun.log"
    client = processes.start_detached(argv, launch.environ, launch.cwd, srun_log)
    deadline = time.monotonic() + SRUN_START_TIMEOUT_S
    results = []
    for node_plan in plan.nodes:
        rank, pid_path = node_plan.node_rank, node_plan.pid_file
        while not pid_path.exists() and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        record, ended = processes.read_pid_file(pid_path), read_exit(paths, rank)
        if record and not (ended and ended.state.failed):
            started = NodeStarted(rank, node_plan.host, record.pid, record.pgid, record.supervisor_pid or 0,
                                  node_plan.log_path, plan.run_id)
            results.append(NodeResult(rank, node_plan.host, argv, 0, started, None, ""))
        else:
            why = ended.reason if ended else f"srun exited with {client.returncode}" if client.poll() is not None else "no answer"
            results.append(NodeResult(rank, node_plan.host, argv, 1, None, f"{why}; see {srun_log} and {node_plan.log_path}", ""))
    return results
