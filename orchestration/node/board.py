"""What the nodes of a run agree on, over the network: node 0's supervisor holds a
``torch.distributed.TCPStore`` on MASTER_PORT + 1 (:func:`coordination_port`) for the run's whole
life, across torchrun's attempts; every other node's supervisor is its client. No file, lock,
mtime or clock is shared: a cluster's file system caches names and attributes for up to a minute
and has no locks that reach across nodes, and machines' clocks differ (docs/design.md, "What the
nodes agree on").

Keys, under the start's run id (a new start never reads an old one's):

    beat/<node>          a counter each supervisor adds 1 to every HEARTBEAT_S: a peer is alive
                         while its counter changes within node_lost_s of the observer's own
                         monotonic clock
    exit/<node>          a supervisor ending (its silence from then on is no loss)
    a<K>/failure         the attempt's first failure (compare_set: the first writer wins)
    a<K>/hang            the attempt's hang claim (compare_set)
    a<K>/end/<node>      how the attempt ended on each node
    a<K>/decision        node 0's decision after it (restart or end)
    a<K>/ready/<node>    a node ready for attempt K
    a<K>/roster          node 0: the nodes attempt K runs on
    a<K>/rejoin          node 0: the nodes back for the next attempt (attempt K saves and ends for them)
    join/<node>          a node brought back (``rejoin``) counts its requests for a place
    join/<node>/<N>      node 0's answer to request N: the attempt after whose end it is taken
    save                 a save request (compare_set: the first reason stays)

One node (NNODES=1) agrees with itself: :class:`MemoryStore`, the same operations in memory, so a
one-node run starts no store and imports no torch here. The files the supervisors write beside
(the failure text, exit records, the ledger) are records for ``status`` and for people, each with
one writer; no supervisor reads them to decide anything.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Callable, Iterable, Protocol, Sequence

from megatron_ext.run_spec.convert import structure, unstructure
from orchestration.node.attempts import AttemptEnd, Decision, HangClaim
from orchestration.node.resume_point import ResumePoint
from orchestration.node.watchdog import Hang
from orchestration.node.wire import coordination_port

STORE_TIMEOUT_S = 30.0
"""A store operation's limit (a get of a key that exists returns at once; the client's connect waits this long)."""


class BoardUnreachable(RuntimeError):
    """Node 0's store did not answer: node 0's supervisor (or its machine, or the link) is gone."""


class Store(Protocol):
    """The part of ``torch.distributed.Store`` used here."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


