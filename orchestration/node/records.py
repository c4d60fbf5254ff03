"""A supervisor's records on the artifact root, kept best effort, and whether that share still answers.

The files a supervisor writes on the share (its heartbeat record every
:data:`~orchestration.node.run_state.HEARTBEAT_S`, its pid file, node 0's ledger and failure text,
the exit record, hang dumps) are records for ``status`` and for people: no node decides anything
from them (orchestration/node/board.py carries the agreements). So a write that fails is no reason
to die: :meth:`RecordKeeper.keep` runs it, and an ``OSError`` (ENOTCONN when an sshfs or FUSE
client is gone, ESTALE, EIO from NFS, ENOSPC) is said once and remembered. A write that does not
return at all (a hard-mounted NFS whose server is gone) is left behind after ``deadline_s`` in a
thread of its own. The heartbeat's write is the probe: once the share has not answered for
``node_lost_s`` the supervisor ends its node's part with :meth:`RecordKeeper.cause`, which names
the node, the root and the error ("node 1 (g0034): the artifact root /shared/runs is unreachable:
[Errno 107] Transport endpoint is not connected").

Side effects: the callers' writes, a thread per write given a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from orchestration.node.board import join_within

log = logging.getLogger(__name__)

T = TypeVar("T")


class RecordKeeper:
    def __init__(self, root: Path, node_name: str, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        """``node_name``: ``node 1 (g0034)``, as causes name it; ``say``: the supervisor's log line."""
        self.root, self.node_name, self.say, self.clock = root, node_name, say, clock
        self.failing_since: float | None = None
        """This machine's clock when the share first failed in the current run of failures."""
        self.problem: str | None = None
        """The first error of the current run of failures (what, and the error)."""
        self._out: threading.Thread | None = None

    def keep(self, what: str, action: Callable[[], T], default: T = None, deadline_s: float | None = None) -> T:
        """``action()`` (a write or read of a record on the share), or ``default`` when it raised
        an OSError or (given ``deadline_s``) did not return in time; either is remembered."""
        if deadline_s is None:
            try:
                value = action()
            except OSError as exc:
                self._failed(what, _describe(exc))
                return default
            self._answered()
            return value
        if self._out is not None and self._out.is_alive():
            self._failed(what, f"an earlier write has not returned for {self.failing_s():.0f} s")
            return default
        answer: dict[str, object] = {}

        def call() -> None:
            try:
                answer["value"] = action()
            except OSError as exc:
                answer["error"] = exc

        self._out = threading.Thread(target=call, name="record-write", daemon=True)
        self._out.start()
        if not join_within(self._out, deadline_s):
            self._failed(what, f"did not return within {deadline_s:.0f} s")
            return default
        if "error" in answer:
            exc = answer["error"]
            self._failed(what, _describe(exc))
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
        if self.failing_since is None:
            self.failing_since, self.problem = self.clock(), f"{error} ({what})"
            self.say(f"warning: {self.cause()}; records are skipped while it fails")

    def _answered(self) -> None:
        if self.failing_since is not None:
            self.say(f"the artifact root {self.root} answers again after {self.failing_s():.0f} s")
        self.failing_since = self.problem = None


def _describe(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
