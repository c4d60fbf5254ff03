"""The launcher under a real Slurm (tests/slurm_cluster.py: munged, slurmctld and one slurmd on
this machine; one node with one task of 2 training processes): a batch job through
submit_training.sh that gets its time-limit signal saves, requeues and runs to the end, a run started
inside an allocation (salloc) stops on request, scancel of a batch job leaves nothing, a batch job
whose supervisor is SIGKILLed fails within a minute with the reason, bad input is one message with
nothing submitted. With CI=true a missing prerequisite is a failure."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from signal import SIGKILL

import pytest

from slurm_cluster import SlurmCluster, missing_prerequisites
from conftest import (require, REPO, assert_same_losses, clean_env, last_iteration, run_script, tagged_pids, wait_for,
                      write_data_set)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require(missing_prerequisites(), "Slurm tests")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).open()
    yield c
    c.close()


@pytest.fixture()
def slurm_env(cluster, artifact_root):
    return clean_env(ARTIFACT_ROOT=str(artifact_root), NPROC_PER_NODE="2", **cluster.env)


def job_state(job: str, env: dict) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "UNKNOWN")


ALLOCATION_SCRIPT = """\
set -u
cd {repo}
bash training_scripts/start_multinode_training.sh gpt_smoke {data} sl_alloc || exit 11
python3 - <<'PY'
import sys, time
sys.path.insert(0, "tests")
from conftest import last_iteration
from pathlib import Path
log = Path("{root}") / "logs" / "sl_alloc_node0.log"
deadline = time.time() + 240
while last_iteration(log) < 2 and time.time() < deadline:
    time.sleep(0.5)