class MemoryStore:
    """:class:`Store` in one process (a one-node run: no peer to agree with)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self._data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self._data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self._data.get(key, b"0")) + amount
        self._data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self._data.get(key)
        if (current is None and expected == "") or current == expected.encode():
            self._data[key] = desired.encode()
        return self._data.get(key, expected.encode())

    def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)


def open_store(run_id: str, nnodes: int, leader: bool, master_addr: str, master_port: int,
               connect_s: float) -> Store:
    """The run's store: in memory for one node; else node 0 hosts a TCPStore on
    :func:`coordination_port` and the others connect (waiting up to ``connect_s`` for node 0)."""
    if nnodes == 1:
        return MemoryStore()
    import torch.distributed as dist

    port = coordination_port(master_port)
    try:
        store = dist.TCPStore(master_addr, port, is_master=leader, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=connect_s if not leader else STORE_TIMEOUT_S))
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        where = "listen on" if leader else "reach node 0's coordination store at"
        raise BoardUnreachable(f"could not {where} {master_addr}:{port} ({str(exc).splitlines()[0][:200]})") from exc
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return dist.PrefixStore(f"{run_id}/", store)


class Board:
    """The run's shared state, one supervisor's view: its own beats and claims, its peers' as it
    last saw them. Store errors become :class:`BoardUnreachable`."""

    def __init__(self, store: Store, node_rank: int, node_lost_s: float, clock: Callable[[], float] = time.monotonic):
        self.store, self.rank, self.node_lost_s, self.clock = store, node_rank, node_lost_s, clock
        self._since = clock()
        self._seen: dict[int, tuple[int, float]] = {}
        """node -> (its beat counter, this machine's monotonic time when it last changed)."""

    # -- the store, with errors named ------------------------------------------------------------
    def _call(self, op: str, *args):
        try:
            return getattr(self.store, op)(*args)
        except (RuntimeError, OSError) as exc:
            raise BoardUnreachable(f"node 0's coordination store did not answer ({str(exc).splitlines()[0][:200]})") from exc

    def _get(self, key: str) -> str | None:
        if not self._call("check", [key]):
            return None
        return self._call("get", key).decode()

    def _claim(self, key: str, value: str) -> bool:
        """``value`` set under ``key`` unless a value is there already: whether this one won."""
        return self._call("compare_set", key, "", value).decode() == value

    # -- liveness ----------------------------------------------------------------------------------
    def beat(self) -> None:
        self._call("add", f"beat/{self.rank}", 1)

    def silent_nodes(self, nodes: Iterable[int]) -> list[int]:
        """The nodes (not this one) whose beat counter has not changed for node_lost_s of this
        machine's monotonic clock (a node never seen: since this board was made)."""
        now, silent = self.clock(), []
        for rank in nodes:
            if rank == self.rank:
                continue
            count = int(self._get(f"beat/{rank}") or 0)
            last = self._seen.get(rank)
            if last is None or last[0] != count:
                self._seen[rank] = (count, now if count or last is not None else self._since)
            if now - self._seen[rank][1] > self.node_lost_s:
                silent.append(rank)
        return silent

    def mark_exited(self) -> None:
        """This node's supervisor is ending: its silence from here on is no loss."""
        self._call("set", f"exit/{self.rank}", "1")

    def exited(self, node_rank: int) -> bool:
        return bool(self._call("check", [f"exit/{node_rank}"]))

    # -- one attempt's agreements ------------------------------------------------------------------
    def claim_failure(self, attempt: int, text: str) -> bool:
        """The attempt's first failure, unless another node's came first."""
        return self._claim(f"a{attempt}/failure", text)

    def failure(self, attempt: int) -> str | None:
        """The attempt's first failure, whole (its first line says what failed first)."""
        return self._get(f"a{attempt}/failure")

    def claim_hang(self, attempt: int, hang: Hang, claimed_at: float) -> bool:
        return self._claim(f"a{attempt}/hang", json.dumps({**unstructure(hang), "claimed_at": claimed_at}))

    def hang_claim(self, attempt: int) -> HangClaim | None:
        raw = self._get(f"a{attempt}/hang")
        return structure(HangClaim, json.loads(raw)) if raw else None

    def write_end(self, end: AttemptEnd) -> None:
        self._call("set", f"a{end.attempt}/end/{end.node_rank}", json.dumps(unstructure(end)))

    def read_end(self, attempt: int, node_rank: int) -> AttemptEnd | None:
        raw = self._get(f"a{attempt}/end/{node_rank}")
        return structure(AttemptEnd, json.loads(raw)) if raw else None

    def write_decision(self, decision: Decision) -> None:
        self._call("set", f"a{decision.attempt}/decision", json.dumps(unstructure(decision)))

    def read_decision(self, attempt: int) -> Decision | None:
        raw = self._get(f"a{attempt}/decision")
        return structure(Decision, json.loads(raw)) if raw else None

    def write_resume_point(self, attempt: int, point: ResumePoint) -> None:
        self._call("set", f"a{attempt}/resume", json.dumps(unstructure(point)))

    def read_resume_point(self, attempt: int) -> ResumePoint | None:
        raw = self._get(f"a{attempt}/resume")
        return structure(ResumePoint, json.loads(raw)) if raw else None

    def mark_ready(self, attempt: int) -> None:
        self._call("set", f"a{attempt}/ready/{self.rank}", "1")

    def ready_nodes(self, attempt: int, nodes: Sequence[int]) -> list[int]:
        return [rank for rank in nodes if self._call("check", [f"a{attempt}/ready/{rank}"])]

    def write_roster(self, attempt: int, members: Sequence[int]) -> None:
        self._call("set", f"a{attempt}/roster", json.dumps(list(members)))

    def read_roster(self, attempt: int) -> tuple[int, ...] | None:
        raw = self._get(f"a{attempt}/roster")
        return tuple(int(r) for r in json.loads(raw)) if raw else None

    # -- a node brought back (NNODES=MIN:MAX) ------------------------------------------------------
    def request_join(self) -> int:
        """This node asks for a place in the run: the request's number (one node may be lost and
        brought back more than once)."""
        return int(self._call("add", f"join/{self.rank}", 1))

    def join_answer(self, request: int) -> int | None:
        """The attempt after whose end node 0 takes this node (its request ``request``), once it answered."""
        raw = self._get(f"join/{self.rank}/{request}")
        return int(raw) if raw else None

    def join_requests(self, nodes: Iterable[int]) -> list[int]:
        """Node 0: the nodes among ``nodes`` with a request it has not answered."""
        pending = []
        for rank in nodes:
            request = int(self._get(f"join/{rank}") or 0)
            if request and not self._call("check", [f"join/{rank}/{request}"]):
                pending.append(rank)
        return pending

    def accept_join(self, rank: int, attempt: int) -> None:
        """Node 0: ``rank``'s latest request answered: it is taken after ``attempt``."""
        request = int(self._get(f"join/{rank}") or 0)
        self._call("set", f"join/{rank}/{request}", str(attempt))

    def claim_rejoin(self, attempt: int, nodes: Sequence[int]) -> None:
        """Node 0: attempt ``attempt`` saves and ends so that ``nodes`` come back in the next."""
        self._claim(f"a{attempt}/rejoin", json.dumps(list(nodes)))

    def rejoin(self, attempt: int) -> tuple[int, ...] | None:
        raw = self._get(f"a{attempt}/rejoin")
        return tuple(json.loads(raw)) if raw else None

    # -- a save request ----------------------------------------------------------------------------
    def request_save(self, why: str) -> None:
        self._claim("save", why)

    def save_request(self) -> str | None:
        return self._get("save")
