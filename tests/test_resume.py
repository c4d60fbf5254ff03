"""Checkpoints and exact resume, through the multi-node start and stop scripts on the namespace
cluster (2 nodes x 1 CPU process, over ssh; tests/netns_cluster.py): a run stopped after a
checkpoint and started again gives the same lm loss at every iteration as a run that was never
stopped, under ZeRO stage 3, past a crash during a save (the previous checkpoint is the one
resumed) and a checkpoint with a changed byte (named, moved aside and passed over for the newest
that verifies); another data-parallel size (2 nodes x 2) is resharded (stage 3, that run's
checkpoint) or refused with the reason (stage 1), before anything starts. MASTER_PORT is left
unset: each start takes a free port.

The other stages resume exactly elsewhere, from runs those tests make anyway (CI time: each stage
here is three 2-node runs): stage 1 in the restarts of tests/test_resilience.py and test_slurm.py
(every iteration's loss to 1e-6 of an uninterrupted run), stage 0 in test_multinode.py's lost node
(a stage-0 checkpoint of 2 ranks resumed by 1, every loss to 1e-5); stage 2 saves and loads as
stage 3 does on the CPU (FSDP2's DTensor state; only reshard_after_forward differs)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from megatron_ext.run_spec.checkpoints import latest_iteration
from megatron_ext.run_spec.iteration_log import parse_log
from orchestration.node.watchdog import worker_pids

from netns_cluster import NamespaceCluster, missing_prerequisites
from standins import PAD_BYTES, pad_checkpoint
from conftest import REPO, clean_env, require, run_script, run_torchrun, tagged_pids, wait_for

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

ITERS = 20
SAVE_EVERY = 5


def write_resume_data_set(path, training: str = "") -> str:
    """gpt_smoke-sized schedule with checkpoints; a fixed global batch, so another data-parallel
    size can resume it (8: 2 ranks x 2 micro-batches of 2, or 4 ranks x 1); ``training``: more of
    its lines (indented)."""
    path.write_text(
        "data:\n  source: embedded\n  split: \"95,5,0\"\n  tokenizer: {type: sentencepiece, vocab_size: 2048}\n"
        f"training:\n  seq_length: 128\n  micro_batch_size: 2\n  global_batch_size: 8\n  train_iters: {ITERS}\n"
        f"  lr: 3.0e-3\n  min_lr: 3.0e-4\n  lr_warmup_iters: 3\n  weight_decay: 0.01\n  eval_iters: 0\n"
        f"  save_interval: {SAVE_EVERY}\n  keep_checkpoints: 2\n" + training
    )
    return str(path)


def losses_from_log(log) -> dict[int, float]:
    """lm loss per iteration from a node log; a resumed run's later lines win."""
    records, skipped = parse_log(log.read_text(errors="replace"))
    assert skipped == 0
    return {r.iteration: r.lm_loss for r in records}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, artifact_root):
    """Node 1 sees the artifact root only through sshfs (tests/netns_cluster.py)."""
    require(missing_prerequisites(share=True), "multi-node tests")
    c = NamespaceCluster(2, tmp_path_factory.mktemp("resume_cluster"), share=artifact_root).open()
    yield c
    c.close()


@pytest.fixture(scope="module")
def resume_env(cluster, artifact_root):
    return clean_env(ARTIFACT_ROOT=str(artifact_root), NPROC_PER_NODE="1", HOSTS="node0,node1", SSH_OPTS=cluster.ssh_opts,
                     MASTER_ADDR=cluster.nodes[0].address, GLOO_SOCKET_IFNAME=cluster.interface, LINK_TEST_S="0.3")


