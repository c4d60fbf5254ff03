"""What runs on one node: check, start, stop and report a run there.

    python -m orchestration node-status my_run --node-rank 0 --host localhost

Called locally, over ssh or through ``docker exec`` by the fan-out; each function returns a
JSON-able dict, printed as one line for the caller to collect. Side effects through
:mod:`orchestration.processes` (processes, pid files) and the run's log file.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Mapping

from megatron_ext.artifacts import RunPaths, artifact_root
from megatron_ext.params import ParamsError, RunParams, check_batch_geometry, load_run_params
from orchestration import processes
from orchestration.engines import ProgramPlan, plan_program
from orchestration.launch_env import LaunchEnv
from orchestration.plan import NODE_TAG, RUN_ID_TAG, RUN_TAG, render_torchrun_argv

START_SETTLE_S = 1.5
"""How long node-start watches torchrun before reporting it started (catches instant failures)."""
_ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+)")
_TOKENS_RE = re.compile(r"([\d,]+) tokens/s")


class NodeError(RuntimeError):
    """A node-side failure that is not the user's input (process died, file problem)."""


def run_paths(env: Mapping[str, str], run: str) -> RunPaths:
    return RunPaths(artifact_root(env), run)


def validate_run(model: str, data: str, launch: LaunchEnv, env: Mapping[str, str]) -> RunParams:
    """Params and batch geometry for the whole cluster (world = NNODES x NPROC_PER_NODE)."""
    params = load_run_params(model, data, env)
    check_batch_geometry(params.training, launch.nnodes * launch.nproc_per_node)
    return params


def program_environment(base: Mapping[str, str], program: ProgramPlan, run: str, run_id: str, node_rank: int,
                        paths: RunPaths) -> dict[str, str]:
    """The environment of every process of the run on this node: tagged with the run."""
    env = dict(base)
    for key, value in program.env.items():
        env.pop(key, None)
        if value is not None:
            env[key] = value
    env.update({RUN_TAG: run, RUN_ID_TAG: run_id, NODE_TAG: str(node_rank), "PYTHONUNBUFFERED": "1",
                "ARTIFACT_ROOT": str(paths.root)})
    return env


def refuse_if_running(paths: RunPaths, node_rank: int) -> None:
    record = processes.read_pid_file(paths.node_pid_file(node_rank))
    if record and processes.record_is_alive(record):
        raise ParamsError(
            f"run {paths.run!r} is already running on node {node_rank} (pid {record.pid}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record.started_at))}); stop it first "
            f"(stop_training.sh {paths.run} on that node, or stop_multinode_training.sh {paths.run}) "
            "or choose another RUN name"
        )


def node_check(run: str, node_rank: int, host: str, launch: LaunchEnv, env: Mapping[str, str]) -> dict:
    """Preflight on this node: not already running, and on node 0 the master port is free."""
    paths = run_paths(env, run)
    refuse_if_running(paths, node_rank)
    if node_rank == 0 and not processes.port_is_free(launch.master_port):
        raise ParamsError(
            f"MASTER_PORT={launch.master_port} is in use on node 0 ({host}); choose a free port, "
            f"e.g. MASTER_PORT={launch.master_port + 1}"
        )
    return {"node_rank": node_rank, "host": host, "ok": True}


def node_start(model: str, data: str, run: str, run_id: str, node_rank: int, host: str,
               launch: LaunchEnv, env: Mapping[str, str], python: str, cwd: str) -> dict:
    """Start this node's torchrun detached, tagged with the run, and record it."""
    params = validate_run(model, data, launch, env)
    paths = run_paths(env, run)
    refuse_if_running(paths, node_rank)
    program = plan_program(params, model, data, paths, env)
    argv = render_torchrun_argv(launch, node_rank, python, program.argv)
    child_env = program_environment(env, program, run, run_id, node_rank, paths)
    log_path = paths.node_log(node_rank)
    proc = processes.start_detached(argv, child_env, cwd, log_path)
    record = processes.new_record(run, run_id, node_rank, host, proc, argv, log_path)
    processes.write_pid_file(paths.node_pid_file(node_rank), record)
    deadline = time.monotonic() + START_SETTLE_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            processes.stop_run(run, node_rank, host, paths.node_pid_file(node_rank), grace_s=1.0)
            raise NodeError(f"torchrun exited with code {code} at start; last log lines:\n{tail(log_path, 15)}")
        time.sleep(0.1)
    return {"node_rank": node_rank, "host": host, "pid": record.pid, "pgid": record.pgid, "log": str(log_path), "run_id": run_id}


def node_stop(run: str, node_rank: int, host: str, env: Mapping[str, str], grace_s: float) -> dict:
    paths = run_paths(env, run)
    result = processes.stop_run(run, node_rank, host, paths.node_pid_file(node_rank), grace_s)
    out = dict(result.__dict__)
    out["ok"] = result.ok
    return out


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


def _megatron_lm_tokens_per_s(text: str, paths: RunPaths) -> list[str]:
    """tokens/s from Megatron-LM's own iteration lines (no progress line there)."""
    import yaml

    from megatron_ext.megatron_lm_log import parse_log

    if not paths.params_path.is_file():
        return []
    seq = (yaml.safe_load(paths.params_path.read_text()) or {}).get("training", {}).get("seq_length")
    records, _ = parse_log(text, seq)
    return [str(records[-1].tokens_per_s)] if records and records[-1].tokens_per_s else []


def node_status(run: str, node_rank: int, host: str, env: Mapping[str, str]) -> dict:
    paths = run_paths(env, run)
    record = processes.read_pid_file(paths.node_pid_file(node_rank))
    alive = bool(record and processes.record_is_alive(record))
    text = tail(paths.node_log(node_rank), 200)
    iterations = _ITERATION_RE.findall(text)
    tokens = _TOKENS_RE.findall(text) or _megatron_lm_tokens_per_s(text, paths)
    lines = [l for l in text.splitlines() if l.strip()]
    return {
        "node_rank": node_rank,
        "host": host,
        "alive": alive,
        "pid": record.pid if record else None,
        "last_iteration": int(iterations[-1][0]) if iterations else None,
        "train_iters": int(iterations[-1][1]) if iterations else None,
        "tokens_per_s": float(tokens[-1].replace(",", "")) if tokens else None,
        "last_line": lines[-1][-160:] if lines else "",
        "log": str(paths.node_log(node_rank)),
    }
