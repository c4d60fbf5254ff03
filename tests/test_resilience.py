"""Runs that finish unattended, on one node: the restart decision and the suspects (pure), then real
runs through the scripts — a worker SIGKILLed and later another SIGSTOPped with MAX_RESTARTS=3
finishes by itself with an uninterrupted run's loss at every iteration; ``stop --save`` saves and
the next start resumes there; ENGINE=megatron-lm's log watch finds a stopped last rank. The
2-node hang, restart, breaker and slow-rank tests are in test_multinode.py, the Slurm time limit in
test_slurm.py."""

from __future__ import annotations

import dataclasses

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_ext.run_spec.checkpoints import latest_iteration
from megatron_ext.run_spec.errors import FINAL, UserError
from megatron_ext.run_spec.engines import MEGATRON_LM
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED
from megatron_ext.run_spec.resilience import (Phase, RankProgress, ResilienceParams, PauseSchedule, for_checkpoint, phase_limit_s,
                                              read_resilience_overrides)
from orchestration.node.attempts import AttemptEnd, AttemptRecord, Evidence, decide, decide_rejoin, trained_to_the_end
from megatron_ext.host.procfs import process_environ
from orchestration.node.run_state import RunState
from orchestration.node.watchdog import RankReport, Watchdog, find_suspects, in_collective

from run_checks import assert_goodput_of_two_faults
from standins import STANDIN_PRETRAIN_GPT, all_rendered_flags, write_checkout
from conftest import (REPO, TEST_DATA, UNATTENDED_SAVE_EVERY, assert_same_losses, clean_env, free_port, last_iteration, megatron_lm_env,
                      run_script, slowed, tagged_pids, wait_for, write_data_set)

POLICY = ResilienceParams(max_restarts=3, attempts_without_progress=2)


# -- pure parts ---------------------------------------------------------------------------------------

def _end(rank, state=RunState.FAILED, requested=False):
    return AttemptEnd(node_rank=rank, attempt=1, state=state, reason="x", requested=requested)


def _record(attempt, start, end):
    return AttemptRecord(attempt=attempt, run_id="r-1", started_at=0.0, checkpoint_at_start=start, ended_at=1.0, state=RunState.FAILED,
                         reason="x", checkpoint_at_end=end)


def test_decide_restarts_gives_up_and_ends():
    ends = {0: _end(0, RunState.STOPPED), 1: _end(1)}
    progressed = [_record(1, None, 50)]
    d = decide(1, ends, progressed, POLICY, 0, RunState.FAILED, "node 1 failed")
    assert d.restart and d.backoff_s == POLICY.restart_backoff_s
    assert d.reason == "restarting as attempt 2 in 5 s: node 1 failed"
    stuck = [_record(1, None, 50), _record(2, 50, 50), _record(3, 50, 50)]
    gave_up = decide(3, ends, stuck, POLICY, 2, RunState.HUNG, "node 1 hung: ...")
    assert not gave_up.restart and gave_up.state == RunState.GAVE_UP
    assert gave_up.reason.startswith("2 attempts in a row made no progress (no new checkpoint); the last ended: node 1 hung")
    lost = decide(1, {0: _end(0), 1: None}, progressed, POLICY, 0, RunState.FAILED, "x", ("n0", "n1"))
    assert not lost.restart and lost.lost == (1,) and lost.reason.startswith(
        "node 1 (n1) gone (its machine or its supervisor: no end of attempt 1 and no heartbeat within 120 s): the run "
        "ends: NNODES=MIN:MAX would let it go on with the nodes left")
    assert decide(1, {0: _end(0, RunState.STOPPED, requested=True), 1: _end(1)}, progressed, POLICY, 0,
                  RunState.FAILED, "x").state == RunState.STOPPED
    stopped = decide(1, {0: _end(0, RunState.STOPPED, requested=True), 1: None}, progressed, POLICY, 0, RunState.FAILED, "x")
    assert stopped.state == RunState.STOPPED and stopped.lost == ()  # a stop asked: a node slower to end is no loss
    leaving = AttemptEnd(node_rank=1, attempt=1, state=RunState.FAILED, reason="node 1 (n1): the artifact root /a is "
                         "unreachable: [Errno 107] Transport endpoint is not connected", leaves=True)
    left = decide(1, {0: _end(0, RunState.STOPPED), 1: leaving}, progressed, POLICY, 0, RunState.FAILED, "x", ("n0", "n1"))
    assert not left.restart and left.lost == (1,) and left.reason.startswith(
        "node 1 (n1) cannot go on (node 1 (n1): the artifact root /a is unreachable: [Errno 107]")
    spent = decide(4, ends, [_record(4, 50, 60)], POLICY, 3, RunState.FAILED, "node 1 failed")
    assert not spent.restart and spent.state == RunState.FAILED and "after 3 restart(s) (MAX_RESTARTS=3)" in spent.reason
    full = decide(1, ends, progressed, POLICY, 0, RunState.FAILED,
                  f"node 0 (h) failed: torchrun exit code 1; rank 0: error: disk full: /c, 0.01 GB free ...; {FINAL}, so ...")
    assert not full.restart and full.state == RunState.FAILED and "disk full" in full.reason


