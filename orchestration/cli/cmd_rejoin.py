"""python -m orchestration rejoin demo 1"""

import json
import sys

from megatron_ext.run_spec.errors import EXIT_OK
from orchestration.cli.console import note
from orchestration.launch_env import LaunchEnv
from orchestration.node.wire import node_label
from orchestration.runner import rejoin
from orchestration.runner.nodes import require_run

HELP = ("bring a node back to a run that went on without it (NNODES=MIN:MAX): node 0 takes it at its next restart; "
        "DRY_RUN=1: the checks and what it would send")


def add_arguments(parser) -> None:
    parser.add_argument("run")
    parser.add_argument("node_rank", type=int, help="the node's rank in the run's start (its place in HOSTS)")
    parser.add_argument("--host", help="a replacement machine in the node's place (default: the host the start recorded)")


def run(args, launch: LaunchEnv) -> int:
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
        return result.exit_code
    print(f"{label} joining run {args.run} (supervisor pid {result.value.supervisor_pid}; log {result.value.log}): node 0 "
          "takes it at its next restart, after every rank saves a checkpoint at its next step; status: "
          f"status_training.sh {args.run}", flush=True)
    return result.exit_code
