"""python -m orchestration compare demo_z0 demo_z1 demo_z3 --name demo   # + artifacts/compare/demo.{png,json,csv}"""

from megatron_ext.run_spec.errors import EXIT_OK, UserError
from megatron_ext.run_spec.run_paths import check_run_name
from orchestration.analysis.compare import DEFAULT_WARMUP_ITERATIONS, compare_runs
from orchestration.analysis.comparison_files import comparison_name, describe_files, write_comparison
from orchestration.analysis.tables import format_comparison
from orchestration.launch_env import LaunchEnv

HELP = "side-by-side table of runs: speed, memory, loss"


def add_warmup(parser) -> None:
    """``--warmup K``: compare's and the sweep's."""
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP_ITERATIONS,
                        help=f"iterations left out of the medians (default {DEFAULT_WARMUP_ITERATIONS})")


def check_warmup(warmup: int) -> int:
    if warmup < 0:
        raise UserError(f"--warmup {warmup} must be >= 0")
    return warmup


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--name", help="files under $ARTIFACT_ROOT/compare/NAME.{png,json,csv} (default the runs joined by _vs_)")
    add_warmup(parser)


def run(args, launch: LaunchEnv) -> int:
    for name in args.runs:
        check_run_name(name)
    name = comparison_name(args.runs, args.name)
    rows = compare_runs(launch.artifact_root, args.runs, check_warmup(args.warmup))
    files = write_comparison(launch.artifact_root, name, rows)
    print(format_comparison(rows))
    print(describe_files(files), flush=True)
    return EXIT_OK