@pytest.fixture(scope="module")
def reference(resume_env, artifact_root, tmp_path_factory):
    """(data set, losses of the run never stopped under ``stage``), one run per stage, on demand, on
    the cluster as the stopped runs (a rank's CPU threads follow the processes per node, and the
    comparison is exact to 1e-6: a 1-node reference of the same 2 ranks would differ in that)."""
    data = write_resume_data_set(tmp_path_factory.mktemp("resume") / "resume.yaml")
    losses: dict[int, dict[int, float]] = {}

    def expected(stage: int) -> dict[int, float]:
        if stage not in losses:
            run = f"resume_ref_z{stage}"
            env = {**resume_env, "ZERO_STAGE": str(stage)}
            assert run_script("start_multinode_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
            wait_for(lambda: not tagged_pids(run), 300, what="the reference run to finish")
            losses[stage] = losses_from_log(artifact_root / "logs" / f"{run}_node0.log")
            assert sorted(losses[stage]) == list(range(1, ITERS + 1))
        return losses[stage]

    return data, expected


def signal_pending(pid: int) -> bool:
    """Whether a signal waits for ``pid`` (a stopped process keeps what it is sent: ShdPnd), or it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return int(next(l.split()[1] for l in status.splitlines() if l.startswith("ShdPnd:")), 16) != 0


def stop_after_a_checkpoint(run: str, data: str, env: dict, root) -> int:
    """Start ``run``, stop it once a checkpoint exists (before the end); the checkpoint's iteration.
    The ranks are held (SIGSTOP) from the first checkpoint until the stop's signal reaches them, so
    the stop lands before the end however fast the ranks are and however slow ssh is."""
    start = run_script("start_multinode_training.sh", "gpt_smoke", data, run, env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    checkpoints = root / "runs" / run / "checkpoints"
    wait_for(lambda: latest_iteration(checkpoints), 240, interval_s=0.2, what="a first checkpoint")
    ranks = [pid for node in (0, 1) for pid in worker_pids(run, node).values()]  # not their children (async saves)
    assert len(ranks) == 2, ranks
    try:
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        stopping = subprocess.Popen(["bash", str(REPO / "training_scripts" / "stop_multinode_training.sh"), run], env=env,
                                    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: all(signal_pending(pid) for pid in ranks), 120, interval_s=0.1, what="the stop's signal to reach the ranks")
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    out, _ = stopping.communicate(timeout=300)
    assert stopping.returncode == 0, out
    assert tagged_pids(run) == []
    saved = latest_iteration(checkpoints)
    assert saved is not None and saved < ITERS, f"stopped too late: checkpoint {saved}"
    return saved


def plant_a_crash_and_a_damaged_checkpoint(checkpoints, saved: int) -> tuple[str, str]:
    """What a process killed in the middle of a save leaves behind (the next save's directory with
    some shards and no meta.json, a half-written marker beside ``latest``), and a complete checkpoint
    after it with one byte changed in a shard (a storage fault), which ``latest`` names. The
    damaged checkpoint's name and its shard's."""
    good = checkpoints / f"iter_{saved:07d}"
    assert sorted(p.name for p in (good / "checksums").iterdir()) == ["rank0.json", "rank1.json"]
    torn = checkpoints / f"iter_{saved + SAVE_EVERY:07d}"
    shutil.rmtree(torn, ignore_errors=True)
    shutil.copytree(good, torn)
    (torn / "meta.json").unlink()
    next(torn.glob("*.distcp")).write_bytes(b"torn")
    damaged = checkpoints / f"iter_{saved + 1:07d}"  # below train_iters whatever saved is
    shutil.copytree(good, damaged)
    shard = sorted(damaged.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    (checkpoints / "latest").write_text(damaged.name)
    (checkpoints / ".latest.tmp").write_text(torn.name[:6])
    return damaged.name, shard.name


def copy_stopped_run(root, run: str, copy: str) -> None:
    """``run`` as it was stopped (checkpoints, metrics, node logs), under the name ``copy``:
    another start of the same stopped run, without stopping one again."""
    shutil.rmtree(root / "runs" / copy, ignore_errors=True)
    shutil.copytree(root / "runs" / run, root / "runs" / copy)
    for log in (root / "logs").glob(f"{run}_node*.log"):
        shutil.copyfile(log, root / "logs" / log.name.replace(run, copy, 1))


STOPPED: dict[str, int] = {}
"""Copies of stopped runs made by the exact-resume test, and their checkpoint's iteration."""


def test_stop_and_start_again_resumes_exactly_past_a_torn_and_a_damaged_checkpoint(reference, resume_env, artifact_root):
    """Stage 3, stopped after a checkpoint, then a crash during a save and a damaged latest
    checkpoint planted (:func:`plant_a_crash_and_a_damaged_checkpoint`): the start verifies, names
    the damaged file, moves that checkpoint aside, resumes from the newest that verifies with the
    exact losses, and overwrites the torn one when it gets there. The one it resumes from is padded
    to ``CHECKPOINT_PAD_GB`` (standins.pad_checkpoint: 1 GB here, 100 GB by hand), half in each
    node's writer, so each node's rank reads its half through at the resume (node 1's over the
    share), and the watchdog's limits allow for its size (issue 54)."""
    stage = 3
    data, expected_for = reference
    expected = expected_for(stage)  # the same stage never stopped: stages differ in float reassociation across nodes
    run = f"resume_z{stage}"
    env = {**resume_env, "ZERO_STAGE": str(stage)}
    saved = stop_after_a_checkpoint(run, data, env, artifact_root)
    checkpoints = artifact_root / "runs" / run / "checkpoints"
    copy_stopped_run(artifact_root, run, "reshard_z3")  # the resharding test starts it again on 4 ranks, undamaged
    STOPPED["reshard_z3"] = saved
    damaged, shard = plant_a_crash_and_a_damaged_checkpoint(checkpoints, saved)
    pad_checkpoint(checkpoints / f"iter_{saved:07d}", PAD_BYTES, writers=(0, 1))
    size = sum(p.stat().st_size for p in (checkpoints / f"iter_{saved:07d}").rglob("*") if p.is_file())
    again = run_script("start_multinode_training.sh", "gpt_smoke", data, run, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    wait_for(lambda: not tagged_pids(run), 300 + PAD_BYTES / 20e6, what="the resumed run to finish")
    log = artifact_root / "logs" / f"{run}_node0.log"
    text = log.read_text()
    assert f"the watchdog allows for the {size / 1e9:.1f} GB checkpoint of iter_{saved:07d}: setup " in text, text[-3000:]
    assert "lost" not in text.rpartition(f"resuming from iteration {saved} (")[2], text[-3000:]
    assert f"resuming from iteration {saved} (" in text
    assert f"warning: the checkpoint of iteration {saved + 1} is damaged ({shard}: other bytes (CRC-32 " in text, text[-3000:]
    assert f"moved aside as {damaged}.damaged" in text and (checkpoints / f"{damaged}.damaged" / shard).is_file()
    status = run_script("status_training.sh", run, env=env).stdout  # the sizes of the kept ones, and that one
    assert f"; moved aside as damaged: {saved + 1} (check_checkpoints.sh {run} reads every byte)" in status, status
    losses = losses_from_log(log)
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert abs(losses[it] - expected[it]) <= 1e-6 * abs(expected[it]), (it, losses[it], expected[it])
    # Metrics continue after the checkpoint instead of starting anew.
    metrics = [json.loads(l)["iteration"] for l in (artifact_root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    assert metrics == list(range(1, ITERS + 1))
    kept = sorted(p.name for p in checkpoints.glob("iter_*") if p.name[5:].isdigit())
    assert len(kept) == 2 and kept[-1] == f"iter_{ITERS:07d}"  # keep_checkpoints: 2


def test_another_data_parallel_size_reshards_stage_3_and_refuses_stage_1(reference, resume_env, artifact_root):
    data, expected_for = reference
    for stage, run in ((3, "reshard_z3"), (1, "reshard_z1")):
        env = {**resume_env, "ZERO_STAGE": str(stage)}
        if stage == 1:  # the refusal reads the checkpoint's record before anything starts: 2 ranks on this machine made it
            made, _ = run_torchrun(artifact_root, run, nproc=2, data=data, train_iters=SAVE_EVERY, ZERO_STAGE="1")
            assert made.returncode == 0 and latest_iteration(artifact_root / "runs" / run / "checkpoints") == SAVE_EVERY, \
                made.stderr[-2000:]
        else:
            saved = STOPPED.get(run) or stop_after_a_checkpoint(run, data, env, artifact_root)
        wider = {**env, "NPROC_PER_NODE": "2"}
        again = run_script("start_multinode_training.sh", "gpt_smoke", data, run, env=wider)
        if stage == 1:
            assert again.returncode == 2 and tagged_pids(run) == []
            assert ("holds ZeroRedundancyOptimizer partitions of 2 ranks, which cannot be resharded to 4 ranks; "
                    "resume with 2 ranks") in again.stderr and again.stderr.count("error:") == 1
            continue
        assert again.returncode == 0, again.stderr
        assert "note: resharding the checkpoint of 2 ranks to 4" in again.stderr
        assert f"resuming from iteration {saved}" in again.stdout
        wait_for(lambda: not tagged_pids(run), 400, what="the resharded run to finish")
        log = (artifact_root / "logs" / f"{run}_node0.log").read_text()
        assert "resharding the checkpoint of 2 ranks to 4" in log
        losses = losses_from_log(artifact_root / "logs" / f"{run}_node0.log")
        assert sorted(losses) == list(range(1, ITERS + 1))
        # The same model, optimizer state and samples: the loss continues where it was, within
        # float reassociation (4 ranks sum the gradients in another order than 2).
        expected = expected_for(3)
        for it in range(saved + 1, ITERS + 1):
            assert abs(losses[it] - expected[it]) <= 1e-3 * abs(expected[it]), (it, losses[it], expected[it])


def test_a_save_in_the_background_lets_training_go_on_and_a_kill_during_it_resumes_from_the_one_before(
        reference, resume_env, artifact_root, cluster, tmp_path):
    """Stage 3 with ``training.async_save: true`` (on CPU too: the default writes in the background on
    GPUs only; the same data set otherwise, so the run never stopped is the reference). After the first checkpoint node 1's
    link to the file server alone is held to 2 Mbit/s: its 7 MB part of the next checkpoint takes
    about 30 s to write, about 80 steps of this model. That is the user's case scaled: a node's
    112 GB share of a Qwen3-32B checkpoint at 1 GB/s takes two minutes, through which steps of
    seconds go on. Training goes past iteration 12 while iteration 10's checkpoint is still a
    ``.iter_0000010.saving-*`` folder without node 1's checksums and ``latest`` names 5; node 1's
    rank is then SIGKILLed in the middle of its write. With MAX_RESTARTS=1 the run restarts from
    iteration 5 (the save was never committed), every loss within 1e-6 of the run never stopped,
    and nothing of the partial folder is left at the end."""
    stage = 3
    data, expected_for = reference
    expected = expected_for(stage)
    data = write_resume_data_set(tmp_path / "background.yaml", "  async_save: true\n")
    run = "background_save_z3"
    env = {**resume_env, "ZERO_STAGE": str(stage), "MAX_RESTARTS": "1"}
    checkpoints = artifact_root / "runs" / run / "checkpoints"
    log = artifact_root / "logs" / f"{run}_node0.log"
    start = run_script("start_multinode_training.sh", "gpt_smoke", data, run, env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        wait_for(lambda: latest_iteration(checkpoints), 240, interval_s=0.1, what="the first checkpoint")
        cluster.throttle_share(cluster.nodes[1], "2mbit")
        assert latest_iteration(checkpoints) == SAVE_EVERY, "the first checkpoint came too late: raise ITERS"

        def writing_while_training() -> bool:
            folders = list(checkpoints.glob(f".iter_{2 * SAVE_EVERY:07d}.saving-*"))
            return bool(folders) and re.search(r"iteration\s+12/", log.read_text(errors="replace")) is not None
        wait_for(writing_while_training, 120, interval_s=0.1, what="iteration 12 while iteration 10 is written")
        folder = next(checkpoints.glob(f".iter_{2 * SAVE_EVERY:07d}.saving-*"))
        assert not (folder / "checksums" / "rank1.json").exists() and latest_iteration(checkpoints) == SAVE_EVERY
        (node1_rank,) = worker_pids(run, 1).values()
        os.kill(node1_rank, signal.SIGKILL)
    finally:
        cluster.unthrottle(cluster.nodes[1])
    wait_for(lambda: not tagged_pids(run), 300, what="the restarted run to finish")
    text = log.read_text()
    assert f"resuming from iteration {SAVE_EVERY} (" in text, text[-3000:]
    losses = losses_from_log(log)
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert abs(losses[it] - expected[it]) <= 1e-6 * abs(expected[it]), (it, losses[it], expected[it])
    assert re.search(r"saved checkpoint at iteration 5 to \S+ in [\d.]+ s \(checksums [\d.]+ s of it; "
                     r"training waited [\d.]+ s\)", text), text[-3000:]
    assert sorted(p.name for p in checkpoints.glob("*iter_*")) == ["iter_0000015", "iter_0000020"]  # no partial folder
