"""python -m orchestration train gpt2 gpt2_smoke"""

import sys

from megatron_ext.run_spec.errors import EXIT_OK, EXIT_STOPPED
from megatron_ext.run_spec.run_paths import check_run_name
from orchestration.cli.console import note, print_plan, start_planned
from orchestration.launch_env import LaunchEnv
from orchestration.runner.nodes import this_node
from orchestration.runner.start import follow_until_ended, log_size, plan_settled_start

HELP = "train in the foreground on this node (torchrun with a fixed node rank)"


def add_arguments(parser) -> None:
    parser.add_argument("model"), parser.add_argument("data"), parser.add_argument("run", nargs="?")


def run(args, launch: LaunchEnv) -> int:
    """Foreground training on this node: the same settled plan as a start of this node, run by the
    node's supervisor, its log copied here until the run ends (Ctrl-C stops it)."""
    name = args.run or f"{args.model}_{args.data}"
    check_run_name(name)
    planned = plan_settled_start(launch, args.model, args.data, name, this_node(launch))
    note(*planned.plan.notes)
    if launch.dry_run:
        return print_plan(planned, launch)
    offset = log_size(planned.plan)
    result = start_planned(launch, planned)
    if not result.started:
        for r in result.nodes:
            print(r.describe_failure(), file=sys.stderr, flush=True)
        return result.exit_code
    end, interrupted = follow_until_ended(launch, result.plan, sys.stdout, offset)
    if interrupted:
        print(f"run {name}: stopped ({interrupted}); status: status_training.sh {name}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    if end.exit_code != EXIT_OK:
        print(f"run {name} ended: {end.describe()}", file=sys.stderr, flush=True)
    return end.exit_code
