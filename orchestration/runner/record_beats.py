"""Which nodes' supervisors still live, judged from another machine by their heartbeat records:
each record's counter (one more at every write, every 2 s) against this machine's monotonic clock.

    python -c "from orchestration.runner.record_beats import RECORD_SILENCE_S; print(RECORD_SILENCE_S)"

Where a run's status comes from the records its nodes write on the shared file system (inside a
Slurm allocation: ``Backend.records_only``), a supervisor killed without a word (SIGKILL, the
out-of-memory killer) leaves its heartbeat record and no exit record: read once, it looks alive
forever. :class:`RecordBeats` remembers, per node, the counter it last saw of this start and when
(by the reader's clock) it last changed; a node whose counter has not changed for
:data:`RECORD_SILENCE_S` has ended without saying how. No clock or mtime of the writer's machine
is read. Pure: the wait (orchestration/runner/control.py) reads the records and the clock and
hands them in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from megatron_ext.host.json_files import SHARE_CACHE_S
from orchestration.node.run_state import HEARTBEAT_S, RECORD_WRITE_S, Heartbeat, RunState
from orchestration.node.wire import NodeStatus

RECORD_GAP_S = RECORD_WRITE_S + HEARTBEAT_S
"""The longest a live supervisor goes between two writes of its heartbeat record: the record is
rewritten every HEARTBEAT_S by a thread of its own (orchestration/node/records.py), whatever its
main thread does (a 47 s stop, node 0's checksum pass, a dump), and a write that takes longer than
RECORD_WRITE_S counts as the share failing."""
RECORD_SILENCE_S = SHARE_CACHE_S + RECORD_GAP_S + 2 * HEARTBEAT_S
"""How long a node's heartbeat record may stay the same, by the reader's clock, before its
supervisor counts as gone (76 s): the share may show a write up to SHARE_CACHE_S late (NFS's
``acregmax``/``acdirmax``), the supervisor may take RECORD_GAP_S between writes, plus two beats.
A supervisor killed without a record keeps a batch job about a minute and a quarter, not until
its time limit. RECORD_SILENCE_S in the environment lowers it, only where the artifact root shows
every write to every node at once (the tests' one machine)."""


@dataclass(kw_only=True)
class RecordBeats:
    """Each node's heartbeat counter of one start and when it last changed (the reader's clock)."""

    run_id: str | None
    """The start watched (its resolved run id): another start's record is not its sign of life.
    None: any record counts (a run with no resolved parameters)."""
    since: float
    """The reader's monotonic clock when the watch began: a node not seen yet is silent from here."""
    silence_s: float = RECORD_SILENCE_S
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Node rank -> (the counter last seen, the reader's clock when it last changed)."""

    def observe(self, node_rank: int, record: Heartbeat | None, now: float) -> None:
        """A read of the node's heartbeat record at ``now`` (None: missing, torn or unreadable)."""
        if record is None or (self.run_id is not None and record.run_id != self.run_id):
            return
        last = self.seen.get(node_rank)
        if last is None or last[0] != record.beat:  # any other number: a new supervisor counts from 1 again
            self.seen[node_rank] = (record.beat, now)

    def silent_s(self, node_rank: int, now: float) -> float:
        """How long the node's counter has stayed the same (or, never seen, since the watch began)."""
        last = self.seen.get(node_rank)
        return now - (last[1] if last is not None else self.since)

    def judge(self, statuses: Mapping[int, NodeStatus | None], now: float) -> tuple[dict[int, NodeStatus | None], tuple[int, ...]]:
        """The statuses as a wait takes them, and the nodes found silent. A node has ended when its
        status says how (its exit record of this start, or the ledger's loss); else it is alive
        until its counter has stayed the same for ``silence_s``, and then failed, with the reason."""
        judged: dict[int, NodeStatus | None] = {}
        silent = []
        for rank, status in statuses.items():
            if status is None or status.exit is not None:
                judged[rank] = status
            elif self.silent_s(rank, now) > self.silence_s:
                why = (f"node {rank}'s supervisor has not updated its record for {self.silent_s(rank, now):.0f} s: it ended "
                       "without saying how (killed, e.g. by the out-of-memory killer), or its machine or its share is gone")
                judged[rank] = dataclasses.replace(status, alive=False, state=RunState.FAILED, exit=why, failure_reason=why)
                silent.append(rank)
            else:
                judged[rank] = dataclasses.replace(status, alive=True)
        return judged, tuple(silent)