def test_a_finished_node_finishes_the_run_whatever_its_peers_made_of_its_teardown():
    """One node finished (its ranks took every step with the others): the others' failing only as
    their peers went (gloo's "Connection closed by peer" at teardown) or stopping for that is no
    reason to restart; a failure of a rank's own, a hang, a lost node or a stop asked is."""
    def end(rank, state, evidence=Evidence.NONE, **more):
        return AttemptEnd(node_rank=rank, attempt=1, state=state, reason="x", evidence=evidence, **more)

    finished, preempted = end(0, RunState.FINISHED), end(0, RunState.PREEMPTED)
    assert trained_to_the_end({0: finished, 1: end(1, RunState.FINISHED)})
    assert trained_to_the_end({0: preempted, 1: end(1, RunState.PREEMPTED)})
    assert trained_to_the_end({0: finished, 1: end(1, RunState.FAILED, Evidence.CONSEQUENCE)})
    assert trained_to_the_end({0: finished, 1: end(1, RunState.STOPPED)})
    assert not trained_to_the_end({0: preempted, 1: end(1, RunState.FAILED, Evidence.CONSEQUENCE)})
    assert not trained_to_the_end({0: finished, 1: end(1, RunState.FAILED, Evidence.RANK)})
    assert not trained_to_the_end({0: finished, 1: end(1, RunState.HUNG)})
    assert not trained_to_the_end({0: finished, 1: None})
    assert not trained_to_the_end({0: finished, 1: end(1, RunState.STOPPED, requested=True)})


def test_a_lost_node_is_left_out_when_enough_are_left_and_node_0_never():
    """NNODES=MIN:MAX (training.resilience.min_nodes): the nodes left go on; fewer than MIN, or node 0
    (the rendezvous host and the leader) lost, end the run saying so."""
    elastic = dataclasses.replace(POLICY, min_nodes=2)
    progressed = [_record(1, None, 50)]
    ends = {0: _end(0, RunState.STOPPED), 1: None, 2: _end(2, RunState.STOPPED)}
    d = decide(1, ends, progressed, elastic, 0, RunState.FAILED, "node 1 lost: no heartbeat", ("a", "b", "c"))
    assert d.restart and d.members == (0, 2) and d.lost == (1,)
    assert "node 1 (b) gone (its machine or its supervisor" in d.reason and "going on with 2 of 3 nodes" in d.reason
    fewer = decide(1, {0: _end(0), 1: None, 2: None}, progressed, elastic, 0, RunState.FAILED, "x", ("a", "b", "c"))
    assert not fewer.restart and "1 node(s) left, fewer than the 2 it may go on with" in fewer.reason and fewer.lost == (1, 2)
    leader = decide(1, {0: None, 1: _end(1), 2: _end(2)}, progressed, elastic, 0, RunState.FAILED, "x", ("a", "b", "c"))
    assert not leader.restart and "node 0 is the rendezvous host and the leader, so the run ends" in leader.reason


def test_a_node_brought_back_is_taken_at_the_next_restart_and_not_counted():
    """A node back (``rejoin``): after an attempt every node of which saved for it, the next attempt
    runs on it too, at once, and MAX_RESTARTS is not spent; a node that reached its last iteration
    first ends the run finished; a failure meanwhile is decided as any (and takes the node too)."""
    elastic = dataclasses.replace(POLICY, min_nodes=1)
    saved = {0: _end(0, RunState.PREEMPTED), 2: _end(2, RunState.PREEMPTED)}
    back = decide_rejoin(3, saved, (1,), 1, 0, 40, ("a", "b", "c"))
    assert back.restart and back.members == (0, 1, 2) and back.joined == (1,) and back.backoff_s == 0
    assert (back.restarts, back.rejoins) == (1, 1) and back.reason.startswith(
        "node 1 (b) back: restarting as attempt 4 on 3 nodes from the checkpoint of iteration 40")
    done = decide_rejoin(3, {0: _end(0, RunState.FINISHED), 2: _end(2, RunState.PREEMPTED)}, (1,), 1, 0, 40)
    assert not done.restart and done.state == RunState.FINISHED
    assert decide_rejoin(3, {0: _end(0, RunState.STOPPED), 2: _end(2)}, (1,), 1, 0, 40) is None
    failed = decide(3, {0: _end(0, RunState.STOPPED), 2: _end(2)}, [_record(3, 30, 40)], elastic, 1, RunState.FAILED,
                    "node 2 failed", ("a", "b", "c"), joiners=(1,))
    assert failed.restart and failed.members == (0, 1, 2) and failed.joined == (1,) and failed.restarts == 2
    assert failed.reason == "restarting as attempt 4 in 5 s; node 1 (b) back: node 2 failed"


def test_an_attempt_on_fewer_nodes_runs_the_plan_on_those():
    from orchestration.node.wire import NodePlan, torchrun_argv

    rendezvous = dict(nnodes=3, nproc_per_node=2, master_addr="a", master_port=6000)
    plan = NodePlan(run="r", run_id="r-1", node_rank=2, host="c", **rendezvous,
                    argv=torchrun_argv("python", ("-m", "megatron_ext.pretrain"), node_rank=2, **rendezvous),
                    env={"NNODES": "3", "NODE_RANK": "2", "LAUNCHER_ATTEMPT": "1"}, unset=(), cwd="/", log_path="l", pid_path="p",
                    per_attempt={"LAUNCHER_ATTEMPT": "..."}, resume_args=("--load", "/ckpt"))
    argv = plan.attempt_argv(True, (0, 2))
    assert argv == (*torchrun_argv("python", ("-m", "megatron_ext.pretrain"), **{**rendezvous, "nnodes": 2}, node_rank=1),
                    "--load", "/ckpt")
    assert plan.attempt_argv(False) == plan.argv and plan.attempt_argv(False, (0, 1, 2)) == plan.argv
    env = plan.process_environment({}, 3, (0, 2))
    assert (env["NNODES"], env["NODE_RANK"], env["LAUNCHER_ATTEMPT"]) == ("2", "1", "3")


def _report(rank, state="S", iteration=10, collective=True, silent_s=31.0, read=True):
    return RankReport(rank=rank, node_rank=rank // 2, host=f"node{rank // 2}", pid=1000 + rank, process_state=state, phase="step",
                      iteration=iteration, phase_elapsed_s=silent_s, limit_s=30.0, stack_read=read,
                      in_collective=collective if read else None, dump=f"node{rank // 2}_rank{rank}.txt")


