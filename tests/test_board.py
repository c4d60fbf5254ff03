"""The run's shared state over the network (orchestration/node/board.py): first-claim-wins,
liveness by the observer's own clock (orchestration/node/liveness.py), the attempt's agreements,
node 0's store gone, and node 0's store that stops answering (a deadline on every call). Against
a real ``torch.distributed.TCPStore`` on loopback (node 0's in a process of its own, stopped with
SIGSTOP: its connections stay open and nothing answers, as when its link is cut), and the
in-memory store of a one-node run with the same answers."""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from conftest import free_port
from megatron_ext.run_spec.resilience import Phase
from orchestration.node.attempts import AttemptEnd, Decision, Evidence, choose_failure
from orchestration.node.board import Board, BoardUnreachable, DeadlineStore, MemoryStore, open_stores
from orchestration.node.failure import Failure, FailureKind
from orchestration.node.liveness import Liveness
from orchestration.node.wire import coordination_port
from orchestration.node.run_state import RunState
from orchestration.node.watchdog import Hang


@pytest.fixture(params=["tcp", "memory"])
def stores(request):
    """(node 0's view, node 1's view) of one store."""
    if request.param == "memory":
        store = MemoryStore()
        yield DeadlineStore(store, 20), DeadlineStore(store, 20)
        return
    yield connected_stores()


def connected_stores():
    """Node 0's store on a port found free and node 1's connection to it, checked to be that
    store: the other xdist worker's runs and connections share this machine's ports, and one may
    take the port between the look and the listen (tried again on another)."""
    for attempt in range(5):
        master_port = free_port()  # the store listens one above
        try:
            server, _ = open_stores("run-1", 2, True, "127.0.0.1", master_port, connect_s=5, deadline_s=20)
            client, _ = open_stores("run-1", 2, False, "127.0.0.1", master_port, connect_s=5, deadline_s=20)
        except BoardUnreachable:
            continue
        server.set("probe", str(attempt))
        if client.check(["probe"]) and client.get("probe").decode() == str(attempt):
            return server, client
    raise AssertionError("no store of this test's own on a free port in 5 tries")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_failure_and_the_first_hang_win(stores):
    node0, node1 = (Board(s, rank) for rank, s in enumerate(stores))
    assert node0.failure(1) is None
    failed = Failure(FailureKind.FAILED, 1, "node 1 failed: rank 3\nlast lines", rank=3)
    assert node1.claim_failure(1, failed)
    assert not node0.claim_failure(1, Failure(FailureKind.LOST, 1, "node 1 lost: ...\n"))
    assert node0.failure(1) == node1.failure(1) == failed and failed.summary == "node 1 failed: rank 3"
    assert node0.failure(2) is None  # each attempt has its own
    hang = Hang(node_rank=1, rank=3, phase=Phase.STEP, iteration=7, elapsed_s=40.0, limit_s=30.0,
                detail="rank 3 in forward for 40 s")
    assert node1.claim_hang(1, hang) and not node0.claim_hang(1, dataclasses.replace(hang, rank=2))
    assert node0.hang_claim(1) == hang
    node0.request_save("stop --save")
    node1.request_save("SIGUSR1 to node 1's supervisor")
    assert node1.save_request() == "stop --save"


def test_ends_decisions_ready_and_roster_cross(stores):
    node0, node1 = (Board(s, rank) for rank, s in enumerate(stores))
    end = AttemptEnd(node_rank=1, attempt=2, state=RunState.FAILED, reason="torchrun exit code 1",
                     failure=Failure(FailureKind.FAILED, 1, "whole\ntext"), evidence=Evidence.RANK)
    node1.write_end(end)
    assert node0.read_end(2, 1) == end and node0.read_end(2, 0) is None
    decision = Decision(attempt=2, restart=True, state=RunState.RESTARTING, reason="restart", backoff_s=1.0, members=(0, 1), lost=())
    node0.write_decision(decision)
    assert node1.read_decision(2) == decision
    node1.mark_ready(3)
    assert node0.ready_nodes(3, (0, 1)) == [1]
    node0.write_roster(3, (0, 1))
    assert node1.read_roster(3) == (0, 1)


