"""Slurm: the srun transport inside an allocation, and batch jobs through sbatch.

    salloc -N 4 --gpus-per-node 8 bash training_scripts/start_multinode_training.sh qwen3_1p7b qwen3_1p7b_smoke q32
    bash training_scripts/submit_training.sh qwen3_1p7b qwen3_1p7b_smoke q32 --nodes 4 --gpus-per-node 8 --time 2:00:00

Inside an allocation (``SLURM_JOB_ID`` set, no ``HOSTS``) the nodes come from
``scontrol show hostnames $SLURM_JOB_NODELIST``, node commands run as ``srun --overlap`` tasks, and
a start is one ``srun`` step with one task per node (``--kill-on-bad-exit``): each task runs the
node's supervisor for the plan of node ``SLURM_NODEID`` (same logs, pid files, run tag and dry
run as over ssh). ``submit`` writes a batch script that runs that start in the foreground inside
the job, submits it and records the job id, which ``status`` and ``stop`` use. Side effects:
Slurm's commands (with this process's environment: SLURM_CONF and the like reach them as they
reach any child), and the job-id file under the artifact root.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node.wire import supervise_argv
from megatron_ext.host.json_files import read_json, write_json_atomic

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                   "DEADLINE")


def run_slurm(argv: Sequence[str], timeout_s: float = 30) -> subprocess.CompletedProcess:
    """One Slurm command; a missing Slurm is a UserError."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UserError(f"{argv[0]} is not installed here; run this on a Slurm login or compute node") from None


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """``scontrol show hostnames NODELIST``: the allocation's nodes, in Slurm's order (node 0 first)."""
    proc = run_slurm(["scontrol", "show", "hostnames", nodelist])
    if proc.returncode:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {proc.stderr.strip()}")
    return tuple(proc.stdout.split())


def plan_file_pattern(paths: RunPaths) -> str:
    """The plan file of the node whose SLURM_NODEID fills ``{node}``."""
    return str(paths.run_state_dir / f"{paths.run}_node{{node}}.plan.json")


def start_step(argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path) -> subprocess.Popen:
    """The srun client of a start step, detached here (its own session; output to ``log_path``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)


def srun_step_argv(job_id: str, nnodes: int, python: str, cwd: str, pattern: str) -> list[str]:
    """The start: one task per node, each the node's supervisor; a task that fails ends the step."""
    return ["srun", f"--jobid={job_id}", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", f"--chdir={cwd}", "--quiet", "--job-name=torchrun", *supervise_argv(python, pattern)]


# -- batch jobs ---------------------------------------------------------------------------------

DEFAULT_SIGNAL_AHEAD_S = 300
"""How long before the time limit Slurm signals the batch job to save (it may come up to a minute
earlier still: Slurm checks its timers about once a minute)."""


@dataclass(frozen=True, kw_only=True)
class BatchRequest:
    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    time: str | None
    partition: str | None
    account: str | None
    signal_ahead_s: int = DEFAULT_SIGNAL_AHEAD_S
    """SIGUSR1 to the batch shell this long before the time limit (0: none): every rank saves a
    checkpoint at the next step, the run ends preempted and the job requeues itself."""


def render_batch_script(model: str, data: str, run: str, request: BatchRequest, python: str, cwd: str,
                        env: Mapping[str, str], log: Path, signal_mark: Path) -> str:
    """A batch script that runs the start in the foreground inside the job (the job ends with the run).

    With ``signal_ahead_s``: ``--signal=B:USR1@...`` reaches only this shell (B:), at any moment,
    even before the start's Python has a handler (Slurm sends it at once when the time limit is
    within the warning time plus its 30 s check period), so the shell's first act is a trap that
    writes ``signal_mark`` (``.<job>.<restart count>`` appended); the start, run in the background
    and waited for, asks every node to save when the mark appears, waits for the save, and
    requeues the job (``--requeue`` alone does not cover a time-out)."""
    head = ["#!/usr/bin/env bash", f"#SBATCH --job-name={run}", f"#SBATCH --nodes={request.nodes}",
            "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={log}", "#SBATCH --open-mode=append"]
    if request.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={request.gpus_per_node}")
    else:
        head.append(f"#SBATCH --cpus-per-task={request.nproc_per_node}")
    for flag, value in (("--time", request.time), ("--partition", request.partition), ("--account", request.account)):
        if value:
            head.append(f"#SBATCH {flag}={value}")
    start = [python, "-m", "orchestration", "start", model, data, run, "--wait"]
    if not request.signal_ahead_s:
        body = [*_job_environment(cwd, env), "exec " + shlex.join(start)]
        return "\n".join(head + body) + "\n"
    mark = f'{shlex.quote(str(signal_mark))}."$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"'
    head += [f"#SBATCH --signal=B:USR1@{request.signal_ahead_s}", "#SBATCH --requeue",
             f"mark={mark}", "trap 'date +%s > \"$mark\"' USR1  # first: Slurm may signal this shell at any moment"]
    body = [*_job_environment(cwd, env),
            shlex.join([*start, "--requeue", "--signal-file"]) + ' "$mark" &',
            "child=$!",
            "while :; do  # a trapped USR1 interrupts wait: wait again until the start itself has ended",
            '  status=0; wait "$child" || status=$?',
            '  kill -0 "$child" 2>/dev/null || break',
            "done",
            'exit "$status"']
    return "\n".join(head + body) + "\n"


def _job_environment(cwd: str, env: Mapping[str, str]) -> list[str]:
    return ["set -euo pipefail", f"cd {shlex.quote(cwd)}",
            "unset HOSTS HOSTFILE NODE_RANK MASTER_ADDR DRY_RUN LAUNCHER_TRANSPORT  # the nodes come from the job",
            *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()))]