def test_suspects_in_order_of_evidence():
    assert [r.rank for r in find_suspects([_report(0), _report(1), _report(2), _report(3, "T")]).ranks] == [3]
    outside = find_suspects([_report(0), _report(1, collective=False), _report(2), _report(3)])
    assert [r.rank for r in outside.ranks] == [1] and outside.why.startswith("not inside a collective")
    behind = find_suspects([_report(0, iteration=11), _report(1, iteration=10), _report(2, iteration=11)])
    assert [r.rank for r in behind.ranks] == [1] and behind.why == "behind the others (iteration 10, the others at 11)"
    silent = find_suspects([_report(0, silent_s=31.0), _report(1, silent_s=41.0), _report(2, silent_s=31.5)])
    assert [r.rank for r in silent.ranks] == [1] and silent.why.startswith("silent first")
    never = find_suspects([_report(0), _report(1, silent_s=None)])
    assert [r.rank for r in never.ranks] == [1] and never.why == "never reported progress"
    alike = find_suspects([_report(0), _report(1)])
    assert len(alike.ranks) == 2 and alike.why.startswith("every rank waits alike")


PY_SPY = '''Process 4242: python -m megatron_ext.pretrain
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2501)
    train_step (megatron_ext/training/loop.py:240)
Thread 4250 (idle): "prefetch"
    _worker (concurrent/futures/thread.py:81)
'''
FAULTHANDLER = '''Thread 0x00007ff0f77fe6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Current thread 0x00007ff152dc7b80 (most recent call first):
  File "/work/megatron_ext/training/loop.py", line 210 in _loss
  File "/work/megatron_ext/training/loop.py", line 235 in train_step
'''


def test_collectives_are_read_from_the_main_thread_of_either_dump():
    assert in_collective(PY_SPY)
    assert not in_collective(PY_SPY.replace("all_reduce (torch/distributed/distributed_c10d.py:2501)", "forward (m.py:1)"))
    assert not in_collective(FAULTHANDLER)
    assert in_collective(FAULTHANDLER.replace("line 210 in _loss", "line 1 in _engine_run_backward"))


def test_phase_limits_and_their_overrides():
    p = ResilienceParams(hang_step_floor_s=30, hang_step_factor=5, hang_warmup_steps=3)

    def progress(phase, steps, slowest):
        return RankProgress(rank=0, local_rank=0, host="h", pid=1, attempt=1, iteration=5, phase=phase, phase_started_at=0.0,
                            steps_done=steps, slowest_recent_step_s=slowest)

    assert phase_limit_s(progress("step", 10, 2.0), p) == 30  # floor
    assert phase_limit_s(progress("step", 10, 8.0), p) == 40  # 5 x the slowest recent step
    assert phase_limit_s(progress("step", 1, 8.0), p) == p.hang_setup_s  # warm-up steps: setup's limit
    assert phase_limit_s(progress("checkpoint", 10, 8.0), p) == p.hang_checkpoint_s
    assert phase_limit_s(progress("prepare", 0, None), p) is None  # a corpus takes as long as it takes
    # [issue 54] a large checkpoint's load and save are allowed for, at a quarter of 1 GB/s per node
    big = for_checkpoint(p, 450 * 10**9)  # Qwen3-32B with its optimizer
    assert (big.hang_setup_s, big.hang_checkpoint_s) == (p.hang_setup_s + 1800, p.hang_checkpoint_s + 1800)
    assert phase_limit_s(progress("setup", 0, None), big) == p.hang_setup_s + 1800
    assert phase_limit_s(progress("step", 10, 2.0), big) == 30 and for_checkpoint(p, 0) == p
    # a fresh start has nothing on disk: its first save is allowed for by the model's estimate, its setup not
    fresh = for_checkpoint(p, 0, 450 * 10**9)
    assert (fresh.hang_setup_s, fresh.hang_checkpoint_s) == (p.hang_setup_s, p.hang_checkpoint_s + 1800)
    assert read_resilience_overrides({"MAX_RESTARTS": "3", "HANG_STEP_FLOOR_S": "60", "HANG_WATCHDOG": "0"}) == {
        "max_restarts": 3, "hang_step_floor_s": 60.0, "hang_watchdog": False}
    with pytest.raises(UserError, match=r"MAX_RESTARTS='many' must be a whole number >= 0, e.g. 3"):
        read_resilience_overrides({"MAX_RESTARTS": "many"})


