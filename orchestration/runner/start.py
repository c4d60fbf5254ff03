"""A start, in its steps: read the inputs, ask every node (the preflight), plan with the answers,
then execute exactly that plan's steps (prepare the data, check Megatron-LM's arguments, write the
parameters file, start every node: ssh / docker exec, or one srun step inside a Slurm allocation),
rolling back on a partial start.

    HOSTS=node0,node1 python -m orchestration start gpt_smoke smoke demo
    DRY_RUN=1 HOSTS=node0,node1 python -m orchestration start gpt_smoke smoke demo   # the same plan, printed

:func:`plan_settled_start` is what a start and its dry run share (the dry run stops there, after
the checks); :func:`start_run` executes the plan and returns a :class:`StartResult`; nothing here
prints (the CLI does, the sweep reads the result). Side effects: the node commands, the steps.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

from megatron_ext.run_spec.resolved import write_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.wandb_run import WandbState, read_wandb_state, write_wandb_state
from orchestration.cluster import slurm
from orchestration.cluster.fanout import NodeResult, call_nodes
from orchestration.launch_env import LaunchEnv
from orchestration.megatron_lm.dataset_helpers import ensure_built
from orchestration.megatron_lm.program import BUILD_HELPERS, CHECK_ARGUMENTS, check_arguments
from orchestration.node.run_state import read_exit, wait_until_started, write_plan_file
from orchestration.node.wire import NodeStarted, StopResult, start_call
from orchestration.runner.control import RunEnd, stop_nodes, wait_until_ended
from orchestration.runner.preflight import Preflight, Problem, leave_out, run_preflight
from orchestration.runner.start_plan import StartInputs, StartPlan, checkpoint_target, plan_start, read_start_inputs

log = logging.getLogger(__name__)

SRUN_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PlannedStart:
    """A start planned with the nodes' answers (what its dry run prints)."""

    inputs: StartInputs
    preflight: Preflight
    plan: StartPlan
    left_out: tuple[Problem, ...] = ()
    """NNODES=MIN:MAX: the problems of the nodes the start leaves out (the run goes on without them)."""

    @property
    def refused(self) -> bool:
        """The preflight found problems: a start starts nothing."""
        return bool(self.preflight.problems)


def plan_settled_start(launch: LaunchEnv, model: str, data: str, run: str, nodes: Sequence[tuple[int, str]]) -> PlannedStart:
    """Read, ask every node, plan with their answers (unsettled when a node did not answer); with
    NNODES=MIN:MAX (not inside Slurm, whose step runs on every node) the nodes the preflight refused
    are left out while enough are left (runner/preflight.py :func:`leave_out`)."""
    inputs = read_start_inputs(launch, model, data, run, nodes)
    t0 = time.monotonic()
    preflight = run_preflight(launch, inputs)
    log.debug("preflight of %d node(s): %.2f s, %d problem(s)", len(nodes), time.monotonic() - t0, len(preflight.problems))
    left_out: tuple[Problem, ...] = ()
    if not launch.use_srun:
        preflight, left_out = leave_out(preflight, launch.min_nodes, launch.nnodes)
    plan = plan_start(launch, inputs, preflight.answers, left_out=sorted({rank for rank, _, _ in left_out}))
    return PlannedStart(inputs, preflight, plan, left_out)


def run_checks(launch: LaunchEnv, planned: PlannedStart) -> tuple[str, ...]:
    """The plan's check steps (a dry run runs them too): their notes; a refusal is a UserError."""
    notes: list[str] = []
    for step in planned.plan.steps:
        if step.check and step.name == CHECK_ARGUMENTS:
            notes += _check_arguments(launch, planned.plan, planned.inputs, planned.inputs.data_ready)
    return tuple(notes)


def _check_arguments(launch: LaunchEnv, plan: StartPlan, inputs: StartInputs, data_ready: bool) -> tuple[str, ...]:
    return check_arguments(plan.program, launch, inputs.checkout, inputs.params.data.tokenizer.model_path, data_ready)


@dataclass(frozen=True)
class StartResult:
    plan: StartPlan
    preflight: Preflight
    notes: tuple[str, ...] = ()
    """What the checks said."""
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


def start_run(launch: LaunchEnv, planned: PlannedStart) -> StartResult:
    """Execute ``planned``: its steps in order; on a partial start the started nodes are stopped."""
    plan = planned.plan
    if planned.refused:
        return StartResult(plan, planned.preflight)
    paths = RunPaths(launch.artifact_root, plan.run)
    notes: tuple[str, ...] = ()
    results: list[NodeResult[NodeStarted]] = []
    data_ready = planned.inputs.data_ready
    for step in plan.steps:
        t0 = time.monotonic()
        if step.name == "prepare-data":
            from megatron_ext.data.prepare import ensure_prepared

            ensure_prepared(planned.inputs.params.data, paths.data_cache_dir)
            data_ready = True
        elif step.name == CHECK_ARGUMENTS:
            notes += _check_arguments(launch, plan, planned.inputs, data_ready)
        elif step.name == BUILD_HELPERS:
            notes += (ensure_built(planned.inputs.checkout.root, launch.python),)
        elif step.name == "link-checkpoints":
            target = checkpoint_target(launch, plan.run)
            target.mkdir(parents=True, exist_ok=True)
            paths.run_dir.mkdir(parents=True, exist_ok=True)
            if paths.checkpoints_dir.is_dir() and not paths.checkpoints_dir.is_symlink():
                paths.checkpoints_dir.rmdir()  # empty (checked when the plan was made)
            paths.checkpoints_dir.symlink_to(target, target_is_directory=True)
        elif step.name == "write-params":
            write_resolved(paths.params_path, plan.resolved)
            wandb_id = plan.program.env.get("WANDB_RUN_ID") if plan.program else None  # Megatron-LM with WANDB_PROJECT
            if wandb_id and read_wandb_state(paths) is None:
                write_wandb_state(paths, WandbState(wandb_id))
        elif step.name == "start-nodes":
            results = start_srun_step(launch, plan, paths) if launch.use_srun else start_nodes(launch, plan, paths)
        log.debug("step %s: %.2f s", step.name, time.monotonic() - t0)
    rolled_back: list[NodeResult[StopResult]] = []
    if not all(r.ok for r in results):
        started = [(r.node_rank, r.host) for r in results if r.ok]
        if started:
            rolled_back = stop_nodes(launch, plan.run, started)
    return StartResult(plan, planned.preflight, notes, tuple(results), tuple(rolled_back))


