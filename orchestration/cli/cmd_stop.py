"""python -m orchestration stop demo           # its Slurm job cancelled, or its Kubernetes submission deleted"""

import shlex

from orchestration.cluster.kubernetes import describe as describe_submission
from orchestration.launch_env import LaunchEnv
from orchestration.node.wire import DEFAULT_STOP_GRACE_S, StopPreview, node_label
from orchestration.runner import control
from orchestration.runner import submit_kubernetes as kubernetes

HELP = "stop a run on every node (or --this-node); DRY_RUN=1: what it would signal"
SAVE_TIMEOUT_S = 900.0
"""``stop --save``: a step, a checkpoint save and the end, with room."""


def add_arguments(parser) -> None:
    parser.add_argument("run")
    parser.add_argument("--this-node", action="store_true")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_STOP_GRACE_S, help="wait after SIGTERM before the sweep")
    parser.add_argument("--save", action="store_true", help="first save a checkpoint at the next step on every rank "
                        "(the run ends preempted; a start resumes there), then stop what is left")
    parser.add_argument("--save-timeout-s", type=float, default=SAVE_TIMEOUT_S,
                        help=f"how long to wait for the save before stopping anyway (default {SAVE_TIMEOUT_S:g})")


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


def run(args, launch: LaunchEnv) -> int:
    submitted = kubernetes.submission_of(launch, args.run, args.this_node)
    if submitted:  # its pods save on SIGTERM: a deletion is a stop --save (node/pod.py)
        deleted = kubernetes.stop_submission(launch, submitted, dry_run=launch.dry_run)
        print(f"would run: {shlex.join(deleted.argv)}" if deleted.dry_run else
              f"{describe_submission(submitted)} of run {args.run}: deleted; every pod was asked to save at its next step "
              "(SIGTERM) and has ended" if deleted.ok else
              f"error: {shlex.join(deleted.argv)} failed: {deleted.output}", flush=True)
        return deleted.exit_code
    if args.save and not launch.dry_run:
        end = control.save_and_wait(launch, args.run, args.this_node, args.save_timeout_s)
        print(f"run {args.run}: " + (end.describe() if end else
                                     f"no end within {args.save_timeout_s:.0f} s of the save request: stopping it"),
              flush=True)
    outcome = control.stop_run(launch, args.run, args.this_node, args.grace_s, dry_run=launch.dry_run)
    print_stop(outcome)
    return outcome.exit_code
