"""Which nodes run an attempt, and what happens when one is lost, left out or brought back: a part
of the node's supervisor (:class:`orchestration.node.supervisor.Supervisor` is made of it,
between_attempts.py and hang_protocol.py; the state is the supervisor's, set in its ``__init__``).

- Node 0 finds a node of the attempt silent for training.resilience.node_lost_s by its own clock
  and claims the attempt's failure in its name; a node other than 0 ends its part when node 0 is
  silent so long, or its store unanswering (:meth:`Membership._lost_peer`; the beat: liveness.py).
- The share unanswering for twice node_lost_s and the main thread stuck on it: the beat thread
  ends the node's part (:meth:`Membership._last_resort`).
- Before a restart every node says it is ready; node 0 names the attempt's nodes, those ready in
  time if still enough (training.resilience.min_nodes); a node left out ends (:meth:`Membership.join`).
- Under NNODES=MIN:MAX node 0 takes back a node brought back (``rejoin``: :meth:`Membership._come_back`
  on that node) and leaves out a node slow for two windows (exclusion.py), each after a
  checkpoint every rank saves on request.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

from megatron_ext.run_spec.convert import structure
from megatron_ext.run_spec.errors import EXIT_NODE_FAILED
from megatron_ext.run_spec.iteration_log import IterationRecord
from orchestration.node import attempts, exclusion, processes
from orchestration.node.attempts import AttemptEnd, Decision, Evidence
from orchestration.node.board import Board, BoardUnreachable
from orchestration.node.failure import Failure, FailureKind
from orchestration.node.run_state import HEARTBEAT_S, RunState, tail, write_pid_file
from orchestration.node.wire import SUPERVISE_COMMAND

SLOW_CHECK_S = 5.0
"""How often node 0 looks at rank 0's metrics for a slow node to leave out (orchestration/node/exclusion.py)."""