PY
bash training_scripts/status_training.sh sl_alloc --json
bash training_scripts/stop_multinode_training.sh sl_alloc || exit 12
"""


def test_run_inside_an_allocation_stops_on_request(slurm_env, artifact_root, tmp_path):
    data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    script = tmp_path / "in_allocation.sh"
    script.write_text(ALLOCATION_SCRIPT.format(repo=REPO, data=data, root=artifact_root))
    try:
        proc = subprocess.run(["salloc", "--nodes=1", "--cpus-per-task=2", "--quiet", "bash", str(script)], cwd=REPO,
                              env=slurm_env, capture_output=True, text=True, timeout=420)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "[node0 " in proc.stdout and "started torchrun pid" in proc.stdout
        node = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("{")))
        assert node["alive"] and node["state"] == "running" and node["last_iteration"] >= 2
        assert "stopped (SIGTERM to process group" in proc.stdout
    finally:
        assert tagged_pids("sl_alloc") == []


def test_bad_input_is_one_message_and_nothing_is_submitted(slurm_env, tmp_path):
    outside = run_script("start_multinode_training.sh", "gpt_smoke", "smoke", "sl_bad", env={**slurm_env, "LAUNCHER_TRANSPORT": "srun"})
    assert outside.returncode == 2 and "LAUNCHER_TRANSPORT=srun needs a Slurm allocation" in outside.stderr
    assert outside.stderr.count("error:") == 1
    too_many = subprocess.run(["salloc", "--nodes=1", "--quiet", "env", "NNODES=2", "bash",
                               str(REPO / "training_scripts" / "start_multinode_training.sh"), "gpt_smoke", "smoke", "sl_bad"],
                              cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=120)
    assert too_many.returncode == 2 and "NNODES=2 but the Slurm allocation" in too_many.stderr, too_many.stderr
    assert "has 1 node(s)" in too_many.stderr
    partition = run_script("submit_training.sh", "gpt_smoke", "smoke", "sl_bad", "--partition", "nosuch", env=slurm_env)
    assert partition.returncode == 2 and "partition 'nosuch' does not exist on this cluster (partitions: debug)" in partition.stderr
    queue = subprocess.run(["squeue", "-h", "-n", "sl_bad"], env=slurm_env, capture_output=True, text=True).stdout
    assert queue.strip() == "" and tagged_pids("sl_bad") == []


def test_dry_run_submit_prints_the_batch_script_and_submits_nothing(slurm_env, artifact_root):
    dry = run_script("submit_training.sh", "gpt_smoke", "smoke", "sl_dry", "--time", "0:10:00",
                     env={**slurm_env, "DRY_RUN": "1"})
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("#!/usr/bin/env bash\n#SBATCH --job-name=sl_dry\n") and "#SBATCH --time=0:10:00" in dry.stdout
    assert "orchestration start gpt_smoke smoke sl_dry --wait" in dry.stdout
    assert "DRY_RUN=1: nothing submitted" in dry.stderr
    queue = subprocess.run(["squeue", "-h", "-n", "sl_dry"], env=slurm_env, capture_output=True, text=True).stdout
    assert queue.strip() == "" and not (artifact_root / "run_state" / "sl_dry.sbatch").exists()
    assert not (artifact_root / "run_state" / "sl_dry.slurm_job.json").exists()


def test_stop_cancels_a_batch_job_and_leaves_nothing(slurm_env, artifact_root, tmp_path):
    data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    submit = run_script("submit_training.sh", "gpt_smoke", data, "sl_cancel", env=slurm_env)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.split("submitted slurm job ")[1].split()[0]
    try:
        wait_for(lambda: last_iteration(artifact_root / "logs" / "sl_cancel_node0.log") >= 2, 300, what="the job to train")
        running = run_script("status_training.sh", "sl_cancel", env=slurm_env)
        assert f"slurm job {job}: RUNNING" in running.stdout and " running " in running.stdout, running.stdout
        dry = run_script("stop_multinode_training.sh", "sl_cancel", env={**slurm_env, "DRY_RUN": "1"})
        assert dry.returncode == 0 and f"would scancel slurm job {job} of run sl_cancel" in dry.stdout, dry.stdout + dry.stderr
        assert job_state(job, slurm_env) == "RUNNING"
        stop = run_script("stop_multinode_training.sh", "sl_cancel", env=slurm_env, timeout=180)
        assert stop.returncode == 0 and f"slurm job {job} of run sl_cancel: CANCELLED" in stop.stdout, stop.stdout + stop.stderr
        wait_for(lambda: not tagged_pids("sl_cancel"), 60, what="every process of the job to end")
    finally:
        subprocess.run(["scancel", job], env=slurm_env)
    assert tagged_pids("sl_cancel") == []


def test_a_supervisor_killed_without_a_record_ends_its_batch_job_long_before_its_time_limit(slurm_env, artifact_root, tmp_path):
    """The node's supervisor SIGKILLed mid-run (as the out-of-memory killer would: no exit record):
    the batch job's waiting start sees its heartbeat record stop changing, by its own clock, and
    after the margin (RECORD_SILENCE_S, lowered here: this machine's one disk shows every write at
    once; 76 s in production) ends the run as failed with the reason, stops what the supervisor
    left, and the job fails within a minute, not at its 10-minute limit. The supervisor is found
    through the node's pid record and checked by its start time and run tag, never by name."""
    from orchestration.node.processes import supervisor_is_alive
    from orchestration.node.run_state import read_pid_file

    data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    env = {**slurm_env, "RECORD_SILENCE_S": "15"}
    submit = run_script("submit_training.sh", "gpt_smoke", data, "sl_killed", "--time", "10", "--signal-ahead-s", "0", env=env)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job = submit.stdout.split("submitted slurm job ")[1].split()[0]
    sbatch_log = artifact_root / "logs" / "sl_killed_sbatch.log"
    try:
        wait_for(lambda: last_iteration(artifact_root / "logs" / "sl_killed_node0.log") >= 2, 300, what="the job to train")
        record = read_pid_file(artifact_root / "run_state" / "sl_killed_node0.pid")
        assert record is not None and supervisor_is_alive(record), record
        os.kill(record.supervisor_pid, SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: job_state(job, env) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 120, interval_s=1,
                 what=f"slurm job {job} to end")
        took_s = time.monotonic() - killed_at
        state, output = job_state(job, env), sbatch_log.read_text()
    finally:
        subprocess.run(["scancel", job], env=env)
    assert state == "FAILED" and took_s < 60, (state, took_s, output[-3000:])
    assert "run sl_killed ended: node0 failed; node 0's supervisor has not updated its record for " in output, output[-3000:]
    assert "it ended without saying how (killed, e.g. by the out-of-memory killer)" in output
    assert not (artifact_root / "run_state" / "sl_killed_node0.exit.json").exists()  # nothing said how: the wait did
    wait_for(lambda: not tagged_pids("sl_killed"), 60, what="every process of the run to end")


