"""Who of a run's supervisors is alive, judged by this machine's own monotonic clock, from a beat
that nothing else holds up.

Each supervisor beats in a thread of its own, on a connection of its own to node 0's coordination
store (orchestration/node/board.py: :func:`~orchestration.node.board.open_stores`): every
:data:`~orchestration.node.run_state.HEARTBEAT_S` it adds 1 to its counter and reads the counters
of the nodes it watches (node 0 watches every node of the attempt; the others watch node 0). So a
supervisor whose main thread is busy for longer than ``node_lost_s`` (stopping torchrun: up to
40 + 5 + 2 s; a dump of 8 ranks; node 0 choosing a checkpoint; a slow write to the share) still
beats, and no peer takes it for lost. Every store call here, as on the main thread, answers within
its deadline (:class:`~orchestration.node.board.DeadlineStore`): a node 0 cut off the network (its
packets vanish, nothing is closed) is silent after ``node_lost_s`` of the observer's clock, not
after TCP gives up (about 15 minutes).

Keys (under the start's run id), one set per *incarnation* of a node: 0 for the supervisor the
start made, N for the one a ``rejoin`` made with its N-th request for a place (node 0 learns N
when it takes the node back), so that a node's old supervisor (ended, or cut off) never speaks
for its new one:

    beat/<node>/<incarnation>   the counter
    exit/<node>/<incarnation>   the supervisor is ending: its silence from then on is no loss
                                (:meth:`~orchestration.node.board.Board.mark_exited`)

Side effects: the beat thread, store calls.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

from orchestration.node.board import BoardUnreachable, DeadlineStore, beat_key, exit_key, join_within
from orchestration.node.run_state import HEARTBEAT_S


class Liveness:
    """This supervisor's beat and its view of the nodes it watches. :meth:`tick` is one round (the
    thread calls it every ``period_s``; tests call it with their own clock); the main thread only
    reads what the last rounds saw (:meth:`lost`, :meth:`silent_s`), which never waits."""

    def __init__(self, store: DeadlineStore, node_rank: int, incarnation: int, node_lost_s: float,
                 clock: Callable[[], float] = time.monotonic, period_s: float = HEARTBEAT_S,
                 after_round: Callable[[], None] | None = None):
        """``after_round``: called by the beat thread after each round (the supervisor's last resort
        when its main thread is stuck on a share that does not answer); it must not log or touch
        the share."""
        self.store, self.rank, self.incarnation, self.after_round = store, node_rank, incarnation, after_round
        self.node_lost_s, self.clock, self.period_s = node_lost_s, clock, period_s
        self._lock = threading.Lock()
        self._watched: dict[int, int] = {}
        """node -> the incarnation watched."""
        self._seen: dict[int, tuple[int, int, float]] = {}
        """node -> (incarnation, its counter, this clock when the counter last changed or watching began)."""
        self._exited: set[int] = set()
        self._answered_at = clock()
        """When the store last answered this thread (node 0's own store: always, on node 0)."""
        self.error: str | None = None
        """The store's last error, as this thread met it."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the main thread says and reads ------------------------------------------------------
    def watch(self, nodes: Mapping[int, int]) -> None:
        """Watch ``nodes`` (node -> incarnation) from now on; a node newly watched (or watched in
        another incarnation) is silent once ``node_lost_s`` passes from now without a change."""
        now = self.clock()
        with self._lock:
            before, self._watched = self._watched, {n: inc for n, inc in nodes.items() if n != self.rank}
            self._seen = {n: seen for n, seen in self._seen.items() if self._watched.get(n) == seen[0]}
            for n, inc in self._watched.items():
                self._seen.setdefault(n, (inc, -1, now))
            self._exited = {n for n in self._exited if before.get(n) == self._watched.get(n)}

    def silent_s(self, node_rank: int) -> float:
        """How long ``node_rank`` (watched) has given no sign, by this machine's clock: its counter
        unchanged, or the store not answering this thread (a node whose store does not answer is
        silent: that is node 0, or the link to it)."""
        now = self.clock()
        with self._lock:
            seen = self._seen.get(node_rank)
            quiet = now - seen[2] if seen else 0.0
            return max(quiet, now - self._answered_at)

    def silent(self) -> list[int]:
        """The watched nodes silent for longer than ``node_lost_s``."""
        with self._lock:
            watched = sorted(self._watched)
        return [n for n in watched if self.silent_s(n) > self.node_lost_s]

    def exited(self, node_rank: int) -> bool:
        with self._lock:
            return node_rank in self._exited

    def lost(self) -> list[int]:
        """The watched nodes silent for longer than ``node_lost_s`` that did not say they end."""
        return [n for n in self.silent() if not self.exited(n)]

    # -- the beat -------------------------------------------------------------------------------
    def tick(self) -> None:
        """One round: this node's counter up by one; the watched nodes' counters and exits read."""
        with self._lock:
            watched = dict(self._watched)

        def round_trip(store) -> tuple[dict[int, int], set[int]]:
            store.add(beat_key(self.rank, self.incarnation), 1)
            counts = {n: int(store.add(beat_key(n, inc), 0)) for n, inc in watched.items()}
            return counts, {n for n, inc in watched.items() if store.check([exit_key(n, inc)])}

        try:
            counts, exited = self.store.run("beat", round_trip)
        except BoardUnreachable as exc:
            self.error = str(exc)
            return
        except Exception as exc:  # noqa: BLE001 - the beat thread never dies of a surprise: that would be taken for a loss
            self.error = f"{type(exc).__name__}: {exc}"
            return
        now = self.clock()
        with self._lock:
            self._answered_at, self.error = now, None
            for n, count in counts.items():
                inc, last, _ = self._seen.get(n, (watched[n], -1, now))
                if inc == watched[n] == self._watched.get(n) and count != last:
                    self._seen[n] = (inc, count, now)
            self._exited |= {n for n in exited if self._watched.get(n) == watched[n]}

    def start(self) -> "Liveness":
        """The first beat now, then one every ``period_s`` in a daemon thread until :meth:`stop`."""
        self.tick()

        def beat() -> None:
            while True:
                deadline = time.monotonic() + self.period_s
                while not self._stop.is_set() and time.monotonic() < deadline:
                    time.sleep(min(0.1, self.period_s))  # sleeps, not a timed wait: board.join_within says why
                if self._stop.is_set():
                    return
                self.tick()
                if self.after_round is not None:
                    self.after_round()

        self._thread = threading.Thread(target=beat, name=f"beat-node{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more beats: the thread ends after its current round (which a deadline bounds)."""
        self._stop.set()
        if self._thread is not None:
            join_within(self._thread, self.node_lost_s + 1.0)
