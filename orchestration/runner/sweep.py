"""The ZeRO sweep: one model and data set under each stage, one after another, then the comparison.

    bash training_scripts/compare_zero_stages.sh gpt_smoke smoke cmp                 # runs cmp_z0 ... cmp_z3
    STAGES=0,3 HOSTS=node0,node1,node2,node3 bash training_scripts/compare_zero_stages.sh qwen3_1p7b qwen3_1p7b_smoke q32
    bash training_scripts/stop_multinode_training.sh q32                             # or Ctrl-C: stops the current stage everywhere

Each stage is an ordinary run, ``PREFIX_z<stage>``, planned and started by the start's own
functions (:func:`~orchestration.runner.start.plan_settled_start`,
:func:`~orchestration.runner.start.start_run`: preflight, every node, rollback) with only
``ZERO_STAGE`` changed, so the seed, data and iterations are the data set's for every stage
(Megatron-LM checks all their arguments first: :func:`check_stage_arguments`). The
sweep waits until every node's supervisor has recorded how the stage ended (finished, failed,
stopped: :func:`~orchestration.runner.control.wait_until_ended`), then compares the stages
(:mod:`orchestration.analysis`, planned memory next to measured). A stage that fails is reported
with the most telling line of its failed nodes' logs (each node's status names it) and the sweep
goes on; so does a stage stopped on its own (``stop PREFIX_z1``).

Stopping: Ctrl-C (or SIGTERM/SIGHUP to the sweep) stops the current stage on every node. The
sweep's record (``run_state/PREFIX.sweep.json``, written when it starts and before each stage)
lets ``stop PREFIX`` reach it at any moment: the stop asks the sweep to stop and stops the stage
the record names; the sweep checks for the request before each stage, after each start and at
every poll. Progress goes to the ``report`` callback (the CLI prints it); the result is a
:class:`SweepResult`. Side effects: processes through the start, stop and status functions, the
sweep's record, the comparison files, signal handlers while it runs, the clock.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, EXIT_OK, EXIT_STOPPED, UserError
from megatron_ext.run_spec.params import load_run_params, with_batch_geometry
from megatron_ext.run_spec.run_paths import RunPaths, check_root_writable, check_run_name
from megatron_ext.host.procfs import pid_is_alive, process_start_time
from orchestration.analysis.compare import DEFAULT_WARMUP_ITERATIONS, RunOutcome, RunSummary, compare_runs, run_records
from orchestration.analysis.comparison_files import ComparisonFiles, write_comparison
from orchestration.launch_env import LaunchEnv
from orchestration.megatron_lm.program import ArgumentCheck, ProgramPlan, Verdicts, argument_check, judge_arguments, run_argument_checks
from orchestration.node.run_state import RunState, stop_command
from orchestration.node.wire import NodeStatus
from orchestration.runner.control import Statuses, node_statuses, stop_run, wait_until_ended
from orchestration.runner.start import plan_settled_start, start_run
from orchestration.runner.start_plan import StartInputs, StartPlan, plan_start, read_start_inputs
from orchestration.runner.preflight import run_preflight
from orchestration.runner.sweep_state import (SweepRecord, clear_sweep_stop, read_sweep_record, sweep_stop_request,
                                              write_sweep_record)

UNREACHABLE_S = 300.0
"""A node that answers no status for this long: stop the stage and report it."""

Report = Callable[[str, bool], None]
"""Progress: (text, final). Final lines are one per stage; the others update a live line."""


def stage_run_name(prefix: str, stage: int) -> str:
    return f"{prefix}_z{stage}"


class SweepStopped(Exception):
    """Ctrl-C, SIGTERM or SIGHUP reached the sweep, or ``stop PREFIX`` asked it to stop."""


@dataclass(frozen=True, kw_only=True)
class StageResult:
    stage: int
    run: str
    outcome: RunOutcome
    elapsed_s: float
    last_iteration: int | None = None
    train_iters: int | None = None
    final_loss: float | None = None


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep would run: every stage's start plan (``DRY_RUN=1`` prints them)."""

    prefix: str
    stages: tuple[tuple[int, str, StartPlan], ...]
    """(stage, run, plan)."""


@dataclass(frozen=True)
class SweepResult:
    prefix: str
    stages: tuple[StageResult, ...]
    rows: tuple[RunSummary, ...]
    files: ComparisonFiles
    stopped: str | None = None
    """Why the sweep was stopped (None: it ran every stage)."""

    @property
    def exit_code(self) -> int:
        """130 stopped, 0 every stage finished, else 1."""
        if self.stopped:
            return EXIT_STOPPED
        return EXIT_OK if all(r.outcome.status == RunState.FINISHED for r in self.stages) else EXIT_NODE_FAILED


