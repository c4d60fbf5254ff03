"""What runs on one node: check, start, supervise, stop and report a run there; the node side's edge.

    python -m orchestration node-status --request '{"target": {"run": "demo", "node_rank": 0, "host": "localhost",
        "artifact_root": "/shared/runs"}}'

Called locally, over ssh, through ``docker exec`` or as an srun task by the launcher, or as a
Kubernetes pod's main process (``node-pod``: orchestration/node/pod.py), with everything it needs
in its one typed request (orchestration/node/wire.py: the run and node, or a node's whole
:class:`~orchestration.node.wire.NodePlan`): it reads no launcher variable. :func:`main` is the
one dispatcher of every node command and the node side's only reader of its environment
(:class:`NodeEnv`: the variables handed on to torchrun, Slurm's task variables, the GPUs it shows)
and of its standard input (``node-start``: the values of the plan's secret variables, one JSON
line, put into the supervisor's environment only). Each command prints one JSON line: its payload
dataclass, or ``{"error": ...}`` (exit 2 for bad input, 1 for a node failure). Imports nothing of
the launcher side.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from megatron_ext.host.devices import visible_gpu_count
from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, EXIT_OK, EXIT_USER_ERROR, UserError
from megatron_ext.run_spec.engines import MEGATRON_CORE, Engine, engine_named
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED
from megatron_ext.host.json_files import SETTLE_S, read_json_settled
from megatron_ext.run_spec.resilience import SLOW_RANK_CLEARED, SLOW_RANK_WARNING
from megatron_ext.run_spec.run_paths import RunPaths, check_run_name
from orchestration.node import processes
from orchestration.node.failure import failure_reason
from orchestration.node.pod import run_pod
from orchestration.node.run_state import (RunState, read_exit, read_failure, read_heartbeat, read_pid_file, reset_node_files,
                                          reset_run_files, stop_command, tail, wait_until_started, write_plan_file)
from orchestration.node.supervisor import Supervisor
from orchestration.node.wire import (NODE_REQUESTS, RUN_ID_TAG, SUPERVISE_COMMAND, LinktestRequest, NodeCheckRequest, NodePlan,
                                     NodeStarted, NodeStatus, NodeTarget, SaveRequest, StatusRequest, StopRequest, decode_payload,
                                     decode_request, decode_secrets, encode_error, encode_payload, supervise_argv)

log = logging.getLogger(__name__)

START_SETTLE_S = 1.5
"""How long node-start watches torchrun before reporting it started (catches instant failures)."""
START_TIMEOUT_S = 30.0
"""How long node-start waits for the supervisor to start torchrun; a supervisor that says in its
heartbeat record that a step before torchrun is under way (node 0 reading a large checkpoint through
before it chooses, the others waiting for that choice) and keeps the record moving is waited for as
long as it does, this long from its last beat (run_state.py ``wait_until_started``)."""


class NodeError(RuntimeError):
    """A node-side failure that is not the user's input (process died, file problem)."""


@dataclass(frozen=True)
class NodeEnv:
    """The node side's environment, read once by :func:`main`."""

    environ: dict[str, str] = field(default_factory=dict)
    """Everything, handed on to torchrun under the plan's variables."""
    visible_gpus: int = 0
    slurm_nodeid: str | None = None
    """SLURM_NODEID: which node's plan a task of the srun start step runs."""
    slurm_step: str | None = None
    """JOB.STEP when this is a task of a Slurm step."""

    @property
    def run_id(self) -> str | None:
        return self.environ.get(RUN_ID_TAG)


def configure_node_logging(level: str) -> None:
    """The node side's logging: plain lines on standard error (which a supervisor's node log
    holds); LOG_LEVEL, forwarded from the launcher, sets the level (default INFO)."""
    logging.basicConfig(level=level.strip().upper() if level.strip().upper() in logging.getLevelNamesMapping() else "INFO",
                        format="%(message)s", stream=sys.stderr)


def read_node_env(env: Mapping[str, str]) -> NodeEnv:
    step = f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}" if "SLURM_STEP_ID" in env and "SLURM_JOB_ID" in env else None
    return NodeEnv(dict(env), visible_gpu_count(env), env.get("SLURM_NODEID"), step)


# -- the commands ---------------------------------------------------------------------------------

