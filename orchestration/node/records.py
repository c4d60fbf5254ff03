"""A supervisor's records on the artifact root, kept best effort, and whether that share still answers.

The files a supervisor writes on the share (its heartbeat record every
:data:`~orchestration.node.run_state.HEARTBEAT_S` from a thread of its own,
:class:`HeartbeatRecord`; its pid file, node 0's ledger and failure text, the exit record, hang
dumps) are records for ``status`` and for people: no node decides anything from them
(orchestration/node/board.py carries the agreements). So a write that fails is no reason to die:
:meth:`RecordKeeper.keep` runs it, and an ``OSError`` (ENOTCONN when an sshfs or FUSE client is
gone, ESTALE, EIO from NFS, ENOSPC) is said once and remembered. A write that does not return at all
(a hard-mounted NFS whose server is gone) is left behind after ``deadline_s`` in a thread of its
own. The heartbeat's write is the probe: once the share has not answered for ``node_lost_s`` the
supervisor ends its node's part with :meth:`RecordKeeper.cause`, which names the node, the root and
the error ("node 1 (g0034): the artifact root /shared/runs is unreachable: [Errno 107] Transport
endpoint is not connected").

Side effects: the callers' writes, a thread per write given a deadline, the heartbeat record's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from orchestration.node.board import join_within
from orchestration.node.run_state import HEARTBEAT_S, RunState

log = logging.getLogger(__name__)

T = TypeVar("T")


class HeartbeatRecord:
    """The node's heartbeat record (what ``status`` reads, and a Slurm start's wait on another
    machine: orchestration/runner/record_beats.py), rewritten every HEARTBEAT_S by a thread of its
    own with a counter one more each time, so that no step of the supervisor's main thread (a 47 s
    stop, node 0's checksum pass, a dump) holds it up; a write that has not returned in
    ``deadline_s`` is left behind (the share failing), and no other starts while it is out. Its
    writes are the share's probe (:class:`RecordKeeper`)."""

    def __init__(self, keeper: "RecordKeeper", write: Callable[[int, RunState, int, str], None], deadline_s: float,
                 period_s: float = HEARTBEAT_S):
        """``write(attempt, state, count, doing)``: one write of the record."""
        self.keeper, self._write, self.deadline_s, self.period_s = keeper, write, deadline_s, period_s
        self.attempt, self.state, self.count = 0, None, 0
        self.doing = ""
        """A long step before torchrun and how far it is (the next write carries it; empty: none)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, attempt: int, state: RunState) -> None:
        """The supervisor's attempt and state from now on, written at once (the first call starts
        the thread that rewrites it)."""
        self.attempt, self.state = attempt, state
        self.write()
        if self._thread is None:
            self._start()

    def write(self) -> None:
        with self._lock:
            self.count += 1
            attempt, state, count, doing = self.attempt, self.state, self.count, self.doing
            self.keeper.keep("writing the heartbeat record", lambda: self._write(attempt, state, count, doing),
                             deadline_s=self.deadline_s)

    def _start(self) -> None:
        def rewrite() -> None:
            while True:
                deadline = time.monotonic() + self.period_s
                while not self._stop.is_set() and time.monotonic() < deadline:
                    time.sleep(0.1)  # sleeps, not a timed wait: orchestration/node/board.py join_within says why
                if self._stop.is_set():
                    return
                self.write()

        self._thread = threading.Thread(target=rewrite, name="heartbeat-record", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


class RecordKeeper:
    def __init__(self, root: Path, node_name: str, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        """``node_name``: ``node 1 (g0034)``, as causes name it; ``say``: the supervisor's log line."""
        self.root, self.node_name, self.say, self.clock = root, node_name, say, clock
        self.failing_since: float | None = None
        """This machine's clock when the share first failed in the current run of failures."""
        self.problem: str | None = None
        """The first error of the current run of failures (what, and the error)."""
        self._out: threading.Thread | None = None
        self._lock = threading.Lock()
        """The heartbeat record's thread and the main thread both keep records."""

    def keep(self, what: str, action: Callable[[], T], default: T = None, deadline_s: float | None = None) -> T:
        """``action()`` (a write or read of a record on the share), or ``default`` when it raised
        an OSError or (given ``deadline_s``) did not return in time; either is remembered. Only a
        call given a deadline (the heartbeat record's write: the probe) says the share answers
        again: a read that works beside writes that fail does not reset the count."""
        if deadline_s is None:
            try:
                return action()
            except OSError as exc:
                self._failed(what, _describe(exc))
                return default
        if self._out is not None and self._out.is_alive():
            self._failed(what, f"an earlier write has not returned for {self.failing_s():.0f} s")
            return default
        answer: dict[str, object] = {}

        def call() -> None:
            try:
                answer["value"] = action()
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                answer["error"] = exc

        self._out = threading.Thread(target=call, name="record-write", daemon=True)
        self._out.start()
        if not join_within(self._out, deadline_s):
            self._failed(what, f"did not return within {deadline_s:.0f} s")
            return default
        if "error" in answer:
            exc = answer["error"]
            self._failed(what, _describe(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}")
            return default
        self._answered()
        return answer.get("value", default)  # type: ignore[return-value]

    def failed(self, what: str, exc: OSError) -> None:
        """An error met outside :meth:`keep` (the supervisor's own, on the share), remembered as its."""
        self._failed(what, _describe(exc))

    def failing_s(self) -> float:
        """How long the share has failed without a success in between (0: it answers)."""
        return 0.0 if self.failing_since is None else self.clock() - self.failing_since

    def cause(self) -> str:
        return f"{self.node_name}: the artifact root {self.root} is unreachable: {self.problem}"

    def _failed(self, what: str, error: str) -> None:
        with self._lock:
            first = self.failing_since is None
            if first:
                self.failing_since, self.problem = self.clock(), f"{error} ({what})"
        if first:
            self.say(f"warning: {self.cause()}; records are skipped while it fails")

    def _answered(self) -> None:
        with self._lock:
            was = self.failing_s() if self.failing_since is not None else None
            self.failing_since = self.problem = None
        if was is not None:
            self.say(f"the artifact root {self.root} answers again after {was:.0f} s")


def _describe(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
