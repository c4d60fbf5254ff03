"""The ZeRO sweep: one model and data set under each stage, one after another, then the comparison.

    bash training_scripts/compare_zero_stages.sh gpt_smoke smoke cmp                 # runs cmp_z0 ... cmp_z3
    STAGES=0,3 HOSTS=node0,node1,node2,node3 bash training_scripts/compare_zero_stages.sh qwen3_1p7b qwen3_1p7b_smoke q32
    bash training_scripts/stop_multinode_training.sh q32                             # or Ctrl-C: stops the current stage everywhere

Each stage is an ordinary run, ``PREFIX_z<stage>``, started with the start command's own code
(:func:`orchestration.cli.cmd_start`: preflight, every node, rollback) with only ``ZERO_STAGE``
changed, so the seed, data and iterations are the data set's for every stage. The sweep waits in
the foreground (node status every second or few; one line per stage) until every node's
supervisor has recorded how the stage ended (finished, failed, stopped), then prints the comparison
(:mod:`orchestration.compare`, planned memory next to measured) and writes
``$ARTIFACT_ROOT/compare/PREFIX.{png,json,csv}`` (:mod:`orchestration.report`). A stage that
fails is reported with the most telling line of its failed node's log (:func:`failure_reason`)
and the sweep goes on; so does a stage stopped on its own (``stop PREFIX_z1``).

Stopping: Ctrl-C (or SIGTERM/SIGHUP to the sweep) stops the current stage on every node through
the stop command's code. While a stage runs, each node's ``run_state/PREFIX_node<N>.pid`` is a
copy of the stage's pid file, so ``stop_multinode_training.sh PREFIX`` (or ``stop_training.sh``)
SIGTERMs the stage's torchrun on every node; the sweep sees the copy gone, finishes the stop
(sweeping leftovers) and ends. Between two stages (about two seconds) there is no stage to stop.

Side effects: processes through the start/stop/status commands, the pid-file copies (this
module's ``node-alias`` node command: ``python -m orchestration.sweep node-alias ...``), the
comparison files, the clock, stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

from megatron_ext.spec.errors import EXIT_NODE_FAILED, EXIT_OK, EXIT_USER_ERROR, UserError
from megatron_ext.spec.params import RunOverrides, load_run_params, with_batch_geometry
from megatron_ext.spec.run_paths import RunPaths, check_run_name
from megatron_ext.spec.zero import parse_zero_stage
from orchestration.compare import DEFAULT_WARMUP_ITERATIONS, RunOutcome, run_records
from orchestration.launch_env import LaunchEnv
from orchestration.planner import add_plan_memory_parser, cmd_plan_memory
from orchestration.report import add_compare_options, cmd_compare, compare_and_report, describe_files

ALL_STAGES = (0, 1, 2, 3)
POLL_S = 3.0
"""Seconds between status polls of a running stage (each asks every node over its transport)."""
LOCAL_POLL_S = 1.0
"""The same when every node is this machine (read in this process: a few milliseconds)."""
EXIT_RECORD_WAIT_S = 10.0
"""After torchrun is gone on every node, how long to wait for the supervisors' records of how it ended."""
UNREACHABLE_S = 300.0
"""A node that answers no status for this long: stop the stage and report it."""
EXIT_STOPPED = 130
"""The sweep was stopped (Ctrl-C, SIGTERM, or stop PREFIX)."""


def stage_run_name(prefix: str, stage: int) -> str:
    return f"{prefix}_z{stage}"


def parse_stages(text: str | None, source: str = "STAGES") -> tuple[int, ...]:
    """``0,1,3`` -> (0, 1, 3), in that order; empty = all four; no repeats."""
    if not text or not text.strip():
        return ALL_STAGES
    stages = []
    for part in text.replace(" ", "").split(","):
        if part not in ("0", "1", "2", "3"):
            raise UserError(f"{source}={text!r}: {part!r} is not a ZeRO stage; list stages 0-3 separated by commas, "
                            f"e.g. {source}=0,1,2,3")
        stage = int(parse_zero_stage(part))
        if stage in stages:
            raise UserError(f"{source}={text!r} lists stage {stage} twice; list each stage once, e.g. {source}=0,1,2,3")
        stages.append(stage)
    return tuple(stages)