def test_a_fresh_start_s_first_save_is_allowed_for_by_the_plan_s_estimate(tmp_path):
    """[issue 54] Before, a fresh start (no checkpoint on disk to measure) kept the plain 600 s for a
    save: Qwen3-32B's first save on one node (450 GB written, then hashed on rank 0 by Megatron-LM's
    manifest) was taken for a hang, and every restart began again from iteration 0 until the breaker."""
    from types import SimpleNamespace

    from megatron_ext.run_spec.run_paths import RunPaths
    from orchestration.node.checkpoint_pass import CheckpointPass
    from orchestration.node.records import RecordKeeper

    said = []
    node = CheckpointPass()
    node.paths, node.policy, node.say = RunPaths(tmp_path, "r"), ResilienceParams(), said.append
    node.records = RecordKeeper(tmp_path, "node 0 (h)", said.append)
    node.plan = SimpleNamespace(checkpoint_bytes=450 * 10**9, initial_weights="")
    limits = node._limits(None)
    assert (limits.hang_setup_s, limits.hang_checkpoint_s) == (600, 2400)
    assert said == ["the watchdog allows a save 2400 s for the model's checkpoint of about 450.0 GB"]
    node.plan, said[:] = SimpleNamespace(checkpoint_bytes=0, initial_weights=""), []
    assert node._limits(None) == node.policy and said == []
    # initial weights to load instead (a Hugging Face directory; a Megatron-LM --save folder: the iteration
    # its tracker names, not every one it holds): setup allows for them, sizes only (sparse files here)
    hf, save = tmp_path / "Qwen3-32B", tmp_path / "lm_save"
    for folder, size in ((hf, 65 * 10**9), (save / "iter_0000010", 100 * 10**9), (save / "iter_0000020", 50 * 10**9)):
        folder.mkdir(parents=True)
        with (folder / "weights.bin").open("wb") as fh:
            fh.truncate(size)
    (save / "latest_checkpointed_iteration.txt").write_text("not a number")  # no error out of the supervisor:
    node.plan = SimpleNamespace(checkpoint_bytes=0, initial_weights=str(save))  # the whole folder, 150 GB
    assert round(node._limits(None).hang_setup_s) == 1200
    (save / "latest_checkpointed_iteration.txt").write_text("20")
    for path, setup, name in ((hf, 860, "Qwen3-32B"), (save, 800, "iter_0000020"), (tmp_path / "gone", 600, None)):
        node.plan, said[:] = SimpleNamespace(checkpoint_bytes=0, initial_weights=str(path)), []
        limits = node._limits(None)
        assert round(limits.hang_setup_s) == setup, (path, limits)
        assert said == ([f"the watchdog allows for the {(setup - 600) / 4:.1f} GB checkpoint of {name}: setup {setup} s, "
                         f"a save {setup} s"] if name else []), said


def test_saves_and_validation_passes_are_known_from_the_schedule_and_the_megatron_lm_log_watch_allows_for_them(tmp_path):
    """[issue 54] Megatron-LM's save lines are rank 0's (node 0's log); the iteration lines the watch
    reads are the last rank's. So the schedule says what follows a line (a validation pass, a save),
    and the lines may stop for their limits: a synchronous save's write, or an asynchronous one's
    finalize (rank 0 hashing every file for --verify-integrity) at a later step. Before, every save
    and validation pass was timed as a step (30 s here), and a save at a user's size, or a long
    validation pass, was taken for a hang at every interval."""
    schedule = PauseSchedule(save_interval=4, train_iters=10)
    assert [i for i in range(1, 12) if schedule.saves_in(i, i + 1)] == [4, 8, 10]
    assert schedule.saves_in(1, 5) and not schedule.saves_in(5, 8) and schedule.saves_in(9, 11)
    assert not PauseSchedule(save_interval=0, train_iters=10).saves_in(1, 100) and not schedule.saves_in(0, 1)
    assert not schedule.evaluates_in(1, 100)  # no eval_interval: no validation pass
    evaluating = PauseSchedule(save_interval=0, train_iters=10, eval_interval=3)
    assert [i for i in range(1, 12) if evaluating.evaluates_in(i, i + 1)] == [3, 6, 9, 10]
    assert [schedule.next_line(i) for i in (0, 1, 4)] == [1, 2, 5]
    assert [PauseSchedule(save_interval=1, train_iters=1, log_interval=10).next_line(i) for i in (1, 9, 10)] == [10, 10, 20]
    line = (TEST_DATA / "megatron_lm" / "iteration_line_core_v0.16.1.txt").read_text().splitlines()[1]
    params = ResilienceParams(hang_checkpoint_s=100, hang_eval_s=70, hang_warmup_steps=1)  # a step's limit: the 30 s floor

    def watch(log_name, pauses=schedule, limits=params):
        log = tmp_path / log_name
        log.write_text(f"attempt 1 of 1: {ATTEMPT_STARTED}\n")
        return log, Watchdog(limits, 0, 1, 2, tmp_path, MEGATRON_LM, log, 0.0, pauses=pauses)

    def lines(log, *iterations):
        with log.open("a") as fh:
            fh.writelines(line.replace("iteration        2/", f"iteration {i:8d}/") + "\n" for i in iterations)

    # the gap after a line holds the steps to the next (a step's limit: 30 s) and what the schedule puts there
    log, w = watch("saves.log")
    lines(log, 1, 2, 3, 4)  # iteration 4 saves after its line
    assert w.check(10.0) is None and w.check(60.0) is None and w.check(139.0) is None
    hang = w.check(141.0)
    assert hang is not None and (hang.phase, hang.iteration, hang.limit_s) == (Phase.CHECKPOINT, 4, 130.0)
    assert hang.detail == "no iteration line after iteration 4 for 131 s (limit 130 s: a save)"
    lines(log, 5)  # a synchronous save has ended at the next line: a step's limit again
    assert w.check(150.0) is None and w.check(179.0) is None
    hang = w.check(181.0)
    assert hang is not None and (hang.phase, hang.iteration, hang.limit_s) == (Phase.STEP, 5, 30.0)
    log, w = watch("async.log", dataclasses.replace(schedule, background=True))
    lines(log, 1, 2, 3, 4)
    assert w.check(10.0) is None
    lines(log, 5)  # an asynchronous save: training went on, and its finalize stops a later step
    assert w.check(20.0) is None and w.check(80.0) is None and w.check(139.0) is None
    hang = w.check(141.0)  # the save's 100 s from its start (t = 10), and the steps' 30 s
    assert hang is not None and (hang.phase, hang.limit_s) == (Phase.CHECKPOINT, 120.0)
    lines(log, 6)  # past the save's window: a step's limit again
    assert w.check(200.0) is None and w.check(225.0) is None
    hang = w.check(231.0)
    assert hang is not None and (hang.phase, hang.iteration, hang.limit_s) == (Phase.STEP, 6, 30.0)
    # Megatron-LM prints an attempt's first line, then every log_interval-th: a save between two lines
    # (a fresh start's at 50 between lines 1 and 100; one at 19 between 10 and 20) counts
    fresh = ResilienceParams(hang_checkpoint_s=2400)  # a fresh start's save limit, by the estimate
    for name, first, pauses, limits, limit in (
            ("sparse.log", (1,), PauseSchedule(save_interval=50, train_iters=1000, log_interval=100), fresh, 600 + 2400),
            ("resumed.log", (1, 10), PauseSchedule(save_interval=19, train_iters=1000, log_interval=10), params, 45 + 100)):
        log, w = watch(name, pauses, limits)
        for i, it in enumerate(first):
            lines(log, it)
            assert w.check(10.0 * (i + 1)) is None
        seen = 10.0 * len(first)
        assert w.check(seen + limit - 1) is None, name  # past setup's (600 s) or the steps' (45 s) limit
        hang = w.check(seen + limit + 1)
        assert hang is not None and (hang.phase, hang.limit_s) == (Phase.CHECKPOINT, limit), (name, hang)
    # background saves: lines 4 and 5 read together (the log is read every 2 s) still open the save's window
    log, w = watch("together.log", dataclasses.replace(schedule, background=True))
    lines(log, 1, 2, 3)
    assert w.check(10.0) is None
    lines(log, 4, 5)
    assert w.check(12.0) is None and w.check(141.0) is None
    hang = w.check(143.0)
    assert hang is not None and (hang.phase, hang.limit_s) == (Phase.CHECKPOINT, 130.0), hang
    # a background save between two lines (every 15, lines every 10) opens its window once, at the line before
    log, w = watch("between.log", PauseSchedule(save_interval=15, train_iters=100, background=True, log_interval=10))
    lines(log, 1, 10)
    assert w.check(10.0) is None  # line 10 at t = 10: the save at 15 follows it
    lines(log, 20)
    assert w.check(50.0) is None and w.check(159.0) is None
    hang = w.check(161.0)  # the save's window from t = 10 (to 110: 60 s past line 20), not from line 20's t = 50
    assert hang is not None and (hang.phase, hang.limit_s) == (Phase.CHECKPOINT, 50.0 + 60.0), hang
    # a validation pass after iteration 3's line: its limit; with a save after the same line, both;
    # after the run's last line, up to three passes (the loop's, pretrain's validation and test), the
    # save, and a background save's finalize
    last = dataclasses.replace(evaluating, save_interval=5)
    for name, pauses, at, extra, phase in (
            ("eval.log", evaluating, 3, 70.0, Phase.EVAL),
            ("eval_and_save.log", dataclasses.replace(evaluating, save_interval=3), 3, 170.0, Phase.CHECKPOINT),
            ("end.log", last, 10, 3 * 70.0 + 100.0, Phase.CHECKPOINT),
            ("end_background.log", dataclasses.replace(last, background=True), 10, 3 * 70.0 + 200.0, Phase.CHECKPOINT)):
        log, w = watch(name, pauses)
        lines(log, *range(1, at + 1))
        limit = 30.0 + extra
        assert w.check(10.0) is None and w.check(10.0 + limit - 1) is None, name
        hang = w.check(10.0 + limit + 1)
        assert hang is not None and (hang.phase, hang.iteration, hang.limit_s) == (phase, at, limit), (name, hang)
    for name, pauses in (("nothing_due.log", schedule), ("no_schedule.log", None)):
        log, w = watch(name, pauses)
        lines(log, 1, 2)
        assert w.check(10.0) is None
        hang = w.check(41.0)
        assert hang is not None and (hang.phase, hang.iteration) == (Phase.STEP, 2), name


