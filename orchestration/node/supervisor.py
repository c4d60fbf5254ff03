"""The per-node supervisor: torchrun's parent, so that a run fails together, says how it ended,
finds its hangs, restarts by itself and saves on preemption.

    python -m orchestration node-supervise --plan-file $ARTIFACT_ROOT/run_state/demo_node1.plan.json

``node-start`` starts one per node, detached (under Slurm, one task of the start's srun step per
node). The supervisors agree over node 0's coordination store (orchestration/node/board.py) and
judge each other alive by a beat that runs in a thread of its own (orchestration/node/liveness.py);
the files they write on the artifact root are records for ``status`` and people, kept best effort
(orchestration/node/records.py). :class:`Supervisor` is made of parts, each in a module of its own
with what it owns: this one, the attempts themselves; membership.py, which nodes run and what
happens when one is lost, left out or brought back; hang_protocol.py, a hang's claim, dumps and
suspects; between_attempts.py, node 0's decision after an attempt, the ledger, and every node's
following of it. For each attempt a supervisor starts the node's torchrun exactly as the plan says
(same process group; the environment is the plan's, with the attempt number by the plan's
per-attempt rule), records it, and then every :data:`POLL_S` seconds:

- torchrun exits: the node's end of the attempt (finished; preempted, when it had asked its ranks
  to save; failed, with the log's reason, which claims the attempt's failure on the board first);
- the board holds the attempt's failure (another node's, a hang's, a lost node's): it stops its torchrun;
- a node lost (membership.py) or a rank hung (hang_protocol.py): the failure is claimed;
- a save request (SIGUSR1 to a supervisor: ``stop --save``, the batch start's SIGUSR1), a node
  brought back or one left out (membership.py) goes to the board, and every node sends each of its
  ranks the engine's save signal directly (not through torchrun, whose handler would tear them down);
- the artifact root has not answered for node_lost_s (its heartbeat record's write fails): this
  node's part ends, naming the node, the root and the error;
- SIGTERM (``stop``): it lets torchrun stop and records ``stopped``.

Before each attempt of a Megatron-LM run node 0 picks the checkpoint it loads, passing over and
moving aside a damaged one, and every node names it (orchestration/node/resume_point.py; this
program's ranks pick their own). Whatever goes wrong in a supervisor itself, its torchrun and ranks
are stopped and the cause is put on the board. The node's final state goes to ``<run>_node<N>.exit.json``.
Side effects: processes, the run_state files, the node log, the node-local progress directory.
"""

from __future__ import annotations

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
from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED
from megatron_ext.run_spec.resilience import (ENDED_PHASES, PROGRESS_DIR_ENV, Phase, read_progress)
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node import processes
from orchestration.node.attempts import AttemptEnd, Decision, Evidence
from orchestration.node.between_attempts import BetweenAttempts
from orchestration.node.checkpoint_pass import CheckpointPass
from orchestration.node.board import Board, BoardUnreachable, open_stores
from orchestration.node.failure import Failure, FailureKind, describe_returncode, failure_summary, follows_a_peer
from orchestration.node.hang_protocol import HangProtocol
from orchestration.node.liveness import Liveness
from orchestration.node.membership import Membership
from orchestration.node.records import HeartbeatRecord, RecordKeeper
from orchestration.node.resume_point import ResumePoint
from orchestration.node.run_state import (HEARTBEAT_S, RECORD_WRITE_S, NodeExit, PidRecord, RunState, begin_attempt, tail,
                                          write_exit, write_failure, write_heartbeat, write_pid_file)
from orchestration.node.watchdog import Watchdog, worker_pids
from orchestration.node.wire import NodePlan

log = logging.getLogger(__name__)

POLL_S = 0.5
LOG_TAIL_LINES = 25
HUNG_STOP_GRACE_S = 10.0
"""A hung attempt's stop: its ranks are sent SIGCONT, then torchrun SIGTERM; this long before SIGKILL."""
PREEMPTED_LINE = "exiting program after receiving"
"""Megatron-LM's line after a signal-triggered save (its exit code is 0, as for a finished run)."""


class Supervisor(Membership, BetweenAttempts, HangProtocol, CheckpointPass):
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

    def _alive(self, bounded_s: float = 0.0) -> None:
        """The main thread's stamp, by which the beat thread's :meth:`_last_resort` judges it stuck;
        ``bounded_s``: the step it begins takes at most that long."""
        self._main_at = time.monotonic() + bounded_s

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
        watchdog = Watchdog(self._limits(checkpoint), self.rank, len(self.members), self.plan.nproc_per_node, self.progress_dir,
                            engine_named(self.plan.engine), Path(self.plan.log_path), time.time(), place=self.members.index(self.rank),
                            pauses=self.plan.pauses)
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
                    if self._claim_lost():
                        continue
                    if saving is None:
                        reported = self._hang(watchdog, reported)
            except BoardUnreachable as exc:  # node 0's store: its supervisor, machine or link is gone
                self._stop_torchrun(proc, str(exc))
                raise
            time.sleep(POLL_S)

    # -- between attempts ---------------------------------------------------------------------

    def finish(self, state: RunState, reason: str, code: int | None = None) -> int:
        self.heartbeat.stop()
        exit_code, sig = describe_returncode(code) if code is not None else (None, None)
        self.say(f"{state}: {reason}")  # before the record: a reader that ends at the record has read this line
        self.records.keep("writing the exit record", lambda: write_exit(self.paths, NodeExit(
            node_rank=self.rank, state=state, exit_code=exit_code, signal=sig, reason=reason, ended_at=time.time(),
            run_id=self.plan.run_id)))
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
            if point is not None:
                self.see_moved_aside(point)
            if self.stopping:  # during the waits above: no torchrun started after the stop's signal
                return self.finish(RunState.STOPPED, "stopped on request")
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