def start_nodes(launch: LaunchEnv, plan: StartPlan, paths: RunPaths) -> list[NodeResult[NodeStarted]]:
    """``node-start`` with each node's plan, every node of the first attempt at once (this
    machine's in this process); a node left out gets only its plan file (what ``rejoin`` sends it)."""
    by_rank = {p.node_rank: p for p in plan.nodes}
    first = set(plan.nodes[0].first_members) if plan.nodes and plan.nodes[0].first_members else set(by_rank)
    for node_plan in plan.nodes:
        if node_plan.node_rank not in first:
            write_plan_file(paths, node_plan.node_rank, node_plan.to_json())
    return call_nodes(launch, [(p.node_rank, p.host) for p in plan.nodes if p.node_rank in first],
                      lambda rank, host: start_call(by_rank[rank], launch.secrets), NodeStarted)


def start_srun_step(launch: LaunchEnv, plan: StartPlan, paths: RunPaths) -> list[NodeResult[NodeStarted]]:
    """Inside a Slurm allocation: one srun step, a task per node, each the node's supervisor for
    the plan the launcher left in the node's plan file; the srun client runs detached here. A result
    per node once its torchrun runs (or the step ended)."""
    for node_plan in plan.nodes:
        write_plan_file(paths, node_plan.node_rank, node_plan.to_json())
    argv = slurm.srun_step_argv(launch.slurm_job_id, launch.nnodes, launch.python, launch.cwd,
                                slurm.plan_file_pattern(paths))
    srun_log = paths.logs_dir / f"{plan.run}_srun.log"
    client = slurm.start_step(argv, launch.environ, launch.cwd, srun_log)
    deadline = time.monotonic() + SRUN_START_TIMEOUT_S
    results = []
    for node_plan in plan.nodes:
        rank = node_plan.node_rank
        wait = wait_until_started(paths, rank, node_plan.pid_file, plan.run_id, lambda: client.poll() is None,
                                  timeout_s=max(0.0, deadline - time.monotonic()))
        if wait.started:
            r = wait.record
            started = NodeStarted(node_rank=rank, host=node_plan.host, pid=r.pid, pgid=r.pgid, supervisor_pid=r.supervisor_pid or 0, log=node_plan.log_path, run_id=plan.run_id)
            results.append(NodeResult(node_rank=rank, host=node_plan.host, argv=argv, returncode=0, value=started, error=None, output=""))
        else:
            ended = wait.ended or read_exit(paths, rank, plan.run_id)
            why = ended.reason if ended else f"srun exited with {client.returncode}" if client.poll() is not None else "no answer"
            results.append(NodeResult(node_rank=rank, host=node_plan.host, argv=argv, returncode=1, value=None, error=f"{why}; see {srun_log} and {node_plan.log_path}", output=""))
    return results


# -- train: one node in the foreground ---------------------------------------------------------------

FOLLOW_POLL_S = 0.2


def follow_until_ended(launch: LaunchEnv, plan: StartPlan, out: TextIO, log_offset: int) -> tuple[RunEnd, str | None]:
    """Copy this node's log to ``out`` from ``log_offset`` until its run ended; SIGINT, SIGTERM or
    SIGHUP stop the run (then the copy goes on until it has ended). (the run's end, the signal that
    stopped it, if one did)."""
    node = plan.nodes[0]
    log_path, nodes = Path(node.log_path), [(node.node_rank, node.host)]
    state = {"position": log_offset, "signal": None, "stopped": False}

    def copy_new(statuses=None, elapsed_s: float = 0.0) -> None:
        try:
            with open(log_path, "rb") as fh:
                fh.seek(state["position"])
                chunk = fh.read()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            state["position"] += len(chunk)
            out.write(chunk.decode(errors="replace"))
            out.flush()
        if state["signal"] and not state["stopped"]:
            state["stopped"] = True
            out.write(f"\n{state['signal']}: stopping run {plan.run} ...\n")
            out.flush()
            stop_nodes(launch, plan.run, nodes)

    def on_signal(signum, frame) -> None:
        state["signal"] = state["signal"] or signal.Signals(signum).name

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        end = wait_until_ended(launch, plan.run, nodes, poll_s=FOLLOW_POLL_S, on_poll=copy_new)
        copy_new()
        return end, state["signal"]
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def log_size(plan: StartPlan) -> int:
    """Where this start's lines will begin in the node log (it keeps every start's lines)."""
    try:
        return os.path.getsize(plan.nodes[0].log_path)
    except OSError:
        return 0