def test_a_node_brought_back_asks_once_per_request_and_hears_its_attempt(stores):
    """A node back asks for a place (a numbered request); node 0 sees it pending until it answers
    with the attempt after which it takes it; the same node lost and back again asks anew."""
    node0, node1 = (Board(s, rank) for rank, s in enumerate(stores))
    assert node0.join_requests([1, 2]) == {}
    first = node1.request_join()
    assert node0.join_requests([1, 2]) == {1: first} and node1.join_answer(first) is None
    node0.claim_rejoin(4, [1])
    node0.claim_rejoin(4, [1, 2])  # the first claim stands
    assert node1.rejoin(4) == (1,) and node1.rejoin(5) is None
    assert node0.accept_join(1, 4) == first  # the incarnation node 0 watches it in
    assert node1.join_answer(first) == 4 and node0.join_requests([1]) == {}
    again = node1.request_join()
    assert again == first + 1 and node0.join_requests([1]) == {1: again} and node1.join_answer(again) is None


def test_a_peer_is_alive_while_its_beat_changes_by_the_observers_clock(stores):
    """No clock but the observer's: node 1's counter, seen changing, keeps it alive; unchanged for
    node_lost_s of node 0's monotonic clock, it is silent; a node never seen is silent node_lost_s
    after the observer began to watch it; a node that said it ends is silent but not lost."""
    clock = Clock()
    node0 = Liveness(stores[0], 0, 0, node_lost_s=20, clock=clock)
    node1 = Liveness(stores[1], 1, 0, node_lost_s=20)
    node0.watch({0: 0, 1: 0, 2: 0})
    node0.tick()
    assert node0.silent() == []
    node1.tick()
    clock.now += 15
    node0.tick()
    assert node0.silent() == []
    clock.now += 10  # 25 s: node 2 never beat; node 1 was seen changing 10 s ago
    node0.tick()
    assert node0.silent() == [2] and node0.lost() == [2]
    clock.now += 15
    node1.tick()
    node0.tick()
    assert node0.silent() == [2]
    clock.now += 21
    node0.tick()
    assert node0.silent() == [1, 2]
    Board(stores[1], 1).mark_exited(0)
    node0.tick()
    assert node0.exited(1) and node0.lost() == [2]


def test_a_node_back_in_a_new_incarnation_is_watched_anew(stores):
    """A node that ended (its exit said) and came back (``rejoin``, request N) beats under its new
    incarnation: its old supervisor's exit does not speak for it, and its new silence is seen."""
    clock = Clock()
    node0 = Liveness(stores[0], 0, 0, node_lost_s=20, clock=clock)
    old = Liveness(stores[1], 1, 0, node_lost_s=20)
    old.tick()
    Board(stores[1], 1).mark_exited(0)
    node0.watch({1: 0})
    node0.tick()
    assert node0.exited(1)
    new = Liveness(stores[1], 1, 3, node_lost_s=20)
    new.tick()
    node0.watch({1: 3})
    node0.tick()
    assert not node0.exited(1) and node0.silent() == []
    clock.now += 21
    node0.tick()
    assert node0.lost() == [1]