def refuse_if_running(target: NodeTarget) -> None:
    record = read_pid_file(processes.pid_path(target))
    if record and processes.record_is_alive(record):
        run = target.run
        raise UserError(
            f"run {run!r} is already running on node {target.node_rank} (pid {record.pid}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record.started_at))}); stop it first "
            f"({stop_command(run, False)} on that node, or {stop_command(run, True)}) or choose another RUN name"
        )


def node_check(request: NodeCheckRequest, node: NodeEnv):
    """Preflight on this node (orchestration/node/preflight.py): the run is not live here, and
    every other check; the report lists every problem found."""
    from orchestration.node.preflight import inspect_node  # node-check's alone: the supervisor starts without it

    refuse_if_running(request.target)
    return inspect_node(request, request.target.paths.run_state_dir, node.visible_gpus, Path.cwd(), node.environ)


def receive_secrets(plan: NodePlan, line: str, node_env: Mapping[str, str]) -> dict[str, str]:
    """The values of the plan's secret variables: from the launcher's line on standard input, else
    this node's own environment (a local start inherits the launcher's); a missing one is a UserError
    that names it (never a value)."""
    try:
        values = decode_secrets(line, plan.secret_names)
    except ValueError as exc:
        raise UserError(f"node {plan.node_rank}: {exc}; start the run with the launcher (start_training.sh, "
                        "start_multinode_training.sh), which sends it") from None
    values.update({k: node_env[k] for k in plan.secret_names if k not in values and k in node_env})
    missing = [k for k in plan.secret_names if k not in values]
    if missing:
        raise UserError(f"node {plan.node_rank}: the secret variable(s) {', '.join(missing)} did not arrive (the "
                        "launcher sends them on node-start's standard input); start with the launcher, or set them "
                        "on this node")
    return values


def reset_for_start(plan: NodePlan) -> RunPaths:
    """What this node's last start left goes before its supervisor starts (node 0 of a start also
    clears the run's failure and attempt files: :attr:`NodePlan.resets_run_state`)."""
    paths = plan.target.paths
    reset_node_files(paths, plan.node_rank)
    if plan.resets_run_state:
        reset_run_files(paths, keep_ledger=plan.first_attempt > 1)
    return paths


def node_start(plan: NodePlan, node: NodeEnv, python: str, secrets: Mapping[str, str] | None = None) -> NodeStarted:
    """Start the node's supervisor detached, which starts the plan's torchrun exactly as planned and
    records it (see orchestration/node/supervisor.py); report once it runs. ``secrets`` go into the
    supervisor's environment (torchrun and the ranks inherit them), not into the plan file."""
    log_path = Path(plan.log_path)
    refuse_if_running(plan.target)
    paths = reset_for_start(plan)
    plan_file = write_plan_file(paths, plan.node_rank, plan.to_json())
    supervisor = processes.start_detached(supervise_argv(python, str(plan_file)),
                                          {**plan.process_environment(node.environ), **(secrets or {})}, plan.cwd, log_path)
    wait = wait_until_started(paths, plan.node_rank, plan.pid_file, plan.run_id, lambda: supervisor.poll() is None,
                              timeout_s=START_SETTLE_S + START_TIMEOUT_S, settle_s=START_SETTLE_S)
    if not wait.started:
        processes.stop_node(plan.target, grace_s=1.0)
        if wait.timed_out:
            doing = f" (it was {wait.doing})" if wait.doing else ""
            raise NodeError(f"torchrun did not start: {START_SETTLE_S + START_TIMEOUT_S:.0f} s passed without it or "
                            f"a step under way before it{doing}; see {log_path}")
        why = wait.ended.reason if wait.ended else f"its supervisor exited with code {supervisor.poll()}"
        raise NodeError(f"the run ended at start ({why}); last log lines:\n{tail(log_path, 15)}")
    record = wait.record
    return NodeStarted(node_rank=plan.node_rank, host=plan.host, pid=record.pid, pgid=record.pgid, supervisor_pid=supervisor.pid,
                       log=str(log_path), run_id=plan.run_id)


