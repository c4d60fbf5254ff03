"""Slurm: the srun transport inside an allocation, and batch jobs through sbatch.

    salloc -N 4 --gpus-per-node 8 bash training_scripts/start_multinode_training.sh qwen3_1p7b qwen3_1p7b_smoke q32
    bash training_scripts/submit_training.sh qwen3_1p7b qwen3_1p7b_smoke q32 --nodes 4 --gpus-per-node 8 --time 2:00:00

Inside an allocation (``SLURM_JOB_ID`` set, no ``HOSTS``) the nodes come from
``scontrol show hostnames $SLURM_JOB_NODELIST``, node commands run as ``srun --overlap`` tasks, and
a start is one ``srun`` step with one task per node (``--kill-on-bad-exit``): each task runs the
node's supervisor for the plan of node ``SLURM_NODEID`` (same logs, pid files, run tag and dry
run as over ssh). ``submit`` writes a batch script that runs that start in the foreground inside
the job, submits it and records the job id, which ``status`` and ``stop`` use. Side effects:
Slurm's commands, the batch script and job-id files under the artifact root.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from megatron_ext.spec.errors import UserError
from megatron_ext.spec.run_paths import RunPaths

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                   "DEADLINE")


def _run(argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), env=dict(env) if env is not None else None, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UserError(f"{argv[0]} is not installed here; run this on a Slurm login or compute node") from None


def allocation_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    """The allocation's nodes, in Slurm's order (node 0 first)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        return ()
    proc = _run(["scontrol", "show", "hostnames", nodelist], env)
    if proc.returncode:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {proc.stderr.strip()}")
    return tuple(proc.stdout.split())


def plan_file_pattern(paths: RunPaths) -> str:
    """The plan file of the node whose SLURM_NODEID fills ``{node}``."""
    return str(paths.run_state_dir / f"{paths.run}_node{{node}}.plan.json")


def srun_step_argv(job_id: str, nnodes: int, python: str, cwd: str, pattern: str) -> list[str]:
    """The start: one task per node, each the node's supervisor; a task that fails ends the step."""
    return ["srun", f"--jobid={job_id}", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", f"--chdir={cwd}", "--quiet", "--job-name=torchrun",
            python, "-m", "orchestration", "node-supervise", "--plan-file", pattern]


# -- batch jobs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchRequest:
    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    time: str | None
    partition: str | None
    account: str | None


def render_batch_script(model: str, data: str, run: str, request: BatchRequest, python: str, cwd: str,
                        env: Mapping[str, str], log: Path) -> str:
    """A batch script that runs the start in the foreground inside the job (the job ends with the run)."""
    lines = ["#!/usr/bin/env bash", f"#SBATCH --job-name={run}", f"#SBATCH --nodes={request.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={log}", "#SBATCH --open-mode=append"]
    if request.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={request.gpus_per_node}")
    else:
        lines.append(f"#SBATCH --cpus-per-task={request.nproc_per_node}")
    for flag, value in (("--time", request.time), ("--partition", request.partition), ("--account", request.account)):
        if value:
            lines.append(f"#SBATCH {flag}={value}")
    lines += ["set -euo pipefail", f"cd {shlex.quote(cwd)}",
              "unset HOSTS HOSTFILE NODE_RANK MASTER_ADDR DRY_RUN LAUNCHER_TRANSPORT  # the nodes come from the job"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines.append("exec " + shlex.join([python, "-m", "orchestration", "start", model, data, run, "--wait"]))
    return "\n".join(lines) + "\n"


def check_partition(partition: str | None, env: Mapping[str, str]) -> None:
    if not partition:
        return
    proc = _run(["scontrol", "show", "partition", partition], env)
    if proc.returncode:
        names = _run(["sinfo", "-h", "-o", "%R"], env).stdout.split()
        raise UserError(f"partition {partition!r} does not exist on this cluster (partitions: {', '.join(sorted(set(names))) or 'none'}); "
                        "choose one with --partition or SBATCH_PARTITION")


def submit(script: Path, env: Mapping[str, str]) -> str:
    """sbatch the script; the job id, or a UserError with sbatch's own message."""
    proc = _run(["sbatch", "--parsable", str(script)], env)
    if proc.returncode:
        raise UserError(f"sbatch refused the job: {proc.stderr.strip()}; nothing was submitted")
    return proc.stdout.strip().split(";")[0]


def job_file(paths: RunPaths) -> Path:
    return paths.run_state_dir / f"{paths.run}.slurm_job.json"


def record_job(paths: RunPaths, job_id: str, script: Path) -> None:
    job_file(paths).write_text(json.dumps({"job_id": job_id, "script": str(script), "submitted_at": time.time()}))


def recorded_job(paths: RunPaths) -> str | None:
    try:
        return json.loads(job_file(paths).read_text())["job_id"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def job_state(job_id: str, env: Mapping[str, str]) -> str:
    """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... or UNKNOWN (Slurm forgot the job)."""
    proc = _run(["scontrol", "show", "job", "-o", job_id], env)
    for word in proc.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


def cancel(job_id: str, env: Mapping[str, str], timeout_s: float = 90) -> str:
    """scancel the job and wait until Slurm says it ended; its final state."""
    _run(["scancel", job_id], env)
    deadline = time.monotonic() + timeout_s
    state = job_state(job_id, env)
    while state not in (*TERMINAL_STATES, "UNKNOWN") and time.monotonic() < deadline:
        time.sleep(1)
        state = job_state(job_id, env)
    return state


def cancel_step(step: str, env: Mapping[str, str]) -> bool:
    return _run(["scancel", step], env).returncode == 0
