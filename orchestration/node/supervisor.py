"""The per-node supervisor: torchrun's parent, so that a run fails together, says how it ended,
finds its hangs, restarts by itself and saves on preemption.

    python -m orchestration node-supervise --plan-file $ARTIFACT_ROOT/run_state/demo_node1.plan.json

``node-start`` starts one per node, detached (under Slurm, one task of the start's srun step per
node). The supervisors agree over node 0's coordination store (orchestration/node/board.py) and
judge each other alive by a beat that runs in a thread of its own (orchestration/node/liveness.py);
the files they write on the artifact root are records for ``status`` and people, kept best effort
(orchestration/node/records.py). For each attempt a supervisor starts the node's torchrun exactly
as the plan says (same process group; the environment is the plan's, with the attempt number by
the plan's per-attempt rule), records it, and then every :data:`POLL_S` seconds:

- torchrun exits: the node's end of the attempt (finished; preempted, when it had asked its ranks
  to save; failed, with the log's reason, which claims the attempt's failure on the board first);
- the board holds the attempt's failure (another node's): it stops its torchrun;
- node 0 finds a node silent for training.resilience.node_lost_s by its own clock (a node other
  than 0: node 0 silent, or its store unanswering past the same deadline): the failure is claimed,
  or this node's part ends naming node 0;
- the watchdog (orchestration/node/watchdog.py) finds a rank past its phase's limit: it claims a
  hang; every node then dumps each of its ranks' stacks into ``runs/<run>/hangs/<attempt>/`` and
  puts its report on the board, node 0 names the suspects ("node 1 (...) hung: rank 3 stopped ...");
- a save request (SIGUSR1 to a supervisor: ``stop --save``, the batch start's SIGUSR1) goes to the
  board, and every node sends each of its ranks the engine's save signal directly (not through
  torchrun, whose handler would tear them down);
- the artifact root has not answered for node_lost_s (its heartbeat record's write fails): this
  node's part ends, naming the node, the root and the error (by the beat thread, when the main
  thread is stuck on a share that hangs: :meth:`Supervisor._last_resort`);
- SIGTERM (``stop``): it lets torchrun stop and records ``stopped``.

Before each attempt of a Megatron-LM run node 0 picks the checkpoint it loads, passing over and
moving aside a damaged one, and every node names it (orchestration/node/resume_point.py; this
program's ranks pick their own). After every attempt each node puts how it ended on the board and
node 0 decides for all (orchestration/node/attempts.py): the run's end (finished, preempted,
stopped, failed, hung, gave up), or a restart after a backoff from the latest complete checkpoint,
on which nodes (under NNODES=MIN:MAX without a node the evidence names: its GPU health after the
attempt, a hang's suspect or the failing node twice in a row, a rank slow for two windows, for
which node 0 has every rank save first; orchestration/node/exclusion.py); every node follows that
decision, whatever its own end was, and a node left out ends its part. Whatever goes wrong in
a supervisor itself, its torchrun and ranks are stopped and the cause is put on the board. The
node's final state goes to ``<run>_node<N>.exit.json``.
Side effects: processes, the run_state files, the node log, the node-local progress directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Callable, Mapping

from megatron_ext.run_spec.checkpoints import latest_iteration
from megatron_ext.run_spec.convert import structure
from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, UserError
from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED, IterationRecord
from megatron_ext.run_spec.resilience import ENDED_PHASES, PROGRESS_DIR_ENV, Phase, read_progress
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node import attempts, exclusion, processes, resume_point
from orchestration.node.attempts import AttemptEnd, Decision, Evidence
from orchestration.node.board import Board, BoardUnreachable, open_stores
from orchestration.node.failure import Failure, FailureKind, describe_returncode, failure_summary, follows_a_peer
from orchestration.node.gpu_health import read_gpu_health
from orchestration.node.liveness import Liveness
from orchestration.node.records import HeartbeatRecord, RecordKeeper
from orchestration.node.resume_point import ResumePoint
from orchestration.node.run_state import (HEARTBEAT_S, RECORD_WRITE_S, NodeExit, PidRecord, RunState, clear_failure, tail, write_exit,
                                          write_failure, write_heartbeat)
from orchestration.node.run_state import begin_attempt, end_attempt, read_ledger, write_pid_file
from orchestration.node.wire import NodePlan
from orchestration.node.flight_recorder import StuckCollective, read_flight_recorders, stuck_collective
from orchestration.node.watchdog import Hang, Watchdog, dump_node, find_suspects, local_ranks, worker_pids

log = logging.getLogger(__name__)

POLL_S = 0.5
LOG_TAIL_LINES = 25
HANG_REPORT_WAIT_S = 30.0
"""How long node 0 waits for every node's hang report on the board before naming the suspects from those it has."""
CHECK_SAY_S = 30.0
"""How often node 0's checksum pass before a Megatron-LM attempt says in the log how far it is."""
HUNG_STOP_GRACE_S = 10.0
"""A hung attempt's stop: its ranks are sent SIGCONT, then torchrun SIGTERM; this long before SIGKILL."""
PREEMPTED_LINE = "exiting program after receiving"
"""Megatron-LM's line after a signal-triggered save (its exit code is 0, as for a finished run)."""
SAVED = (RunState.FINISHED, RunState.PREEMPTED)
"""How an attempt ends on a node when nothing failed."""
SLOW_CHECK_S = 5.0
"""How often node 0 looks at rank 0's metrics for a slow node to leave out (orchestration/node/exclusion.py)."""


