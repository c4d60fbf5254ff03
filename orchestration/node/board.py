"""What the nodes of a run agree on, over the network: node 0's supervisor holds a
``torch.distributed.TCPStore`` on MASTER_PORT + 1 (:func:`coordination_port`) for the run's whole
life, across torchrun's attempts; every other node's supervisor is its client. No file, lock,
mtime or clock is shared: a cluster's file system caches names and attributes for up to a minute
and has no locks that reach across nodes, and machines' clocks differ (docs/design.md, "What the
nodes agree on").

Keys, under the start's run id (a new start never reads an old one's):

    beat/<node>/<inc>    each supervisor's beat, and ``exit/<node>/<inc>`` when it ends
                         (orchestration/node/liveness.py: its own thread, its own connection)
    a<K>/failure         the attempt's first Failure (kind, node, rank, text; compare_set: the first
                         writer wins): it stops every node; node 0 records the one the evidence names
    a<K>/hang            the attempt's hang claim (compare_set)
    a<K>/report/<node>   each node's report of its ranks once a hang is claimed (their state,
                         progress and stacks' verdicts; the dumps themselves are files for people)
    a<K>/end/<node>      how the attempt ended on each node (its own failure whole, if any)
    a<K>/decision        node 0's decision after it (restart, or how the run ends): every node
                         follows it, whatever its own end was
    a<K>/resume          node 0: the checkpoint a Megatron-LM attempt loads
    a<K>/share           node 0: the checkpoint whose files the attempt's nodes read, a share each,
                         before it chooses (resume_point.py ShareAsk; one at a time, newest first)
    a<K>/share/<it>/<node>  what that node found in its share of checkpoint <it> (ShareCheck)
    a<K>/ready/<node>    a node ready for attempt K
    a<K>/roster          node 0: the nodes attempt K runs on
    a<K>/rejoin          node 0: the nodes back for the next attempt (attempt K saves and ends for them)
    a<K>/exclude         node 0: the node the next attempt leaves out, and why (attempt K saves and
                         ends for it: a slow node, orchestration/node/exclusion.py)
    join/<node>          a node brought back (``rejoin``) counts its requests for a place
    join/<node>/<N>      node 0's answer to request N: the attempt after whose end it is taken
                         (N is that supervisor's incarnation)
    save                 a save request (compare_set: the first reason stays)

Every call answers within a deadline (:class:`DeadlineStore`): a TCPStore bounds only ``get`` and
``wait`` itself, and against a node 0 cut off the network any other call blocks until TCP gives up.

One node (NNODES=1) agrees with itself: :class:`MemoryStore`, the same operations in memory, so a
one-node run starts no store and imports no torch here. The files the supervisors write beside
(the failure text, exit records, the ledger) are records for ``status`` and for people, each with
one writer; no supervisor reads them to decide anything.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from typing import Callable, Iterable, Protocol, Sequence, TypeVar

from megatron_ext.run_spec.convert import structure, unstructure
from orchestration.node.attempts import AttemptEnd, Decision
from orchestration.node.exclusion import Exclusion
from orchestration.node.failure import Failure
from orchestration.node.resume_point import ResumePoint, ShareAsk, ShareCheck
from orchestration.node.watchdog import Hang, RankReport
from orchestration.node.wire import coordination_port

STORE_TIMEOUT_S = 30.0
"""How long node 0's supervisor waits to listen on its port, and for its own connections."""
ABSENT = "\x00absent"
"""What :meth:`Board._get` asks a compare_set to expect: no value of the board's is it."""
T = TypeVar("T")


def beat_key(node_rank: int, incarnation: int) -> str:
    return f"beat/{node_rank}/{incarnation}"


def exit_key(node_rank: int, incarnation: int) -> str:
    return f"exit/{node_rank}/{incarnation}"


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