class Membership:
    """The supervisor's watch on the other nodes, the attempt's roster, its exclusions and rejoins."""

    def _watch(self, nodes) -> None:
        """Node 0 watches ``nodes`` (each in the incarnation it took it back in); the others, node 0."""
        self.liveness.watch({n: self.incarnations.get(n, 0) for n in nodes} if self.leader else {0: 0})

    def _last_resort(self) -> None:
        """From the beat thread, after each of its rounds. When the share has not answered for twice
        node_lost_s and the main thread has made no step for node_lost_s, the main thread is stuck on
        the share (a hard mount whose server is gone: a write, even a log line, waits for ever), and
        the beat, which touches neither the share nor the log, would keep this node alive for ever.
        So this thread ends the node's part: the cause on the board over its own connection, every
        process of the node's run killed, its end and exit marked, then this process. No record can
        be written, nothing is logged."""
        now = time.monotonic()
        if self.records.failing_s() <= 2 * self.policy.node_lost_s or now - self._main_at <= self.policy.node_lost_s:
            return
        cause = self.records.cause() + " (the supervisor, stuck on it, ended by its beat thread)"
        failure = Failure(FailureKind.ROOT_UNREACHABLE, self.rank, cause + "\n")
        board = Board(self.liveness.store, self.rank)  # this thread's own connection
        try:
            board.claim_failure(self.attempt, failure)
            board.write_end(AttemptEnd(node_rank=self.rank, attempt=self.attempt, state=RunState.FAILED, reason=cause,
                                       failure=failure, evidence=Evidence.NODE, leaves=True))
            if self.leader:
                board.write_decision(Decision(attempt=self.attempt, restart=False, state=RunState.FAILED, reason=cause))
            board.mark_exited(self.incarnation)
        except BoardUnreachable:
            pass
        for pid in processes.tagged_processes(self.plan.run, self.rank, self._root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(EXIT_NODE_FAILED)

    def _lost_peer(self) -> int | None:
        """Node 0: a node of this attempt silent for node_lost_s (by this machine's clock) that did not
        say it ends. The others: node 0 silent so long (its store unanswering counts) ends this
        node's part (:class:`BoardUnreachable`). Node 0 watches every node, the others node 0 alone:
        a beat costs O(1) store operations on a node, O(N) on node 0 (benchmarks/coordination.py)."""
        lost = self.liveness.lost()
        if not self.leader:
            if 0 in lost:
                raise BoardUnreachable(f"node 0's supervisor has given no sign for {self.liveness.silent_s(0):.0f} s "
                                       f"(its machine, its supervisor or the network to it is gone)"
                                       + (f": {self.liveness.error}" if self.liveness.error else ""))
            if self.liveness.exited(0):
                raise BoardUnreachable("node 0's supervisor ended (the run ended there)")
            return None
        return next((rank for rank in self.members if rank in lost), None)

    def _claim_lost(self) -> bool:
        """Node 0: a node of the attempt lost (:meth:`_lost_peer`) is the attempt's failure, claimed in
        its name; every node then stops its torchrun. Whether one was."""
        lost = self._lost_peer()
        if lost is not None:
            self._claim_failure(Failure(FailureKind.LOST, lost, f"node {lost}{self._host(lost)} lost: its supervisor has "
                                        f"given no sign for {self.liveness.silent_s(lost):.0f} s (its machine, its supervisor "
                                        f"or the network to it is gone); noticed by node {self.rank}\n"))
        return lost is not None

    @property
    def absent(self) -> list[int]:
        """The nodes of the start the current attempt runs without (lost, or brought back and joining)."""
        return [n for n in range(self.nnodes) if n not in self.members]

    def _rejoin_request(self) -> str | None:
        """While nodes are out of the run (NNODES=MIN:MAX), node 0 looks for one brought back
        (``rejoin``) and claims the attempt's rejoin: every node then asks its ranks to save and
        end, and the next attempt takes the node back. The reason, once claimed."""
        if not self.absent:
            return None
        if self.leader:
            back = self.board.join_requests(self.absent)
            if back:
                self.board.claim_rejoin(self.attempt, sorted(back))
        back = self.board.rejoin(self.attempt)
        return (f"{attempts.node_names(back, self.plan.hosts)} back: a checkpoint now, then attempt {self.attempt + 1} "
                f"on {len(self.members) + len(back)} of {self.nnodes} nodes") if back else None

    def _leaving_request(self) -> str | None:
        """While a node may be left out (NNODES=MIN:MAX with more than MIN nodes, RESTART_EXCLUDE),
        node 0 looks at rank 0's metrics every SLOW_CHECK_S for a slow node worth leaving out
        (exclusion.py) and claims the attempt's exclusion of it: every node then asks its ranks to
        save and end, and the next attempt runs without it. The reason, once claimed."""
        if not (self.plan.restart_exclude and self.policy.min_nodes and len(self.members) > self.policy.min_nodes):
            return None
        if self.leader and time.monotonic() >= self._slow_checked + SLOW_CHECK_S:
            self._slow_checked = time.monotonic()
            charges = exclusion.slow_charges(self._metrics_since(self._attempt_started_at), self.policy.slow_rank_window_s,
                                             self.members, self.plan.nproc_per_node)
            leaving = exclusion.choose_exclusion(charges, self.members, self.policy.min_nodes, True, self.plan.hosts)
            if leaving.nodes:
                self.board.claim_exclusion(self.attempt, leaving)
            elif leaving.said != self._slow_said:  # node 0 slow, or MIN reached: said once
                self._slow_said = leaving.said
                if leaving.said:
                    self.say(leaving.said)
        leaving = self.board.exclusion(self.attempt)
        return f"{leaving.said}: a checkpoint now, then attempt {self.attempt + 1} without it" if leaving else None

    def _metrics_since(self, since: float) -> list[IterationRecord]:
        """Rank 0's metrics records (on this machine: node 0's) written since ``since`` (this
        machine's clock, as the records'), from the file's last 256 KB."""
        text = self.records.keep("reading the metrics", lambda: tail(self.paths.metrics_path, 1000, 262144), "")
        records = []
        for line in text.splitlines():
            try:
                record = structure(IterationRecord, json.loads(line))
            except ValueError:  # the first line cut by the tail, a line being written
                continue
            if record.time >= since:
                records.append(record)
        return records

    def join(self, decided: tuple[int, ...]) -> bool:
        """Before a restart: say this node is ready; node 0 waits for the nodes ``decided`` and names
        the attempt's nodes (those ready in time, if still enough: training.resilience.min_nodes);
        every other node waits for that roster. Whether this node runs the attempt."""
        self.board.mark_ready(self.attempt)
        join_s = self.policy.join_s
        if self.leader:
            self._watch(decided)
            self._wait(join_s, lambda: len(self.board.ready_nodes(self.attempt, decided)) == len(decided),
                       RunState.RESTARTING)
            ready = tuple(self.board.ready_nodes(self.attempt, decided))
            missing = sorted(set(decided) - set(ready))
            names = ", ".join(f"{r}{self._host(r)}" for r in missing)
            enough = not missing or (self.policy.min_nodes and len(ready) >= self.policy.min_nodes)
            if self.stopping or not enough:
                if not self.stopping:
                    self._claim_failure(Failure(FailureKind.DID_NOT_JOIN, missing[0], f"node(s) {names} did not join attempt "
                                                f"{self.attempt} within {join_s:.0f} s; noticed by node {self.rank}\n"))
                return False
            if missing:
                self.say(f"node(s) {names} did not join attempt {self.attempt} within {join_s:.0f} s: it runs on {len(ready)} of "
                         f"{self.nnodes} nodes")
            self.board.write_roster(self.attempt, ready)
            self.members = ready
            return True
        # node 0's roster, or its word that there is no attempt K (a save asked in the backoff: its
        # decision; a node that did not join: the failure it claimed)
        roster = self._wait(join_s + 2 * HEARTBEAT_S, lambda: self.board.read_roster(self.attempt)
                            or self.board.read_decision(self.attempt) or self.board.failure(self.attempt), RunState.RESTARTING)
        if isinstance(roster, Decision):
            self.ended_by = roster
            return False
        if isinstance(roster, Failure):
            return False
        if roster is None or self.rank not in roster:
            if roster is not None and not self.stopping:
                self.say(f"left out of attempt {self.attempt} (not ready in time): this node ends here")
            return False
        self.members = roster
        return True

    def _come_back(self, request: int) -> int | None:
        """A node brought back (``rejoin``, its request number ``request``): wait (``joining``)
        until node 0 takes this node at its next restart, then follow that decision. None when it
        follows; else this supervisor's exit (the run ended meanwhile, or a stop)."""
        self.say(f"back for run {self.plan.run}: node 0 takes this node at its next restart (after the ranks save "
                 "a checkpoint at their next step)")
        self.beat(RunState.JOINING)  # before the pid file, which node-start waits for: status then shows it joining
        self.records.keep("writing the pid file", lambda: write_pid_file(
            self.plan.pid_file, processes.new_record(self.plan, os.getpid(), [SUPERVISE_COMMAND])))
        answer = self._wait(float("inf"), lambda: self.board.join_answer(request) or
                            (-1 if self.liveness.exited(0) or 0 in self.liveness.silent() else None), RunState.JOINING)
        if self.stopping:
            return self.finish(RunState.STOPPED, "stopped on request")
        if answer == -1:
            return self.finish(RunState.STOPPED, "the run ended on node 0 before it took this node back")
        self.attempt = answer
        if not self._follow(self.board.read_decision(answer)):
            return self.finish(*self._between_attempts_end())
        return None
