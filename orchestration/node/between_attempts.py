"""Between two attempts, a part of the node's supervisor (:class:`orchestration.node.supervisor.Supervisor`;
the state is the supervisor's, set in its ``__init__``). After every attempt each node puts how
it ended on the board and node 0 decides for all (orchestration/node/attempts.py): the run's end
(finished, preempted, stopped, failed, hung, gave up), or a restart after a backoff from the
latest complete checkpoint, on which nodes (under NNODES=MIN:MAX without a node the evidence
names: its GPU health after the attempt, a hang's suspect or the failing node twice in a row, a
rank slow for two windows, for which node 0 has every rank save first; orchestration/node/exclusion.py).
Node 0 alone writes the ledger and the failure record. Every node follows that decision, whatever
its own end was, and waits its backoff.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from orchestration.node import attempts, exclusion
from orchestration.node.attempts import AttemptEnd, Decision
from orchestration.node.failure import FailureKind
from orchestration.node.gpu_health import read_gpu_health
from orchestration.node.hang_protocol import HANG_REPORT_WAIT_S
from orchestration.node.run_state import RunState, clear_failure, end_attempt, read_ledger

SAVED = (RunState.FINISHED, RunState.PREEMPTED)
"""How an attempt ends on a node when nothing failed."""


class BetweenAttempts:
    """Node 0's decision after an attempt, the ledger, and every node's following of the decision."""

    def decide(self, end: AttemptEnd) -> Decision:
        """Node 0: every node's end of this attempt, then the decision (the run's end, or a restart
        on which nodes); the others read it and follow."""
        join_s = self.policy.join_s
        if not self.leader:
            decision = self._wait(2 * join_s + HANG_REPORT_WAIT_S, lambda: self.board.read_decision(self.attempt),
                                  RunState.RESTARTING)
            if decision is None:
                state = RunState.STOPPED if self.stopping else RunState.FAILED
                why = ("stopped on request" if self.stopping else f"node 0 (the leader) made no decision after attempt "
                       f"{self.attempt} within {2 * join_s + HANG_REPORT_WAIT_S:.0f} s: the run ends here")
                return Decision(attempt=self.attempt, restart=False, state=state, reason=why)
            return decision
        # Every node's end, or its beat stopped (lost: it will write none), within join_s.
        def settled() -> bool:
            lost = self.liveness.lost()
            return all(n in lost or self.board.read_end(self.attempt, n) for n in self.members)

        self._wait(join_s, settled, RunState.RESTARTING, until_stop=False)
        ends = {n: self.board.read_end(self.attempt, n) for n in self.members}
        back = self.board.rejoin(self.attempt)
        checkpoint = self._latest_checkpoint()
        rejoin = attempts.decide_rejoin(self.attempt, ends, back, self.restarts, self.rejoins, checkpoint,
                                        self.plan.hosts) if back and not self.stopping and not self.board.save_request() else None
        if rejoin is not None:  # every node saved for the nodes back (or reached its last iteration): nothing failed
            self._close_ledger(RunState.PREEMPTED if rejoin.restart else rejoin.state,
                               f"saved a checkpoint for {attempts.node_names(back, self.plan.hosts)} to come back"
                               if rejoin.restart else rejoin.reason, checkpoint)
            return self._publish(rejoin)
        leaving = self.board.exclusion(self.attempt) if not back and not self.stopping and not self.board.save_request() else None
        planned = exclusion.decide_leaving(self.attempt, ends, leaving, self.restarts, self.rejoins, checkpoint) if leaving else None
        if planned is not None:  # every node saved so that a slow node is left out (or one reached its last iteration)
            self._close_ledger(RunState.PREEMPTED if planned.restart else planned.state,
                               f"saved a checkpoint to go on without {attempts.node_names(leaving.nodes, self.plan.hosts)}"
                               if planned.restart else planned.reason, checkpoint, excluded=planned.excluded,
                               exclusion=planned.exclusion)
            return self._publish(planned)
        if self.stopping:
            ends[self.rank] = AttemptEnd(node_rank=self.rank, attempt=self.attempt, state=RunState.STOPPED,
                                         reason="stopped on request", requested=True)
        first = self.board.failure(self.attempt)
        chosen = attempts.choose_failure(first, ends)
        if attempts.trained_to_the_end(ends):
            state = RunState.FINISHED if any(e.state == RunState.FINISHED for e in ends.values()) else RunState.PREEMPTED
            reason = end.reason if end.state == state else next(e.reason for e in ends.values() if e.state == state)
            self._close_ledger(state, reason, checkpoint)
            if first is not None:  # what a teardown made of a finished run is no failure of it
                self.records.keep("moving the failure record aside", self._set_failure_aside)
            return self._publish(Decision(attempt=self.attempt, restart=False, state=state, reason=reason))
        if chosen is not None and chosen != first:
            self._record_failure(chosen)  # a node's own cause, stronger than what the others made of it
        failure = chosen.summary if chosen else end.reason
        cause = RunState.HUNG if chosen is not None and chosen.kind == FailureKind.HUNG else RunState.FAILED
        reports = [r for n in self.members for r in self.board.read_report(self.attempt, n) or []] \
            if cause == RunState.HUNG else []  # only a hang's nodes report
        suspects = exclusion.suspect_nodes(chosen, reports, ends)  # a hang's suspects, else the failure's own node
        self._close_ledger(cause if chosen else end.state, failure, checkpoint, suspects=suspects, failure_kind=chosen and chosen.kind)
        ledger = self.records.keep("reading the ledger", lambda: read_ledger(self.paths), [])
        back = self.board.join_requests(self.absent) if self.policy.min_nodes else {}
        decision = attempts.decide(self.attempt, ends, ledger, self.policy, self.restarts, cause, failure, self.plan.hosts,
                                   joiners=sorted(back), rejoins_so_far=self.rejoins)
        decision = self._exclude(decision, ends, ledger)
        if not decision.restart:  # the ledger's last word is how the run ended
            self._close_ledger(decision.state, decision.reason, checkpoint, lost=decision.lost)
        if decision.restart:  # the next attempt starts without this one's failure (kept beside the ledger)
            if decision.lost or decision.excluded or decision.exclusion:
                going = f"; the run goes on with {len(decision.members)} of {self.nnodes} nodes" \
                    if decision.lost or decision.excluded else ""
                self._close_ledger(cause, failure + going, checkpoint, lost=decision.lost, excluded=decision.excluded,
                                   exclusion=decision.exclusion)
            self.records.keep("moving the failure record aside", self._set_failure_aside)
        return self._publish(decision)

    def _exclude(self, decision: Decision, ends: Mapping[int, AttemptEnd | None], ledger: list) -> Decision:
        """Node 0: a restart without the nodes the evidence names (their GPU health after this attempt,
        the same node named by attempts in a row: exclusion.py), where the policy leaves them out."""
        if not decision.restart:
            return decision
        charges = [*exclusion.health_charges(ends), *exclusion.failed_attempts_charges(ledger, self.plan.run_id)]
        return exclusion.apply_exclusion(decision, exclusion.choose_exclusion(
            charges, decision.members, self.policy.min_nodes, self.plan.restart_exclude, self.plan.hosts))

    def _with_health(self, end: AttemptEnd) -> AttemptEnd:
        """An attempt that did not finish here: this node's GPU health check (a GPU node's: a
        hardware fault it finds is evidence against the node, exclusion.py), in its end."""
        if end.state in SAVED or end.requested or self.stopping:
            return end
        self._alive(120.0)  # a few commands, each under gpu_health's timeout: not stuck
        found = exclusion.hardware_findings(read_gpu_health())
        if found:
            self.say(f"GPU health after attempt {self.attempt}: " + "; ".join(f"{f.gpu}: {f.what}" for f in found))
        return dataclasses.replace(end, health=tuple(f"{f.gpu}: {f.what}" for f in found)) if found else end

    def _set_failure_aside(self) -> None:
        if self.paths.failure_file.exists():  # node 0's own record: it alone writes and moves it
            os.replace(self.paths.failure_file, self.paths.attempt_file(self.attempt, "failure.txt"))
        clear_failure(self.paths)

    def _close_ledger(self, state: RunState, reason: str, checkpoint: int | None, lost: tuple[int, ...] = (),
                      **evidence) -> None:
        """Node 0: this attempt's entry in the ledger (what ended it, the checkpoint it reached;
        ``evidence``: its suspects, the nodes left out after it and why)."""
        self.records.keep("writing the ledger", lambda: end_attempt(self.paths, self.attempt, state, reason, checkpoint,
                                                                    lost=lost, **evidence))

    def _publish(self, decision: Decision) -> Decision:
        """Node 0: the decision on the board, and the nodes it takes back told so (and watched in
        the incarnation their request names)."""
        self.board.write_decision(decision)
        for rank in decision.joined:
            self.incarnations[rank] = self.board.accept_join(rank, decision.attempt)
        return decision

    def _follow(self, decision: Decision) -> bool:
        """Every node: node 0's restart decision taken, its backoff waited; whether the next attempt
        follows (a save request or a stop in the backoff ends the run)."""
        self.decided = decision.members or self.members
        self.restarts, self.rejoins, self.joined = decision.restarts, decision.rejoins, decision.joined
        self.say(decision.reason)
        self.beat(RunState.RESTARTING)
        if not self.leader:  # node 0 alone reads a save request here: its word on the next attempt, or the roster
            word = self._wait(decision.backoff_s, lambda: self.board.read_decision(self.attempt + 1), RunState.RESTARTING)
            self.attempt += 1
            self.ended_by = word
            return word is None and not self.stopping
        if self._wait(decision.backoff_s, self._save_request, RunState.RESTARTING) and not self.stopping:
            state, reason = self._between_attempts_end()
            self._publish(Decision(attempt=self.attempt + 1, restart=False, state=state, reason=reason))
            return False
        self.attempt += 1
        return not self.stopping

    def _between_attempts_end(self) -> tuple[RunState, str]:
        if self.ended_by is not None:
            return self.ended_by.state, self.ended_by.reason
        if self.stopping:
            return RunState.STOPPED, "stopped on request"
        return RunState.PREEMPTED, "a save was requested between attempts: the latest checkpoint stands"