def test_node_0_gone_is_one_clear_error():
    master_port = free_port()
    server = dist.TCPStore("127.0.0.1", coordination_port(master_port), is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    node1 = Board(open_stores("run-1", 2, False, "127.0.0.1", master_port, connect_s=5, deadline_s=20)[0], 1)
    node1.mark_ready(1)
    del server  # node 0's supervisor ends: its store with it
    with pytest.raises(BoardUnreachable, match="node 0's coordination store did not answer"):
        for _ in range(50):
            node1.mark_ready(1)
    nobody = free_port()
    with pytest.raises(BoardUnreachable, match=f"could not reach node 0's coordination store at 127.0.0.1:{nobody + 1}"):
        open_stores("run-1", 2, False, "127.0.0.1", nobody, connect_s=1, deadline_s=20)


def wait_until_stopped(pid, timeout_s=10.0):
    """Until the kernel shows the process stopped (state T in /proc/PID/stat), every thread of it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
                  for tid in os.listdir(f"/proc/{pid}/task")]
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


def test_node_0_that_stops_answering_is_silent_and_every_call_ends_by_its_deadline():
    """Node 0's store in a process of its own, SIGSTOPped: its connections stay open and nothing
    answers (a TCPStore's own timeout bounds only get and wait: a check or an add would block until
    TCP gives up). Every call returns BoardUnreachable within its deadline, the calls after it at
    once while the first is still out; node 1's beat thread finds node 0 silent after node_lost_s;
    once node 0 answers again, so do the calls."""
    master_port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import datetime, sys, time, torch.distributed as d; "
         f"s = d.TCPStore('127.0.0.1', {coordination_port(master_port)}, is_master=True, wait_for_workers=False, "
         "timeout=datetime.timedelta(seconds=30)); print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    liveness = None
    try:
        assert server.stdout.readline().strip() == "up"
        main, beat = open_stores("run-1", 2, False, "127.0.0.1", master_port, connect_s=10, deadline_s=2)
        node1 = Board(main, 1)
        liveness = Liveness(beat, 1, 0, node_lost_s=2, period_s=0.2).start()
        liveness.watch({0: 0})
        node1.mark_ready(1)
        assert node1.ready_nodes(1, [1]) == [1] and liveness.lost() == []
        os.kill(server.pid, signal.SIGSTOP)
        wait_until_stopped(server.pid)  # a signal is delivered later: on a loaded machine the store
        started = time.monotonic()     # could still answer one more call after kill() returned
        with pytest.raises(BoardUnreachable, match="did not answer a check within 2 s"):
            node1.ready_nodes(1, [1])
        assert 1.5 < time.monotonic() - started < 6
        started = time.monotonic()
        with pytest.raises(BoardUnreachable, match="has not answered a check for"):
            node1.failure(1)
        assert time.monotonic() - started < 1
        deadline = time.monotonic() + 10
        while liveness.lost() != [0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert liveness.lost() == [0] and liveness.silent_s(0) > 2
        deadline = time.monotonic() + 5
        while liveness.error is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "coordination store" in (liveness.error or "")
        os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while liveness.lost() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert liveness.lost() == [] and node1.ready_nodes(1, [1]) == [1]
    finally:
        if liveness is not None:
            liveness.stop()
        os.kill(server.pid, signal.SIGCONT)
        time.sleep(0.5)  # the calls still out answered before the store goes
        server.kill()
        server.wait()


def test_node_0_records_the_failure_with_the_strongest_evidence():
    """What stopped every node is the first claim; what node 0 records is the node's own cause with
    the strongest evidence: a share gone on node 1 beats node 0's "Connection closed by peer" claimed
    before it; a rank's own error beats a consequence; a hang's summary (no end carries it) stands
    against a consequence."""
    def end(rank, failure, evidence):
        return AttemptEnd(node_rank=rank, attempt=1, state=RunState.FAILED, reason=failure.summary, failure=failure,
                          evidence=evidence)

    peer = Failure(FailureKind.FAILED, 0, "node 0 (a) failed: rank 0: RuntimeError: Connection closed by peer")
    share = Failure(FailureKind.ROOT_UNREACHABLE, 1, "node 1 (b): the artifact root /x is unreachable: [Errno 107] ...")
    ends = {0: end(0, peer, Evidence.CONSEQUENCE), 1: end(1, share, Evidence.NODE)}
    assert choose_failure(peer, ends) == share
    own = Failure(FailureKind.FAILED, 1, "node 1 (b) failed: rank 1: ValueError: x", rank=1)
    ends = {0: end(0, peer, Evidence.CONSEQUENCE), 1: end(1, own, Evidence.RANK)}
    assert choose_failure(peer, ends) == own
    hang = Failure(FailureKind.HUNG, 1, "node 1 hung: rank 3 stopped", rank=3)
    assert choose_failure(hang, {0: end(0, peer, Evidence.CONSEQUENCE), 1: None}) == hang
    assert choose_failure(None, {0: None}) is None
