"""Restarts that leave out the node the evidence names (orchestration/node/exclusion.py): the policy on
constructed evidence (a hang's suspect twice in a row, GPU health from gpu_health's own parsers on
its samples, a slow rank in metrics records), never node 0, RESTART_EXCLUDE=0 read at the launcher's
edge and carried by the plan, the ledger, the Slurm requeue's rendered ``--exclude``; then a real
run on the namespace cluster: with NNODES=1:2 a node whose rank hangs in two attempts in a row is
left out of the third, which goes on on node 0 alone with the losses of the 2-node attempts, and
the ledger and status name the node and why."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_ext.run_spec.checkpoints import latest_iteration
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED, IterationRecord, parse_log
from megatron_ext.run_spec.resilience import ResilienceParams
from orchestration.cluster import slurm
from orchestration.launch_env import read_launch_env
from orchestration.node import exclusion
from orchestration.node.attempts import AttemptEnd, Decision, Evidence, decide
from orchestration.node.board import Board, MemoryStore
from orchestration.node.exclusion import Charge, ChargeKind, Exclusion, choose_exclusion
from orchestration.node.failure import Failure, FailureKind
from orchestration.node.gpu_health import GpuHealth, gpu_bus_ids, nvidia_smi_findings, xid_findings
from orchestration.node.run_state import AttemptRecord, RunState, begin_attempt, end_attempt, left_out_nodes, read_ledger
from orchestration.node.watchdog import RankReport, find_suspects
from orchestration.runner.submit import requeue_exclusions

from conftest import TEST_DATA, tagged_pids, wait_for, write_data_set

HOSTS = ("g0", "g1", "g2", "g3")


def _record(attempt: int, suspects=(), state=RunState.HUNG, run_id="s1", nodes=(0, 1), **more) -> AttemptRecord:
    return AttemptRecord(attempt=attempt, run_id=run_id, started_at=0.0, checkpoint_at_start=None, state=state, reason="x",
                         nodes=tuple(nodes), suspects=tuple(suspects), **more)


def _report(rank: int, node: int, state="S") -> RankReport:
    return RankReport(rank=rank, node_rank=node, host=f"g{node}", pid=1000 + rank, process_state=state, phase="step",
                      iteration=10, phase_elapsed_s=31.0, limit_s=30.0, stack_read=True, in_collective=True, dump="d")


# -- the evidence ---------------------------------------------------------------------------------------

def test_a_hang_names_its_suspects_node_and_a_failure_its_own_node_not_the_peers():
    hang = Failure(FailureKind.HUNG, 1, "node 1 hung: rank 3 stopped\n", rank=3)
    stopped = [_report(0, 0), _report(1, 0), _report(2, 1), _report(3, 1, "T")]
    assert exclusion.suspect_nodes(hang, stopped, {}) == (1,)
    alike = [_report(0, 0), _report(1, 1)]  # every rank waits in a collective: no one singled out
    assert not find_suspects(alike).named and exclusion.suspect_nodes(hang, alike, {}) == ()
    own = AttemptEnd(node_rank=2, attempt=1, state=RunState.FAILED, reason="r", evidence=Evidence.RANK,
                     failure=Failure(FailureKind.FAILED, 2, "node 2 failed: rank 5\n", rank=5))
    peer = AttemptEnd(node_rank=1, attempt=1, state=RunState.FAILED, reason="r", evidence=Evidence.CONSEQUENCE,
                      failure=Failure(FailureKind.FAILED, 1, "Connection closed by peer\n"))
    ends = {0: None, 1: peer, 2: own}
    assert exclusion.suspect_nodes(own.failure, stopped, ends) == (2,)  # not a hang: the reports name no one
    assert exclusion.suspect_nodes(peer.failure, [], ends) == ()  # a consequence names no one


def test_the_same_node_named_by_two_attempts_in_a_row_of_this_start_is_charged():
    two = [_record(1, (1,)), _record(2, (1,))]
    charges = exclusion.failed_attempts_charges(two, "s1")
    assert [(c.node, c.kind) for c in charges] == [(1, ChargeKind.FAILED_ATTEMPTS)]
    assert "2 attempts in a row (attempt 1 hung, attempt 2 hung" in charges[0].why
    assert exclusion.failed_attempts_charges(two[:1], "s1") == []  # once: not yet
    assert exclusion.failed_attempts_charges([_record(1, (1,)), _record(2, (2,))], "s1") == []  # other nodes
    assert exclusion.failed_attempts_charges([_record(1, (1,)), _record(2, ()), _record(3, (1,))], "s1") == []  # not in a row
    assert exclusion.failed_attempts_charges([_record(1, (1,), run_id="s0"), _record(2, (1,))], "s1") == []  # another start's


def test_only_hardware_findings_of_the_gpu_check_are_evidence_against_a_node():
    smi = (TEST_DATA / "gpu_health" / "nvidia_smi_h200_unhealthy.xml").read_text()
    log = (TEST_DATA / "gpu_health" / "kernel_log_xid.txt").read_text()
    health = GpuHealth(tuple(nvidia_smi_findings(smi) + xid_findings(log, gpu_bus_ids(smi))), ())
    kept = [f.what for f in exclusion.hardware_findings(health)]
    assert any(w.startswith("2 uncorrected ECC errors") for w in kept) and any(w.startswith("Xid 79") for w in kept)
    assert any(w.startswith("Xid 94") for w in kept) and any("row remap is pending" in w for w in kept)
    assert not any(w.startswith("Xid 13 ") for w in kept), kept  # an application's Xid: the GPU stays in service
    assert not any("already runs on it" in w or "in use by no process" in w for w in kept), kept  # someone else's GPU use
    assert exclusion.hardware_findings(None) == () and exclusion.hardware_findings(GpuHealth((), ("no kernel log",))) == ()
    end = AttemptEnd(node_rank=1, attempt=3, state=RunState.STOPPED, reason="r", health=("GPU 0: Xid 79 logged once",))
    assert exclusion.health_charges({0: None, 1: end}) == [
        Charge(1, ChargeKind.GPU_HEALTH, "its GPU health check after attempt 3 found GPU 0: Xid 79 logged once")]


def _metrics(slow_rank: int | None, ratio: float, seconds: float, world: int, step_s: float = 1.0) -> list[IterationRecord]:
    """One record a second: every rank busy 0.1 s per step, ``slow_rank`` ``ratio`` times that and named slow."""
    out = []
    for i in range(int(seconds)):
        busy = [0.1 * (ratio if r == slow_rank else 1.0) for r in range(world)]
        out.append(IterationRecord(iteration=i + 1, train_iters=1000, consumed_samples=0, lm_loss=1.0, lr=1e-4, grad_norm=1.0,
                                   step_time_s=step_s, tokens_per_s=1.0, tflops_per_gpu=0.0, global_batch_size=8,
                                   world_size=world, zero_stage=0, busy_s_per_rank=busy,
                                   slow_ranks=[slow_rank] if slow_rank is not None else [], time=1000.0 + i))
    return out


def test_a_rank_slow_for_two_whole_windows_charges_its_node_where_the_run_is_faster_without_it():
    # 2 nodes x 2 ranks, rank 3 (node 1) 3x the others for 45 s, window 20 s: 2 nodes held back make 2/3 of a node's
    # progress, 1 node alone makes 1: worth it (above 2x)
    charges = exclusion.slow_charges(_metrics(3, 3.0, 45, 4), 20.0, (0, 1), 2)
    assert [(c.node, c.kind) for c in charges] == [(1, ChargeKind.SLOW)]
    assert "its rank 3 was named slow in every record for 45 s (2 windows of 20 s): busy 3.0x" in charges[0].why
    assert exclusion.slow_charges(_metrics(3, 3.0, 35, 4), 20.0, (0, 1), 2) == []  # not yet two whole windows
    assert exclusion.slow_charges(_metrics(3, 1.5, 45, 4), 20.0, (0, 1), 2) == []  # 2 nodes at 1.5x beat 1 node
    assert [c.node for c in exclusion.slow_charges(_metrics(3, 1.5, 45, 4), 20.0, (0, 1, 2, 3), 1)] == [3]  # 4 at 1.5x: not
    assert exclusion.slow_charges(_metrics(None, 1.0, 45, 4), 20.0, (0, 1), 2) == []
    # The nodes of the attempt, not of the start: after node 1 was lost, place 1 is node 2.
    assert [c.node for c in exclusion.slow_charges(_metrics(1, 3.0, 45, 2), 20.0, (0, 2), 1)] == [2]
    caught_up = _metrics(3, 3.0, 45, 4)
    caught_up[-1] = dataclasses.replace(caught_up[-1], slow_ranks=[])
    assert exclusion.slow_charges(caught_up, 20.0, (0, 1), 2) == []


# -- the choice ---------------------------------------------------------------------------------------

HANG_TWICE = Charge(1, ChargeKind.FAILED_ATTEMPTS, "the evidence named it in 2 attempts in a row")


def test_the_node_named_is_left_out_while_min_nodes_stay_never_node_0():
    chosen = choose_exclusion([HANG_TWICE], (0, 1), 1, True, HOSTS)
    assert chosen == Exclusion((1,), "node 1 (g1) left out (the evidence named it in 2 attempts in a row)")
    node0 = choose_exclusion([Charge(0, ChargeKind.FAILED_ATTEMPTS, "named twice")], (0, 1), 1, True, HOSTS)
    assert node0.nodes == () and node0.said.startswith("node 0 (g0) is named (named twice), but node 0 is the run's leader "
                                                       "and rendezvous host and is never left out")
    too_few = choose_exclusion([HANG_TWICE], (0, 1), 2, True, HOSTS)
    assert too_few.nodes == () and "without it 1 node(s) would be left, fewer than the 2" in too_few.said
    fixed = choose_exclusion([HANG_TWICE], (0, 1), 0, True, HOSTS)
    assert fixed.nodes == () and "a run started with a fixed NNODES keeps every node" in fixed.said
    assert choose_exclusion([HANG_TWICE], (0, 2), 1, True, HOSTS) == Exclusion()  # node 1 is not in the run
    assert choose_exclusion([Charge(0, ChargeKind.FAILED_ATTEMPTS, "named twice")], (0,), 0, True, HOSTS) == Exclusion()  # 1 node
    # MIN 2 of 4 with two nodes charged: both go; MIN 3: the GPU fault first, the other kept and said
    gpu = Charge(3, ChargeKind.GPU_HEALTH, "Xid 79")
    assert choose_exclusion([HANG_TWICE, gpu], (0, 1, 2, 3), 2, True, HOSTS).nodes == (1, 3)
    one = choose_exclusion([HANG_TWICE, gpu], (0, 1, 2, 3), 3, True, HOSTS)
    assert one.nodes == (3,) and one.said.startswith("node 3 (g3) left out (Xid 79); node 1 (g1) kept, though")


def test_restart_exclude_0_keeps_every_node_and_says_so_read_at_the_edge_and_carried_by_the_plan(tmp_path):
    kept = choose_exclusion([HANG_TWICE], (0, 1), 1, False, HOSTS)
    assert kept == Exclusion((), "RESTART_EXCLUDE=0: node 1 (g1) kept, though the evidence named it in 2 attempts in a row")
    base = {"ARTIFACT_ROOT": str(tmp_path), "HOSTS": "g0,g1", "NNODES": "1:2"}
    assert read_launch_env(base).restart_exclude is True
    assert read_launch_env({**base, "RESTART_EXCLUDE": "0"}).restart_exclude is False
    assert read_launch_env({**base, "RESTART_EXCLUDE": "on"}).restart_exclude is True
    with pytest.raises(UserError, match=r"RESTART_EXCLUDE='maybe' must be 0 or 1 \(off or on; default 1\)"):
        read_launch_env({**base, "RESTART_EXCLUDE": "maybe"})
    from orchestration.runner.start_plan import plan_start, read_start_inputs

    for value, expected in (("0", False), ("", True)):
        launch = read_launch_env({**base, "RESTART_EXCLUDE": value}, python="/usr/bin/python3", cwd="/work")
        plan = plan_start(launch, read_start_inputs(launch, "gpt_smoke", "smoke", "r1", list(enumerate(launch.hosts))))
        assert [p.restart_exclude for p in plan.nodes] == [expected, expected]  # what node 0's supervisor follows
        assert all(json.loads(p.to_json())["restart_exclude"] is expected for p in plan.nodes)  # and the dry run shows


def test_a_restart_goes_on_without_the_node_left_out_and_every_other_decision_stands():
    policy = ResilienceParams(max_restarts=3, min_nodes=1)
    ends = {n: AttemptEnd(node_rank=n, attempt=2, state=RunState.HUNG, reason="hung") for n in (0, 1)}
    restart = decide(2, ends, [], policy, 1, RunState.HUNG, "node 1 hung: rank 1 stopped", HOSTS)
    applied = exclusion.apply_exclusion(restart, choose_exclusion([HANG_TWICE], restart.members, 1, True, HOSTS))
    assert (applied.restart, applied.members, applied.excluded) == (True, (0,), (1,))
    assert applied.reason == (f"{restart.reason}; node 1 (g1) left out (the evidence named it in 2 attempts in a row); "
                              "attempt 3 runs on 1 node(s)")
    said = exclusion.apply_exclusion(restart, choose_exclusion([HANG_TWICE], restart.members, 1, False, HOSTS))
    assert said.members == (0, 1) and said.excluded == () and said.exclusion.startswith("RESTART_EXCLUDE=0")
    ended = decide(2, ends, [], ResilienceParams(max_restarts=1, min_nodes=1), 1, RunState.HUNG, "hung", HOSTS)
    assert exclusion.apply_exclusion(ended, Exclusion((1,), "x")) == ended  # no restart: nothing to leave out of
    assert exclusion.apply_exclusion(restart, Exclusion()) == restart


def test_a_slow_node_left_out_restarts_at_once_not_counted_against_max_restarts():
    leaving = Exclusion((1,), "node 1 (g1) left out (slow)")
    saved = {n: AttemptEnd(node_rank=n, attempt=4, state=RunState.PREEMPTED, reason="saved") for n in (0, 1)}
    decision = exclusion.decide_leaving(4, saved, leaving, 2, 1, 120)
    assert (decision.restart, decision.members, decision.excluded, decision.restarts, decision.rejoins, decision.backoff_s) == \
        (True, (0,), (1,), 2, 2, 0.0)
    assert decision.reason == "node 1 (g1) left out (slow): restarting as attempt 5 on 1 node(s) from the checkpoint of iteration 120"
    finished = {**saved, 1: AttemptEnd(node_rank=1, attempt=4, state=RunState.FINISHED, reason="done")}
    assert exclusion.decide_leaving(4, finished, leaving, 2, 1, 120).state == RunState.FINISHED
    failed = {**saved, 1: AttemptEnd(node_rank=1, attempt=4, state=RunState.FAILED, reason="x")}
    assert exclusion.decide_leaving(4, failed, leaving, 2, 1, 120) is None  # decide() decides a failure


def test_the_board_carries_the_exclusion_and_the_ledger_keeps_it(tmp_path):
    from megatron_ext.run_spec.run_paths import RunPaths

    board = Board(MemoryStore(), 0)
    assert board.exclusion(3) is None
    board.claim_exclusion(3, Exclusion((1,), "node 1 left out (slow)"))
    board.claim_exclusion(3, Exclusion((2,), "another"))  # the first claim stays
    assert board.exclusion(3) == Exclusion((1,), "node 1 left out (slow)")
    decision = Decision(attempt=2, restart=True, state=RunState.RESTARTING, reason="r", members=(0,), excluded=(1,), exclusion="w")
    board.write_decision(decision)
    assert board.read_decision(2) == decision
    paths = RunPaths(tmp_path, "r")
    paths.run_state_dir.mkdir(parents=True)
    begin_attempt(paths, 2, "s1", 5, (0, 1))
    end_attempt(paths, 2, RunState.HUNG, "hung", 5, suspects=(1,))
    end_attempt(paths, 2, RunState.HUNG, "hung; goes on", 5, excluded=(1,), exclusion="node 1 left out (why)")
    record = read_ledger(paths)[0]
    assert (record.suspects, record.excluded, record.exclusion, record.reason) == ((1,), (1,), "node 1 left out (why)",
                                                                                 "hung; goes on")


# -- what rejoin says and what a requeued Slurm job leaves out ---------------------------------------------

def test_a_requeued_slurm_job_excludes_the_nodes_left_out_and_says_so():
    ledger = [_record(1, (1,), nodes=(0, 1, 2)), _record(2, (1,), nodes=(0, 1, 2), excluded=(1,), exclusion="node 1 (g1) left out (x)"),
              _record(3, nodes=(0, 2), lost=(2,)), _record(4, nodes=(0,), state=RunState.PREEMPTED)]
    assert left_out_nodes(ledger) == {1: "left out after attempt 2: node 1 (g1) left out (x)", 2: "lost in attempt 3"}
    assert left_out_nodes([*ledger, _record(5, nodes=(0, 1))]) == {2: "lost in attempt 3"}  # node 1 back (rejoin)
    out = requeue_exclusions(ledger, HOSTS, enabled=True)
    assert out == {"g1": "node 1 (g1) left out after attempt 2: node 1 (g1) left out (x)", "g2": "node 2 (g2) lost in attempt 3"}
    assert requeue_exclusions(ledger, HOSTS, enabled=False) == {}  # RESTART_EXCLUDE=0: the job requeues as it was
    plan = slurm.plan_requeue("812", list(out), "g7")
    assert plan.exclude == ("g1", "g2") and plan.commands == (
        ("scontrol", "requeuehold", "812"), ("scontrol", "update", "JobId=812", "ExcNodeList=g7,g1,g2"),
        ("scontrol", "release", "812"))
    assert slurm.plan_requeue("812", [], "g7").commands == (("scontrol", "requeue", "812"),)
    assert slurm.plan_requeue("812", ["g1"], "(null)").commands[1][-1] == "ExcNodeList=g1"


# -- a real run: NNODES=1:2, node 1's rank hangs in two attempts in a row --------------------------------------------

def _losses_by_attempt(log: Path) -> list[dict[int, float]]:
    """Each attempt's iteration -> lm loss from rank 0's lines in node 0's log."""
    return [{r.iteration: r.lm_loss for r in parse_log(part)[0]} for part in log.read_text().split(ATTEMPT_STARTED)[1:]]


