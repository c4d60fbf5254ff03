"""python -m orchestration sweep gpt_smoke smoke demo        # DRY_RUN=1: every stage's plan"""

import sys

from megatron_ext.run_spec.errors import EXIT_OK
from megatron_ext.run_spec.zero import parse_stages
from orchestration.analysis.comparison_files import describe_files
from orchestration.analysis.tables import format_comparison
from orchestration.cli.cmd_compare import add_warmup, check_warmup
from orchestration.cli.console import note
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import stop_command
from orchestration.runner.sweep import check_sweep, plan_sweep, run_sweep, stage_run_name

HELP = "train MODEL on DATA under each ZeRO stage (STAGES, default 0-3) as PREFIX_z<stage>, one after another, then compare them"


def add_arguments(parser) -> None:
    parser.add_argument("model"), parser.add_argument("data"), parser.add_argument("prefix")
    parser.add_argument("--stages", help="comma list of stages (default $STAGES, else 0,1,2,3)")
    add_warmup(parser)


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


def run(args, launch: LaunchEnv) -> int:
    stages = parse_stages(args.stages, "--stages") if args.stages else parse_stages(launch.stages_text)
    warmup = check_warmup(args.warmup)
    prefix = args.prefix
    if launch.dry_run:
        for stage, name, plan in plan_sweep(launch, args.model, args.data, prefix, stages).stages:
            note(f"stage {stage}: {name}", *plan.notes)
            print("\n".join(plan.to_json_lines()), flush=True)
        return EXIT_OK
    iterations = check_sweep(launch, args.model, args.data, prefix, stages)
    runs = ", ".join(stage_run_name(prefix, s) for s in stages)
    print(f"sweep {prefix}: {args.model} on {args.data}, ZeRO stages {','.join(map(str, stages))} as {runs}; "
          f"{launch.nnodes} node(s) x {launch.nproc_per_node} processes, {iterations} iterations each; stop: Ctrl-C or "
          f"{stop_command(prefix, launch.nnodes > 1)}", flush=True)
    if launch.zero_stage is not None:
        print(f"note: ZERO_STAGE={launch.zero_stage} is ignored: the sweep sets each stage (STAGES picks them)")
    result = run_sweep(launch, args.model, args.data, prefix, stages, LiveLine(), warmup)
    print("")
    print(format_comparison(list(result.rows)))
    print(describe_files(result.files), flush=True)
    return result.exit_code