def test_a_rank_whose_busy_time_over_the_window_outweighs_the_others_is_named():
    from megatron_ext.run_spec.resilience import (BusyInterval as I, check_resilience, describe_slow_ranks, slow_ranks,
                                                  still_slow)

    even = [I(10, 1.0, (0.95, 0.97, 0.93, 0.99))] * 30
    assert slow_ranks(even, 1.25, 20) == []  # equal ranks on a noisy machine: never named
    steady = [I(10, 1.0, (0.6, 0.9, 0.6, 0.6))] * 20  # uniformly 1.5x: its peers wait 0.3 s of each second
    (named,) = slow_ranks(steady, 1.25, 20)
    assert named.rank == 1 and named.window_s == 20 and (named.seconds, named.others_median_s) == pytest.approx((0.09, 0.06))
    assert slow_ranks(steady[:19], 1.25, 20) == []  # the window not covered yet: a start's first seconds
    # In bursts: stopped 0.4 s of every 0.8 s, wherever it falls. Interval by interval it is slow in
    # some and not in others; over the window its busy time is twice the waiting rank's.
    bursts = [I(5, 0.8, (0.35, 0.75)), I(5, 0.4, (0.35, 0.35))] * 20
    (named,) = slow_ranks(bursts, 1.25, 20)
    assert named.rank == 1 and named.ratio == pytest.approx(1.1 / 0.7)
    assert slow_ranks([I(1, 0.5, (0.1, 0.5))] + even, 1.25, 20) == []  # one hiccup outside the window: forgotten
    assert slow_ranks([I(10, 30.0, (10.0, 20.0))], 1.25, 20)[0].rank == 1  # an interval longer than the window: itself
    assert slow_ranks([I(10, 30.0, (10.0,))], 1.25, 20) == []  # one rank: nobody to compare with
    line = describe_slow_ranks(slow_ranks(steady + [I(10, 1.0, (0.6, 0.6, 0.6, 1.2))] * 20, 1.25, 20), 2,
                               ["node0", "node0", "node1", "node1"], 1.25)
    assert line == ("warning: slow rank 3 (node 1, node1, local rank 1): busy 0.120 s per step, 2.0x the median of the "
                    "other ranks (0.060 s), over the last 20 s (busy: its steps less its waits for the others); every "
                    "rank waits for it (training.resilience.slow_rank_ratio 1.25)"), line
    assert still_slow([named], {1: 4.0, 2: 9.0}, 1.5) == {1: 5.5}  # staying slow adds up; a rank not slow now starts again
    with pytest.raises(UserError, match=r"slow_rank_ratio=1.0 must be > 1"):
        check_resilience(ResilienceParams(slow_rank_ratio=1.0), "training.resilience")
    with pytest.raises(UserError, match=r"slow_rank_window_s=0 must be > 0"):
        check_resilience(ResilienceParams(slow_rank_window_s=0), "training.resilience")


