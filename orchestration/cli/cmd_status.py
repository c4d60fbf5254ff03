"""python -m orchestration status demo         # then its attempts, goodput, slow ranks, checkpoints"""

import json

from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.analysis.checkpoint_health import check_run_checkpoints, format_checkpoint_line, moved_aside
from orchestration.analysis.goodput import format_goodput_line, read_goodput
from orchestration.cluster.backends import backend_for
from orchestration.cluster.kubernetes import describe as describe_submission
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import HEARTBEAT_S
from orchestration.node.wire import encode_payload
from orchestration.runner import control
from orchestration.runner import submit_kubernetes as kubernetes
from orchestration.runner.nodes import require_run

HELP = "per node: alive, pid, last iteration, tokens/s, last log line"


def add_arguments(parser) -> None:
    parser.add_argument("run")
    parser.add_argument("--this-node", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per node")


def run(args, launch: LaunchEnv) -> int:
    if not args.this_node:
        require_run(launch, args.run)
    submitted = kubernetes.submission_of(launch, args.run, args.this_node)
    report = kubernetes.collect_status(launch, args.run) if submitted else control.collect_status(launch, args.run, args.this_node)
    if submitted and not args.json:
        print(f"{describe_submission(submitted)}:\n" + "\n".join(kubernetes.kubectl_view(launch, submitted)), flush=True)
    if report.job:
        print(f"slurm job {report.job}: {report.job_state}" if not args.json else
              json_line({"slurm_job": report.job, "state": report.job_state}), flush=True)
    if (report.job or submitted or backend_for(launch).records_only) and not args.json:  # the records each node writes, read here
        print(f"(the nodes as their records under {launch.artifact_root / 'run_state'} show them here; a shared "
              "file system may show another node's record up to a minute late)", flush=True)
        beats = ", ".join(f"node{r.node_rank} {r.value.beat}" for r in report.nodes if r.ok and r.value.beat is not None)
        if beats:  # one status cannot tell a supervisor gone without a record from a live one; two can
            print(f"(heartbeat records' counters: {beats}; each goes up every {HEARTBEAT_S:.0f} s while its "
                  "supervisor lives: the same number in a status two minutes later means it has stopped)", flush=True)
    if args.json:
        for r in report.nodes:
            print(json_line(r.value) if r.ok else json_line({"node_rank": r.node_rank, "host": r.host,
                                                             "error": r.describe_failure()}))
        return report.exit_code
    print(f"{'node':<5} {'host':<16} {'state':<11} {'pid':>8} {'iteration':>11} {'tokens/s':>10}  last log line")
    for r in report.nodes:
        if not r.ok:
            print(r.describe_failure())
            continue
        p = r.value
        it = f"{p.last_iteration}/{p.train_iters}" if p.last_iteration is not None else "-"
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s is not None else "-"
        print(f"{p.node_rank:<5} {p.host:<16} {p.state.value:<11} {p.pid or '-':>8} {it:>11} {tps:>10}  {p.last_line}")
    for line in describe_attempts(report):  # before the reads below, which may fail
        print(line)
    paths = RunPaths(launch.artifact_root, args.run)
    goodput = read_goodput(paths)  # the ledger and node 0's lines (docs/faults.md#goodput)
    slow = next((r.value.slow_ranks for r in report.nodes if r.ok and r.value.slow_ranks), None)
    checkpoints = format_checkpoint_line(check_run_checkpoints(paths, sizes_only=True), moved_aside(paths))
    failed = report.failure and f"run failed: {report.failure} (details: {paths.failure_file})"
    for line in (goodput and format_goodput_line(goodput), slow, checkpoints, failed):
        if line:  # each of these only where there is one
            print(line)
    return report.exit_code


def describe_attempts(report: control.StatusReport) -> list[str]:
    """``attempt 3 of 4``, on how many of the nodes, and why each earlier attempt ended (and which
    nodes it lost)."""
    if not report.attempts or (len(report.attempts) == 1 and (report.max_attempts or 1) == 1):
        return []
    hosts = {r.node_rank: r.host for r in report.nodes}
    current = report.attempts[-1]
    of = f" of {report.max_attempts}" if report.max_attempts else ""
    on = (f" on {len(current.nodes)} of {len(hosts)} nodes" if current.nodes and len(current.nodes) < len(hosts) else "")

    def names(nodes) -> str:
        return ", ".join(f"{n} ({hosts.get(n, '?')})" for n in nodes)

    back = f"; node(s) {names(current.joined)} back" if current.joined else ""
    lines = [f"attempt {current.attempt}{of}{on}" + (f": {current.state}" if current.state else ": running") + back]
    for r in report.attempts[:-1]:
        checkpoints = f" (checkpoint {r.checkpoint_at_start if r.checkpoint_at_start is not None else '-'} -> " \
                      f"{r.checkpoint_at_end if r.checkpoint_at_end is not None else '-'})"
        lost = f"; lost node(s) {names(r.lost)}" if r.lost else ""
        joined = f"; node(s) {names(r.joined)} back" if r.joined else ""
        left_out = f"; {r.exclusion}" if r.exclusion else ""  # the evidence against a node: who was left out, or why not
        lines.append(f"  attempt {r.attempt} {r.state or 'ended'}{checkpoints}{joined}{lost}{left_out}: {r.reason}")
    return lines


def json_line(value) -> str:
    return json.dumps(value) if isinstance(value, dict) else encode_payload(value)
