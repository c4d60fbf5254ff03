"""The hang protocol, a part of the node's supervisor (:class:`orchestration.node.supervisor.Supervisor`;
the state is the supervisor's, set in its ``__init__``): the watchdog (orchestration/node/watchdog.py)
finds a rank past its phase's limit and the node claims a hang on the board; every node then dumps
each of its ranks' stacks into ``runs/<run>/hangs/<attempt>/`` and puts its report on the board;
node 0 names the suspects ("node 1 (...) hung: rank 3 stopped ...") in the attempt's failure.
"""

from __future__ import annotations

import time

from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node.failure import Failure, FailureKind
from orchestration.node.flight_recorder import StuckCollective, read_flight_recorders, stuck_collective
from orchestration.node.watchdog import Hang, Watchdog, dump_node, find_suspects, local_ranks

HANG_REPORT_WAIT_S = 30.0
"""How long node 0 waits for every node's hang report on the board before naming the suspects from those it has."""


class HangProtocol:
    """One poll of the hang protocol (:meth:`HangProtocol._hang`)."""

    def _hang(self, watchdog: Watchdog, reported: bool) -> bool:
        """The hang protocol, one poll: claim a hang found here; dump this node's ranks once a hang
        is claimed and put their report on the board; node 0 names the suspects once every node
        reported. Whether this node reported."""
        claim = self.board.hang_claim(self.attempt)
        if claim is None:
            found = watchdog.check(time.time())  # this machine's clock against its own ranks' reports
            if found is not None and self.board.claim_hang(self.attempt, found):
                self.say(f"hang: {found.detail}; dumping every rank's stack")
            return reported
        if self._hang_seen is None:
            self._hang_seen = time.monotonic()
        if not reported:
            ranks = local_ranks(self.members.index(self.rank), self.plan.nproc_per_node)  # the attempt's global ranks here
            reports = self.records.keep("writing the hang dumps", lambda: dump_node(
                self.plan.target, ranks, self.progress_dir, self.policy, self.attempt, claim.detail), [])
            self.board.write_report(self.attempt, reports)
            reported = True
        if self.leader and self._failure() is None:
            # Node 0 waits for every node's report on the board, or HANG_REPORT_WAIT_S of its own
            # clock from when it saw the claim (a node that cannot dump, or is gone).
            reports = {n: self.board.read_report(self.attempt, n) for n in self.members}
            if all(r is not None for r in reports.values()) or time.monotonic() - self._hang_seen > HANG_REPORT_WAIT_S:
                self._claim_failure(hang_summary(self.paths, self.attempt, claim, reports))
        return reported


def hang_summary(paths: RunPaths, attempt: int, claim: Hang, reports: dict) -> Failure:
    """A hung attempt's failure, its text: who (the suspects), where, for how long, the collective
    the ranks hung in (torch's flight-recorder analyser: node/flight_recorder.py), and the dumps."""
    everyone = [r for rs in reports.values() if rs for r in rs]
    suspects = find_suspects(everyone)
    missing = sorted(n for n, rs in reports.items() if rs is None)
    first = suspects.ranks[0] if suspects.ranks else None
    nodes = sorted({r.node_rank for r in suspects.ranks}) or [claim.node_rank]
    hosts = ", ".join(f"node {n}" for n in nodes)
    where = (f" in {first.phase} of iteration {first.iteration} for {first.phase_elapsed_s:.0f} s"
             + (f" (limit {first.limit_s:.0f} s)" if first.limit_s else "") if first and first.phase else "")
    ranks = ", ".join(f"rank {r.rank} (node {r.node_rank})" for r in suspects.ranks) or "no rank"
    collective = stuck_collective(*read_flight_recorders(everyone)) if everyone else "no rank reported"
    named = f"; {collective.describe()}" if isinstance(collective, StuckCollective) else ""
    head = (f"{hosts} hung: {ranks} {suspects.why}{where}"
            + (f"; {suspects.others}" if suspects.others else "") + named
            + f"; every rank's stack: {paths.hangs_dir(attempt)}")
    lines = [head, f"--- attempt {attempt}, detected by node {claim.node_rank}: {claim.detail} ---"]
    if not named:
        lines.append(f"flight recorder: {collective}")
    for r in sorted(everyone, key=lambda r: r.rank):
        progress = (f"{r.phase} of iteration {r.iteration} for {r.phase_elapsed_s:.0f} s" if r.phase else "no progress report")
        stack = "in a collective" if r.in_collective else "outside any collective" if r.in_collective is False else "stack not read"
        lines.append(f"rank {r.rank} (node {r.node_rank}, {r.host}, pid {r.pid}, state {r.process_state}): {progress}; "
                     f"{stack}; {r.dump}")
    if missing:
        lines.append(f"no report from node(s) {', '.join(map(str, missing))} within {HANG_REPORT_WAIT_S:.0f} s")
    return Failure(FailureKind.HUNG, nodes[0], "\n".join(lines) + "\n", first.rank if first else None)
