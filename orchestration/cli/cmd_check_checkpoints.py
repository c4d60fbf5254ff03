"""python -m orchestration check-checkpoints demo"""

from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.resolved import read_resolved
from orchestration.analysis.checkpoint_health import check_run_checkpoints, format_checkpoint_report
from orchestration.launch_env import LaunchEnv
from orchestration.runner.nodes import require_run

HELP = "every checkpoint of RUN, verified against the checksums recorded when it was written, or damaged (which file, how)"


def add_arguments(parser) -> None:
    parser.add_argument("run")
    parser.add_argument("--sizes", action="store_true", help="compare sizes only (quick: no file read)")


def run(args, launch: LaunchEnv) -> int:
    paths = require_run(launch, args.run)
    report, resolved = check_run_checkpoints(paths, args.sizes), read_resolved(paths.params_path)
    covered = f"\n(checksums: {engine_named(resolved and resolved.runtime.engine).checksums})" if report.checkpoints else ""
    print(format_checkpoint_report(report) + covered, flush=True)
    return report.exit_code
