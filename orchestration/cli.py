"""``python -m orchestration``: start, stop, status, logs, rejoin, train, submit, compare, sweep, plan-memory, preflight.

    python -m orchestration start gpt_smoke smoke demo              # every node in HOSTS/HOSTFILE
    python -m orchestration start gpt_smoke smoke demo --this-node  # this node only (NODE_RANK)
    python -m orchestration status demo
    python -m orchestration logs demo --since 10m --follow          # every node's log merged, each line named
    python -m orchestration stop demo                               # DRY_RUN=1: what it would signal
    python -m orchestration rejoin demo 1                           # node 1 back (NNODES=MIN:MAX)
    python -m orchestration train gpt2 gpt2_smoke                   # foreground, this node
    python -m orchestration submit gpt_smoke smoke demo --nodes 2   # DRY_RUN=1: the batch script
    python -m orchestration compare demo_z0 demo_z1 demo_z3 --name demo   # + artifacts/compare/demo.{png,json,csv}
    python -m orchestration sweep gpt_smoke smoke demo                 # ZERO_STAGE 0-3 one after another, then compare
    python -m orchestration plan-memory qwen3_1p7b                     # expected memory per GPU per stage
    python -m orchestration preflight gpt_smoke smoke demo             # the start's checks, nothing started

This module is every launcher command's parser, its dispatch and all its printing: each command
plans (orchestration/runner/), prints the plan when ``DRY_RUN=1``, executes it and prints the typed
result; what a result means (an exit code, a requeue) is decided in the runner. The environment is
read once, here at the entry (:func:`orchestration.launch_env.launch_env_from_process`), and
logging is configured here (LOG_LEVEL or ``--verbose``: notes and warnings on standard error,
results on standard output). The node commands (``node-*``) are another program:
orchestration/node/commands.py. Exit codes: :mod:`megatron_ext.run_spec.errors`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_USER_ERROR, UserError
from megatron_ext.run_spec.params import COLLECTIVE_TIMEOUT_S
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths, check_run_name, runs_under
from megatron_ext.run_spec.zero import parse_stages
from orchestration.analysis.checkpoint_health import (check_run_checkpoints, format_checkpoint_line,
                                                      format_checkpoint_report, moved_aside)
from orchestration.analysis.compare import DEFAULT_WARMUP_ITERATIONS, compare_runs
from orchestration.analysis.goodput import format_goodput_line, read_goodput
from orchestration.analysis.memory_plan import (DEFAULT_BUS_BANDWIDTH_GBS, DEFAULT_DEVICE, DEFAULT_HEADROOM, DEVICES,
                                                MemoryRequest, plan_memory_request)
from orchestration.analysis.comparison_files import comparison_name, describe_files, write_comparison
from orchestration.analysis.tables import format_comparison, format_memory_plan
from orchestration.runner.links import format_links
from orchestration.cluster import slurm
from orchestration.cluster.backends import backend_for
from orchestration.import_args.importer import import_arg_files
from orchestration.import_args.outputs import check_outputs, write_outputs
from orchestration.import_args.yaml_files import imported_yaml, render_report
from orchestration.launch_env import LaunchEnv, launch_env_from_process
from orchestration.node.run_state import HEARTBEAT_S
from orchestration.node.wire import DEFAULT_STOP_GRACE_S, StopPreview, encode_payload, node_label, stop_command
from orchestration.runner import control, rejoin
from orchestration.runner.export import export_argv, run_export
from orchestration.runner.node_logs import NodeProblem, plan_logs, read_logs
from orchestration.runner.nodes import nodes_to_start, this_node
from orchestration.runner.preflight import Problem
from orchestration.runner.start import (PlannedStart, follow_until_ended, log_size, plan_settled_start, run_checks,
                                        start_run)
from orchestration.runner.submit import plan_submit, requeue_after_save, submit_batch
from orchestration.runner import submit_kubernetes as kubernetes
from orchestration.cluster.kubernetes import (DEFAULT_MAX_RESTARTS, DEFAULT_TERMINATION_GRACE_S, KubernetesRequest,
                                               describe as describe_submission, parse_rdma)
from orchestration.runner.sweep import SweepResult, check_sweep, plan_sweep, run_sweep, stage_run_name

log = logging.getLogger("orchestration")

EXIT_STOPPED = 130
"""The sweep was stopped (Ctrl-C, SIGTERM, or stop PREFIX), or ``train`` by Ctrl-C."""
SAVE_TIMEOUT_S = 900.0
"""``stop --save``: a step, a checkpoint save and the end, with room."""
LEVEL_PREFIX = {logging.DEBUG: "debug: ", logging.INFO: "note: ", logging.WARNING: "warning: ", logging.ERROR: "error: "}


class _PrefixFormatter(logging.Formatter):
    """``note: ...`` for INFO, ``warning: ...``, ``error: ...``, ``debug: ...``: the launcher's lines."""

    def format(self, record: logging.LogRecord) -> str:
        return LEVEL_PREFIX.get(record.levelno, "") + record.getMessage()


