"""A start, in its steps: read the inputs, ask every node (the preflight), plan with the answers,
then execute exactly that plan's steps (each a Step object of runner/start_plan.py: prepare the
data, check Megatron-LM's arguments, write the parameters file, start every node through the
backend, cluster/backends.py), rolling back on a partial start.

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

from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, EXIT_OK
from orchestration.cluster.backends import backend_for
from orchestration.cluster.fanout import NodeResult
from orchestration.launch_env import LaunchEnv
from orchestration.megatron_lm.program import Verdicts
from orchestration.node.wire import NodeStarted, StopResult
from orchestration.runner.control import RunEnd, wait_until_ended
from orchestration.runner.preflight import Preflight, Problem, leave_out, run_preflight
from orchestration.runner.start_plan import StartInputs, StartPlan, Started, plan_start, read_start_inputs

log = logging.getLogger(__name__)


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

    @property
    def dry_run_exit_code(self) -> int:
        """Its dry run's: a refusal's, but 0 when a node did not answer (the plan is printed unsettled)."""
        return self.preflight.exit_code if self.preflight.answered else EXIT_OK


def plan_settled_start(launch: LaunchEnv, model: str, data: str, run: str, nodes: Sequence[tuple[int, str]]) -> PlannedStart:
    """Read, ask every node, plan with their answers (unsettled when a node did not answer); with
    NNODES=MIN:MAX (not inside Slurm, whose step runs on every node) the nodes the preflight refused
    are left out while enough are left (runner/preflight.py :func:`leave_out`)."""
    inputs = read_start_inputs(launch, model, data, run, nodes)
    t0 = time.monotonic()
    preflight = run_preflight(launch, inputs)
    log.debug("preflight of %d node(s): %.2f s, %d problem(s)", len(nodes), time.monotonic() - t0, len(preflight.problems))
    left_out: tuple[Problem, ...] = ()
    if not backend_for(launch, nodes).fixed_nodes:
        preflight, left_out = leave_out(preflight, launch.min_nodes, launch.nnodes)
    plan = plan_start(launch, inputs, preflight.answers, left_out=sorted({rank for rank, _, _ in left_out}))
    return PlannedStart(inputs, preflight, plan, left_out)


def run_checks(launch: LaunchEnv, planned: PlannedStart) -> tuple[str, ...]:
    """The plan's check steps (a dry run runs them too): their notes; a refusal is a UserError."""
    start = Started(launch=launch, plan=planned.plan, inputs=planned.inputs, data_ready=planned.inputs.data_ready)
    return tuple(note for step in planned.plan.steps if step.check for note in step.run(start))


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

    @property
    def exit_code(self) -> int:
        """0 started everywhere; the preflight's refusal (2, or 1 when a node did not answer); else 1."""
        return self.preflight.exit_code if self.refused else EXIT_OK if self.started else EXIT_NODE_FAILED

    def failure(self) -> str:
        """Why the start did not happen, in one line (the sweep's reason for a stage)."""
        if self.refused:
            return (f"preflight found {len(self.preflight.problems)} problem(s): "
                    + "; ".join(f"node{rank} {host}: {problem}" for rank, host, problem in self.preflight.problems))
        return "; ".join(r.describe_failure().replace("\n", " ") for r in self.nodes if not r.ok)


def start_run(launch: LaunchEnv, planned: PlannedStart, verdicts: Verdicts | None = None) -> StartResult:
    """Execute ``planned``: its steps in order; on a partial start the started nodes are stopped.
    ``verdicts``: Megatron-LM argument checks already run (a sweep's), which its check step takes."""
    plan = planned.plan
    if planned.refused:
        return StartResult(plan, planned.preflight)
    start = Started(launch=launch, plan=plan, inputs=planned.inputs, data_ready=planned.inputs.data_ready,
                    verdicts=dict(verdicts or {}))
    notes: tuple[str, ...] = ()
    for step in plan.steps:
        t0 = time.monotonic()
        notes += step.run(start)
        log.debug("step %s: %.2f s", step.name, time.monotonic() - t0)
    rolled_back: list[NodeResult[StopResult]] = []
    started = [(r.node_rank, r.host) for r in start.nodes if r.ok]
    if started and len(started) < len(start.nodes):
        rolled_back, _ = backend_for(launch, plan.node_hosts).stop(launch, plan.run, started)
    return StartResult(plan, planned.preflight, notes, tuple(start.nodes), tuple(rolled_back))


# -- train: one node in the foreground ---------------------------------------------------------------

FOLLOW_POLL_S = 0.2


def follow_until_ended(launch: LaunchEnv, plan: StartPlan, out: TextIO, log_offset: int) -> tuple[RunEnd, str | None]:
    """Copy this node's log to ``out`` from ``log_offset`` until its run ended; SIGINT, SIGTERM or
    SIGHUP stop the run (then the copy goes on until it has ended). (the run's end, the signal that
    stopped it, if one did)."""
    node = plan.nodes[0]
    log_path, nodes = Path(node.log_path), [(node.node_rank, node.host)]
    state = {"position": log_offset, "signal": None, "stopped": False}

    def copy_new(statuses=None, elapsed_s: float = 0.0) -> None:  # noqa: ARG001 (the interface's signature)
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
            backend_for(launch, nodes).stop(launch, plan.run, nodes)

    def on_signal(signum, _frame) -> None:
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