def _stage_launch(launch: LaunchEnv, stage: int) -> LaunchEnv:
    return dataclasses.replace(launch, overrides=dataclasses.replace(launch.overrides, zero_stage=stage))


def check_sweep(launch: LaunchEnv, model: str, data: str, prefix: str, stages: Sequence[int]) -> int:
    """Everything a sweep can refuse before it starts anything: names, every stage's parameters
    and batch at this world size, stage runs that would resume from old checkpoints, a sweep
    PREFIX already running, a live run called PREFIX, an artifact root it cannot write. The
    iterations of each stage."""
    check_run_name(prefix)
    check_root_writable(launch.artifact_root)
    iterations = 0
    for stage in stages:
        run = check_run_name(stage_run_name(prefix, stage))
        params, _ = with_batch_geometry(load_run_params(model, data, _stage_launch(launch, stage).overrides), launch.world_size)
        iterations = params.training.train_iters
        checkpoints = RunPaths(launch.artifact_root, run).checkpoints_dir
        if checkpoints.is_dir() and any(checkpoints.iterdir()):
            raise UserError(f"run {run} has checkpoints in {checkpoints}: its start would resume from them, and a "
                            f"sweep compares fresh runs; choose another PREFIX or remove {checkpoints}")
    record = read_sweep_record(launch.artifact_root, prefix)
    if record and not record.ended and record.hostname == socket.gethostname() and pid_is_alive(record.pid, record.start_time):
        raise UserError(f"a sweep {prefix!r} is running (pid {record.pid}, stage {record.current_run or '-'}); stop it "
                        f"first ({stop_command(prefix, launch.nnodes > 1)}) or choose another PREFIX")
    live = [r for r in node_statuses(launch, prefix, list(enumerate(launch.hosts)), None) if r.ok and r.value.alive]
    if live:
        raise UserError(f"{prefix!r} is a live run of its own on node(s) {', '.join(str(r.node_rank) for r in live)}; "
                        f"choose another PREFIX for the sweep")
    return iterations


def plan_sweep(launch: LaunchEnv, model: str, data: str, prefix: str, stages: Sequence[int]) -> SweepPlan:
    """Every stage's start plan, settled by one preflight of every node (the dry run: nothing
    prepared or started)."""
    check_sweep(launch, model, data, prefix, stages)
    nodes = list(enumerate(launch.hosts))
    inputs = [read_start_inputs(_stage_launch(launch, s), model, data, stage_run_name(prefix, s), nodes) for s in stages]
    answers = run_preflight(launch, inputs[0]).answers if inputs else None
    return SweepPlan(prefix, tuple((s, i.run, plan_start(_stage_launch(launch, s), i, answers))
                                   for s, i in zip(stages, inputs)))


def check_stage_arguments(launch: LaunchEnv, model: str, data: str, prefix: str, stages: Sequence[int]) -> Verdicts:
    """ENGINE=megatron-lm: Megatron-LM's check of every stage's arguments in one child (the data prepared
    first): a stage it refuses is a UserError naming it before stage 0 starts; each stage's start
    takes its verdict instead of a child of its own (~5 s here). Other engines, a refused preflight: {}."""
    nodes = list(enumerate(launch.hosts))
    first = read_start_inputs(_stage_launch(launch, stages[0]), model, data, stage_run_name(prefix, stages[0]), nodes)
    if first.checkout is None:
        return {}
    if first.prepared is not None and not first.data_ready:
        from megatron_ext.data.prepare import ensure_prepared

        ensure_prepared(first.params.data, RunPaths(launch.artifact_root, first.run).data_cache_dir)
    preflight = run_preflight(launch, first)
    if preflight.problems:
        return {}
    planned: dict[int, tuple[LaunchEnv, StartInputs, ProgramPlan, ArgumentCheck]] = {}
    for stage in stages:
        stage_launch = _stage_launch(launch, stage)
        try:  # a stage its plan refuses (a known limit) is left to its start: a failed row, the sweep goes on
            i = read_start_inputs(stage_launch, model, data, stage_run_name(prefix, stage), nodes)
            program = plan_start(stage_launch, i, preflight.answers).program
            check = argument_check(program, stage_launch, i.checkout, i.params.data.tokenizer.model_path, i.data_ready)
        except UserError:
            continue
        if isinstance(check, ArgumentCheck):
            planned[stage] = (stage_launch, i, program, check)
    verdicts = {c: v for c, v in run_argument_checks(c for *_, c in planned.values()).items() if v.status != "unavailable"}
    for stage, (stage_launch, i, program, check) in planned.items():
        if check in verdicts:  # unavailable: each stage's start tries again, and says so
            try:
                judge_arguments(check, verdicts[check], program, stage_launch, i.checkout, i.params.data.tokenizer.model_path)
            except UserError as exc:
                raise UserError(f"stage {stage} ({i.run}): {exc}") from None
    return verdicts


