"""Faults of the cluster itself, on a real 2-node cluster (network namespaces, an OpenSSH server
per node, the artifact root through sshfs from a file server of its own: tests/netns_cluster.py):

- node 0 cut off the network (its link set down: packets vanish, no connection is closed): node
  1's supervisor finds node 0 silent by its own clock and stops its ranks, naming node 0, within
  ``node_lost_s`` and a stop; no TCP timeout (about 15 minutes) is waited for;
- node 1's share gone (its sshfs client killed: ENOTCONN there): every process of the run ends,
  and the failure node 0 records names node 1 and the artifact root, not the "Connection closed by
  peer" the other ranks raised after; the same for a share that hangs (its client SIGSTOPped);
- a supervisor's main thread held past ``node_lost_s`` (node 1's stop of a rank that does not end
  at SIGTERM, torchrun's own 30 s before its SIGKILL): its beat runs in a thread of its own, so
  node 0 takes no node for lost, and the run restarts on both nodes.

2 nodes x 1 process of gpt_smoke, ``node_lost_s`` 6 s. With CI=true a missing prerequisite is a
failure, not a skip."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from netns_cluster import NamespaceCluster, missing_prerequisites
from conftest import clean_env, last_iteration, require, run_script, tagged_pids, wait_for, write_data_set
from orchestration.node.watchdog import worker_pids

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

NODE_LOST_S = 6
RESILIENCE = f"node_lost_s: {NODE_LOST_S}, join_s: 30, restart_backoff_s: 1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, artifact_root):
    require(missing_prerequisites(share=True), "multi-node tests")
    c = NamespaceCluster(2, tmp_path_factory.mktemp("faults_cluster"), share=artifact_root).open()
    yield c
    c.close()


@pytest.fixture()
def env(cluster, artifact_root):
    return clean_env(HOSTS="node0,node1", SSH_OPTS=cluster.ssh_opts, MASTER_ADDR=cluster.nodes[0].address,
                     NPROC_PER_NODE="1", GLOO_SOCKET_IFNAME=cluster.interface, ARTIFACT_ROOT=str(artifact_root),
                     LINK_TEST_S="0.3", MASTER_PORT="29750")


def exit_record(artifact_root: Path, run: str, node: int) -> dict | None:
    path = artifact_root / "run_state" / f"{run}_node{node}.exit.json"
    return json.loads(path.read_text()) if path.exists() else None


def start_long_run(run: str, env: dict, artifact_root: Path, tmp_path: Path, iterations: int) -> None:
    """A 2 x 1 run of 5000 iterations started, and trained on node 1 to ``iterations``."""
    data = write_data_set(tmp_path / "long.yaml", train_iters=5000, global_batch=8, resilience=RESILIENCE)
    start = run_script("start_multinode_training.sh", "gpt_smoke", data, run, env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    wait_for(lambda: last_iteration(artifact_root / "logs" / f"{run}_node1.log") >= iterations, 240, what="node 1 to train")


def test_node_0_cut_off_ends_node_1s_part_within_node_lost_s_naming_node_0(cluster, env, artifact_root, tmp_path):
    """Node 0's link down at iteration 2: node 1 stops its ranks, naming node 0, within
    node_lost_s and a stop (its store calls end by their deadline; its beat finds node 0 silent)."""
    run = "cf_cut"
    try:
        start_long_run(run, env, artifact_root, tmp_path, 2)
        assert set(tagged_pids(run)) & _node_pids(cluster, 1)
        cluster.cut(cluster.nodes[0])
        cut_at = time.monotonic()
        # node 1's every process of the run (its supervisor, torchrun, its rank) gone, its record written
        wait_for(lambda: exit_record(artifact_root, run, 1) is not None and not set(tagged_pids(run)) & _node_pids(cluster, 1),
                 120, interval_s=0.2, what="node 1's part to end")
        ended_s = time.monotonic() - cut_at
        ended = exit_record(artifact_root, run, 1)
        assert ended["state"] == "failed" and "lost node 0 (the run's leader)" in ended["reason"], ended
        # node_lost_s to find node 0 silent (a store call out at most as long), then torchrun's stop
        assert ended_s < NODE_LOST_S + 45, ended_s
        log1 = (artifact_root / "logs" / f"{run}_node1.log").read_text()
        assert "stopping torchrun: node 0's" in log1, log1[-3000:]
        wait_for(lambda: exit_record(artifact_root, run, 0) is not None, 120, what="node 0's part to end")
        assert "node 1 (node1) lost" in exit_record(artifact_root, run, 0)["reason"] or \
            "node 1 (node1) gone" in exit_record(artifact_root, run, 0)["reason"], exit_record(artifact_root, run, 0)
        print(f"node 1's part ended {ended_s:.1f} s after node 0's link was cut (node_lost_s {NODE_LOST_S})")
    finally:
        cluster.mend(cluster.nodes[0])
        run_script("stop_multinode_training.sh", run, env=env)
    wait_for(lambda: not tagged_pids(run), 60, what="nothing of the run left")


@contextlib.contextmanager
def node_1s_share_broken(cluster, run: str, env: dict, artifact_root: Path, tmp_path: Path,
                         break_share: Callable[[object], int], limit_s: float) -> Iterator[tuple[float, str]]:
    """A long run trained to iteration 3 on both nodes, then ``break_share(node 1)`` (the cluster's
    ``lose_share`` or ``hang_share``): yields the seconds until every process of the run had ended
    and node 0's failure text. After, node 1 mended (its sshfs client gone, its sshd and mount
    namespace anew) and the run stopped."""
    try:
        start_long_run(run, env, artifact_root, tmp_path, 3)
        break_share(cluster.nodes[1])
        broken_at = time.monotonic()
        wait_for(lambda: not tagged_pids(run), limit_s, interval_s=0.2, what="every process of the run to end")
        ended_s = time.monotonic() - broken_at
        yield ended_s, (artifact_root / "run_state" / f"{run}_failure.txt").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):  # a hung client killed; a lost one is gone already
            cluster.lose_share(cluster.nodes[1])
        cluster.kill_sshd(cluster.nodes[1])  # its sessions and their broken mount go with its mount namespace
        cluster.start_sshd(cluster.nodes[1])
        cluster.wait_for_ssh(cluster.nodes[1])
        run_script("stop_multinode_training.sh", run, env=env)
    wait_for(lambda: not tagged_pids(run), 60, what="nothing of the run left")


def test_node_1s_share_lost_ends_the_run_naming_node_1_and_the_file_system(cluster, env, artifact_root, tmp_path):
    """Node 1's sshfs client killed at iteration 3: every process of the run ends; node 0 records
    node 1's cause (the artifact root unreachable, with the error), though its own ranks' "Connection
    closed by peer" may have been claimed first; node 1 leaves the run (the ledger says it cannot go
    on); status, asked on node 0 alone, shows it."""
    run = "cf_share"
    with node_1s_share_broken(cluster, run, env, artifact_root, tmp_path, cluster.lose_share, 120) as (ended_s, failure):
        assert failure.startswith(f"node 1 (node1): the artifact root {artifact_root} is unreachable: [Errno 107] "), failure
        ledger = json.loads((artifact_root / "run_state" / f"{run}_attempts.json").read_text())
        assert ledger[-1]["state"] == "failed" and "node 1 (node1) cannot go on" in ledger[-1]["reason"], ledger
        assert exit_record(artifact_root, run, 0)["state"] == "failed"
        status = run_script("status_training.sh", run, env={**env, "HOSTS": "node0"}).stdout
        assert "the artifact root" in status and "node 1 (node1)" in status, status
        print(f"every process of the run ended {ended_s:.1f} s after node 1's share was lost")


def test_node_1s_share_hung_ends_the_run_naming_node_1_and_the_file_system(cluster, env, artifact_root, tmp_path):
    """Node 1's sshfs client SIGSTOPped at iteration 3 (a hard mount whose server is gone: every
    call on the share waits, a log line too): the heartbeat record's write misses its deadline, the
    node's part ends, by its main thread or, stuck on the share, by its beat thread; every process
    of the run ends, and node 0 records node 1's cause."""
    run = "cf_hung"
    with node_1s_share_broken(cluster, run, env, artifact_root, tmp_path, cluster.hang_share, 180) as (ended_s, failure):
        assert failure.startswith(f"node 1 (node1): the artifact root {artifact_root} is unreachable: "), failure
        assert exit_record(artifact_root, run, 0)["state"] == "failed"
        print(f"every process of the run ended {ended_s:.1f} s after node 1's share hung (node_lost_s {NODE_LOST_S})")