# -- why a run failed: from its node log ----------------------------------------------------------

_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt))(?::\s*(.*))?$")
_ROOT_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")


def failure_reason(log_text: str) -> tuple[int, str]:
    """(how telling, reason) from a node log's tail: a program ``error:`` line (3); else a rank
    killed by a signal other than SIGTERM/SIGINT, from torchrun's root-cause summary (2: the
    other ranks' errors follow from it); else the last exception line other than torchrun's own
    (2: e.g. ``torch.OutOfMemoryError: CUDA out of memory...``); else torchrun's summary or the
    signal it got (1); else the last line (0). Pure."""
    lines = [_RANK_PREFIX.sub("", l.rstrip()) for l in log_text.splitlines()[-400:]]
    errors = [l for l in lines if l.startswith("error: ")]
    exceptions = [m for m in (_EXCEPTION.match(l.strip()) for l in lines) if m and not m.group(1).endswith("ChildFailedError")]
    root = {}
    if "Root Cause (first observed failure):" in lines:
        for l in lines[lines.index("Root Cause (first observed failure):") + 1:]:
            m = _ROOT_FIELD.match(l)
            if m:
                root.setdefault(m.group(1), m.group(2).strip())
    torchrun = ""
    if root:
        rank = root.get("rank", "?").split(" ")[0]
        detail = root.get("traceback", "")
        if not detail or detail.startswith("To enable traceback"):
            detail = f"exit code {root.get('exitcode', '?').split(' ')[0]}"
        if "SIGKILL" in detail:
            detail += " (SIGKILL: e.g. the kernel's out-of-memory killer)"
        torchrun = f"rank {rank}: {detail}"

    def cut(text: str) -> str:
        return text if len(text) <= 300 else text[:297] + "..."

    if errors:
        return 3, cut(errors[-1])
    signal_text = root.get("traceback", "")
    if signal_text.startswith("Signal ") and not signal_text.startswith(("Signal 15 ", "Signal 2 ")):
        return 2, cut(torchrun)  # a rank was killed (e.g. SIGKILL): the other ranks' errors follow from it
    real = [m for m in exceptions if not m.group(1).endswith("SignalException")]
    if real:
        m = real[-1]
        text = f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
        return 2, cut(text + (f" (torchrun: {torchrun})" if torchrun else ""))
    if exceptions:  # torchrun itself got a signal: someone stopped it
        return 1, cut(f"{exceptions[-1].group(1).rsplit('.', 1)[-1]}: {exceptions[-1].group(2) or ''}".strip())
    if torchrun:
        return 1, cut(torchrun)
    meaningful = [l for l in lines if l.strip() and not set(l.strip()) <= set("=-")]
    if meaningful:
        return 0, cut(meaningful[-1].strip())
    return 0, "the run ended before its last iteration and its log is empty"


# -- the pid-file copy that lets stop PREFIX reach the current stage (node side) ------------------

def node_alias(root: Path, prefix: str, run: str, node_rank: int, action: str) -> dict:
    """On this node: ``free`` refuses when PREFIX's pid file names a live process (a run called
    PREFIX, or another sweep PREFIX), ``link`` copies RUN's pid file to PREFIX's, ``unlink``
    removes that copy (only if it is RUN's), ``check`` says whether it is still there."""
    from orchestration import processes

    src, dst = RunPaths(root, run).node_pid_file(node_rank), RunPaths(root, prefix).node_pid_file(node_rank)
    current = processes.read_pid_file(dst)
    if action == "free":
        if current and processes.record_is_alive(current):
            raise UserError(f"{prefix!r} is running on node {node_rank} as {current.run!r} (pid {current.pid}); "
                            f"stop it first (stop_multinode_training.sh {prefix}) or choose another PREFIX")
        return {"node_rank": node_rank, "free": True}
    if action == "link":
        record = processes.read_pid_file(src)
        if record is None:
            raise UserError(f"run {run!r} has no pid file on node {node_rank} ({src}); it did not start there")
        if current and current.run != run and not current.run.startswith(f"{prefix}_z") and processes.record_is_alive(current):
            raise UserError(f"{prefix!r} is a live run of its own on node {node_rank}; choose another PREFIX for the sweep")
        processes.write_pid_file(dst, record)
        return {"node_rank": node_rank, "linked": True}
    mine = current is not None and current.run == run
    if action == "unlink" and mine:
        dst.unlink(missing_ok=True)
    return {"node_rank": node_rank, "linked": mine and action == "check"}


