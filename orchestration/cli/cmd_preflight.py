"""python -m orchestration preflight gpt_smoke smoke demo"""

from megatron_ext.run_spec.errors import EXIT_OK
from orchestration.cli.console import format_problems, note_left_out
from orchestration.launch_env import LaunchEnv
from orchestration.runner.links import format_links
from orchestration.runner.nodes import nodes_to_start
from orchestration.runner.start import plan_settled_start, run_checks

HELP = "the start's checks on every node, nothing started"


def add_arguments(parser) -> None:
    parser.add_argument("model"), parser.add_argument("data"), parser.add_argument("run")
    parser.add_argument("--this-node", action="store_true")


def run(args, launch: LaunchEnv) -> int:
    nodes = nodes_to_start(launch, args.this_node)
    planned = plan_settled_start(launch, args.model, args.data, args.run, nodes)
    if planned.preflight.links:
        print(format_links(planned.preflight.links))
    if planned.left_out:  # NNODES=MIN:MAX: a start would go on without them; the table says why
        print(format_problems(planned.left_out))
        note_left_out(planned)
    if planned.preflight.problems:
        print(format_problems(planned.preflight.problems))
        return planned.preflight.exit_code
    for text in (*run_checks(launch, planned), *planned.plan.notes):
        print(f"note: {text}")
    left = len({rank for rank, _, _ in planned.left_out})
    print(f"preflight: no problem on {len(nodes) - left} node(s)" + (f"; {left} left out" if left else ""))
    return EXIT_OK