def test_the_time_limit_signal_saves_requeues_and_finishes_with_the_same_losses(slurm_env, artifact_root, unattended):
    """A batch job through submit_training.sh whose script asks Slurm for USR1 60 s ahead of its
    time limit (``--signal=B:USR1@60``): the batch shell's trap marks it, the waiting start asks
    every rank to save at the next step, the run ends preempted, the job requeues itself, resumes
    from that checkpoint and finishes; its loss at every iteration equals an uninterrupted run's.
    The test sends that signal itself at iteration 5 of the first round of 60 (``scancel --signal=USR1
    --batch``: the batch shell only, as ``B:`` has Slurm do): Slurm's own comes at its first
    30-second check within 60 s of the limit, a moment that depends on how fast this machine
    trains, and a run that ends first has nothing to requeue (the 10-minute limit keeps Slurm's own
    out of the way). Also: a secret set where the job is submitted reaches the ranks (of both
    rounds) through sbatch's export of the environment, never through the batch script or a log."""
    from megatron_ext.host.procfs import process_environ

    data, reference = unattended
    key = secrets.token_hex(20)
    submit = run_script("submit_training.sh", "gpt_smoke", data, "sl_time", "--time", "10", "--signal-ahead-s", "60",
                        env={**slurm_env, "WANDB_API_KEY": key})
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job = submit.stdout.split("submitted slurm job ")[1].split()[0]
    script = (artifact_root / "run_state" / "sl_time.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@60" in script and "#SBATCH --requeue" in script and "--wait --requeue" in script
    assert "#SBATCH --nodes=1" in script and "orchestration start gpt_smoke" in script
    assert key not in script and key not in submit.stdout + submit.stderr
    seen: dict[int, str | None] = {}
    log = artifact_root / "logs" / "sl_time_node0.log"

    def ranks_seen() -> None:
        seen.update({p: e.get("WANDB_API_KEY") for p in tagged_pids("sl_time") if "LOCAL_RANK" in (e := process_environ(p))})

    def ended() -> bool:
        ranks_seen()
        return job_state(job, slurm_env) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")

    try:
        wait_for(lambda: ranks_seen() or last_iteration(log) >= 5, 300, interval_s=0.5, what="iteration 5")
        signal = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env, capture_output=True, text=True)
        assert signal.returncode == 0, signal.stderr
        wait_for(ended, 600, interval_s=1, what=f"slurm job {job} to end")
        sbatch_log = (artifact_root / "logs" / "sl_time_sbatch.log").read_text()
        assert job_state(job, slurm_env) == "COMPLETED", sbatch_log[-3000:]
    finally:
        subprocess.run(["scancel", job], env=slurm_env)
    assert sbatch_log.count("run sl_time ended: node0 preempted") == 1 and f"slurm job {job} requeued" in sbatch_log, sbatch_log
    assert "resuming from iteration" in sbatch_log and "run sl_time ended: node0 finished" in sbatch_log
    assert_same_losses(artifact_root / "runs" / "sl_time" / "metrics.jsonl", reference)
    assert len(seen) >= 4 and set(seen.values()) == {key}, seen  # both rounds' ranks had it
    for path in [*(artifact_root / "logs").glob("sl_time_*"), *(artifact_root / "run_state").glob("sl_time*")]:
        assert key.encode() not in path.read_bytes(), path
    status = run_script("status_training.sh", "sl_time", env=slurm_env)
    assert f"slurm job {job}: COMPLETED" in status.stdout and " finished " in status.stdout, status.stdout
    assert tagged_pids("sl_time") == []