def node_main(argv: Sequence[str] | None = None) -> int:
    """``python -m orchestration.sweep node-alias ACTION PREFIX RUN --node-rank N --artifact-root R``."""
    p = argparse.ArgumentParser(prog="python -m orchestration.sweep")
    p.add_argument("command", choices=["node-alias"])
    p.add_argument("action", choices=["free", "link", "unlink", "check"])
    p.add_argument("prefix"), p.add_argument("run")
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--artifact-root", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        check_run_name(args.prefix), check_run_name(args.run)
        print(json.dumps(node_alias(args.artifact_root, args.prefix, args.run, args.node_rank, args.action)), flush=True)
    except UserError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return EXIT_USER_ERROR
    return EXIT_OK


# -- the sweep (launcher side) --------------------------------------------------------------------

class SweepStopped(Exception):
    """Ctrl-C, SIGTERM or SIGHUP reached the sweep, or ``stop PREFIX`` stopped the current stage."""


@dataclass(frozen=True)
class StageResult:
    stage: int
    run: str
    outcome: RunOutcome
    elapsed_s: float
    last_iteration: int | None = None
    train_iters: int | None = None


class Sweep:
    """One sweep: its nodes, and the start, stop and status steps for each stage."""

    def __init__(self, launch: LaunchEnv, model: str, data: str, prefix: str, out: TextIO = sys.stdout):
        self.launch, self.model, self.data, self.prefix, self.out = launch, model, data, prefix, out
        self.nodes = list(enumerate(launch.hosts))
        self.live = out.isatty()
        self.engine = launch.overrides.engine
        from orchestration.transports import runs_here

        self.poll_s = LOCAL_POLL_S if all(runs_here(launch, h) for _, h in self.nodes) else POLL_S

    # steps on every node ---------------------------------------------------------------

    def _stage_launch(self, stage: int) -> LaunchEnv:
        return dataclasses.replace(self.launch, overrides=dataclasses.replace(self.launch.overrides, zero_stage=stage))

    def _fan_out(self, argv_for, timeout_s: float = 120.0):
        from orchestration.fanout import fan_out

        return fan_out(self.launch, self.nodes, argv_for, self.launch.forwarded, os.getcwd(), timeout_s)

    def _alias(self, action: str, run: str) -> list:
        root = str(self.launch.artifact_root)
        return self._fan_out(lambda rank, host: [sys.executable, "-m", "orchestration.sweep", "node-alias", action,
                                                 self.prefix, run, "--node-rank", str(rank), "--artifact-root", root])

    @staticmethod
    def cli_args(*argv: str) -> argparse.Namespace:
        """A start or stop command's arguments as its own parser gives them (every default)."""
        from orchestration import cli

        return cli.build_parser().parse_args(list(argv))

    def start(self, stage: int, run: str) -> tuple[bool, str]:
        """The start command for this stage, its output captured: (started, output)."""
        from orchestration import cli

        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                rc = cli.cmd_start(self.cli_args("start", self.model, self.data, run), self._stage_launch(stage))
        except UserError as exc:
            return False, f"error: {exc}"
        return rc == EXIT_OK, captured.getvalue()

    def stop(self, run: str) -> str:
        """The stop command for ``run`` on every node (waits, sweeps leftovers), output captured."""
        from orchestration import cli

        captured = io.StringIO()
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            cli.cmd_stop(self.cli_args("stop", run), self.launch)
        return captured.getvalue()

    def statuses(self, run: str, seq_length: int | None) -> dict[int, dict | None]:
        """Every node's status (None = no answer); in this process for this machine's nodes."""
        from orchestration import node
        from orchestration.plan import orchestration_argv
        from orchestration.transports import runs_here

        paths = RunPaths(self.launch.artifact_root, run)
        out: dict[int, dict | None] = {}
        remote = [(r, h) for r, h in self.nodes if not runs_here(self.launch, h)]
        for rank, host in self.nodes:
            if runs_here(self.launch, host):
                out[rank] = node.node_status(paths, rank, host, seq_length)
        if remote:
            from orchestration.fanout import fan_out

            seq = ["--seq-length", str(seq_length)] if seq_length else []
            results = fan_out(self.launch, remote, lambda rank, host: orchestration_argv(
                sys.executable, "node-status", run, "--node-rank", str(rank), "--host", host,
                "--artifact-root", str(self.launch.artifact_root), *seq), self.launch.forwarded, os.getcwd(), 60.0)
            out.update({r.node_rank: (r.payload if r.ok else None) for r in results})
        return out

    # one stage ----------------------------------------------------------------------------

    def show(self, text: str, final: bool) -> None:
        if self.live:
            self.out.write("\r\033[K" + text + ("\n" if final else ""))
            self.out.flush()
        elif final:
            print(text, file=self.out, flush=True)

    def wait(self, stage: int, run: str, seq_length: int, train_iters: int, started: float) -> dict[int, dict | None]:
        """Until the run has ended on every node: torchrun gone and its supervisor's record of how
        (finished, failed, stopped) written, or EXIT_RECORD_WAIT_S after torchrun went. Each node's
        supervisor stops its node when another fails or goes silent; a node that answers no status
        for UNREACHABLE_S gets the stage stopped from here."""
        gone_since = unknown_since = None
        while True:
            statuses = self.statuses(run, seq_length)
            known = [s for s in statuses.values() if s is not None]
            now = time.monotonic()
            gone = len(known) == len(statuses) and not any(s["alive"] for s in known)
            gone_since = (gone_since or now) if gone else None
            if gone and (all(s.get("exit") for s in known) or now - gone_since > EXIT_RECORD_WAIT_S):
                return statuses
            last = max((s["last_iteration"] or 0 for s in known), default=0)
            tps = next((s["tokens_per_s"] for s in known if s.get("tokens_per_s")), None)
            progress = f"iteration {last}/{train_iters}" if last else "waiting for the first iteration"
            self.show(f"stage {stage} ({run}): {progress}" + (f", {tps:,.0f} tokens/s" if tps else "")
                      + f", {now - started:.0f} s", final=False)
            unknown_since = (unknown_since or now) if len(known) < len(statuses) else None
            if unknown_since and now - unknown_since > UNREACHABLE_S:
                self.stop(run)
                return {**self.statuses(run, seq_length), **{r: None for r, st in statuses.items() if st is None}}
            time.sleep(self.poll_s)

    def reason(self, run: str, statuses: dict[int, dict | None]) -> str:
        """The most telling reason over the failed nodes' logs (all nodes' when none says failed):
        this machine's copy of the log, else what the node's supervisor recorded."""
        from orchestration.node import tail

        failed = [r for r, s in statuses.items() if s and s.get("state") == "failed"] or sorted(statuses)
        best = (-1, "")
        for rank in failed:
            log = RunPaths(self.launch.artifact_root, run).node_log(rank)
            s = statuses[rank] or {}
            if log.is_file():
                score, text = failure_reason(tail(log, 400, max_bytes=262144))
            else:
                score, text = 0, s.get("exit") or s.get("run_failure") or s.get("last_line") or f"node {rank} gave no status"
            if score > best[0]:
                best = (score, f"node {rank}: {text}" if len(statuses) > 1 else text)
        return best[1]

    def run_stage(self, stage: int) -> StageResult:
        run = stage_run_name(self.prefix, stage)
        params, _ = with_batch_geometry(load_run_params(self.model, self.data, RunOverrides(stage, self.launch.overrides.engine)),
                                        self.launch.world_size)
        t = params.training
        self.engine = t.engine
        started = time.monotonic()
        self.show(f"stage {stage} ({run}): starting on {len(self.nodes)} node(s) x {self.launch.nproc_per_node} processes",
                  final=False)
        try:
            ok, output = self.start(stage, run)
            if not ok:
                lines = [l.strip() for l in output.splitlines() if l.strip() and not l.startswith("note:")]
                reason = " ".join(lines[-3:]) or "the start command failed without a message"
                return StageResult(stage, run, self.outcome("failed", stage, f"did not start: {reason[:400]}"),
                                   time.monotonic() - started)
            for r in self._alias("link", run):
                if not r.ok:
                    raise UserError(r.describe_failure())
            statuses = self.wait(stage, run, t.seq_length, t.train_iters, started)
        except (KeyboardInterrupt, SweepStopped) as exc:
            self.stop_everywhere(run)
            why = "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else str(exc)
            raise SweepStopped(f"{why}; stage {stage} ({run}) stopped on every node") from None
        except UserError:
            self.stop_everywhere(run)
            raise
        elapsed = time.monotonic() - started
        records = run_records(RunPaths(self.launch.artifact_root, run))
        last = records[-1].iteration if records else max((s["last_iteration"] or 0 for s in statuses.values() if s), default=0)
        states = [s.get("state") if s else "no answer" for s in statuses.values()]
        if last >= t.train_iters and "failed" not in states:
            self._alias("unlink", run)
            return StageResult(stage, run, self.outcome("done", stage), elapsed, last, t.train_iters)
        if "failed" not in states:
            check = self._alias("check", run)[0]  # node 0: the copy is gone when stop PREFIX stopped the stage
            if check.ok and not check.payload.get("linked"):
                self.stop_everywhere(run)
                raise SweepStopped(f"stop {self.prefix} stopped stage {stage} ({run}) at iteration {last}/{t.train_iters}")
            if "stopped" in states and "no answer" not in states:  # someone stopped this stage's run itself
                self.stop_everywhere(run)
                return StageResult(stage, run, self.outcome("stopped", stage, f"stopped on request at iteration {last}/"
                                                            f"{t.train_iters} (stop {run}); the sweep goes on"),
                                   elapsed, last, t.train_iters)
        reason = self.reason(run, statuses)
        self.stop_everywhere(run)
        return StageResult(stage, run, self.outcome("failed", stage, reason), elapsed, last, t.train_iters)

    def outcome(self, status: str, stage: int, reason: str | None = None) -> RunOutcome:
        return RunOutcome(status, reason, zero_stage=stage, engine=self.engine,
                          nnodes=self.launch.nnodes, nproc_per_node=self.launch.nproc_per_node)

    def stop_everywhere(self, run: str) -> None:
        """The stop command for the stage, and the pid-file copies removed; Ctrl-C and SIGTERM wait meanwhile."""
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.show(f"stopping {run} on every node ...", final=False)
            self.stop(run)
            self._alias("unlink", run)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def describe(self, r: StageResult) -> str:
        head = f"stage {r.stage} ({r.run}): "
        if r.outcome.status == "done":
            records = run_records(RunPaths(self.launch.artifact_root, r.run))
            loss = f", final loss {records[-1].lm_loss:.4f}" if records else ""
            return head + f"done in {r.elapsed_s:.0f} s, {r.last_iteration}/{r.train_iters} iterations{loss}"
        log = RunPaths(self.launch.artifact_root, r.run).node_log(0)
        return head + f"FAILED after {r.elapsed_s:.0f} s: {r.outcome.reason} (log: {log})"