def test_the_busy_clock_counts_sleep_as_waiting_and_a_gap_as_busy(monkeypatch):
    """The CPU clock's rule (training/busy_clock.py), and the clock itself on this process: it reads
    the main thread's state (asleep in a lock as a rank in a gloo collective, or running) and the
    whole process's CPU (another thread computing for it), and adds up what the rule makes of each
    sample. Its inputs are checked, not its totals: on a loaded machine a starved sampler's gaps are
    busy time by the rule, so the totals follow the machine's load."""
    import threading
    import time

    from megatron_ext.training import busy_clock
    from megatron_ext.training.busy_clock import GAP_S, IDLE_CPU_SHARE, SampledBusyClock, busy_share, thread_state

    assert thread_state("123 (pt_main (x) 2) S 1 2 3") == "S" and thread_state("9 (python3) R 1") == "R"
    assert busy_share("S", 0.005, 0.0001) == 0.0  # asleep, the process idle: waiting for a peer
    assert busy_share("R", 0.005, 0.0) == 0.005 and busy_share("D", 0.005, 0.0) == 0.005
    assert busy_share("S", 0.005, 0.008) == 0.005  # asleep while its intra-op threads compute for it
    assert busy_share("S", GAP_S * 4, 0.0) == GAP_S * 4  # the sampler did not run: stopped or starved, this rank's time
    seen: list[tuple[str, float, float]] = []
    monkeypatch.setattr(busy_clock, "busy_share", lambda *sample: seen.append(sample) or busy_share(*sample))
    clock = SampledBusyClock()

    def sampled(work) -> list[tuple[str, float, float]]:
        with clock.counting():
            work()
        samples = seen[:]  # the sampler reads nothing once counting ends
        seen.clear()
        assert samples and clock.take() == pytest.approx(sum(busy_share(*sample) for sample in samples))
        return samples

    def compute():  # 0.3 s of this thread's CPU, however loaded the machine
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            sum(range(1000))

    def helped():  # as torch's intra-op threads compute while the main thread waits for them
        helper = threading.Thread(target=compute)
        helper.start()
        helper.join()

    waiting = sampled(lambda: threading.Event().wait(0.6))
    edges = 4  # starting and joining the work: up to two samples at each end see the main thread run
    assert [s for s, _, _ in waiting].count("S") >= len(waiting) - edges, waiting  # the main thread (not the sampler)
    assert all(cpu < IDLE_CPU_SHARE * elapsed for state, elapsed, cpu in waiting if state == "S"), waiting  # idle
    running = sampled(compute)  # running or runnable; asleep at times on the GIL the sampler holds
    assert "R" in {s for s, _, _ in running} and sum(cpu for _, _, cpu in running) > 0.1, running
    computing = sampled(helped)
    assert [s for s, _, _ in computing].count("S") >= len(computing) - edges, computing
    assert sum(cpu for _, _, cpu in computing) > 0.1, computing  # the helper's CPU is the process's


def test_status_shows_the_standing_slow_rank_warning_of_the_latest_attempt():
    from orchestration.node.commands import standing_slow_ranks

    warned = "warning: slow rank 1 (node 0, h, local rank 1): busy 0.4 s per step, 4.0x ..."
    log = f"attempt 1 of 1: starting torchrun\n iteration 5\n{warned}\n iteration 6\n"
    assert standing_slow_ranks(log) == warned
    assert standing_slow_ranks(log + "note: no slow rank (iteration 9): rank(s) 1 caught up\n") is None
    assert standing_slow_ranks(log + "attempt 2 of 2: starting torchrun\n iteration 7\n") is None  # an earlier attempt's


# -- real runs on this machine ------------------------------------------------------------------------

@pytest.fixture()
def env(artifact_root):
    return clean_env(ARTIFACT_ROOT=str(artifact_root), MASTER_PORT=str(free_port()))


def worker(run: str, rank: int) -> int | None:
    return next((p for p in tagged_pids(run) if process_environ(p).get("RANK") == str(rank)), None)


def status_of(run: str, env: dict) -> dict:
    return json.loads(run_script("status_training.sh", run, "--json", env=env).stdout.splitlines()[0])