def _raise_stopped(signum, _frame):
    raise SweepStopped(f"signal {signal.Signals(signum).name}")


class Sweep:
    """One sweep: its nodes, its record, and the start, wait and stop of each stage."""

    def __init__(self, launch: LaunchEnv, model: str, data: str, prefix: str, stages: Sequence[int], report: Report,
                 verdicts: Verdicts | None = None):
        self.launch, self.model, self.data, self.prefix, self.report = launch, model, data, prefix, report
        self.verdicts = verdicts or {}
        self.nodes = list(enumerate(launch.hosts))
        self.engine = launch.overrides.engine
        pid = os.getpid()
        self.record = SweepRecord(prefix=prefix, pid=pid, start_time=process_start_time(pid) or 0, hostname=socket.gethostname(),
                                  stages=tuple(stages))

    # the record ---------------------------------------------------------------------------

    def _write_record(self, **changes) -> None:
        self.record = dataclasses.replace(self.record, **changes)
        write_sweep_record(self.launch.artifact_root, self.record)

    def _check_stop_request(self, stage: int, run: str, when: str) -> None:
        why = sweep_stop_request(self.launch.artifact_root, self.prefix)
        if why:
            raise SweepStopped(f"{why} stopped stage {stage} ({run}) {when}")

    # one stage ----------------------------------------------------------------------------

    def wait(self, stage: int, run: str, seq_length: int, train_iters: int, started: float) -> dict[int, NodeStatus | None]:
        """Until the stage's run has ended on every node (control.wait_until_ended), with a progress
        line at every poll and the sweep's stop request checked there; a node that answers no status
        for UNREACHABLE_S gets the stage stopped."""
        def on_poll(statuses: Statuses, elapsed_s: float) -> None:  # noqa: ARG001 (the interface's signature)
            known = [s for s in statuses.values() if s is not None]
            last = max((s.last_iteration or 0 for s in known), default=0)
            self._check_stop_request(stage, run, f"at iteration {last}/{train_iters}")
            tps = next((s.tokens_per_s for s in known if s.tokens_per_s), None)
            progress = f"iteration {last}/{train_iters}" if last else "waiting for the first iteration"
            self.report(f"stage {stage} ({run}): {progress}" + (f", {tps:,.0f} tokens/s" if tps else "")
                        + f", {time.monotonic() - started:.0f} s", False)

        return wait_until_ended(self.launch, run, self.nodes, seq_length, on_poll=on_poll, unreachable_s=UNREACHABLE_S).statuses

    @staticmethod
    def reason(statuses: dict[int, NodeStatus | None]) -> str:
        """The most telling reason over the failed nodes' logs (all nodes' when none says failed),
        as each node's status read it from its own log."""
        failed = [r for r, s in statuses.items() if s and s.state.failed] or sorted(statuses)
        best = (-1, "")
        for rank in failed:
            s = statuses[rank]
            if s is None:
                score, text = 0, f"node {rank} gave no status"
            elif s.failure_reason:
                score, text = s.failure_score, s.failure_reason
            else:
                score, text = 0, s.exit or s.run_failure or s.last_line or f"node {rank} gave no status"
            if score > best[0]:
                best = (score, f"node {rank}: {text}" if len(statuses) > 1 else text)
        return best[1]

    def outcome(self, state: RunState, stage: int, reason: str | None = None) -> RunOutcome:
        return RunOutcome(status=state, reason=reason, zero_stage=stage, engine=self.engine,
                          nnodes=self.launch.nnodes, nproc_per_node=self.launch.nproc_per_node)

    def stop_everywhere(self, run: str) -> None:
        """The stop of the stage on every node; Ctrl-C and SIGTERM wait meanwhile."""
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.report(f"stopping {run} on every node ...", False)
            stop_run(self.launch, run)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def run_stage(self, stage: int) -> StageResult:
        run = stage_run_name(self.prefix, stage)
        self._check_stop_request(stage, run, "before it started")
        stage_launch = _stage_launch(self.launch, stage)
        started = time.monotonic()
        self.report(f"stage {stage} ({run}): starting on {len(self.nodes)} node(s) x {self.launch.nproc_per_node} processes", False)
        self._write_record(current_run=run)
        try:
            try:
                planned = plan_settled_start(stage_launch, self.model, self.data, run, self.nodes)
                t = planned.inputs.params.training
                self.engine = t.engine
                result = start_run(stage_launch, planned, self.verdicts)
                not_started = None if result.started else result.failure()[:400]
            except UserError as exc:
                not_started = f"error: {exc}"
            self._check_stop_request(stage, run, "while it started")
            if not_started is not None:
                return StageResult(stage=stage, run=run, outcome=self.outcome(RunState.FAILED, stage, f"did not start: {not_started}"),
                                   elapsed_s=time.monotonic() - started)
            statuses = self.wait(stage, run, t.seq_length, t.train_iters, started)
        except (KeyboardInterrupt, SweepStopped) as exc:
            self.stop_everywhere(run)
            why = f"Ctrl-C; stage {stage} ({run}) stopped on every node" if isinstance(exc, KeyboardInterrupt) else str(exc)
            raise SweepStopped(why) from None
        elapsed = time.monotonic() - started
        records = run_records(RunPaths(self.launch.artifact_root, run))
        last = records[-1].iteration if records else max((s.last_iteration or 0 for s in statuses.values() if s), default=0)
        final_loss = records[-1].lm_loss if records else None
        states = [s.state if s else None for s in statuses.values()]
        failed = any(state is not None and state.failed for state in states)
        if last >= t.train_iters and not failed:
            state, reason = RunState.FINISHED, None
        elif not failed and RunState.STOPPED in states and None not in states:  # someone stopped this stage's run itself
            state, reason = RunState.STOPPED, f"stopped on request at iteration {last}/{t.train_iters} (stop {run}); the sweep goes on"
        else:
            state, reason = RunState.FAILED, self.reason(statuses)
        if state != RunState.FINISHED:
            self.stop_everywhere(run)
        return StageResult(stage=stage, run=run, outcome=self.outcome(state, stage, reason), elapsed_s=elapsed, last_iteration=last,
                           train_iters=t.train_iters, final_loss=final_loss)

    # the whole sweep -------------------------------------------------------------------------

    def run(self, stages: Sequence[int]) -> tuple[list[StageResult], str | None]:
        results: list[StageResult] = []
        clear_sweep_stop(self.launch.artifact_root, self.prefix)
        self._write_record()
        handlers = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            for stage in stages:
                try:
                    result = self.run_stage(stage)
                except (SweepStopped, KeyboardInterrupt) as exc:
                    stopped = str(exc) or "Ctrl-C"
                    results.append(StageResult(stage=stage, run=stage_run_name(self.prefix, stage),
                                               outcome=self.outcome(RunState.STOPPED, stage, stopped), elapsed_s=0.0))
                    return results, stopped
                results.append(result)
                self.report(describe_stage(self.launch, result), True)
            return results, None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self._write_record(current_run=None, ended=True)
            clear_sweep_stop(self.launch.artifact_root, self.prefix)