def configure_logging(level: str) -> None:
    """Standard error, one prefixed line per record, at ``level`` (LOG_LEVEL, or DEBUG with --verbose)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrefixFormatter())
    root = logging.getLogger("orchestration")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def note(text: str) -> None:
    log.info(text)


def format_problems(problems: Sequence[Problem]) -> str:
    lines = [f"{'node':<5} {'host':<16} problem"]
    lines += [f"{rank:<5} {host:<16} {problem}" for rank, host, problem in problems]
    return "\n".join(lines)


# -- start, train, preflight ----------------------------------------------------------------------

def note_left_out(planned: PlannedStart) -> None:
    """NNODES=MIN:MAX: the nodes the start leaves out, why, and how to bring one back (stderr)."""
    if not planned.left_out:
        return
    nodes = sorted({(rank, host) for rank, host, _ in planned.left_out})
    total = len(planned.plan.nodes)
    note(f"left out of the start (NNODES=MIN:MAX): the run starts on {total - len(nodes)} of {total} nodes without "
         f"node(s) {', '.join(f'{r} ({h})' for r, h in nodes)}, whose preflight found:\n"
         f"{format_problems(planned.left_out)}\nonce fixed, bring one back with rejoin_multinode_training.sh "
         f"{planned.plan.run} NODE_RANK (every node saves at its next step and the run goes on with it)")


def note_links(planned: PlannedStart) -> None:
    """The checks a node could not run (GPU health it could not read), and with several nodes the
    links the preflight measured, as a table (stderr)."""
    for r in planned.preflight.reports:
        for text in r.notes:
            note(f"node {r.node_rank} ({r.host}): {text}")
    if planned.preflight.links:
        note("links between the nodes (each node's exchanges with its ring neighbours, the run's backend):\n"
             + format_links(planned.preflight.links))


def print_plan(planned: PlannedStart, launch: LaunchEnv) -> int:
    """The dry run: the checks' notes, the plan (a header line, then one JSON line per node), and
    what a start would make of the preflight; the exit code a start would have up to there."""
    note_left_out(planned)
    note_links(planned)
    for text in run_checks(launch, planned):
        note(text)
    for line in planned.plan.to_json_lines():
        print(line, flush=True)
    preflight = planned.preflight
    if preflight.problems and preflight.answered:
        print(f"error: preflight found {len(preflight.problems)} problem(s); a start would start nothing:\n"
              f"{format_problems(preflight.problems)}", file=sys.stderr)
        return EXIT_USER_ERROR
    if preflight.problems:
        note(f"the plan is unsettled: {len(preflight.problems)} node(s) did not answer the preflight (a start would "
             f"stop there):\n{format_problems(preflight.problems)}")
    return EXIT_OK


def _start(launch: LaunchEnv, planned):
    """Start the settled plan: (the result, the exit code when the preflight refused it), the
    refusal's table and the start's notes printed."""
    result = start_run(launch, planned)
    if result.refused:
        print(f"error: preflight found {len(result.preflight.problems)} problem(s); nothing was started:\n"
              f"{format_problems(result.preflight.problems)}", file=sys.stderr)
        return result, EXIT_USER_ERROR if result.preflight.answered else EXIT_NODE_FAILED
    for text in result.notes:
        note(text)
    return result, None


def cmd_start(args, launch: LaunchEnv) -> int:
    nodes = nodes_to_start(launch, args.this_node)
    planned = plan_settled_start(launch, args.model, args.data, args.run, nodes)
    for text in planned.plan.notes:
        note(text)
    if launch.dry_run:
        return print_plan(planned, launch)
    note_left_out(planned)
    note_links(planned)
    result, refused = _start(launch, planned)
    if refused is not None:
        return refused
    for r in result.nodes:
        print(f"{r.label} started torchrun pid {r.value.pid}; log {r.value.log}" if r.ok else r.describe_failure(), flush=True)
    if not result.started:
        if result.rolled_back:
            print(f"stopping the {len(result.rolled_back)} node(s) that did start, so nothing is left running", file=sys.stderr)
        return EXIT_NODE_FAILED
    plan = result.plan
    paths = RunPaths(launch.artifact_root, args.run)
    t = plan.resolved.params.training
    resume = (f"resuming from iteration {plan.resume_from} (for a fresh start use another RUN name or remove "
              f"{paths.checkpoints_dir})" if plan.resume_from is not None else "fresh start")
    print(
        f"run {args.run} started: {len(nodes)} node(s) x {launch.nproc_per_node} processes, world size "
        f"{launch.world_size}, ZERO_STAGE={t.zero_stage}, engine {t.engine}, {plan.geometry.describe()}, "
        f"{resume}, MASTER_PORT {plan.master_port}, collective timeout {COLLECTIVE_TIMEOUT_S[launch.device]} s, "
        f"{t.resilience.describe()}{engine_named(t.engine).progress_note}; "
        f"status: status_training.sh {args.run}; stop: {stop_command(args.run, not args.this_node)}",
        flush=True,
    )
    if not args.wait:
        return EXIT_OK
    save_signal = control.SaveSignal(launch=launch, run=args.run, nodes=nodes, mark=args.signal_file)
    save_signal.install()
    end = control.wait_until_ended(launch, args.run, nodes, on_poll=save_signal.poll)
    print(f"run {args.run} ended: {end.describe()}", flush=True)
    code = control.end_exit_code(end.states)
    if code == EXIT_PREEMPTED and args.requeue and save_signal.received and launch.slurm_job_id:
        print(requeue_after_save(launch, args.run), flush=True)
    return code


def cmd_train(args, launch: LaunchEnv) -> int:
    """Foreground training on this node: the same settled plan as a start of this node, run by the
    node's supervisor, its log copied here until the run ends (Ctrl-C stops it)."""
    run = args.run or f"{args.model}_{args.data}"
    check_run_name(run)
    planned = plan_settled_start(launch, args.model, args.data, run, this_node(launch))
    for text in planned.plan.notes:
        note(text)
    if launch.dry_run:
        return print_plan(planned, launch)
    offset = log_size(planned.plan)
    result, refused = _start(launch, planned)
    if refused is not None:
        return refused
    if not result.started:
        for r in result.nodes:
            print(r.describe_failure(), file=sys.stderr, flush=True)
        return EXIT_NODE_FAILED
    end, interrupted = follow_until_ended(launch, result.plan, sys.stdout, offset)
    if interrupted:
        print(f"run {run}: stopped ({interrupted}); status: status_training.sh {run}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    code = control.end_exit_code(end.states)
    if code != EXIT_OK:
        print(f"run {run} ended: {end.describe()}", file=sys.stderr, flush=True)
    return code


def cmd_preflight(args, launch: LaunchEnv) -> int:
    """The start's checks on every node, on their own: nothing is started."""
    nodes = nodes_to_start(launch, args.this_node)
    planned = plan_settled_start(launch, args.model, args.data, args.run, nodes)
    if planned.preflight.links:
        print(format_links(planned.preflight.links))
    if planned.left_out:  # NNODES=MIN:MAX: a start would go on without them; the table says why
        print(format_problems(planned.left_out))
        note_left_out(planned)
    if planned.preflight.problems:
        print(format_problems(planned.preflight.problems))
        return EXIT_USER_ERROR if planned.preflight.answered else EXIT_NODE_FAILED
    for text in run_checks(launch, planned):
        print(f"note: {text}")
    for text in planned.plan.notes:
        print(f"note: {text}")
    left = len({rank for rank, _, _ in planned.left_out})
    print(f"preflight: no problem on {len(nodes) - left} node(s)" + (f"; {left} left out" if left else ""))
    return EXIT_OK


# -- stop, status ---------------------------------------------------------------------------------

def describe_stop(r) -> str:
    if not r.ok:
        return r.describe_failure()
    p = r.value
    if isinstance(p, StopPreview):
        tagged = f"{len(p.tagged)} live process(es) carry the run's tags: {', '.join(map(str, p.tagged))}" if p.tagged \
            else "no live process carries the run's tags"
        if p.group is None:
            return f"{r.label} would signal nothing now (no live recorded process; {tagged})"
        return (f"{r.label} would SIGTERM process group {p.group} (torchrun pid {p.recorded_pid}), wait up to "
                f"{p.grace_s:.0f} s, then SIGTERM and SIGKILL what still carries the run's tags ({tagged})")
    if not p.ok:
        return f"{r.label} processes still alive after SIGKILL: {p.left}"
    if not p.was_running and not p.swept:
        return f"{r.label} not running"
    extra = f"; swept {len(p.swept)} leftover process(es)" if p.swept else ""
    extra += f"; SIGKILLed {p.killed}" if p.killed else ""
    return f"{r.label} stopped (SIGTERM to process group {p.signalled_group}){extra}"


def print_stop(outcome: control.StopOutcome) -> None:
    if outcome.job:
        print(f"would scancel slurm job {outcome.job} of run {outcome.run}" if outcome.dry_run
              else f"slurm job {outcome.job} of run {outcome.run}: {outcome.job_state}", flush=True)
        return
    if outcome.sweep is not None:
        stage = outcome.sweep.current_run
        asked = "would ask the sweep to stop" if outcome.dry_run else "asked to stop"
        print(f"sweep {outcome.run}: {asked}" + (f"; its current stage {stage}:" if stage else " (between stages)"),
              flush=True)
        if outcome.stage is not None:
            print_stop(outcome.stage)
        return
    for rank, host, step in outcome.cancelled_steps:
        print(f"{node_label(rank, host)} srun could not reach it: cancelled step {step}", flush=True)
    for r in outcome.nodes:
        print(describe_stop(r), flush=True)


def cmd_stop(args, launch: LaunchEnv) -> int:
    submitted = kubernetes.submission_of(launch, args.run, args.this_node)
    if submitted:  # its pods save on SIGTERM: a deletion is a stop --save (node/pod.py)
        outcome = kubernetes.stop_submission(launch, submitted, dry_run=launch.dry_run)
        print(f"would run: {shlex.join(outcome.argv)}" if outcome.dry_run else
              f"{describe_submission(submitted)} of run {args.run}: deleted; every pod was asked to save at its next step "
              "(SIGTERM) and has ended" if outcome.ok else
              f"error: {shlex.join(outcome.argv)} failed: {outcome.output}", flush=True)
        return EXIT_OK if outcome.ok else EXIT_NODE_FAILED
    if args.save and not launch.dry_run:
        end = control.save_and_wait(launch, args.run, args.this_node, args.save_timeout_s)
        print(f"run {args.run}: " + (end.describe() if end else
                                     f"no end within {args.save_timeout_s:.0f} s of the save request: stopping it"),
              flush=True)
    outcome = control.stop_run(launch, args.run, args.this_node, args.grace_s, dry_run=launch.dry_run)
    print_stop(outcome)
    return EXIT_OK if outcome.ok else EXIT_NODE_FAILED


def cmd_rejoin(args, launch: LaunchEnv) -> int:
    require_run(launch, args.run)
    planned = rejoin.plan_rejoin(launch, args.run, args.node_rank, args.host)
    label = node_label(args.node_rank, planned.plan.host)
    if planned.out:
        note(f"{label} was {planned.out}")
    if launch.dry_run:
        note(f"attempt {planned.attempt} of run {args.run} runs on node(s) {', '.join(map(str, planned.nodes))}; "
             f"{label} would be sent its plan with rejoin set (one JSON line below)")
        print(json.dumps({"node_rank": args.node_rank, "host": planned.plan.host, "command": planned.call.command,
                          "plan": json.loads(planned.plan.to_json())}), flush=True)
        return EXIT_OK
    result = rejoin.rejoin_node(launch, planned)
    if not result.ok:
        print(result.describe_failure(), file=sys.stderr, flush=True)
        return EXIT_NODE_FAILED
    print(f"{label} joining run {args.run} (supervisor pid {result.value.supervisor_pid}; log {result.value.log}): node 0 "
          "takes it at its next restart, after every rank saves a checkpoint at its next step; status: "
          f"status_training.sh {args.run}", flush=True)
    return EXIT_OK


def require_run(launch: LaunchEnv, run: str) -> RunPaths:
    paths = RunPaths(launch.artifact_root, run)
    if not paths.exists():
        known = runs_under(launch.artifact_root)
        raise UserError(f"no run {run!r} under ARTIFACT_ROOT={launch.artifact_root}; "
                        + (f"runs there: {', '.join(known)}" if known else "no run was started there")
                        + " (give the run name a start printed, or set ARTIFACT_ROOT to where it ran)")
    return paths


def cmd_status(args, launch: LaunchEnv) -> int:
    if not args.this_node:
        require_run(launch, args.run)
    submitted = kubernetes.submission_of(launch, args.run, args.this_node)
    report = kubernetes.collect_status(launch, args.run) if submitted else control.collect_status(launch, args.run, args.this_node)
    if submitted and not args.json:
        print(f"{describe_submission(submitted)}:\n" + "\n".join(kubernetes.kubectl_view(launch, submitted)), flush=True)
    if report.job:
        print(f"slurm job {report.job}: {report.job_state}" if not args.json else
              json_line({"slurm_job": report.job, "state": report.job_state}), flush=True)
    if (report.job or submitted or backend_for(launch).records_only) and not args.json:  # the records each node writes, read here
        print(f"(the nodes as their records under {launch.artifact_root / 'run_state'} show them here; a shared "
              "file system may show another node's record up to a minute late)", flush=True)
        beats = ", ".join(f"node{r.node_rank} {r.value.beat}" for r in report.nodes if r.ok and r.value.beat is not None)
        if beats:  # one status cannot tell a supervisor gone without a record from a live one; two can
            print(f"(heartbeat records' counters: {beats}; each goes up every {HEARTBEAT_S:.0f} s while its "
                  "supervisor lives: the same number in a status two minutes later means it has stopped)", flush=True)
    if args.json:
        for r in report.nodes:
            print(json_line(r.value) if r.ok else json_line({"node_rank": r.node_rank, "host": r.host,
                                                             "error": r.describe_failure()}))
        return EXIT_OK if report.ok else EXIT_NODE_FAILED
    print(f"{'node':<5} {'host':<16} {'state':<11} {'pid':>8} {'iteration':>11} {'tokens/s':>10}  last log line")
    for r in report.nodes:
        if not r.ok:
            print(r.describe_failure())
            continue
        p = r.value
        it = f"{p.last_iteration}/{p.train_iters}" if p.last_iteration is not None else "-"
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s is not None else "-"
        print(f"{p.node_rank:<5} {p.host:<16} {p.state.value:<11} {p.pid or '-':>8} {it:>11} {tps:>10}  {p.last_line}")
    for line in describe_attempts(report):
        print(line)
    goodput = read_goodput(RunPaths(launch.artifact_root, args.run))  # the ledger and node 0's lines (docs/faults.md#goodput)
    if goodput is not None:
        print(format_goodput_line(goodput))
    slow = next((r.value.slow_ranks for r in report.nodes if r.ok and r.value.slow_ranks), None)
    if slow:
        print(slow)
    paths = RunPaths(launch.artifact_root, args.run)
    checkpoints = format_checkpoint_line(check_run_checkpoints(paths, sizes_only=True), moved_aside(paths))
    if checkpoints:
        print(checkpoints)
    if report.failure:
        print(f"run failed: {report.failure} (details: {paths.failure_file})")
    return EXIT_OK if report.ok else EXIT_NODE_FAILED


def cmd_logs(args, launch: LaunchEnv) -> int:
    """``logs RUN [-f] [--node N] [--rank R] [--since T] [--grep P] [-n N] [--via-nodes]``: every node's
    log merged in time order (orchestration/runner/node_logs.py); DRY_RUN=1: where each is read."""
    require_run(launch, args.run)
    plan = plan_logs(launch, args.run, node=args.node, rank=args.rank, since=args.since, grep=args.grep, lines=args.lines,
                     follow=args.follow, via_nodes=args.via_nodes)
    if launch.dry_run:
        print("\n".join(plan.to_json_lines()), flush=True)
        return EXIT_OK
    failed = False
    try:
        for item in read_logs(launch, plan):
            if isinstance(item, NodeProblem):
                failed = True
                print(f"error: {item.describe()}", file=sys.stderr, flush=True)
            else:
                print(item, flush=args.follow)
    except KeyboardInterrupt:  # the way out of --follow
        pass
    except BrokenPipeError:  # | head: nothing more to print, and nothing at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_NODE_FAILED if failed else EXIT_OK


def describe_attempts(report: control.StatusReport) -> list[str]:
    """``attempt 3 of 4``, on how many of the nodes, and why each earlier attempt ended (and which
    nodes it lost)."""
    if not report.attempts or (len(report.attempts) == 1 and (report.max_attempts or 1) == 1):
        return []
    hosts = {r.node_rank: r.host for r in report.nodes}
    current = report.attempts[-1]
    of = f" of {report.max_attempts}" if report.max_attempts else ""
    on = (f" on {len(current.nodes)} of {len(hosts)} nodes" if current.nodes and len(current.nodes) < len(hosts) else "")

    def names(nodes) -> str:
        return ", ".join(f"{n} ({hosts.get(n, '?')})" for n in nodes)

    back = f"; node(s) {names(current.joined)} back" if current.joined else ""
    lines = [f"attempt {current.attempt}{of}{on}" + (f": {current.state}" if current.state else ": running") + back]
    for r in report.attempts[:-1]:
        checkpoints = f" (checkpoint {r.checkpoint_at_start if r.checkpoint_at_start is not None else '-'} -> " \
                      f"{r.checkpoint_at_end if r.checkpoint_at_end is not None else '-'})"
        lost = f"; lost node(s) {names(r.lost)}" if r.lost else ""
        joined = f"; node(s) {names(r.joined)} back" if r.joined else ""
        left_out = f"; {r.exclusion}" if r.exclusion else ""  # the evidence against a node: who was left out, or why not
        lines.append(f"  attempt {r.attempt} {r.state or 'ended'}{checkpoints}{joined}{lost}{left_out}: {r.reason}")
    return lines


def json_line(value) -> str:
    return json.dumps(value) if isinstance(value, dict) else encode_payload(value)


# -- submit ---------------------------------------------------------------------------------------

def cmd_submit(args, launch: LaunchEnv) -> int:
    """sbatch a batch script that runs the start inside the job (srun transport) and waits for it;
    with --kubernetes, the run as a JobSet (:func:`cmd_submit_kubernetes`)."""
    check_submit_options(args)
    if args.kubernetes:
        return cmd_submit_kubernetes(args, launch)
    plan = plan_submit(launch, args.model, args.data, args.run, args.nodes, args.gpus_per_node, args.time,
                       args.partition, args.account, args.signal_ahead_s)
    if launch.dry_run:
        print(plan.script, end="", flush=True)
        note(f"DRY_RUN=1: nothing submitted; the batch script above would be written to {plan.script_path} and sbatched")
        return EXIT_OK
    job = submit_batch(launch, plan)
    r = plan.request
    print(f"submitted slurm job {job} for run {args.run}: {r.nodes} node(s) x {r.nproc_per_node} processes; batch script "
          f"{plan.script_path}; status: status_training.sh {args.run}; stop: {stop_command(args.run, True)}", flush=True)
    return EXIT_OK


KUBERNETES_OPTIONS = ("image", "namespace", "volume_claim", "queue", "rdma", "max_restarts", "termination_grace_s", "shm_size",
                      "exclusive_topology", "secret", "trainjob", "python", "workdir", "apply")
SLURM_OPTIONS = ("time", "partition", "account", "signal_ahead_s")


def check_submit_options(args) -> None:
    """Slurm's options with --kubernetes, or Kubernetes' without it: one error naming them."""
    defaults = {"max_restarts": DEFAULT_MAX_RESTARTS, "termination_grace_s": DEFAULT_TERMINATION_GRACE_S,
                "signal_ahead_s": slurm.DEFAULT_SIGNAL_AHEAD_S}
    wrong = [name for name in (SLURM_OPTIONS if args.kubernetes else KUBERNETES_OPTIONS)
             if getattr(args, name) not in (None, False, defaults.get(name))]
    if wrong:
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        raise UserError(f"{flags} {'are' if len(wrong) > 1 else 'is'} for "
                        + ("a Slurm batch job, not --kubernetes; leave them out" if args.kubernetes else
                           "--kubernetes; add --kubernetes, or leave them out for a Slurm batch job"))


def cmd_submit_kubernetes(args, launch: LaunchEnv) -> int:
    """``submit MODEL DATA RUN --kubernetes --image I --volume-claim C ...``: the run's node plans as a
    JobSet (or a TrainJob); printed, or with --apply applied through kubectl (DRY_RUN=1: printed only)."""
    request = KubernetesRequest(image=args.image or "", volume_claim=args.volume_claim or "", namespace=args.namespace,
                                queue=args.queue, gpus_per_node=args.gpus_per_node or 0, rdma_resource=parse_rdma(args.rdma),
                                max_restarts=args.max_restarts, termination_grace_s=args.termination_grace_s,
                                shm_size=args.shm_size, exclusive_topology=args.exclusive_topology, secret_name=args.secret,
                                trainjob=args.trainjob)
    apply = args.apply and not launch.dry_run
    planned = kubernetes.plan_kubernetes(launch, args.model, args.data, args.run, request, args.nodes, args.python,
                                         args.workdir, apply=apply)
    for text in planned.notes:
        note(text)
    manifest = planned.manifest
    if not apply:
        print(manifest.to_yaml(), end="", flush=True)
        note(f"{'DRY_RUN=1: ' if launch.dry_run else ''}nothing applied or written; --apply runs kubectl apply -f - with "
             "this manifest" + (f" (and the Secret {manifest.secret_name} before it)" if manifest.secret_name else ""))
        return EXIT_OK
    submission, notes = kubernetes.apply_kubernetes(launch, planned)
    for text in notes:
        note(text)
    print(f"applied {describe_submission(submission)} for run {args.run}: {len(planned.plan.nodes)} pod(s) x "
          f"{planned.launch.nproc_per_node} processes; status: status_training.sh {args.run}; stop (every pod saves "
          f"first): {stop_command(args.run, True)}", flush=True)
    return EXIT_OK


# -- compare, sweep, plan-memory --------------------------------------------------------------------

def _check_warmup(warmup: int) -> int:
    if warmup < 0:
        raise UserError(f"--warmup {warmup} must be >= 0")
    return warmup


def cmd_compare(args, launch: LaunchEnv) -> int:
    """``compare RUN... [--name N] [--warmup K]``: the table, and the PNG, JSON and CSV."""
    for run in args.runs:
        check_run_name(run)
    name = comparison_name(args.runs, args.name)
    rows = compare_runs(launch.artifact_root, args.runs, _check_warmup(args.warmup))
    files = write_comparison(launch.artifact_root, name, rows)
    print(format_comparison(rows))
    print(describe_files(files), flush=True)
    return EXIT_OK


class LiveLine:
    """The sweep's progress: one updating line on a terminal, final lines only in a log."""

    def __init__(self, out=sys.stdout):
        self.out, self.live = out, out.isatty()

    def __call__(self, text: str, final: bool) -> None:
        if self.live:
            self.out.write("\r\033[K" + text + ("\n" if final else ""))
            self.out.flush()
        elif final:
            print(text, file=self.out, flush=True)


def cmd_sweep(args, launch: LaunchEnv) -> int:
    """``sweep MODEL DATA PREFIX [--stages 0,1]`` (STAGES from the environment otherwise)."""
    stages = parse_stages(args.stages, "--stages") if args.stages else parse_stages(launch.stages_text)
    warmup = _check_warmup(args.warmup)
    prefix = args.prefix
    if launch.dry_run:
        for stage, run, plan in plan_sweep(launch, args.model, args.data, prefix, stages).stages:
            note(f"stage {stage}: {run}")
            for text in plan.notes:
                note(text)
            for line in plan.to_json_lines():
                print(line, flush=True)
        return EXIT_OK
    iterations = check_sweep(launch, args.model, args.data, prefix, stages)
    runs = ", ".join(stage_run_name(prefix, s) for s in stages)
    print(f"sweep {prefix}: {args.model} on {args.data}, ZeRO stages {','.join(map(str, stages))} as {runs}; "
          f"{launch.nnodes} node(s) x {launch.nproc_per_node} processes, {iterations} iterations each; stop: Ctrl-C or "
          f"{stop_command(prefix, launch.nnodes > 1)}", flush=True)
    if launch.zero_stage is not None:
        print(f"note: ZERO_STAGE={launch.zero_stage} is ignored: the sweep sets each stage (STAGES picks them)")
    result: SweepResult = run_sweep(launch, args.model, args.data, prefix, stages, LiveLine(), warmup)
    print("")
    print(format_comparison(list(result.rows)))
    print(describe_files(result.files), flush=True)
    if result.stopped:
        return EXIT_STOPPED
    return EXIT_OK if result.all_finished else EXIT_NODE_FAILED


def cmd_plan_memory(args, launch: LaunchEnv) -> int:
    """``plan-memory MODEL [DATA]``: the plan for NNODES x NPROC_PER_NODE GPUs (or the options)."""
    request = MemoryRequest(**{k: getattr(args, k) for k in MemoryRequest.__dataclass_fields__})
    plan = plan_memory_request(request, launch.nnodes, launch.nproc_per_node, launch.gpu_memory_gb_text)
    print(plan.to_json() if args.json else format_memory_plan(plan), flush=True)
    return EXIT_OK


def cmd_check_checkpoints(args, launch: LaunchEnv) -> int:
    """``check-checkpoints RUN [--sizes]``: every checkpoint of the run, verified or damaged."""
    paths = require_run(launch, args.run)
    report, resolved = check_run_checkpoints(paths, args.sizes), read_resolved(paths.params_path)
    covered = f"\n(checksums: {engine_named(resolved and resolved.runtime.engine).checksums})" if report.checkpoints else ""
    print(format_checkpoint_report(report) + covered, flush=True)
    return EXIT_OK if report.loadable or not report.checkpoints else EXIT_NODE_FAILED


# -- import-megatron-args -------------------------------------------------------------------------

def cmd_import_megatron_args(args, launch: LaunchEnv) -> int:
    """``import-megatron-args FILE... --model-out M.yaml --data-out D.yaml``: Megatron-LM argument files
    -> a model preset and a data set (orchestration/import_args/); DRY_RUN=1 or --dry-run prints both
    and writes nothing."""
    dry_run = args.dry_run or launch.dry_run
    outputs = check_outputs(args.model_out, args.data_out, args.force, dry_run)
    result = import_arg_files(args.files, args.var, args.megatron_lm_dir or launch.megatron_lm_dir)
    texts = imported_yaml(result)
    print(render_report(result), end="", flush=True)
    if dry_run:
        for path, text in zip(outputs, texts):
            print(f"--- {path} (dry run: not written)\n{text}", end="")
        return EXIT_OK
    write_outputs(outputs, texts)
    for path in outputs:
        print(f"wrote {path}")
    return EXIT_OK


# -- export-hf ------------------------------------------------------------------------------------

def cmd_export(args, launch: LaunchEnv) -> int:
    """``export-hf RUN OUT_DIR [--iteration N]`` (a Hugging Face model directory) and
    ``export-megatron-lm RUN SAVE_DIR`` (a Megatron-LM --save folder): a checkpoint of the run,
    written by megatron_ext/export_hf.py or export_megatron_lm.py in a child process (the launcher
    imports no torch); DRY_RUN=1 prints that command."""
    require_run(launch, args.run)
    argv = export_argv(launch, args.run, Path(args.out), args.iteration, args.force, args.command.removeprefix("export-"))
    if launch.dry_run:
        print(shlex.join(argv), flush=True)
        return EXIT_OK
    return run_export(launch, argv)


# -- the parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m orchestration", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug lines on standard error (LOG_LEVEL=DEBUG)")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a run on every node (or --this-node), detached")
    start.add_argument("model"), start.add_argument("data"), start.add_argument("run")
    start.add_argument("--this-node", action="store_true", help="only this machine, as node NODE_RANK")
    start.add_argument("--wait", action="store_true", help="stay until the run ends; exit 0 if every node finished, "
                       "3 if it saved and ended on request, 93 if the restart breaker gave up; SIGUSR1 meanwhile asks "
                       "every node to save and end")
    start.add_argument("--requeue", action="store_true", help="with --wait inside a Slurm batch job: after SIGUSR1 "
                       "and the save, requeue the job (submit_training.sh's batch script passes it)")
    start.add_argument("--signal-file", type=Path, help="with --wait: a file whose appearance means SIGUSR1 (the "
                       "batch shell's trap writes it)")
    stop = sub.add_parser("stop", help="stop a run on every node (or --this-node); DRY_RUN=1: what it would signal")
    stop.add_argument("run")
    stop.add_argument("--this-node", action="store_true")
    stop.add_argument("--grace-s", type=float, default=DEFAULT_STOP_GRACE_S, help="wait after SIGTERM before the sweep")
    stop.add_argument("--save", action="store_true", help="first save a checkpoint at the next step on every rank "
                      "(the run ends preempted; a start resumes there), then stop what is left")
    stop.add_argument("--save-timeout-s", type=float, default=SAVE_TIMEOUT_S,
                      help=f"how long to wait for the save before stopping anyway (default {SAVE_TIMEOUT_S:g})")
    status = sub.add_parser("status", help="per node: alive, pid, last iteration, tokens/s, last log line")
    status.add_argument("run")
    status.add_argument("--this-node", action="store_true")
    status.add_argument("--json", action="store_true", help="one JSON object per node")
    logs = sub.add_parser("logs", help="every node's log merged in time order, each line named [node host rank], "
                                       "lines many ranks print alike shown once")
    logs.add_argument("run")
    logs.add_argument("-f", "--follow", action="store_true", help="go on printing as the logs grow, until the run has "
                      "ended (or Ctrl-C); starts with the last 20 lines unless -n or --since says otherwise")
    logs.add_argument("--node", type=int, help="this node's log only")
    logs.add_argument("--rank", type=int, help="the lines that name this global rank only (torch's [rankN]:, error: rank "
                      "N:); lines that name no rank are left out")
    logs.add_argument("--since", help="from this time on: a span back from now (30s, 10m, 2h, 1d) or a time in the "
                      "nodes' local time (2026-12-06 08:20, 08:20 for today)")
    logs.add_argument("--grep", metavar="PATTERN", help="the lines whose text matches this regular expression")
    logs.add_argument("-n", "--lines", type=int, help="the last N lines (of what the filters keep; read back from "
                      "each log's end)")
    logs.add_argument("--via-nodes", action="store_true", help="read each log on its node over its transport (ssh, "
                      "docker exec, srun), not through the shared file system (which may show another node's lines "
                      "up to a minute late)")
    back = sub.add_parser("rejoin", help="bring a node back to a run that went on without it (NNODES=MIN:MAX): node 0 "
                                         "takes it at its next restart; DRY_RUN=1: the checks and what it would send")
    back.add_argument("run")
    back.add_argument("node_rank", type=int, help="the node's rank in the run's start (its place in HOSTS)")
    back.add_argument("--host", help="a replacement machine in the node's place (default: the host the start recorded)")
    train = sub.add_parser("train", help="train in the foreground on this node (torchrun with a fixed node rank)")
    train.add_argument("model"), train.add_argument("data"), train.add_argument("run", nargs="?")
    submit = sub.add_parser("submit", help="sbatch a job that runs MODEL DATA RUN on its nodes and waits for it, or "
                                           "with --kubernetes render it as a JobSet; DRY_RUN=1: print the batch script "
                                           "or the manifest")
    submit.add_argument("model"), submit.add_argument("data"), submit.add_argument("run")
    submit.add_argument("--nodes", type=int, help="nodes (default NNODES, 1)")
    submit.add_argument("--gpus-per-node", type=int, help="GPUs (and processes) per node (default: CPUs, NPROC_PER_NODE)")
    submit.add_argument("--time", help="time limit (default SBATCH_TIMELIMIT, else the partition's)")
    submit.add_argument("--partition", help="partition (default SBATCH_PARTITION, else the cluster's default)")
    submit.add_argument("--account", help="account (default SBATCH_ACCOUNT)")
    submit.add_argument("--signal-ahead-s", type=int, default=slurm.DEFAULT_SIGNAL_AHEAD_S,
                        help=f"save this long before the time limit and requeue (default {slurm.DEFAULT_SIGNAL_AHEAD_S}; "
                             "0: no save, no requeue)")
    k8s = submit.add_argument_group("Kubernetes (docs/kubernetes.md)")
    k8s.add_argument("--kubernetes", action="store_true", help="render the run as a JobSet of --nodes pods (printed; "
                     "--apply: kubectl apply)")
    k8s.add_argument("--image", help="the container image with this project (required)")
    k8s.add_argument("--volume-claim", help="a ReadWriteMany PersistentVolumeClaim, mounted at ARTIFACT_ROOT (required)")
    k8s.add_argument("--namespace", help="default: kubectl's context's")
    k8s.add_argument("--queue", help="Kueue LocalQueue (label kueue.x-k8s.io/queue-name)")
    k8s.add_argument("--rdma", metavar="RESOURCE=COUNT", help="an RDMA device resource per pod, e.g. rdma/ib=1")
    k8s.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, help="JobSet failurePolicy.maxRestarts: "
                     f"recreations of every pod after one ended failed (default {DEFAULT_MAX_RESTARTS})")
    k8s.add_argument("--termination-grace-s", type=int, default=DEFAULT_TERMINATION_GRACE_S, help="the pods' "
                     "terminationGracePeriodSeconds: SIGTERM saves at the next step, SIGKILL after this (default "
                     f"{DEFAULT_TERMINATION_GRACE_S})")
    k8s.add_argument("--shm-size", help="sizeLimit of the memory-backed /dev/shm (e.g. 64Gi; default: none)")
    k8s.add_argument("--exclusive-topology", metavar="NODE_LABEL", help="every pod in one domain of this node label, "
                     "alone there (alpha.jobset.sigs.k8s.io/exclusive-topology)")
    k8s.add_argument("--secret", help="the Secret the secret variables are read from (default <name>-secrets)")
    k8s.add_argument("--trainjob", metavar="RUNTIME", help="a Kubeflow Trainer v2 TrainJob on this "
                     "ClusterTrainingRuntime instead of a JobSet")
    k8s.add_argument("--python", help="the image's interpreter (default: this launcher's)")
    k8s.add_argument("--workdir", help="this project's directory in the image (default: this one's)")
    k8s.add_argument("--apply", action="store_true", help="kubectl apply -f - the manifest (and the Secret first)")
    preflight = sub.add_parser("preflight", help="the start's checks on every node, nothing started")
    preflight.add_argument("model"), preflight.add_argument("data"), preflight.add_argument("run")
    preflight.add_argument("--this-node", action="store_true")
    warmup = dict(type=int, default=DEFAULT_WARMUP_ITERATIONS,
                  help=f"iterations left out of the medians (default {DEFAULT_WARMUP_ITERATIONS})")
    compare = sub.add_parser("compare", help="side-by-side table of runs: speed, memory, loss")
    compare.add_argument("runs", nargs="+")
    compare.add_argument("--name", help="files under $ARTIFACT_ROOT/compare/NAME.{png,json,csv} (default the runs joined by _vs_)")
    compare.add_argument("--warmup", **warmup)
    sweep = sub.add_parser("sweep", help="train MODEL on DATA under each ZeRO stage (STAGES, default 0-3) as "
                                         "PREFIX_z<stage>, one after another, then compare them")
    sweep.add_argument("model"), sweep.add_argument("data"), sweep.add_argument("prefix")
    sweep.add_argument("--stages", help="comma list of stages (default $STAGES, else 0,1,2,3)")
    sweep.add_argument("--warmup", **warmup)
    p = sub.add_parser("plan-memory", help="memory and data-parallel traffic per GPU for each ZeRO stage, on paper")
    p.add_argument("model", help="model preset under params/models (or a YAML path)")
    p.add_argument("data", nargs="?", help="data set (sequence, micro batch, vocabulary, global batch); optional")
    p.add_argument("--gpus", type=int, help="data-parallel GPUs in all (default NNODES x NPROC_PER_NODE)")
    p.add_argument("--nnodes", type=int, help="default NNODES")
    p.add_argument("--nproc-per-node", type=int, help="default NPROC_PER_NODE")
    p.add_argument("--device", choices=sorted(DEVICES), help=f"device kind (default {DEFAULT_DEVICE}; cpu = fp32 CPU path)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GB (default $GPU_MEMORY_GB, else the device's)")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="fraction of memory kept free (default 0.1)")
    p.add_argument("--bus-bandwidth-gbs", type=float, default=DEFAULT_BUS_BANDWIDTH_GBS,
                   help=f"data-parallel bus bandwidth, GB/s (default {DEFAULT_BUS_BANDWIDTH_GBS:g}: 4x8 H100 all-reduce)")
    p.add_argument("--seq-length", type=int, help="tokens per sequence, at most the model's max_position_embeddings (default the data "
                   "set's, else 4096 or the model's positions where fewer)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default the data set's, else 1)")
    p.add_argument("--vocab-size", type=int, help="unpadded vocabulary (default the preset's, else the data set's)")
    p.add_argument("--grad-reduce-in-bf16", action="store_true", default=None,
                   help="reduce gradients in bf16 (default the data set's training.grad_reduce_in_bf16)")
    p.add_argument("--json", action="store_true", help="the plan as one JSON object")
    imp = sub.add_parser("import-megatron-args", help="Megatron-LM argument files (shell arrays or a pretrain_gpt.py "
                         "command line) -> a model preset and a data set YAML; lists every flag without a counterpart")
    imp.add_argument("files", nargs="+", help="shell files, read in order like sourcing them (later ones override)")
    imp.add_argument("--model-out", required=True, help="the model preset to write (.yaml)")
    imp.add_argument("--data-out", required=True, help="the data set to write (.yaml: data and training)")
    imp.add_argument("--megatron-lm-dir", help="read the flags from this checkout (default $MEGATRON_LM_DIR, else "
                     "Megatron-LM core_v0.16.1's flag table)")
    imp.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                     help="a variable the files use but do not set, or a script argument (5=/data/x_text_document)")
    imp.add_argument("--force", action="store_true", help="overwrite existing outputs")
    imp.add_argument("--dry-run", action="store_true", help="print both YAML files and the list, write nothing (DRY_RUN=1)")
    check = sub.add_parser("check-checkpoints", help="every checkpoint of RUN, verified against the checksums recorded "
                           "when it was written, or damaged (which file, how)")
    check.add_argument("run")
    check.add_argument("--sizes", action="store_true", help="compare sizes only (quick: no file read)")
    for name, what in (("export-hf", "a Hugging Face model directory: config.json, safetensors, generation_config.json, "
                                      "the tokenizer"),
                       ("export-megatron-lm", "a Megatron-LM --save folder (torch_dist, weights only) that "
                                              "--pretrained-checkpoint and training.init_checkpoint start from")):
        export = sub.add_parser(name, help=f"a checkpoint of RUN (any stage, any data-parallel size) as {what}")
        export.add_argument("run"), export.add_argument("out", help="the directory to write")
        export.add_argument("--iteration", type=int, help="the checkpoint's iteration (default: the latest)")
        export.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    return parser


COMMANDS = {"start": cmd_start, "stop": cmd_stop, "rejoin": cmd_rejoin, "status": cmd_status, "logs": cmd_logs, "train": cmd_train,
            "preflight": cmd_preflight, "submit": cmd_submit, "compare": cmd_compare, "sweep": cmd_sweep, "plan-memory": cmd_plan_memory,
            "import-megatron-args": cmd_import_megatron_args, "export-hf": cmd_export, "export-megatron-lm": cmd_export,
            "check-checkpoints": cmd_check_checkpoints}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        launch = launch_env_from_process(slurm.expand_nodelist)
        configure_logging("DEBUG" if args.verbose else launch.log_level)
        if getattr(args, "run", None) is not None:
            check_run_name(args.run)
        return COMMANDS[args.command](args, launch)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
