"""Every command of ``python -m orchestration`` is a module of this package named after it, ``cmd_<verb>.py`` (as
torchx's ``cmd_*.py``; ``python -m orchestration VERB --help``): ``HELP`` its help (``VERBS``: one per verb; constants,
as docstrings are dropped under ``python -OO``), ``add_arguments`` its arguments, and ``run(args, launch)`` plans
(orchestration/runner/), prints the plan in a dry run, executes it, prints the typed result and returns the exit code
the result decides (``exit_code``; the codes: :mod:`megatron_ext.run_spec.errors`). What several commands print is
console.py's. The environment is read once, here at the entry (:func:`orchestration.launch_env.launch_env_from_process`),
and logging is configured here (LOG_LEVEL or ``--verbose``: notes and warnings on standard error, results on standard
output). A dry run is ``LaunchEnv.dry_run`` alone: DRY_RUN=1, or import-megatron-args' ``--dry-run``. The node
commands (``node-*``) are another program: orchestration/node/commands.py.
"""

import argparse
import sys
from dataclasses import replace
from typing import Sequence

from megatron_ext.run_spec.errors import EXIT_USER_ERROR, UserError
from megatron_ext.run_spec.run_paths import check_run_name
from orchestration.cli import (cmd_check_checkpoints, cmd_compare, cmd_export, cmd_import_megatron_args, cmd_logs,
                               cmd_plan_memory, cmd_preflight, cmd_rejoin, cmd_start, cmd_status, cmd_stop, cmd_submit,
                               cmd_sweep, cmd_train)
from orchestration.cli.console import configure_logging
from orchestration.cluster import slurm
from orchestration.launch_env import LaunchEnv, launch_env_from_process

DESCRIPTION = "``python -m orchestration``: start, stop, status, logs, rejoin, train, submit, compare, sweep, plan-memory, preflight."
COMMANDS = (cmd_start, cmd_stop, cmd_status, cmd_logs, cmd_rejoin, cmd_train, cmd_submit, cmd_preflight, cmd_compare,
            cmd_sweep, cmd_plan_memory, cmd_import_megatron_args, cmd_check_checkpoints, cmd_export)
"""The command modules, in the order --help lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m orchestration", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug lines on standard error (LOG_LEVEL=DEBUG)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        verb = command.__name__.rsplit(".cmd_", 1)[1].replace("_", "-")
        for name, text in (getattr(command, "VERBS", None) or {verb: command.HELP}).items():
            command.add_arguments(verb_parser := sub.add_parser(name, help=text))
            verb_parser.set_defaults(execute=command.run)
    return parser


def run_command(args: argparse.Namespace, launch: LaunchEnv) -> int:
    """The command ``args`` names; its ``--dry-run`` (import-megatron-args') is DRY_RUN=1."""
    return args.execute(args, replace(launch, dry_run=True) if getattr(args, "dry_run", False) else launch)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        launch = launch_env_from_process(slurm.expand_nodelist)
        configure_logging("DEBUG" if args.verbose else launch.log_level)
        if getattr(args, "run", None) is not None:
            check_run_name(args.run)
        return run_command(args, launch)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
