"""python -m orchestration start gpt_smoke smoke demo              # every node in HOSTS/HOSTFILE
   python -m orchestration start gpt_smoke smoke demo --this-node  # this node only (NODE_RANK)"""

import sys
from pathlib import Path

from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.errors import EXIT_OK, EXIT_PREEMPTED
from megatron_ext.run_spec.params import COLLECTIVE_TIMEOUT_S
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cli.console import note, note_left_out, note_links, print_plan, start_planned
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import stop_command
from orchestration.runner import control
from orchestration.runner.nodes import nodes_to_start
from orchestration.runner.start import plan_settled_start
from orchestration.runner.submit import requeue_after_save

HELP = "start a run on every node (or --this-node), detached"


def add_arguments(parser) -> None:
    parser.add_argument("model"), parser.add_argument("data"), parser.add_argument("run")
    parser.add_argument("--this-node", action="store_true", help="only this machine, as node NODE_RANK")
    parser.add_argument("--wait", action="store_true", help="stay until the run ends; exit 0 if every node finished, "
                        "3 if it saved and ended on request, 93 if the restart breaker gave up; SIGUSR1 meanwhile asks "
                        "every node to save and end")
    parser.add_argument("--requeue", action="store_true", help="with --wait inside a Slurm batch job: after SIGUSR1 "
                        "and the save, requeue the job (submit_training.sh's batch script passes it)")
    parser.add_argument("--signal-file", type=Path, help="with --wait: a file whose appearance means SIGUSR1 (the "
                        "batch shell's trap writes it)")


def run(args, launch: LaunchEnv) -> int:
    nodes = nodes_to_start(launch, args.this_node)
    planned = plan_settled_start(launch, args.model, args.data, args.run, nodes)
    note(*planned.plan.notes)
    if launch.dry_run:
        return print_plan(planned, launch)
    note_left_out(planned)
    note_links(planned)
    result = start_planned(launch, planned)
    for r in result.nodes:
        print(f"{r.label} started torchrun pid {r.value.pid}; log {r.value.log}" if r.ok else r.describe_failure(), flush=True)
    if not result.started:
        if result.rolled_back:
            print(f"stopping the {len(result.rolled_back)} node(s) that did start, so nothing is left running", file=sys.stderr)
        return result.exit_code
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
    if end.exit_code == EXIT_PREEMPTED and args.requeue and save_signal.received and launch.slurm_job_id:
        print(requeue_after_save(launch, args.run), flush=True)
    return end.exit_code