def describe_stage(launch: LaunchEnv, r: StageResult) -> str:
    head = f"stage {r.stage} ({r.run}): "
    if r.outcome.status == RunState.FINISHED:
        loss = f", final loss {r.final_loss:.4f}" if r.final_loss is not None else ""
        return head + f"done in {r.elapsed_s:.0f} s, {r.last_iteration}/{r.train_iters} iterations{loss}"
    if r.outcome.status == RunState.STOPPED and not r.elapsed_s:
        return head + f"stopped ({r.outcome.reason})"
    log = RunPaths(launch.artifact_root, r.run).node_log(0)
    return head + f"FAILED after {r.elapsed_s:.0f} s: {r.outcome.reason} (log: {log})"


def run_sweep(launch: LaunchEnv, model: str, data: str, prefix: str, stages: Sequence[int], report: Report,
              warmup: int = DEFAULT_WARMUP_ITERATIONS) -> SweepResult:
    """Every stage's Megatron-LM arguments checked (:func:`check_stage_arguments`), then every stage
    in turn, then the comparison and its files (after :func:`check_sweep`)."""
    sweep = Sweep(launch, model, data, prefix, stages, report, check_stage_arguments(launch, model, data, prefix, stages))
    results, stopped = sweep.run(stages)
    if stopped:
        report(describe_stage(launch, results[-1]), True)
    outcomes = {r.run: r.outcome for r in results}
    rows = compare_runs(launch.artifact_root, [r.run for r in results], warmup, outcomes)
    return SweepResult(prefix, tuple(results), tuple(rows), write_comparison(launch.artifact_root, prefix, rows), stopped)