@pytest.mark.slow
def test_a_slow_rank_is_named_steady_or_in_bursts_and_the_waiting_one_or_a_cpu_hog_never(env, artifact_root, tmp_path):
    """gpt_smoke on 2 CPU processes, the default rule (1.25x the other's busy time over 20 s, for 5
    s in a row). Rank 1 stopped 20 ms of every 40 ms (uniformly ~2x slower on an idle machine; less
    where other processes share the cores, since the others get its CPU while it is stopped: at 10
    ms of every 30 ms, ~1.5x idle, it stayed under the 1.25x rule beside two busy loops): named
    within 60 s, in the log, status and the metrics; freed, it catches up. Then a CPU hog per core beside
    the run for 25 s (beside this suite's other worker): nobody named, and that window, clean of any slow
    rank, starts the next kind afresh. Rank 1 stopped 0.4 s of every 0.8 s (in bursts, landing in its
    forward, backward or optimizer step alike): named within 60 s. Rank 0, which waits for it, never."""
    window = ResilienceParams().slow_rank_window_s
    data = write_data_set(tmp_path / "long.yaml", train_iters=20000, global_batch=8)
    run = "slow_rank_1n"
    log = artifact_root / "logs" / f"{run}_node0.log"
    said = lambda: [l for l in log.read_text().splitlines() if l.startswith(("warning: slow rank", "note: no slow rank"))]  # noqa: E731
    assert run_script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
    try:
        wait_for(lambda: last_iteration(log) >= 5, 240, what="the run to train")
        slow = worker(run, 1)
        for stopped_s, running_s in ((0.02, 0.02), (0.4, 0.4)):
            if stopped_s == 0.4:  # a window with nobody slow in it (each kind from a clean start), CPU hogs beside the run
                caught_up = len(said())
                # one per core: every rank shares its core alike (one hog on 2 cores shares one rank's core
                # for seconds at a time: rank 0 was named at 1.3x once, just after it, under the suite's load)
                hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
                try:
                    time.sleep(window + 5)
                finally:
                    for hog in hogs:
                        hog.kill()
                        hog.wait()
                assert said()[caught_up:] == [], said()
            before = len(said())
            with slowed(slow, stopped_s, running_s):
                at = time.monotonic()
                wait_for(lambda: len(said()) > before and said()[-1].startswith("warning: slow rank 1 (node 0, "), 60,
                         interval_s=0.2, what=f"rank 1 stopped {stopped_s} s of every {stopped_s + running_s} s to be named")
                named_after = time.monotonic() - at
                shown = run_script("status_training.sh", run, env=env).stdout
            print(f"stopped {stopped_s} s of every {stopped_s + running_s} s: named after {named_after:.1f} s")
            assert said()[-1] in shown or said()[-1].startswith("note: no slow rank"), shown
            if stopped_s < 0.4:  # freed, it catches up (once is enough)
                wait_for(lambda: said()[-1].startswith("note: no slow rank"), 90, what="rank 1 to catch up")
        assert not [l for l in said() if l.startswith("warning: slow rank") and " 0 (node 0" in l], said()
        metrics = [json.loads(l) for l in (artifact_root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        assert any(r["slow_ranks"] == [1] for r in metrics) and all(len(r["busy_s_per_rank"]) == 2 for r in metrics)
        assert not any(0 in (r["slow_ranks"] or []) for r in metrics)
    finally:
        run_script("stop_training.sh", run, env=env)


@pytest.mark.slow
def test_a_killed_and_a_stopped_worker_with_restarts_finish_with_the_same_losses(env, artifact_root, unattended):
    """MAX_RESTARTS=3: SIGKILL of rank 1 after the first checkpoint -> attempt 2 resumes; SIGSTOP of
    rank 0 after the next one -> the watchdog (step floor 5 s) dumps the stacks and attempt 3
    resumes; the run reaches its last iteration by itself, every iteration's loss equal to an
    uninterrupted run's, nothing left running. Its goodput (issue 56): the crash's and the hang's
    costs each in their own part, as this test timed them, and status's parts adding up."""
    data, reference = unattended
    run = "unattended_1n"
    log = artifact_root / "logs" / f"{run}_node0.log"
    checkpoints = artifact_root / "runs" / run / "checkpoints"
    start = run_script("start_training.sh", "gpt_smoke", data, run, env={**env, "MAX_RESTARTS": "3", "HANG_STEP_FLOOR_S": "5"})
    assert start.returncode == 0, start.stdout + start.stderr
    assert "restarts: up to 3 (backoff 1 s; gives up after 2 attempts without a new checkpoint)" in start.stdout
    try:
        first, second = UNATTENDED_SAVE_EVERY, 2 * UNATTENDED_SAVE_EVERY  # the first two checkpoints, 4 steps past each
        wait_for(lambda: (latest_iteration(checkpoints) or 0) >= first and last_iteration(log) > first + 4, 240,
                 what="a checkpoint")
        os.kill(worker(run, 1), signal.SIGKILL)
        killed_at = time.time()  # this machine is node 0: its clock is the ledger's and the log's
        wait_for(lambda: status_of(run, env).get("attempt") == 2, 120, what="attempt 2")
        wait_for(lambda: (latest_iteration(checkpoints) or 0) >= second and last_iteration(log) > second + 4, 300,
                 what="attempt 2 past another checkpoint")
        os.kill(worker(run, 0), signal.SIGSTOP)
        stopped_at = time.time()
        wait_for(lambda: not tagged_pids(run), 600, what="the run to finish by itself")
    finally:
        run_script("stop_training.sh", run, env=env)
    node = status_of(run, env)
    assert node["state"] == "finished" and node["attempt"] == 3, node
    text = run_script("status_training.sh", run, env=env).stdout
    assert "attempt 3 of 4: finished" in text, text
    assert "attempt 1 failed (checkpoint - -> " in text and "attempt 2 hung (checkpoint " in text, text
    dumps = artifact_root / "runs" / run / "hangs" / "2"
    stopped = (dumps / "node0_rank0.txt").read_text()
    assert "process state T" in stopped and "Thread" in stopped and "(megatron_ext/training/" in stopped, stopped
    failure = (artifact_root / "run_state" / f"{run}_a2.failure.txt").read_text()
    assert failure.startswith("node 0 hung: rank 0 (node 0) stopped (process state T"), failure
    assert " of process group 0 (default_pg): entered by rank(s) 1, not by rank(s) 0 (no record from" in failure, failure
    assert_same_losses(artifact_root / "runs" / run / "metrics.jsonl", reference)
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(artifact_root / "runs" / run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == sorted(reference)  # each step once: the lost ones purged
    lines = log.read_text()
    assert "attempt 2 of 4: starting torchrun (the ranks resume from the checkpoint at iteration" in lines
    assert tagged_pids(run) == []
    # [issue 56: goodput] status's line adds up to its wall clock; the crash and the hang each cost, in their own
    # part, what this test measures on its own clock from its signal to the next attempt's first line
    assert_goodput_of_two_faults(text, artifact_root, run, "4", killed_at, stopped_at, lines)


@pytest.mark.slow
def test_stop_save_saves_at_the_next_step_and_the_next_start_resumes(env, artifact_root, tmp_path):
    data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    run = "saved_on_request"
    log = artifact_root / "logs" / f"{run}_node0.log"
    assert run_script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
    try:
        wait_for(lambda: last_iteration(log) >= 3, 180, what="three iterations")
        stop = run_script("stop_training.sh", run, "--save", env=env)
        assert stop.returncode == 0 and f"run {run}: node0 preempted" in stop.stdout, stop.stdout + stop.stderr
        saved = latest_iteration(artifact_root / "runs" / run / "checkpoints")
        assert saved is not None and saved >= 3 and f"preempted: saved a checkpoint at iteration {saved}" in log.read_text()
        assert status_of(run, env)["state"] == "preempted" and tagged_pids(run) == []
        again = run_script("start_training.sh", "gpt_smoke", data, run, env=env)
        assert again.returncode == 0 and f"resuming from iteration {saved}" in again.stdout, again.stdout
    finally:
        run_script("stop_training.sh", run, env=env)
    assert tagged_pids(run) == []


@pytest.mark.slow
def test_megatron_lm_log_watch_finds_a_stopped_last_rank(env, artifact_root, tmp_path):
    """ENGINE=megatron-lm writes no progress files: the supervisor of the last rank's node times the
    iteration lines (the stand-in checkout of test_megatron_lm.py prints one every 0.2 s)."""

    checkout = write_checkout(tmp_path / "Megatron-LM", (0, 16, 1), all_rendered_flags())
    (checkout / "pretrain_gpt.py").write_text(STANDIN_PRETRAIN_GPT)
    data = tmp_path / "lm.yaml"
    data.write_text((REPO / "params" / "data" / "smoke.yaml").read_text().replace("train_iters: 30", "train_iters: 2000"))
    run = "lm_hang"
    # The shim answers the preflight's CUDA probe (and is inert in the stand-in's ranks, which import no torch).
    lm_env = {**megatron_lm_env(checkout, **env), "HANG_STEP_FLOOR_S": "3"}
    start = run_script("start_training.sh", "gpt_smoke", str(data), run, env=lm_env)
    assert start.returncode == 0 and "(Megatron-LM: from its iteration lines)" in start.stdout, start.stdout + start.stderr
    log = artifact_root / "logs" / f"{run}_node0.log"
    try:
        wait_for(lambda: last_iteration(log) >= 5, 120, what="iteration lines")
        stopped_at = time.monotonic()
        os.kill(worker(run, 1), signal.SIGSTOP)  # the last rank: the one that prints
        wait_for(lambda: not tagged_pids(run), 60, what="the hung run to end")
        assert time.monotonic() - stopped_at < 30
    finally:
        run_script("stop_training.sh", run, env=lm_env)
    failure = (artifact_root / "run_state" / f"{run}_failure.txt").read_text()
    assert failure.startswith("node 0 hung: rank 1 (node 0) stopped (process state T"), failure
    assert "no iteration line after iteration" in failure
    assert status_of(run, lm_env)["state"] == "hung"


@pytest.fixture()
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only): the checkpoints' own file system, resized by the test."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full disk needs root to mount a tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(folder) -> None:
    """Fill the file system of ``folder`` to its last byte, as another job would."""
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 2**16)
                fh.flush()
        except OSError:
            pass


@pytest.mark.slow
def test_a_full_disk_is_refused_at_start_and_ends_the_run_at_a_save(env, artifact_root, tmp_path, small_disk):
    """CHECKPOINT_ROOT on a 1 MiB tmpfs: the preflight refuses with the sizes. At 200 MiB the run
    starts (MAX_RESTARTS=2); after its first checkpoint another writer fills the disk; the next
    save meets ENOSPC: its partial folder is removed, ``latest`` stays, the run ends failed with
    "disk full: ..." and is not restarted; nothing is left running."""
    import subprocess

    data = write_data_set(tmp_path / "saving.yaml", train_iters=400, save_interval=10)
    run = "full_disk"
    env = {**env, "CHECKPOINT_ROOT": str(small_disk), "MAX_RESTARTS": "2"}
    refused = run_script("start_training.sh", "gpt_smoke", data, run, env=env)
    assert refused.returncode == 2 and tagged_pids(run) == [], refused.stdout + refused.stderr
    assert "the run's checkpoints will not fit: " in refused.stderr and "CHECKPOINT_ROOT" in refused.stderr
    subprocess.run(["mount", "-o", "remount,size=200m", str(small_disk)], check=True)
    checkpoints = small_disk / run / "checkpoints"
    assert run_script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
    try:
        wait_for(lambda: latest_iteration(checkpoints), 240, interval_s=0.2, what="a first checkpoint")
        first = latest_iteration(checkpoints)
        _fill(small_disk)
        wait_for(lambda: not tagged_pids(run), 240, what="the run to end at the next save")
    finally:
        run_script("stop_training.sh", run, env=env)
    node = status_of(run, env)
    assert node["state"] == "failed" and node["attempt"] == 1, node  # not restarted
    failure = (artifact_root / "run_state" / f"{run}_failure.txt").read_text().splitlines()[0]
    assert f"error: disk full: {checkpoints.resolve()}, 0.00 GB free, a checkpoint needs " in failure, failure
    assert f"({FINAL}, so the run ends)" in failure
    assert latest_iteration(checkpoints) == first
    assert [p.name for p in checkpoints.glob("iter_*")] == [f"iter_{first:07d}"]  # the partial one removed
    assert tagged_pids(run) == []
