"""python -m orchestration logs demo --since 10m --follow     # DRY_RUN=1: where each node's log is read"""

import os
import sys

from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, EXIT_OK
from orchestration.launch_env import LaunchEnv
from orchestration.runner.node_logs import NodeProblem, plan_logs, read_logs
from orchestration.runner.nodes import require_run

HELP = "every node's log merged in time order, each line named [node host rank], lines many ranks print alike shown once"


def add_arguments(parser) -> None:
    parser.add_argument("run")
    parser.add_argument("-f", "--follow", action="store_true", help="go on printing as the logs grow, until the run has "
                        "ended (or Ctrl-C); starts with the last 20 lines unless -n or --since says otherwise")
    parser.add_argument("--node", type=int, help="this node's log only")
    parser.add_argument("--rank", type=int, help="the lines that name this global rank only (torch's [rankN]:, error: rank "
                        "N:); lines that name no rank are left out")
    parser.add_argument("--since", help="from this time on: a span back from now (30s, 10m, 2h, 1d) or a time in the "
                        "nodes' local time (2026-12-06 08:20, 08:20 for today)")
    parser.add_argument("--grep", metavar="PATTERN", help="the lines whose text matches this regular expression")
    parser.add_argument("-n", "--lines", type=int, help="the last N lines (of what the filters keep; read back from "
                        "each log's end)")
    parser.add_argument("--via-nodes", action="store_true", help="read each log on its node over its transport (ssh, "
                        "docker exec, srun), not through the shared file system (which may show another node's lines "
                        "up to a minute late)")


def run(args, launch: LaunchEnv) -> int:
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
