"""A Slurm batch job that runs a start inside the job and ends with the run: plan, then submit.

    bash training_scripts/submit_training.sh qwen3_1p7b qwen3_1p7b_smoke q32 --nodes 4 --gpus-per-node 8 --time 2:00:00
    DRY_RUN=1 bash training_scripts/submit_training.sh gpt_smoke smoke demo   # prints the batch script, submits nothing

:func:`plan_submit` checks everything a start would (parameters at the job's world size, the run
not already submitted, the partition) and renders the batch script (a :class:`BatchPlan`);
:func:`submit_batch` writes it under the artifact root, sbatches it and records the job id that
``status`` and ``stop`` use. The script exports the forwarded variables but never a secret
(WANDB_API_KEY, HF_TOKEN, ...: orchestration/launch_env.py): sbatch hands the job the submitting
environment (``--export=ALL``, Slurm's default), and the start inside the job passes them on to its
srun step the same way. Side effects: ``submit_batch`` only (and Slurm's read-only queries).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster import slurm
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import AttemptRecord, left_out_nodes, read_ledger, stop_command
from orchestration.runner.start_plan import plan_start, read_start_inputs


@dataclass(frozen=True)
class BatchPlan:
    run: str
    request: slurm.BatchRequest
    script_path: Path
    script: str
    """The batch script's text, as it will be submitted."""


def plan_submit(launch: LaunchEnv, model: str, data: str, run: str, nodes: int | None = None,
                gpus_per_node: int | None = None, time: str | None = None, partition: str | None = None,
                account: str | None = None, signal_ahead_s: int = slurm.DEFAULT_SIGNAL_AHEAD_S) -> BatchPlan:
    nodes = nodes or launch.nnodes
    nproc = gpus_per_node or launch.nproc_per_node
    request = slurm.BatchRequest(nodes=nodes, nproc_per_node=nproc, gpus_per_node=gpus_per_node or 0,
                                 time=time or launch.slurm_batch.get("time"),
                                 partition=partition or launch.slurm_batch.get("partition"),
                                 account=account or launch.slurm_batch.get("account"), signal_ahead_s=signal_ahead_s)
    if signal_ahead_s < 0:
        raise UserError(f"--signal-ahead-s {signal_ahead_s} must be >= 0 (0: no save before the time limit)")
    job_launch = dataclasses.replace(launch, nnodes=nodes, nproc_per_node=nproc,
                                     hosts=tuple(f"slurm-node{i}" for i in range(nodes)), use_srun=True)
    plan_start(job_launch, read_start_inputs(job_launch, model, data, run, list(enumerate(job_launch.hosts))))  # checks only
    paths = RunPaths(launch.artifact_root, run)
    earlier = slurm.recorded_job(paths)
    if earlier and slurm.job_state(earlier) in ("PENDING", "RUNNING"):
        raise UserError(f"run {run!r} is already submitted as slurm job {earlier}; stop it first "
                        f"({stop_command(run, True)}) or choose another RUN name")
    slurm.check_partition(request.partition)
    check_secrets_exported(launch)
    env = {**launch.forwarded, "ARTIFACT_ROOT": str(launch.artifact_root), "NPROC_PER_NODE": str(nproc),
           "NNODES": f"{launch.min_nodes}:{nodes}" if launch.min_nodes is not None else str(nodes),
           **({"RESTART_EXCLUDE": "0"} if not launch.restart_exclude else {}),
           **({"ZERO_STAGE": str(launch.zero_stage)} if launch.zero_stage is not None else {}),
           **({"ENGINE": launch.overrides.engine} if launch.overrides.engine else {}),
           **({"MASTER_PORT": str(launch.master_port)} if launch.master_port_explicit else {})}
    script = slurm.render_batch_script(model, data, run, request, launch.python, launch.cwd, env,
                                       paths.logs_dir / f"{run}_sbatch.log", paths.run_state_dir / f"{run}.batch_signal")
    return BatchPlan(run, request, paths.run_state_dir / f"{run}.sbatch", script)


def check_secrets_exported(launch: LaunchEnv) -> None:
    """The secrets reach the job only through sbatch's export of the submitting environment: refuse an
    SBATCH_EXPORT that would leave one behind (the script never holds them)."""
    export = launch.environ.get("SBATCH_EXPORT", "").strip()
    names = {item.split("=", 1)[0].strip() for item in export.split(",")}
    missing = sorted(set(launch.secrets) - names) if export and "ALL" not in names else []
    if missing:
        raise UserError(f"SBATCH_EXPORT (names: {','.join(sorted(names))}) would keep {', '.join(missing)} from the job (secrets "
                        "travel in the submitting environment, never in the batch script); unset SBATCH_EXPORT, make it "
                        f"ALL, or add {','.join(missing)} to it")


def submit_batch(launch: LaunchEnv, plan: BatchPlan) -> str:
    """Write the script, sbatch it, record the job: the job id."""
    paths = RunPaths(launch.artifact_root, plan.run)
    plan.script_path.parent.mkdir(parents=True, exist_ok=True)
    paths.logs_dir.mkdir(parents=True, exist_ok=True)
    plan.script_path.write_text(plan.script)
    job = slurm.submit(plan.script_path)
    slurm.record_job(paths, job, plan.script_path)
    return job


def requeue_exclusions(this_start: Sequence[AttemptRecord], hosts: Sequence[str], enabled: bool) -> dict[str, str]:
    """The hosts a requeued job leaves out (``--exclude``), each with why: the nodes the start went on
    without and did not take back (left out on the evidence against them, or lost:
    orchestration/node/exclusion.py), never node 0's; none with RESTART_EXCLUDE=0. Pure."""
    left = left_out_nodes(this_start) if enabled else {}
    return {hosts[n]: f"node {n} ({hosts[n]}) {why}" for n, why in sorted(left.items()) if 0 < n < len(hosts)}


def plan_requeue_after_save(launch: LaunchEnv, run: str, excluded_before: str | None = None) -> tuple[slurm.RequeuePlan, dict[str, str]]:
    """The requeue of this batch job (``launch.slurm_job_id``) after its save, leaving out the hosts
    its start went on without (:func:`requeue_exclusions`, from the ledger), with why for each."""
    paths = RunPaths(launch.artifact_root, run)
    resolved = read_resolved(paths.params_path)
    this_start = [r for r in read_ledger(paths) if resolved is not None and r.run_id == resolved.runtime.run_id]
    out = requeue_exclusions(this_start, resolved.runtime.hosts if resolved else (), launch.restart_exclude)
    return slurm.plan_requeue(launch.slurm_job_id, list(out), excluded_before), out


def requeue_after_save(launch: LaunchEnv, run: str) -> str:
    """Inside a batch job that saved on SIGUSR1 (its time limit or a preemption): requeue it, so that
    it starts again and resumes from that checkpoint, without the nodes the run left out. What
    happened, in one line."""
    job = launch.slurm_job_id
    plan, why = plan_requeue_after_save(launch, run, slurm.job_field(job, "ExcNodeList") if launch.restart_exclude else None)
    refused = slurm.requeue(plan)
    without = f" without {', '.join(plan.exclude)} (--exclude: {'; '.join(why.values())})" if plan.exclude else ""
    return (f"run {run}: checkpoint saved; " + (f"slurm job {job} requeued{without}: it starts again and resumes there"
                                                if refused is None else f"requeueing slurm job {job}: {refused}"))
