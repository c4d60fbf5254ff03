"""The run's shared state over the network (orchestration/node/board.py): first-claim-wins,
liveness by the observer's own clock, the attempt's agreements, and node 0's store gone. Against
a real ``torch.distributed.TCPStore`` on loopback, and the in-memory store of a one-node run with
the same answers."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from conftest import free_port
from orchestration.node.attempts import AttemptEnd, Decision
from orchestration.node.board import Board, BoardUnreachable, MemoryStore, open_store
from orchestration.node.wire import coordination_port
from orchestration.node.run_state import RunState
from orchestration.node.watchdog import Hang


@pytest.fixture(params=["tcp", "memory"])
def stores(request):
    """(node 0's view, node 1's view) of one store."""
    if request.param == "memory":
        store = MemoryStore()
        yield store, store
        return
    yield connected_stores()


def connected_stores():
    """Node 0's store on a port found free and node 1's connection to it, checked to be that
    store: the other xdist worker's runs and connections share this machine's ports, and one may
    take the port between the look and the listen (tried again on another)."""
    for attempt in range(5):
        master_port = free_port()  # the store listens one above
        try:
            server = open_store("run-1", 2, True, "127.0.0.1", master_port, connect_s=5)
            client = open_store("run-1", 2, False, "127.0.0.1", master_port, connect_s=5)
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
    node0, node1 = (Board(s, rank, node_lost_s=20) for rank, s in enumerate(stores))
    assert node0.failure(1) is None
    assert node1.claim_failure(1, "node 1 failed: rank 3\nlast lines")
    assert not node0.claim_failure(1, "node 0 failed: connection closed")
    assert node0.failure(1) == node1.failure(1) == "node 1 failed: rank 3\nlast lines"
    assert node0.failure(2) is None  # each attempt has its own
    hang = Hang(node_rank=1, rank=3, phase="forward", iteration=7, elapsed_s=40.0, limit_s=30.0,
                detail="rank 3 in forward for 40 s")
    assert node1.claim_hang(1, hang, claimed_at=5.0) and not node0.claim_hang(1, hang, claimed_at=6.0)
    assert node0.hang_claim(1).claimed_at == 5.0
    node0.request_save("stop --save")
    node1.request_save("SIGUSR1 to node 1's supervisor")
    assert node1.save_request() == "stop --save"


def test_ends_decisions_ready_and_roster_cross(stores):
    node0, node1 = (Board(s, rank, node_lost_s=20) for rank, s in enumerate(stores))
    end = AttemptEnd(node_rank=1, attempt=2, state=RunState.FAILED, reason="torchrun exit code 1", at=3.0)
    node1.write_end(end)
    assert node0.read_end(2, 1) == end and node0.read_end(2, 0) is None
    decision = Decision(attempt=2, restart=True, state=RunState.RESTARTING, reason="restart", backoff_s=1.0, members=(0, 1), lost=())
    node0.write_decision(decision)
    assert node1.read_decision(2) == decision
    node1.mark_ready(3)
    assert node0.ready_nodes(3, (0, 1)) == [1]
    node0.write_roster(3, (0, 1))
    assert node1.read_roster(3) == (0, 1)
    assert not node0.exited(1)
    node1.mark_exited()
    assert node0.exited(1)


def test_a_node_brought_back_asks_once_per_request_and_hears_its_attempt(stores):
    """A node back asks for a place (a numbered request); node 0 sees it pending until it answers
    with the attempt after which it takes it; the same node lost and back again asks anew."""
    node0, node1 = (Board(s, rank, node_lost_s=20) for rank, s in enumerate(stores))
    assert node0.join_requests([1, 2]) == []
    first = node1.request_join()
    assert node0.join_requests([1, 2]) == [1] and node1.join_answer(first) is None
    node0.claim_rejoin(4, [1])
    node0.claim_rejoin(4, [1, 2])  # the first claim stands
    assert node1.rejoin(4) == (1,) and node1.rejoin(5) is None
    node0.accept_join(1, 4)
    assert node1.join_answer(first) == 4 and node0.join_requests([1]) == []
    again = node1.request_join()
    assert again == first + 1 and node0.join_requests([1]) == [1] and node1.join_answer(again) is None


def test_a_peer_is_alive_while_its_beat_changes_by_the_observers_clock(stores):
    """No clock but the observer's: node 1's counter, seen changing, keeps it alive; unchanged for
    node_lost_s of node 0's monotonic clock, it is silent; a node never seen is silent node_lost_s
    after the observer began to look."""
    clock = Clock()
    node0 = Board(stores[0], 0, node_lost_s=20, clock=clock)
    node1 = Board(stores[1], 1, node_lost_s=20)
    assert node0.silent_nodes([0, 1, 2]) == []
    node1.beat()
    clock.now += 15
    assert node0.silent_nodes([0, 1, 2]) == []
    clock.now += 10  # 25 s: node 2 never beat; node 1 was seen changing 10 s ago
    assert node0.silent_nodes([0, 1, 2]) == [2]
    clock.now += 15
    node1.beat()
    assert node0.silent_nodes([0, 1]) == []
    clock.now += 21
    assert node0.silent_nodes([0, 1]) == [1]


def test_node_0_gone_is_one_clear_error():
    master_port = free_port()
    server = dist.TCPStore("127.0.0.1", coordination_port(master_port), is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    node1 = Board(open_store("run-1", 2, False, "127.0.0.1", master_port, connect_s=5), 1, node_lost_s=20)
    node1.beat()
    del server  # node 0's supervisor ends: its store with it
    with pytest.raises(BoardUnreachable, match="node 0's coordination store did not answer"):
        for _ in range(50):
            node1.beat()
    nobody = free_port()
    with pytest.raises(BoardUnreachable, match=f"could not reach node 0's coordination store at 127.0.0.1:{nobody + 1}"):
        open_store("run-1", 2, False, "127.0.0.1", nobody, connect_s=1)