def join_within(thread: threading.Thread, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``thread`` to end (whether it did), timed by sleeps on this
    machine's monotonic clock, not by a lock's timed wait: where libfaketime offsets a node's clock
    (the tests' node 1), it shifts the monotonic clock that ``time.sleep`` follows but not the
    kernel's ``sem_clockwait`` under ``Thread.join(timeout)``, which then waits 30 s longer. The
    pauses start at a yield and double from 50 us to 50 ms: a store call on the loopback answers in
    about 0.1 ms, and a first pause of 0.5 ms made every call cost 0.7 ms (benchmarks/coordination.py)."""
    deadline, pause = time.monotonic() + seconds, 0.0
    while thread.is_alive():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(max(pause * 2, 0.00005), 0.05)
    return True


class DeadlineStore:
    """A :class:`Store` whose every call answers within ``deadline_s`` or raises
    :class:`BoardUnreachable`, as does any error of the store's. The call runs in a daemon thread
    this one waits for: a call that never returns (node 0 cut off) is left behind, and while it is
    still out every later call fails at once (a TCPStore client runs one call at a time: the next
    would only queue behind it), until it returns. One thread's connection: the supervisor's main
    thread and its beat thread each have their own (:func:`open_stores`)."""

    def __init__(self, store: Store, deadline_s: float):
        self.store, self.deadline_s = store, deadline_s
        self._out: tuple[threading.Thread, str, float] | None = None

    def run(self, what: str, calls: Callable[[Store], T]) -> T:
        """``calls(store)``, several calls on the store at once, within one deadline (the beat's
        round: one thread for all its calls)."""
        if self._out is not None and self._out[0].is_alive():
            _, pending, since = self._out
            raise BoardUnreachable(f"node 0's coordination store has not answered a {pending} for "
                                   f"{time.monotonic() - since:.0f} s")
        answer: dict[str, object] = {}

        def call() -> None:
            try:
                answer["value"] = calls(self.store)
            except BaseException as exc:  # handed to the waiting thread
                answer["error"] = exc

        thread = threading.Thread(target=call, name=f"store-{what}", daemon=True)
        self._out = (thread, what, time.monotonic())
        thread.start()
        if not join_within(thread, self.deadline_s):
            raise BoardUnreachable(f"node 0's coordination store did not answer a {what} within {self.deadline_s:.0f} s")
        self._out = None
        if "error" in answer:
            exc = answer["error"]
            if isinstance(exc, (RuntimeError, OSError)):  # DistNetworkError, DistStoreError, a reset connection
                raise BoardUnreachable(f"node 0's coordination store did not answer ({str(exc).splitlines()[0][:200]})") from exc
            raise exc
        return answer["value"]

    def set(self, key: str, value: str) -> None:
        self.run("set", lambda store: store.set(key, value))

    def get(self, key: str) -> bytes:
        return self.run("get", lambda store: store.get(key))

    def add(self, key: str, amount: int) -> int:
        return self.run("add", lambda store: store.add(key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.run("compare_set", lambda store: store.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return self.run("check", lambda store: store.check(keys))


def open_stores(run_id: str, nnodes: int, leader: bool, master_addr: str, master_port: int, connect_s: float,
                deadline_s: float) -> tuple[DeadlineStore, DeadlineStore]:
    """The run's store, twice: one connection for the supervisor's main thread, one for its beat
    (orchestration/node/liveness.py), so that neither waits behind the other's call. In memory for
    one node (the same store twice); else node 0 hosts a TCPStore on :func:`coordination_port` and
    every supervisor connects (the others waiting up to ``connect_s`` for node 0). Every call
    answers within ``deadline_s`` (:class:`DeadlineStore`)."""
    if nnodes == 1:
        store = MemoryStore()  # two threads, each its own keys: each dict operation is one step
        return DeadlineStore(store, deadline_s), DeadlineStore(store, deadline_s)
    import torch.distributed as dist

    port = coordination_port(master_port)

    def connect(hosts: bool, wait_s: float) -> DeadlineStore:
        try:
            store = dist.TCPStore(master_addr, port, is_master=hosts, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=wait_s))
        except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
            where = "listen on" if hosts else "reach node 0's coordination store at"
            raise BoardUnreachable(f"could not {where} {master_addr}:{port} ({str(exc).splitlines()[0][:200]})") from exc
        store.set_timeout(datetime.timedelta(seconds=deadline_s))
        return DeadlineStore(dist.PrefixStore(f"{run_id}/", store), deadline_s)

    main = connect(leader, connect_s if not leader else STORE_TIMEOUT_S)
    return main, connect(False, connect_s if not leader else STORE_TIMEOUT_S)


class Board:
    """The run's shared state, one supervisor's view: its claims, and what node 0 and its peers
    said. Store errors (and calls past their deadline) are :class:`BoardUnreachable`."""

    def __init__(self, store: Store, node_rank: int):
        self.store, self.rank = store, node_rank

    def _get(self, key: str) -> str | None:
        """The value under ``key``, or None, in one call: a compare_set that never matches answers
        what is there, or its own expected value where nothing is."""
        value = self.store.compare_set(key, ABSENT, ABSENT).decode()
        return None if value == ABSENT else value

    def _read(self, key: str, cls: type[T]) -> T | None:
        raw = self._get(key)
        return structure(cls, json.loads(raw)) if raw else None

    def _claim(self, key: str, value: str) -> bool:
        """``value`` set under ``key`` unless a value is there already: whether this one won."""
        return self.store.compare_set(key, "", value).decode() == value

    def mark_exited(self, incarnation: int) -> None:
        """This supervisor (``incarnation``) is ending: its silence from here on is no loss
        (orchestration/node/liveness.py reads it)."""
        self.store.set(exit_key(self.rank, incarnation), "1")

    # -- one attempt's agreements ------------------------------------------------------------------
    def claim_failure(self, attempt: int, failure: Failure) -> bool:
        """The attempt's first failure, unless another node's came first."""
        return self._claim(f"a{attempt}/failure", json.dumps(unstructure(failure)))

    def failure(self, attempt: int) -> Failure | None:
        return self._read(f"a{attempt}/failure", Failure)

    def claim_hang(self, attempt: int, hang: Hang) -> bool:
        """The first node whose watchdog found a rank past its limit in the attempt claims it."""
        return self._claim(f"a{attempt}/hang", json.dumps(unstructure(hang)))

    def hang_claim(self, attempt: int) -> Hang | None:
        return self._read(f"a{attempt}/hang", Hang)

    def write_report(self, attempt: int, reports: Sequence[RankReport]) -> None:
        """This node's ranks once a hang is claimed (their dumps are files beside, for people)."""
        self.store.set(f"a{attempt}/report/{self.rank}", json.dumps(unstructure(list(reports))))

    def read_report(self, attempt: int, node_rank: int) -> list[RankReport] | None:
        return self._read(f"a{attempt}/report/{node_rank}", list[RankReport])

    def write_end(self, end: AttemptEnd) -> None:
        self.store.set(f"a{end.attempt}/end/{end.node_rank}", json.dumps(unstructure(end)))

    def read_end(self, attempt: int, node_rank: int) -> AttemptEnd | None:
        return self._read(f"a{attempt}/end/{node_rank}", AttemptEnd)

    def write_decision(self, decision: Decision) -> None:
        self.store.set(f"a{decision.attempt}/decision", json.dumps(unstructure(decision)))

    def read_decision(self, attempt: int) -> Decision | None:
        return self._read(f"a{attempt}/decision", Decision)

    def write_resume_point(self, attempt: int, point: ResumePoint) -> None:
        self.store.set(f"a{attempt}/resume", json.dumps(unstructure(point)))

    def read_resume_point(self, attempt: int) -> ResumePoint | None:
        return self._read(f"a{attempt}/resume", ResumePoint)

    def ask_share(self, attempt: int, ask: ShareAsk) -> None:
        self.store.set(f"a{attempt}/share", json.dumps(unstructure(ask)))

    def share_asked(self, attempt: int) -> ShareAsk | None:
        return self._read(f"a{attempt}/share", ShareAsk)

    def write_share(self, attempt: int, iteration: int, check: ShareCheck) -> None:
        self.store.set(f"a{attempt}/share/{iteration}/{check.node}", json.dumps(unstructure(check)))

    def read_share(self, attempt: int, iteration: int, node_rank: int) -> ShareCheck | None:
        return self._read(f"a{attempt}/share/{iteration}/{node_rank}", ShareCheck)

    def mark_ready(self, attempt: int) -> None:
        self.store.set(f"a{attempt}/ready/{self.rank}", "1")

    def ready_nodes(self, attempt: int, nodes: Sequence[int]) -> list[int]:
        return [rank for rank in nodes if self.store.check([f"a{attempt}/ready/{rank}"])]

    def write_roster(self, attempt: int, members: Sequence[int]) -> None:
        self.store.set(f"a{attempt}/roster", json.dumps(list(members)))

    def read_roster(self, attempt: int) -> tuple[int, ...] | None:
        raw = self._get(f"a{attempt}/roster")
        return tuple(int(r) for r in json.loads(raw)) if raw else None

    # -- a node brought back (NNODES=MIN:MAX) ------------------------------------------------------
    def request_join(self) -> int:
        """This node asks for a place in the run: the request's number (one node may be lost and
        brought back more than once)."""
        return int(self.store.add(f"join/{self.rank}", 1))

    def join_answer(self, request: int) -> int | None:
        """The attempt after whose end node 0 takes this node (its request ``request``), once it answered."""
        raw = self._get(f"join/{self.rank}/{request}")
        return int(raw) if raw else None

    def join_requests(self, nodes: Iterable[int]) -> dict[int, int]:
        """Node 0: the nodes among ``nodes`` with a request it has not answered, each with the
        request's number (its supervisor's incarnation)."""
        pending = {}
        for rank in nodes:
            request = int(self._get(f"join/{rank}") or 0)
            if request and not self.store.check([f"join/{rank}/{request}"]):
                pending[rank] = request
        return pending

    def accept_join(self, rank: int, attempt: int) -> int:
        """Node 0: ``rank``'s latest request answered: it is taken after ``attempt``. The request's
        number: the incarnation of ``rank``'s supervisor from then on (orchestration/node/liveness.py)."""
        request = int(self._get(f"join/{rank}") or 0)
        self.store.set(f"join/{rank}/{request}", str(attempt))
        return request

    def claim_rejoin(self, attempt: int, nodes: Sequence[int]) -> None:
        """Node 0: attempt ``attempt`` saves and ends so that ``nodes`` come back in the next."""
        self._claim(f"a{attempt}/rejoin", json.dumps(list(nodes)))

    def rejoin(self, attempt: int) -> tuple[int, ...] | None:
        raw = self._get(f"a{attempt}/rejoin")
        return tuple(json.loads(raw)) if raw else None

    # -- a node left out on the evidence against it ---------------------------------------------------
    def claim_exclusion(self, attempt: int, leaving: Exclusion) -> None:
        """Node 0: attempt ``attempt`` saves and ends so that the next one leaves ``leaving.nodes`` out."""
        self._claim(f"a{attempt}/exclude", json.dumps(unstructure(leaving)))

    def exclusion(self, attempt: int) -> Exclusion | None:
        return self._read(f"a{attempt}/exclude", Exclusion)

    # -- a save request ----------------------------------------------------------------------------
    def request_save(self, why: str) -> None:
        self._claim("save", why)

    def save_request(self) -> str | None:
        return self._get("save")