@pytest.mark.multinode
@pytest.mark.slow
def test_a_node_whose_rank_hangs_twice_is_left_out_and_the_run_goes_on(tmp_path_factory, artifact_root):
    """NNODES=1:2 over 2 nodes x 1 rank, MAX_RESTARTS=3, HANG_STEP_FLOOR_S=5: node 1's rank SIGSTOPped
    in attempt 1 and again in attempt 2; node 0 names node 1 the suspect both times and leaves it out
    of attempt 3, which trains on node 0 alone (2 micro-batches a step where there were 2 ranks of 1)
    from the checkpoint, each iteration's loss that of the 2-node attempts (within float
    reassociation). Node 1's supervisor ends, "left out", nothing of the run left on it; the
    ledger, node 1's exit record and status say which node and why."""
    from netns_cluster import NamespaceCluster, missing_prerequisites
    from conftest import clean_env, require, run_script
    from orchestration.node.watchdog import worker_pids

    require(missing_prerequisites(), "multi-node tests")
    cluster = NamespaceCluster(2, tmp_path_factory.mktemp("cluster")).open()
    run = "mn_excluded"
    env = clean_env(HOSTS="node0,node1", SSH_OPTS=cluster.ssh_opts, MASTER_ADDR=cluster.nodes[0].address, MASTER_PORT="29686",
                    NPROC_PER_NODE="1", GLOO_SOCKET_IFNAME=cluster.interface, ARTIFACT_ROOT=str(artifact_root), LINK_TEST_S="0.3",
                    NNODES="1:2", MAX_RESTARTS="3", HANG_STEP_FLOOR_S="5")
    data = write_data_set(tmp_path_factory.mktemp("data") / "hangs.yaml", train_iters=5000, global_batch=8, save_interval=8,
                          resilience="restart_backoff_s: 1, node_lost_s: 6, join_s: 12")
    node0_log, node1_log = (artifact_root / "logs" / f"{run}_node{n}.log" for n in (0, 1))

    checkpoints = artifact_root / "runs" / run / "checkpoints"
    marks: dict[str, float] = {}

    def stop_node1_rank(attempt: int, after: int) -> None:
        """SIGSTOP node 1's rank once node 1's log shows attempt ``attempt`` past iteration ``after``."""
        wait_for(lambda: max((_losses_by_attempt(node1_log) + [{}] * attempt)[attempt - 1] or [0]) > after, 240,
                 interval_s=0.1, what=f"node 1 past iteration {after} in attempt {attempt}")
        os.kill(worker_pids(run, 1, str(artifact_root))[1], signal.SIGSTOP)
        marks[f"hang {attempt}"] = time.monotonic()

    def attempt_trains(attempt: int, past: int = 0) -> bool:
        losses = _losses_by_attempt(node0_log)
        return len(losses) >= attempt and bool(losses[attempt - 1]) and max(losses[attempt - 1]) > past

    marks["start"] = time.monotonic()
    try:
        start = run_script("start_multinode_training.sh", "gpt_smoke", str(data), run, env=env)
        assert start.returncode == 0, start.stdout + start.stderr
        wait_for(lambda: (latest_iteration(checkpoints) or 0) >= 8, 240, what="the checkpoint of iteration 8")
        stop_node1_rank(1, after=8)
        wait_for(lambda: attempt_trains(2), 120, interval_s=0.2, what="attempt 2's first iteration")
        marks["attempt 2"] = time.monotonic()
        resumed = int(re.findall(r"resuming from iteration (\d+)", node0_log.read_text())[-1])
        stop_node1_rank(2, after=resumed + 3)  # past its warm-up steps (setup's limit), before its next save
        wait_for(lambda: attempt_trains(3), 120, interval_s=0.2, what="attempt 3's first iteration on node 0 alone")
        marks["attempt 3"] = time.monotonic()
        wait_for(lambda: attempt_trains(3, past=resumed + 5), 60, interval_s=0.2, what="attempt 3 to train on")
        assert tagged_pids_on(run, 1) == []  # node 1's part ended: nothing of the run left there
        exit1 = json.loads((artifact_root / "run_state" / f"{run}_node1.exit.json").read_text())
        assert exit1["state"] == "left out" and exit1["reason"].startswith("left out of the run by node 0 after attempt 2: "
                                                                           "node 1 (node1) left out (the evidence named it"), exit1
        ledger = json.loads((artifact_root / "run_state" / f"{run}_attempts.json").read_text())
        assert [(a["state"], a["nodes"], a["suspects"], a["excluded"]) for a in ledger] == [
            ("hung", [0, 1], [1], []), ("hung", [0, 1], [1], [1]), (None, [0], [], [])], ledger
        assert ledger[1]["exclusion"] == ("node 1 (node1) left out (the evidence named it in 2 attempts in a row (attempt 1 "
                                          "hung, attempt 2 hung: a hang's suspect or the failure's own node each time))")
        status = run_script("status_training.sh", run, env=env).stdout
        rows = [line.split()[:4] for line in status.splitlines() if line[:1].isdigit()]
        assert rows == [["0", "node0", "running", rows[0][3]], ["1", "node1", "left", "out"]], status
        assert "attempt 3 of 4 on 1 of 2 nodes: running" in status, status
        assert re.search(r"attempt 2 hung \(checkpoint \d+ -> \d+\); node 1 \(node1\) left out \(the evidence named it in 2 "
                         r"attempts in a row .*\): node 1 hung: rank 1 \(node 1\) stopped", status), status
        losses = _losses_by_attempt(node0_log)
        alone = losses[2]  # 1 rank of 2 micro-batches: the same samples as 2 ranks of 1
        both = {**losses[0], **losses[1]}
        shared = sorted(set(alone) & set(both))
        assert len(shared) >= 3, (losses, shared)
        for it in shared:
            assert abs(alone[it] - both[it]) <= 1e-5 * abs(both[it]), (it, alone[it], both[it])
        went_on = {k: round(marks[f"attempt {n + 1}"] - marks[f"hang {n}"], 1) for n, k in ((1, "hang 1"), (2, "hang 2"))}
        print(f"\nexclusion run: from each hang to the next attempt's first iteration {went_on} s; "
              f"the test {time.monotonic() - marks['start']:.0f} s (the cluster's start before it)")
        print("\n".join(json.dumps(a) for a in ledger))
        print(status)
        assert went_on["hang 2"] <= 60, went_on  # the lost-node test allows 120 s for its next attempt
    finally:
        run_script("stop_multinode_training.sh", run, env=env)
        cluster.close()
    assert tagged_pids(run) == []