def test_a_stop_held_past_node_lost_s_takes_no_node_for_lost(cluster, env, artifact_root, tmp_path):
    """After the first checkpoint node 1's rank is SIGSTOPped and node 0's SIGKILLed: node 1's stop
    of its torchrun takes torchrun's 30 s (node_lost_s 6 s), node 0 waits for node 1's end, names
    node 0's rank, loses no node, and restarts on both (MAX_RESTARTS 1)."""
    data = write_data_set(tmp_path / "short.yaml", train_iters=5000, global_batch=8, save_interval=5,
                          resilience=f"node_lost_s: {NODE_LOST_S}, join_s: 90, restart_backoff_s: 1, max_restarts: 1")
    run = "cf_held"
    held = None
    try:
        start = run_script("start_multinode_training.sh", "gpt_smoke", data, run, env=env)
        assert start.returncode == 0, start.stdout + start.stderr
        wait_for(lambda: (artifact_root / "runs" / run / "checkpoints" / "latest").exists(), 240, what="a checkpoint")
        held = next(iter(worker_pids(run, 1, str(artifact_root)).values()))
        os.kill(held, signal.SIGSTOP)  # it cannot act on torchrun's SIGTERM: node 1's stop takes torchrun's 30 s
        os.kill(next(iter(worker_pids(run, 0, str(artifact_root)).values())), signal.SIGKILL)
        log1 = artifact_root / "logs" / f"{run}_node1.log"
        wait_for(lambda: "attempt 2 of 2: starting torchrun" in log1.read_text(), 180, what="node 1's attempt 2")
        held = None
        ledger = json.loads((artifact_root / "run_state" / f"{run}_attempts.json").read_text())
        assert [(a["nodes"], a["lost"]) for a in ledger] == [([0, 1], []), ([0, 1], [])], ledger
        assert ledger[0]["reason"].startswith("node 0 (node0) failed: torchrun exit code 1; rank 0"), ledger[0]
        text = log1.read_text()
        assert "stopping torchrun: another node failed" in text and " lost" not in text, text[-3000:]
    finally:
        if held is not None:
            os.kill(held, signal.SIGCONT)
        run_script("stop_multinode_training.sh", run, env=env)
    wait_for(lambda: not tagged_pids(run), 60, what="nothing of the run left")


def _node_pids(cluster, node: int) -> set[int]:
    return set(cluster.namespace_pids(cluster.nodes[node]))