def node_supervise(plan_file: str, node: NodeEnv) -> int:
    """The node's supervisor for its plan (``{node}`` in the path = SLURM_NODEID: one srun step
    runs a task per node, each picks its own node's plan)."""
    path = Path(plan_file.replace("{node}", node.slurm_nodeid or "0"))
    raw = read_json_settled(path)  # under srun the launcher wrote it on another machine: it may show late
    if raw is None:
        log.error("error: the node's plan %s did not appear whole on this node within %.0f s: the artifact root "
                  "must be a file system every node mounts (ARTIFACT_ROOT)", path, SETTLE_S)
        return EXIT_NODE_FAILED
    plan = decode_payload(NodePlan, raw)
    if node.run_id != plan.run_id:  # started by srun: take the plan's environment and tags first
        argv = supervise_argv(sys.executable, plan_file)
        os.execve(argv[0], argv, plan.process_environment(node.environ))
    if node.slurm_step:  # a task of the start step: a process group of its own, so stop signals only the run
        os.setpgid(0, 0)
        reset_for_start(plan)  # started by srun, not node-start: the node resets its files here
    missing = [k for k in plan.secret_names if k not in node.environ]  # srun: the step inherits them, or not
    if missing:
        log.warning("[supervisor node%d] warning: the secret variable(s) %s did not reach this node; the ranks run "
                    "without them", plan.node_rank, ", ".join(missing))
    return Supervisor(plan, node.environ, node.slurm_step).run()


def planned_engine(paths: RunPaths, node_rank: int) -> Engine:
    """The engine the node's last plan ran (its log's iteration lines are that engine's)."""
    try:
        return engine_named(NodePlan.from_json(paths.node_plan_file(node_rank).read_text()).engine)
    except (OSError, ValueError, TypeError, KeyError):
        return MEGATRON_CORE


def node_status(request: StatusRequest) -> NodeStatus:
    """Alive or not, and the last iteration line of the node's log (either engine's), read
    with the one iteration-line parser; ``seq_length`` turns step time into tokens/s.
    ``by_heartbeat``: from another machine that shares the files: alive = its supervisor's
    heartbeat record of this start (``run_id``) is there and its exit record is not (its state,
    the record's). A one-shot status cannot tell a supervisor gone without a record from a live
    one: the record's counter (``beat``) can, between two statuses; a waiting start compares it
    (orchestration/runner/record_beats.py)."""
    by_heartbeat, node_rank, paths = request.by_heartbeat, request.target.node_rank, request.target.paths
    record = read_pid_file(paths.node_pid_file(node_rank))
    this_start = request.run_id if by_heartbeat else None
    ended = read_exit(paths, node_rank, this_start)
    beat = read_heartbeat(paths, node_rank)
    if beat is not None and this_start and beat.run_id != this_start:
        beat = None  # an earlier start's record, not yet replaced (or not yet seen replaced)
    if by_heartbeat:  # another machine's records, perhaps seen late: no clock or mtime of theirs is compared here
        alive = beat is not None and not ended  # a node lost without a record: the ledger says so (the caller reads it)
        training = alive and beat.state == RunState.RUNNING
    else:
        joining = bool(beat and beat.state == RunState.JOINING and record and record.pid == record.supervisor_pid)
        training = bool(record and not joining and processes.record_is_alive(record))
        # Alive while any process of the node's run is: the supervisor writes its exit record
        # before it removes its folder and exits, so a record alone does not mean the node is gone
        # (the caller waiting for the end would otherwise find processes of the run still there).
        alive = training or bool(record and processes.supervisor_is_alive(record))
    if training:
        state = RunState.RUNNING
    elif ended:
        state = ended.state
    elif alive:
        state = RunState.JOINING if beat and beat.state == RunState.JOINING else RunState.RESTARTING
    else:
        state = RunState.STOPPED if paths.node_log(node_rank).exists() else RunState.NOT_STARTED
    text = tail(paths.node_log(node_rank), 200)
    records, _ = planned_engine(paths, node_rank).parse_log(text, request.seq_length)
    score, reason = failure_reason(tail(paths.node_log(node_rank), 400, max_bytes=262144)) \
        if not training and state.ended and state != RunState.FINISHED else (0, None)
    last = records[-1] if records else None
    lines = [line for line in text.splitlines() if line.strip()]
    return NodeStatus(
        node_rank=node_rank, host=request.target.host, alive=alive, state=state, exit=ended.reason if ended else None,
        run_failure=read_failure(paths), pid=record.pid if record else None,
        last_iteration=last.iteration if last else None, train_iters=last.train_iters if last else None,
        tokens_per_s=last.tokens_per_s if last and last.tokens_per_s else None,
        last_line=lines[-1][-160:] if lines else "", log=str(paths.node_log(node_rank)),
        attempt=beat.attempt if beat else None, failure_reason=reason, failure_score=score,
        slow_ranks=standing_slow_ranks(text), beat=beat.beat if beat else None,
    )