def tagged_pids_on(run: str, node: int) -> list[int]:
    from megatron_ext.host.procfs import process_environ

    return [p for p in tagged_pids(run) if process_environ(p).get("LAUNCHER_NODE_RANK") == str(node)]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_batch_job_requeues_itself_without_the_node_left_out(tmp_path):
    """The real Slurm (tests/slurm_cluster.py): a batch job runs slurm.requeue with the plan that
    leaves out its own node, from inside the job as the start does after its save; Slurm takes it
    (requeued held, the node excluded, released) before it ends the job's processes: the job is
    pending again, requeued once, with the node in its ExcNodeList (here its only node, so it stays
    pending and is cancelled)."""
    import subprocess

    from conftest import REPO, require
    from slurm_cluster import SlurmCluster, missing_prerequisites

    require(missing_prerequisites(), "Slurm tests")
    (tmp_path / "slurm").mkdir()
    cluster = SlurmCluster(tmp_path / "slurm").open()
    env = {**os.environ, **cluster.env}
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --output={out}\n#SBATCH --requeue\ncd {REPO}\n"
                      "python3 -c 'import os; from orchestration.cluster import slurm; job = os.environ[\"SLURM_JOB_ID\"]; "
                      "print(\"requeue:\", slurm.requeue(slurm.plan_requeue(job, [os.environ[\"SLURMD_NODENAME\"]], "
                      "slurm.job_field(job, \"ExcNodeList\"))), flush=True)'\n")
    job = ""
    try:
        job = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()

        def fields() -> dict[str, str]:
            show = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
            return dict(w.split("=", 1) for w in show.split() if "=" in w)

        requeued = wait_for(lambda: (f := fields()).get("Restarts") == "1" and f.get("JobState") == "PENDING" and f, 60,
                            interval_s=0.5, what="the job requeued")
        assert requeued["ExcNodeList"] == cluster.hostname and requeued["Priority"] != "0", requeued  # excluded, released
        assert "requeue: None" in out.read_text(), out.read_text()  # every command taken, before the job was ended
    finally:
        if job:
            subprocess.run(["scancel", job], env=env)
        cluster.close()
