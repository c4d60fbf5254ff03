"""What runs on one node: check, start, stop and report a run there.

    python -m orchestration node-status my_run --node-rank 0 --host localhost --artifact-root /shared/runs

Called locally, over ssh or through ``docker exec`` by the fan-out, with everything it needs as
arguments (the artifact root, or a node's whole :class:`NodePlan`): it reads no launcher variable.
Each function returns a JSON-able dict, printed as one line for the caller to collect. Side
effects through :mod:`orchestration.processes` (processes, pid files) and the run's log file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping

from megatron_ext.spec.errors import UserError
from megatron_ext.spec.iteration_log import parse_log
from megatron_ext.spec.run_paths import RunPaths
from orchestration import processes
from orchestration.plan import NodePlan
from orchestration.supervisor import read_exit

START_SETTLE_S = 1.5
"""How long node-start watches torchrun before reporting it started (catches instant failures)."""


class NodeError(RuntimeError):
    """A node-side failure that is not the user's input (process died, file problem)."""


def refuse_if_running(pid_path: Path, run: str, node_rank: int) -> None:
    record = processes.read_pid_file(pid_path)
    if record and processes.record_is_alive(record):
        raise UserError(
            f"run {run!r} is already running on node {node_rank} (pid {record.pid}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record.started_at))}); stop it first "
            f"(stop_training.sh {run} on that node, or stop_multinode_training.sh {run}) "
            "or choose another RUN name"
        )


def node_check(paths: RunPaths, args, visible_gpus: int) -> dict:
    """Preflight on this node (orchestration/preflight.py): the run is not live here, and every
    other check; the report lists every problem found."""
    from orchestration.preflight import inspect_node

    refuse_if_running(paths.node_pid_file(args.node_rank), paths.run, args.node_rank)
    report = inspect_node(args.node_rank, args.host, args.master_addr, args.master_port, args.nproc_per_node,
                          args.require_path, args.shared_token, paths.run_state_dir, visible_gpus, Path.cwd())
    return report.to_json()


def write_plan_file(paths: RunPaths, plan: NodePlan) -> Path:
    """The node's plan for its supervisor, after removing what the node's last start left
    (exit record, heartbeat, pid file); both the ssh and the srun start use it."""
    for stale in (paths.node_exit_file(plan.node_rank), paths.node_heartbeat_file(plan.node_rank), Path(plan.pid_path)):
        stale.unlink(missing_ok=True)
    plan_file = paths.node_plan_file(plan.node_rank)
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(plan.to_json())
    return plan_file


def node_start(plan: NodePlan, node_env: Mapping[str, str], python: str) -> dict:
    """Start the node's supervisor detached, which starts the plan's torchrun exactly as planned and
    records it (see orchestration/supervisor.py); report once it runs."""
    paths = RunPaths(Path(plan.env["ARTIFACT_ROOT"]), plan.run)
    pid_path, log_path = Path(plan.pid_path), Path(plan.log_path)
    refuse_if_running(pid_path, plan.run, plan.node_rank)
    plan_file = write_plan_file(paths, plan)
    supervisor = processes.start_detached([python, "-m", "orchestration", "node-supervise", "--plan-file", str(plan_file)],
                                          plan.process_environment(node_env), plan.cwd, log_path)
    deadline = time.monotonic() + START_SETTLE_S
    record = None
    while time.monotonic() < deadline or record is None:
        record = record or processes.read_pid_file(pid_path)
        ended = read_exit(paths.node_exit_file(plan.node_rank))
        if supervisor.poll() is not None or (ended and ended.state == "failed"):
            processes.stop_run(plan.run, plan.node_rank, plan.host, pid_path, grace_s=1.0)
            why = ended.reason if ended else f"its supervisor exited with code {supervisor.returncode}"
            raise NodeError(f"the run ended at start ({why}); last log lines:\n{tail(log_path, 15)}")
        if record is None and time.monotonic() > deadline + 30:
            raise NodeError(f"torchrun did not start within {START_SETTLE_S + 30:.0f}s; see {log_path}")
        time.sleep(0.1)
    return {"node_rank": plan.node_rank, "host": plan.host, "pid": record.pid, "pgid": record.pgid,
            "supervisor_pid": supervisor.pid, "log": str(log_path), "run_id": plan.run_id}


def node_stop(paths: RunPaths, node_rank: int, host: str, grace_s: float) -> dict:
    result = processes.stop_run(paths.run, node_rank, host, paths.node_pid_file(node_rank), grace_s)
    return {**result.__dict__, "ok": result.ok}


def tail(path: Path, lines: int, max_bytes: int = 65536) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            text = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def node_status(paths: RunPaths, node_rank: int, host: str, seq_length: int | None, by_heartbeat: bool = False) -> dict:
    """Alive or not, and the last iteration line of the node's log (either engine's), read
    with the one iteration-line parser; ``seq_length`` turns step time into tokens/s.
    ``by_heartbeat``: from another machine, alive = the node's supervisor beat recently."""
    from orchestration.supervisor import NODE_LOST_S

    record = processes.read_pid_file(paths.node_pid_file(node_rank))
    if by_heartbeat:
        beat = paths.node_heartbeat_file(node_rank)
        alive = beat.exists() and time.time() - beat.stat().st_mtime < NODE_LOST_S and not read_exit(paths.node_exit_file(node_rank))
    else:
        alive = bool(record and processes.record_is_alive(record))
    ended = read_exit(paths.node_exit_file(node_rank))
    state = "running" if alive else ended.state if ended else "stopped" if paths.node_log(node_rank).exists() else "not started"
    failure = paths.failure_file.read_text().splitlines()[0] if paths.failure_file.is_file() else None
    text = tail(paths.node_log(node_rank), 200)
    records, _ = parse_log(text, seq_length)
    last = records[-1] if records else None
    lines = [l for l in text.splitlines() if l.strip()]
    return {
        "node_rank": node_rank,
        "host": host,
        "alive": alive,
        "state": state,
        "exit": ended.reason if ended else None,
        "run_failure": failure,
        "pid": record.pid if record else None,
        "last_iteration": last.iteration if last else None,
        "train_iters": last.train_iters if last else None,
        "tokens_per_s": last.tokens_per_s if last and last.tokens_per_s else None,
        "last_line": lines[-1][-160:] if lines else "",
        "log": str(paths.node_log(node_rank)),
    }