def check_partition(partition: str | None) -> None:
    if not partition:
        return
    proc = run_slurm(["scontrol", "show", "partition", partition])
    if proc.returncode:
        names = run_slurm(["sinfo", "-h", "-o", "%R"]).stdout.split()
        raise UserError(f"partition {partition!r} does not exist on this cluster (partitions: {', '.join(sorted(set(names))) or 'none'}); "
                        "choose one with --partition or SBATCH_PARTITION")


def submit(script: Path) -> str:
    """sbatch the script; the job id, or a UserError with sbatch's own message."""
    proc = run_slurm(["sbatch", "--parsable", str(script)])
    if proc.returncode:
        raise UserError(f"sbatch refused the job: {proc.stderr.strip()}; nothing was submitted")
    return proc.stdout.strip().split(";")[0]


def job_file(paths: RunPaths) -> Path:
    return paths.run_state_dir / f"{paths.run}.slurm_job.json"


def record_job(paths: RunPaths, job_id: str, script: Path) -> None:
    write_json_atomic(job_file(paths), {"job_id": job_id, "script": str(script), "submitted_at": time.time()})


def recorded_job(paths: RunPaths) -> str | None:
    raw = read_json(job_file(paths))
    return raw.get("job_id") if isinstance(raw, dict) else None


def job_state(job_id: str) -> str:
    """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... or UNKNOWN (Slurm forgot the job)."""
    return job_field(job_id, "JobState") or "UNKNOWN"


def cancel(job_id: str, timeout_s: float = 90) -> str:
    """scancel the job and wait until Slurm says it ended; its final state."""
    run_slurm(["scancel", job_id])
    deadline = time.monotonic() + timeout_s
    state = job_state(job_id)
    while state not in (*TERMINAL_STATES, "UNKNOWN") and time.monotonic() < deadline:
        time.sleep(1)
        state = job_state(job_id)
    return state


@dataclass(frozen=True)
class RequeuePlan:
    """How a batch job goes back to the queue: ``scontrol requeue``; or, to leave nodes out of its
    next run (``--exclude``), requeued held, those nodes added to its excluded nodes, released. A
    job's excluded nodes can be changed only while it is pending, and from inside the job: hence
    held, so that Slurm cannot start it again on the same nodes in between."""

    job_id: str
    exclude: tuple[str, ...] = ()
    """The hosts its next run leaves out (its ``ExcNodeList`` from now on, with those it had)."""
    commands: tuple[tuple[str, ...], ...] = ()


def plan_requeue(job_id: str, exclude: Sequence[str] = (), excluded_before: str | None = None) -> RequeuePlan:
    """The commands that requeue ``job_id`` leaving out ``exclude`` on top of ``excluded_before``
    (the job's ExcNodeList, a host list as Slurm prints it, e.g. ``g[01-02]``). Pure."""
    if not exclude:
        return RequeuePlan(job_id, (), (("scontrol", "requeue", job_id),))
    before = [] if excluded_before in (None, "", "(null)") else [excluded_before]
    hosts = ",".join([*before, *sorted(set(exclude))])
    return RequeuePlan(job_id, tuple(sorted(set(exclude))), (
        ("scontrol", "requeuehold", job_id),
        ("scontrol", "update", f"JobId={job_id}", f"ExcNodeList={hosts}"),
        ("scontrol", "release", job_id)))


def job_field(job_id: str, name: str) -> str | None:
    """One field of ``scontrol show job -o`` (``ExcNodeList``, ``JobState``, ...), or None."""
    proc = run_slurm(["scontrol", "show", "job", "-o", job_id])
    for word in proc.stdout.split():
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
    return None


def requeue(plan: RequeuePlan) -> str | None:
    """Run the plan: the job goes back to the queue and runs its batch script again (its start
    resumes from the latest checkpoint), on other nodes than those left out. None when Slurm took
    every command, else the failing command and Slurm's message (a job left held is released).
    Requeued, Slurm ends the job's processes, the caller's too when it runs inside the job (SIGTERM,
    then SIGKILL after KillWait): SIGTERM is ignored until the commands are done."""
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        for argv in plan.commands:
            proc = run_slurm(list(argv))
            if proc.returncode:
                if argv[1] == "update":  # held: let it run again, with the nodes it had
                    run_slurm(["scontrol", "release", plan.job_id])
                return f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}"
        return None
    finally:
        signal.signal(signal.SIGTERM, before)


def cancel_step(step: str) -> bool:
    return run_slurm(["scancel", step]).returncode == 0