class Supervisor:
    def __init__(self, plan: NodePlan, node_env: Mapping[str, str], slurm_step: str | None = None):
        self.plan, self.node_env, self.slurm_step = plan, dict(node_env), slurm_step
        """``node_env``: the node's own environment (the plan's goes on top); ``slurm_step``:
        JOB.STEP when this supervisor is a task of the start's srun step."""
        self.paths = RunPaths(plan.artifact_root, plan.run)
        self.nnodes, self.rank, self.policy = plan.nnodes, plan.node_rank, plan.resilience
        self.leader = self.rank == 0
        self.stopping = False
        self.attempt = plan.first_attempt
        self.restarts = 0
        """Restarts counted against MAX_RESTARTS (node 0's count, which every node takes from its decision)."""
        self.rejoins = 0
        """Restarts made for nodes brought back (not counted against MAX_RESTARTS)."""
        self.joined: tuple[int, ...] = ()
        """The nodes the current attempt took back (the ledger records them)."""
        self.progress_dir = Path(plan.env[PROGRESS_DIR_ENV])
        self.members: tuple[int, ...] = tuple(plan.first_members) or tuple(range(self.nnodes))
        """The nodes (ranks in the start's plan) of the current attempt: all, those the start did not
        leave out, or those left after a lost one."""
        self.decided = self.members
        self.board: Board | None = None
        """The run's shared state over the network (orchestration/node/board.py), from :meth:`run`."""
        self.liveness: Liveness | None = None
        """This node's beat and its view of who else is alive (orchestration/node/liveness.py), from :meth:`run`."""
        self.incarnation = 0
        """Which supervisor of this node this is: 0 the start's, N the one a ``rejoin``'s N-th request made."""
        self.incarnations: dict[int, int] = {}
        """Node 0: the incarnation of every node it took back (others: 0)."""
        self.records = RecordKeeper(plan.artifact_root, f"node {self.rank}{self._host(self.rank)}", self.say)
        self.heartbeat = HeartbeatRecord(self.records, lambda attempt, state, count, doing: write_heartbeat(
            self.paths, self.rank, attempt, state, plan.run_id, count, doing), deadline_s=RECORD_WRITE_S)
        self.proc: subprocess.Popen | None = None
        """The current attempt's torchrun, while there is one."""
        self.record: PidRecord | None = None
        """Its record (the pid file's content, kept here: stopping it reads nothing from the share)."""
        self._main_at = time.monotonic()
        """The main thread's last step (:meth:`_alive`)."""
        self._signalled_save: str | None = None
        self.ended_by: Decision | None = None
        """Node 0's decision that the run ends before the attempt this node is joining."""
        self._recorded_failure: int | None = None
        self._hang_seen: float | None = None
        self._slow_checked, self._slow_said, self._attempt_started_at = 0.0, "", 0.0
        """Node 0's look at rank 0's metrics for a slow node (:meth:`_leaving_request`)."""
        self._root = str(plan.artifact_root)
        """This run's processes carry it (another run of the same name may use another root here)."""

    # -- small steps --------------------------------------------------------------------------

    def _on_sigterm(self, _signum, _frame) -> None:
        self.stopping = True  # torchrun, in the same process group, got the signal too

    def _on_sigusr1(self, _signum, _frame) -> None:
        self._signalled_save = f"SIGUSR1 to node {self.rank}'s supervisor"  # passed on at the next poll

    def say(self, text: str) -> None:
        log.info("[supervisor node%d] %s", self.rank, text)

    def _host(self, rank: int) -> str:
        return f" ({self.plan.hosts[rank]})" if rank < len(self.plan.hosts) else ""

    def beat(self, state: RunState) -> None:
        """The supervisor's state in the record ``status`` reads, written now (and rewritten every
        HEARTBEAT_S by its own thread, its counter one more each time: a reader on another machine
        takes this supervisor as gone once the counter stops changing); the write probes the share.
        The beat the other nodes judge this one by runs in a thread of its own too (liveness.py)."""
        self.heartbeat.set(self.attempt, state)

    def _latest_checkpoint(self) -> int | None:
        return self.records.keep("reading the checkpoints' folder", lambda: latest_iteration(self.paths.checkpoints_dir))

    def _log_tail(self, lines: int, max_bytes: int = 65536) -> str:
        return self.records.keep("reading the node log", lambda: tail(Path(self.plan.log_path), lines, max_bytes), "")

    def _watch(self, nodes) -> None:
        """Node 0 watches ``nodes`` (each in the incarnation it took it back in); the others, node 0."""
        self.liveness.watch({n: self.incarnations.get(n, 0) for n in nodes} if self.leader else {0: 0})

    def _alive(self, bounded_s: float = 0.0) -> None:
        """The main thread's stamp, by which the beat thread's :meth:`_last_resort` judges it stuck;
        ``bounded_s``: the step it begins takes at most that long."""
        self._main_at = time.monotonic() + bounded_s

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

    def _failure(self) -> Failure | None:
        """The attempt's first failure, from the board; node 0 keeps its record (its text),
        ``run_state/<run>_failure.txt``, of which it is the only writer."""
        failure = self.board.failure(self.attempt)
        if failure is not None and self.leader and self._recorded_failure != self.attempt:
            self._record_failure(failure)
        return failure

    def _record_failure(self, failure: Failure) -> None:
        self.records.keep("writing the failure record", lambda: write_failure(self.paths, failure.text))
        self._recorded_failure = self.attempt

    def _claim_failure(self, failure: Failure) -> Failure:
        """``failure`` claimed on the board as the attempt's (unless another node's came first)."""
        self.board.claim_failure(self.attempt, failure)
        self._failure()  # node 0 records it at once
        return failure

    def _save_request(self) -> str | None:
        """A save asked of this run: by SIGUSR1 to this supervisor (``stop --save``, the batch
        start's SIGUSR1), passed on to every node through the board."""
        if self._signalled_save:
            self.board.request_save(self._signalled_save)
            self._signalled_save = None  # posted: the first reason stays on the board
        return self.board.save_request()

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

    def _wait(self, seconds: float, done: Callable[[], object], state: RunState, beat: bool = True,
              until_stop: bool = True) -> object:
        """Poll ``done`` until it gives something or ``seconds`` pass, with ``state`` in the heartbeat
        record (unless ``beat`` is False); None on timeout, or when a stop arrives (unless
        ``until_stop`` is False: node 0 still collects the others' ends). A node other than 0 whose
        node 0 went silent or ended ends here (:class:`BoardUnreachable`)."""
        deadline = time.monotonic() + seconds
        if beat and state != self.heartbeat.state:
            self.beat(state)
        while True:
            self._alive()
            value = done()
            if value or (self.stopping and until_stop) or time.monotonic() >= deadline:
                return value
            try:
                self._lost_peer()
            except BoardUnreachable:
                value = done()  # node 0's last word may have come just before its end
                if value:
                    return value
                raise
            time.sleep(POLL_S)

    # -- one attempt --------------------------------------------------------------------------

    def _start_torchrun(self, checkpoint: int | None, point: ResumePoint | None) -> subprocess.Popen:
        shutil.rmtree(self.progress_dir, ignore_errors=True)
        self.progress_dir.mkdir(parents=True)
        (self.paths.run_dir / "hangs").mkdir(parents=True, exist_ok=True)  # Megatron-LM's flight recorder writes there
        # exactly the plan's, by its per-attempt rules (the attempt, its nodes, the resume flag)
        env = self.plan.process_environment(self.node_env, self.attempt, self.members)
        argv = self.plan.attempt_argv(checkpoint is not None, self.members, point)
        with open(self.plan.log_path, "ab", buffering=0) as out:
            proc = subprocess.Popen(list(argv), cwd=self.plan.cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)
        self.proc = proc
        self.record = processes.new_record(self.plan, proc.pid, argv, self.slurm_step)
        self.records.keep("writing the pid file", lambda: write_pid_file(self.plan.pid_file, self.record))
        return proc

    def _stop_torchrun(self, proc: subprocess.Popen, reason: str, hung: bool = False) -> None:
        self.say(f"stopping torchrun: {reason}")
        grace_s = HUNG_STOP_GRACE_S if hung else processes.DEFAULT_STOP_GRACE_S
        self._alive(grace_s + processes.SWEEP_KILL_AFTER_S + 2.0)  # a step of bounded length: not stuck
        if hung:  # a stopped rank cannot act on SIGTERM until it continues
            for pid in worker_pids(self.plan.run, self.rank, self._root).values():
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        processes.stop_node(self.plan.target, grace_s, signal_group=False, record=self.record)
        proc.poll()

    def _forward_save(self, signalled: set[int]) -> set[int]:
        """Send the engine's save signal to every rank ready for it and not yet signalled: a rank
        that has not installed its handler would die of SIGUSR1 (this program: once it reported
        progress; Megatron-LM: once the log shows an iteration line)."""
        pids = worker_pids(self.plan.run, self.rank, self._root)
        engine = engine_named(self.plan.engine)
        if engine.progress_from_log:
            ready = set(pids.values()) if engine.parse_log(self._log_tail(400))[0] else set()
        else:
            reported = read_progress(self.progress_dir)
            ready = {pid for rank, pid in pids.items() if rank in reported and reported[rank].pid == pid
                     and reported[rank].phase not in ENDED_PHASES}  # a rank past its last step has no handler left
        sig = signal.Signals[self.plan.save_signal]
        for pid in sorted(ready - signalled):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if ready - signalled:
            self.say(f"asked {len(ready | signalled)} of {len(pids)} rank(s) to save a checkpoint at the next step and "
                     f"end ({sig.name})")
        return signalled | ready

    def _preempted(self) -> bool:
        """The ranks ended after saving on request (this program's progress, or Megatron-LM's line)."""
        if any(p.phase == Phase.PREEMPTED for p in read_progress(self.progress_dir).values()):
            return True
        return PREEMPTED_LINE in self._log_tail(40)

    def _sweep(self) -> None:
        """torchrun is gone; its workers, in sessions of their own, may not be (torchrun SIGKILLed),
        nor what they started (a multiprocessing resource tracker, which ignores SIGTERM and ends
        when its rank's pipe closes): every process of the node's run but this one, gone."""
        processes.stop_node(self.plan.target, 0.0, signal_group=False, record=self.record)

    def _ended(self, state: RunState, reason: str, **more) -> AttemptEnd:
        self.proc = None
        return AttemptEnd(node_rank=self.rank, attempt=self.attempt, state=state, reason=reason, **more)

    def _end(self, code: int, saving: bool) -> AttemptEnd:
        if code == 0:
            self._sweep()  # what a rank started may outlive it by a moment (a resource tracker cleaning up)
            if saving and self._preempted():
                return self._ended(RunState.PREEMPTED, "saved a checkpoint on request and ended")
            return self._ended(RunState.FINISHED, "torchrun exited with code 0")
        stopping = self.stopping
        try:
            if not stopping:  # the claim first: the other nodes stop now, not after the sweep below
                self.heartbeat.write()  # the share's probe: its loss is the cause, not what the ranks made of it
                if self.records.failing_since is not None:
                    return self._leave(None)
                failure = failure_summary(self.rank, self.plan.host, code, self._log_tail(400, max_bytes=262144),
                                          LOG_TAIL_LINES)
                self._claim_failure(failure)
        finally:
            self._sweep()
        if stopping:
            return self._ended(RunState.STOPPED, "stopped on request", requested=True)
        evidence = Evidence.CONSEQUENCE if follows_a_peer(failure.summary) else Evidence.RANK
        return self._ended(RunState.FAILED, failure.summary, failure=failure, evidence=evidence)

    def _leave(self, proc: subprocess.Popen | None) -> AttemptEnd:
        """The share has not answered for node_lost_s (or failed as torchrun failed): this node's
        part ends with that cause, claimed on the board (the others stop, and node 0 records it)."""
        cause = self.records.cause()
        failure = self._claim_failure(Failure(FailureKind.ROOT_UNREACHABLE, self.rank, cause + "\n"))
        if proc is not None and proc.poll() is None:  # after the claim: a log line on a share that hangs waits for ever
            self._stop_torchrun(proc, cause)
        return self._ended(RunState.FAILED, cause, failure=failure, evidence=Evidence.NODE, leaves=True)

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

    def resume_point(self) -> ResumePoint | None:
        """Megatron-LM's attempts: node 0 picks the checkpoint (resume_point.py) and puts it on the
        board; the others wait for it. None where the ranks pick their own (this program). What
        each node does meanwhile is in its heartbeat record (``doing``), which a start waiting on
        the node follows: node 0's pass over a large checkpoint takes minutes."""
        choice = self.plan.checkpoint_choice
        if choice is None:
            return None
        try:
            if not self.leader:  # as long as node 0 takes (a checksum pass over a large checkpoint), while it beats
                self.heartbeat.doing = "waiting for node 0's choice of the checkpoint to resume from"
                point = self._wait(float("inf"), lambda: self.board.read_resume_point(self.attempt), RunState.RESTARTING)
                return point or ResumePoint(None, False, refused="stopped on request")
            self.heartbeat.doing = "choosing the checkpoint to resume from"
            self.beat(self.heartbeat.state or RunState.RUNNING)  # the record (and its thread) before the pass
            progress = resume_point.PassProgress(tell=self._tell_doing, say=self.say, say_every_s=CHECK_SAY_S)
            try:
                point, damaged = resume_point.choose(self.paths.checkpoints_dir, choice.init_checkpoint, progress)
                if summary := progress.summary():
                    self.say(summary)
                resume_point.take(point, damaged, self.paths.checkpoints_dir)
            except (OSError, UserError) as exc:
                point = ResumePoint(None, False, refused=f"could not choose the checkpoint to resume from: {exc}")
            self.board.write_resume_point(self.attempt, point)
            return point
        finally:
            self.heartbeat.doing = ""

    def _tell_doing(self, doing: str) -> None:
        """The step under way before torchrun, in the heartbeat record's next write."""
        self.heartbeat.doing = doing

    def run_attempt(self, point: ResumePoint | None = None) -> AttemptEnd:
        checkpoint = self._latest_checkpoint() if point is None else point.iteration
        self._attempt_started_at, self._slow_checked = time.time(), time.monotonic()
        if self.leader:
            self.records.keep("writing the ledger", lambda: begin_attempt(
                self.paths, self.attempt, self.plan.run_id, checkpoint, self.members, self.joined))
        total = self.plan.first_attempt + self.policy.max_restarts + self.rejoins
        self.say(f"attempt {self.attempt} of {total}: {ATTEMPT_STARTED}"
                 + (f" (the ranks resume from the checkpoint at iteration {checkpoint})" if checkpoint is not None else ""))
        if point is not None:  # node 0's choice, as every node got it
            self.say(point.describe())
        self._watch(self.members)
        proc = self._start_torchrun(checkpoint, point)
        watchdog = Watchdog(self.policy, self.rank, len(self.members), self.plan.nproc_per_node, self.progress_dir,
                            engine_named(self.plan.engine), Path(self.plan.log_path), time.time(), place=self.members.index(self.rank))
        saving, signalled, reported = None, set(), False
        self._hang_seen = None
        self.beat(RunState.RUNNING)
        while True:
            self._alive()
            code = proc.poll()
            if code is not None:
                return self._end(code, saving is not None)
            try:
                if self.records.failing_s() > self.policy.node_lost_s and not self.stopping:
                    return self._leave(proc)
                if not self.stopping:
                    why = saving or self._save_request() or self._rejoin_request() or self._leaving_request()
                    if why:
                        if saving is None:
                            self.say(f"save requested ({why})")
                        saving = why
                        signalled = self._forward_save(signalled)
                    failure = self._failure()
                    if failure is not None:
                        hung = failure.kind == FailureKind.HUNG
                        why = f"{'the run hung' if hung else 'another node failed'}: {failure.summary}"
                        self._stop_torchrun(proc, why, hung)
                        return self._ended(RunState.HUNG if hung else RunState.STOPPED, why)
                    lost = self._lost_peer()
                    if lost is not None:
                        self._claim_failure(Failure(FailureKind.LOST, lost, f"node {lost}{self._host(lost)} lost: its supervisor "
                                                    f"has given no sign for {self.liveness.silent_s(lost):.0f} s (its machine, its "
                                                    f"supervisor or the network to it is gone); noticed by node {self.rank}\n"))
                        continue
                    if saving is None:
                        reported = self._hang(watchdog, reported)
            except BoardUnreachable as exc:  # node 0's store: its supervisor, machine or link is gone
                self._stop_torchrun(proc, str(exc))
                raise
            time.sleep(POLL_S)

    # -- between attempts ---------------------------------------------------------------------

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

    def finish(self, state: RunState, reason: str, code: int | None = None) -> int:
        self.heartbeat.stop()
        exit_code, sig = describe_returncode(code) if code is not None else (None, None)
        self.records.keep("writing the exit record", lambda: write_exit(self.paths, NodeExit(
            node_rank=self.rank, state=state, exit_code=exit_code, signal=sig, reason=reason, ended_at=time.time(),
            run_id=self.plan.run_id)))
        self.say(f"{state}: {reason}")
        shutil.rmtree(self.progress_dir, ignore_errors=True)
        if self.liveness is not None:
            try:
                self.board.mark_exited(self.incarnation)
                if self.leader:  # the store lives in this process: keep it until the others are done with it
                    back = self.board.join_requests(self.absent)  # joining: told by exit/0
                    others = [n for n in (*self.members, *back) if n != self.rank]
                    self.incarnations.update(back)
                    self._watch(others)
                    self._wait(self.policy.node_lost_s + HEARTBEAT_S,
                               lambda: all(self.liveness.exited(n) or n in self.liveness.silent() for n in others),
                               state, beat=False, until_stop=False)
            except BoardUnreachable:
                pass  # node 0 ended first: nothing is left to tell it
            self.liveness.stop()
        return 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGUSR1, self._on_sigusr1)
        try:
            store, beat_store = open_stores(self.plan.run_id, self.nnodes, self.leader, self.plan.master_addr, self.plan.master_port,
                                            connect_s=self.policy.join_s, deadline_s=self.policy.node_lost_s)
        except BoardUnreachable as exc:
            return self.finish(RunState.FAILED, f"{exc}: node 0's supervisor holds the run's coordination store "
                                                "(MASTER_PORT + 1); start the run on node 0 too, and allow TCP to it")
        self.board = Board(store, self.rank)
        try:
            request = self.board.request_join() if self.plan.rejoin else None
            self.incarnation = request or 0
            self.liveness = Liveness(beat_store, self.rank, self.incarnation, self.policy.node_lost_s,
                                     after_round=self._last_resort).start()
            self._watch(self.members)
            if request is not None:
                ended = self._come_back(request)
                if ended is not None:
                    return ended
            return self._attempts()
        except BoardUnreachable as exc:
            self._stop_current(str(exc))
            if self.stopping:
                return self.finish(RunState.STOPPED, "stopped on request")
            return self.finish(RunState.FAILED, f"lost node 0 (the run's leader): {exc}")
        except Exception as exc:  # whatever else: this node's part ends, its ranks with it, the cause told
            return self._fail(exc)

    def _fail(self, exc: Exception) -> int:
        """The supervisor itself failed: its torchrun and ranks stopped, the cause (the share, named
        with its path and error, or the error itself) on the board for node 0 to record, and node 0's
        own failure its decision for every node; then this node ends."""
        if isinstance(exc, OSError) and exc.filename and Path(str(exc.filename)).is_relative_to(self._root):
            self.records.failed(str(exc.filename), exc)
            kind, cause = FailureKind.ROOT_UNREACHABLE, self.records.cause()
        else:
            kind, cause = FailureKind.SUPERVISOR, (f"node {self.rank}{self._host(self.rank)}: the supervisor failed: "
                                                   f"{type(exc).__name__}: {exc}")
        log.error("%s\n%s", cause, "".join(traceback.format_exception(exc)).rstrip())
        try:  # told first: the other nodes stop now, not after this node's stop below (up to 47 s)
            failure = self._claim_failure(Failure(kind, self.rank, cause + "\n"))
            self.board.write_end(AttemptEnd(node_rank=self.rank, attempt=self.attempt, state=RunState.FAILED, reason=cause,
                                            failure=failure, evidence=Evidence.NODE, leaves=True))
            if self.leader:
                self._publish(Decision(attempt=self.attempt, restart=False, state=RunState.FAILED, reason=cause))
        except BoardUnreachable:
            pass
        self._stop_current(cause)
        return self.finish(RunState.FAILED, cause)

    def _stop_current(self, reason: str) -> None:
        """The current attempt's torchrun (if any) and every process of the node's run stopped."""
        if self.proc is not None and self.proc.poll() is None:
            self._stop_torchrun(self.proc, reason)
        self._sweep()
        self.proc = None

    def _attempts(self) -> int:
        while True:
            if self.attempt > self.plan.first_attempt and not self.join(self.decided):
                if self.ended_by is not None:  # node 0's word before the attempt (a save asked in the backoff)
                    return self.finish(*self._between_attempts_end())
                failure = None if self.stopping else self._failure()
                return self.finish(RunState.STOPPED if self.stopping else RunState.FAILED, "stopped on request" if self.stopping
                                   else failure.summary if failure else "a node did not join")
            point = self.resume_point()
            if point is not None and point.refused:
                return self.finish(RunState.STOPPED, "stopped on request") if self.stopping else \
                    self.finish(RunState.FAILED, point.refused)
            end = self._with_health(self.run_attempt(point))
            self.board.write_end(end)
            decision = self.decide(end)
            if end.leaves:  # whatever node 0 decided for the others, this node cannot go on
                return self.finish(RunState.FAILED, end.reason)
            if not decision.restart:
                return self.finish(decision.state, decision.reason)
            if self.rank in decision.excluded:  # its ranks are stopped: it leaves, until a rejoin brings it back
                return self.finish(RunState.LEFT_OUT, f"left out of the run by node 0 after attempt {self.attempt}: "
                                   f"{decision.exclusion}; rejoin_multinode_training.sh {self.plan.run} {self.rank} "
                                   "brings it back")
            if not self._follow(decision):
                return self.finish(*self._between_attempts_end())

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

    def _come_back(self, request: int) -> int | None:
        """A node brought back (``rejoin``, its request number ``request``): wait (``joining``)
        until node 0 takes this node at its next restart, then follow that decision. None when it
        follows; else this supervisor's exit (the run ended meanwhile, or a stop)."""
        self.say(f"back for run {self.plan.run}: node 0 takes this node at its next restart (after the ranks save "
                 "a checkpoint at their next step)")
        self.beat(RunState.JOINING)  # before the pid file, which node-start waits for: status then shows it joining
        self.records.keep("writing the pid file", lambda: write_pid_file(
            self.plan.pid_file, processes.new_record(self.plan, os.getpid(), ["node-supervise"])))
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