def _raise_stopped(signum, frame):
    raise SweepStopped(f"signal {signal.Signals(signum).name}")


def check_sweep(launch: LaunchEnv, model: str, data: str, prefix: str, stages: Sequence[int]) -> None:
    """Everything a sweep can refuse before it starts anything: names, every stage's parameters
    and batch at this world size, and stage runs that would resume from old checkpoints."""
    check_run_name(prefix)
    for stage in stages:
        run = check_run_name(stage_run_name(prefix, stage))
        with_batch_geometry(load_run_params(model, data, RunOverrides(stage, launch.overrides.engine)), launch.world_size)
        checkpoints = RunPaths(launch.artifact_root, run).checkpoints_dir
        if checkpoints.is_dir() and any(checkpoints.iterdir()):
            raise UserError(f"run {run} has checkpoints in {checkpoints}: its start would resume from them, and a "
                            f"sweep compares fresh runs; choose another PREFIX or remove {checkpoints}")


def run_sweep(launch: LaunchEnv, model: str, data: str, prefix: str, stages: Sequence[int],
              warmup: int = DEFAULT_WARMUP_ITERATIONS, out: TextIO = sys.stdout) -> int:
    check_sweep(launch, model, data, prefix, stages)
    sweep = Sweep(launch, model, data, prefix, out)
    if launch.dry_run:
        for stage in stages:
            print(f"# stage {stage}: {stage_run_name(prefix, stage)}", file=out, flush=True)
            from orchestration import cli

            cli.cmd_start(sweep.cli_args("start", model, data, stage_run_name(prefix, stage)), sweep._stage_launch(stage))
        return EXIT_OK
    failed = [c for c in sweep._alias("free", stage_run_name(prefix, stages[0])) if not c.ok]
    if failed:  # PREFIX is a live run of its own, or another sweep PREFIX runs
        raise UserError("; ".join(c.describe_failure() for c in failed))
    iters = load_run_params(model, data, RunOverrides(stages[0], launch.overrides.engine)).training.train_iters
    print(f"sweep {prefix}: {model} on {data}, ZeRO stages {','.join(map(str, stages))} as "
          f"{', '.join(stage_run_name(prefix, s) for s in stages)}; {launch.nnodes} node(s) x {launch.nproc_per_node} "
          f"processes, {iters} iterations each; stop: Ctrl-C or "
          f"{'stop_training.sh' if launch.nnodes == 1 else 'stop_multinode_training.sh'} {prefix}", file=out, flush=True)
    if launch.zero_stage is not None:
        print(f"note: ZERO_STAGE={launch.zero_stage} is ignored: the sweep sets each stage (STAGES picks them)", file=out)
    results: list[StageResult] = []
    stopped = None
    handlers = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for stage in stages:
            try:
                result = sweep.run_stage(stage)
            except (SweepStopped, KeyboardInterrupt) as exc:
                stopped = str(exc) or "Ctrl-C"
                results.append(StageResult(stage, stage_run_name(prefix, stage), sweep.outcome("stopped", stage, stopped), 0.0))
                sweep.show(f"stage {stage} ({stage_run_name(prefix, stage)}): stopped ({stopped})", final=True)
                break
            results.append(result)
            sweep.show(sweep.describe(result), final=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    outcomes = {r.run: r.outcome for r in results}
    table, files = compare_and_report(launch.artifact_root, [r.run for r in results], prefix, warmup, outcomes)
    print("", file=out)
    print(table, file=out)
    print(describe_files(files), file=out, flush=True)
    if stopped:
        return EXIT_STOPPED
    return EXIT_OK if all(r.outcome.status == "done" for r in results) else EXIT_NODE_FAILED


def cmd_sweep(args, launch: LaunchEnv) -> int:
    """``sweep MODEL DATA PREFIX [--stages 0,1]`` (STAGES from the environment otherwise)."""
    stages = parse_stages(args.stages, "--stages") if args.stages else parse_stages(os.environ.get("STAGES"))
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup} must be >= 0")
    return run_sweep(launch, args.model, args.data, args.prefix, stages, args.warmup)


def add_commands(sub) -> None:
    """``sweep``, ``plan-memory``, and the ``compare`` options (``--name``, ``--warmup``); call
    after ``compare`` is added."""
    p = sub.add_parser("sweep", help="train MODEL on DATA under each ZeRO stage (STAGES, default 0-3) as "
                                     "PREFIX_z<stage>, one after another, then compare them")
    p.add_argument("model"), p.add_argument("data"), p.add_argument("prefix")
    p.add_argument("--stages", help="comma list of stages (default $STAGES, else 0,1,2,3)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP_ITERATIONS,
                   help=f"iterations left out of the medians (default {DEFAULT_WARMUP_ITERATIONS})")
    add_plan_memory_parser(sub)
    if "compare" in sub.choices:
        add_compare_options(sub.choices["compare"])


COMMANDS = {"sweep": cmd_sweep, "plan-memory": cmd_plan_memory, "compare": cmd_compare}


if __name__ == "__main__":
    sys.exit(node_main())