def standing_slow_ranks(log_text: str) -> str | None:
    """The last slow-rank warning of the log's latest attempt, unless a later line says they
    caught up (rank 0's lines: megatron_ext/training/loop.py)."""
    for line in reversed(log_text.rpartition(ATTEMPT_STARTED)[2].splitlines()):
        if line.startswith(SLOW_RANK_CLEARED):
            return None
        if line.startswith(SLOW_RANK_WARNING):
            return line.strip()
    return None


def node_linktest(request: LinktestRequest, node: NodeEnv):
    from orchestration.node.linktest import run_linktest  # node-linktest's alone: the supervisor starts without it

    return run_linktest(request, node.environ)


ANSWERS: dict[type, Callable[[Any, NodeEnv, str], Any]] = {
    NodePlan: lambda plan, node, line: node_start(plan, node, sys.executable, receive_secrets(plan, line, node.environ)),
    NodeCheckRequest: lambda r, node, _: node_check(r, node),
    LinktestRequest: lambda r, node, _: node_linktest(r, node),
    SaveRequest: lambda r, *_: processes.ask_to_save(r.target),
    StopRequest: lambda r, *_: processes.preview_stop(r.target, r.grace_s) if r.dry_run else processes.stop_node(r.target, r.grace_s),
    StatusRequest: lambda r, *_: node_status(r),
}
"""Each request type and what answers it (request, the node's environment, node-start's secrets line)."""


def answer(argv: Sequence[str], environ: Mapping[str, str], stdin_line: str = "") -> tuple[int, str]:
    """One node command (not ``node-supervise``): (exit code, its one JSON line). ``stdin_line``:
    node-start's secrets line. Also how the launcher answers its own machine's calls in-process."""
    args = build_node_parser().parse_args(list(argv))
    try:
        request = decode_request(args.command, args.request)
    except ValueError as exc:
        return EXIT_USER_ERROR, encode_error(f"{exc}; send node commands with the launcher of the same checkout")
    try:
        check_run_name(request.target.run)  # it becomes file names
        payload = ANSWERS[type(request)](request, read_node_env(environ), stdin_line)
    except UserError as exc:
        return EXIT_USER_ERROR, encode_error(str(exc))
    except NodeError as exc:
        return EXIT_NODE_FAILED, encode_error(str(exc))
    return EXIT_OK, encode_payload(payload)


def plan_names_secrets(request: str) -> bool:
    """Whether node-start's plan names secret variables (then their line waits on standard input)."""
    try:
        return bool(json.loads(request).get("secret_names"))
    except (ValueError, AttributeError):
        return False  # answer() says what is wrong with the request


def build_node_parser() -> argparse.ArgumentParser:
    """The node side's parser: each node command's one argument, its request as JSON (node/wire.py)."""
    parser = argparse.ArgumentParser(prog="python -m orchestration", description="node commands (sent by the launcher)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, option, supervise in ((SUPERVISE_COMMAND, "--plan-file", node_supervise),
                                    ("node-pod", "--plan-dir", lambda plan_dir, node: run_pod(plan_dir, node.environ, sys.executable))):
        command = sub.add_parser(name)
        command.add_argument(option, dest="plan", required=True)
        command.set_defaults(supervise=supervise)  # a plan file, not a request: runs until the node's run ends
    for name, request in NODE_REQUESTS.items():
        sub.add_parser(name).add_argument("--request", required=True, help=f"the {request.__name__} as JSON (node/wire.py)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Every node command: one JSON line out (the supervisor runs until its torchrun ends)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_node_parser().parse_args(argv)
    configure_node_logging(os.environ.get("LOG_LEVEL", ""))
    if args.command not in NODE_REQUESTS:
        code = args.supervise(args.plan, read_node_env(os.environ))
        logging.shutdown()
        sys.stdout.flush()
        # A store call still out (node 0 cut off) sits in torch's C++ in a daemon thread: no
        # interpreter teardown under it (one that returns then aborts the process).
        os._exit(code)
    needs_secrets = NODE_REQUESTS[args.command] is NodePlan and plan_names_secrets(args.request) and not sys.stdin.isatty()
    code, line = answer(argv, os.environ, sys.stdin.readline() if needs_secrets else "")  # the launcher's one line
    print(line, flush=True)
    return code
