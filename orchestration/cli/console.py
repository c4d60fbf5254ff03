"""What several launcher commands print, and how: logging (notes and warnings on standard error,
each prefixed), the problem table, and a planned start's notes, its dry run and its start (start,
train and preflight)."""

import logging
import sys
from typing import Sequence

from orchestration.launch_env import LaunchEnv
from orchestration.runner.links import format_links
from orchestration.runner.preflight import Problem
from orchestration.runner.start import PlannedStart, StartResult, run_checks, start_run

log = logging.getLogger("orchestration")

LEVEL_PREFIX = {logging.DEBUG: "debug: ", logging.INFO: "note: ", logging.WARNING: "warning: ", logging.ERROR: "error: "}


class _PrefixFormatter(logging.Formatter):
    """``note: ...`` for INFO, ``warning: ...``, ``error: ...``, ``debug: ...``: the launcher's lines."""

    def format(self, record: logging.LogRecord) -> str:
        return LEVEL_PREFIX.get(record.levelno, "") + record.getMessage()


def configure_logging(level: str) -> None:
    """Standard error, one prefixed line per record, at ``level`` (LOG_LEVEL, or DEBUG with --verbose)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrefixFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def note(*texts: str) -> None:
    for text in texts:
        log.info(text)


def format_problems(problems: Sequence[Problem]) -> str:
    lines = [f"{'node':<5} {'host':<16} problem"]
    lines += [f"{rank:<5} {host:<16} {problem}" for rank, host, problem in problems]
    return "\n".join(lines)


def note_left_out(planned: PlannedStart) -> None:
    """NNODES=MIN:MAX: the nodes the start leaves out, why, and how to bring one back (stderr)."""
    if not planned.left_out:
        return
    nodes = sorted({(rank, host) for rank, host, _ in planned.left_out})
    total = len(planned.plan.nodes)
    note(f"left out of the start (NNODES=MIN:MAX): the run starts on {total - len(nodes)} of {total} nodes without "
         f"node(s) {', '.join(f'{r} ({h})' for r, h in nodes)}, whose preflight found:\n"
         f"{format_problems(planned.left_out)}\nonce fixed, bring one back with rejoin_multinode_training.sh "
         f"{planned.plan.run} NODE_RANK (every node saves at its next step and the run goes on with it)")


def note_links(planned: PlannedStart) -> None:
    """The checks a node could not run (GPU health it could not read), and with several nodes the
    links the preflight measured, as a table (stderr)."""
    note(*(f"node {r.node_rank} ({r.host}): {text}" for r in planned.preflight.reports for text in r.notes))
    if planned.preflight.links:
        note("links between the nodes (each node's exchanges with its ring neighbours, the run's backend):\n"
             + format_links(planned.preflight.links))


def print_plan(planned: PlannedStart, launch: LaunchEnv) -> int:
    """The dry run: the checks' notes, the plan (a header line, then one JSON line per node), and
    what a start would make of the preflight; the exit code a start would have up to there."""
    note_left_out(planned)
    note_links(planned)
    note(*run_checks(launch, planned))
    print("\n".join(planned.plan.to_json_lines()), flush=True)
    preflight = planned.preflight
    if preflight.problems and preflight.answered:
        print(f"error: preflight found {len(preflight.problems)} problem(s); a start would start nothing:\n"
              f"{format_problems(preflight.problems)}", file=sys.stderr)
    elif preflight.problems:
        note(f"the plan is unsettled: {len(preflight.problems)} node(s) did not answer the preflight (a start would "
             f"stop there):\n{format_problems(preflight.problems)}")
    return planned.dry_run_exit_code


def start_planned(launch: LaunchEnv, planned: PlannedStart) -> StartResult:
    """Start the settled plan; the preflight's refusal printed as a table, else the start's notes."""
    result = start_run(launch, planned)
    if result.refused:
        print(f"error: preflight found {len(result.preflight.problems)} problem(s); nothing was started:\n"
              f"{format_problems(result.preflight.problems)}", file=sys.stderr)
    note(*result.notes)
    return result
