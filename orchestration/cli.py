"""``python -m orchestration``: start, stop, status, train, compare (and the node-side commands).

    python -m orchestration start gpt_smoke smoke demo              # every node in HOSTS/HOSTFILE
    python -m orchestration start gpt_smoke smoke demo --this-node  # this node only (NODE_RANK)
    python -m orchestration status demo
    python -m orchestration stop demo
    python -m orchestration train gpt2 gpt2_smoke                   # foreground, this node
    python -m orchestration compare demo_z0 demo_z1 demo_z3

The environment is read here, once (:func:`orchestration.launch_env.read_launch_env`); node
commands get what they need as arguments. Exit codes: :mod:`megatron_ext.spec.errors`. The
entry point is the only place that configures output; every node command prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import uuid
from typing import Mapping, Sequence

from megatron_ext.spec.checkpoints import check_resumable, latest_iteration, read_meta
from megatron_ext.spec.errors import EXIT_NODE_FAILED, EXIT_OK, EXIT_USER_ERROR, UserError
from megatron_ext.spec.params import COLLECTIVE_TIMEOUT_S
from megatron_ext.spec.params import RunOverrides, load_run_params, with_batch_geometry
from megatron_ext.spec.resolved import read_resolved, write_resolved
from megatron_ext.spec.run_paths import RunPaths, check_run_name
from orchestration import node
from orchestration.engines import plan_program
from orchestration.fanout import DEFAULT_NODE_TIMEOUT_S, NodeResult, fan_out
from orchestration.launch_env import LaunchEnv, read_launch_env, visible_gpu_count
from orchestration.plan import NodePlan, StartPlan, build_start_plan, orchestration_argv
from orchestration.processes import DEFAULT_STOP_GRACE_S


def _launch_env(env: Mapping[str, str]) -> LaunchEnv:
    return read_launch_env(env, visible_gpu_count(env))


def _nodes(launch: LaunchEnv, this_node: bool) -> list[tuple[int, str]]:
    if this_node:
        return [(launch.node_rank, "localhost")]
    return list(enumerate(launch.hosts))


def plan_start(launch: LaunchEnv, model: str, data: str, run: str, nodes: Sequence[tuple[int, str]],
               prepare: bool) -> StartPlan:
    """Checked params for the whole cluster (world = NNODES x NPROC_PER_NODE), the program every
    rank runs (data prepared first when ``prepare``), and the plan of every node in ``nodes``."""
    check_run_name(run)
    params = load_run_params(model, data, RunOverrides(launch.zero_stage, launch.overrides.engine))
    params, geometry = with_batch_geometry(params, launch.world_size)
    paths = RunPaths(launch.artifact_root, run)
    resume_from = latest_iteration(paths.checkpoints_dir)
    notes = []
    if resume_from is not None and params.training.engine == "megatron-core":
        t = params.training
        note = check_resumable(read_meta(paths.checkpoints_dir, resume_from), launch.world_size, t.zero_stage,
                               t.global_batch_size, launch.device, paths.checkpoints_dir)
        notes += [note] if note else []
    program = plan_program(params, model, data, paths, launch, prepare=prepare)
    for note in (*program.notes, *notes):
        print(f"note: {note}", file=sys.stderr, flush=True)
    run_id = f"{run}-{uuid.uuid4().hex[:10]}"
    plan = build_start_plan(launch, params, geometry, program, run, run_id, nodes, sys.executable, os.getcwd())
    return dataclasses.replace(plan, resume_from=resume_from)


def _on_nodes(launch: LaunchEnv, nodes: Sequence[tuple[int, str]], argv_for,
              timeout_s: float = DEFAULT_NODE_TIMEOUT_S) -> list[NodeResult]:
    """Run ``python -m orchestration <argv_for(rank, host)>`` on every node, with the forwarded
    environment (the same interpreter, PATH and PYTHONPATH there)."""
    python = sys.executable
    return fan_out(launch, nodes, lambda rank, host: orchestration_argv(python, *argv_for(rank, host)),
                   launch.forwarded, os.getcwd(), timeout_s)


def _node_args(command: str, run: str, launch: LaunchEnv, *extra: str):
    return lambda rank, host: [command, run, "--node-rank", str(rank), "--host", host,
                               "--artifact-root", str(launch.artifact_root), *extra]


def _report(results: Sequence[NodeResult], describe) -> bool:
    for r in results:
        print(describe(r) if r.ok else r.describe_failure(), flush=True)
    return all(r.ok for r in results)


# -- user commands ------------------------------------------------------------------------------

def cmd_start(args, launch: LaunchEnv) -> int:
    nodes = _nodes(launch, args.this_node)
    plan = plan_start(launch, args.model, args.data, args.run, nodes, prepare=not launch.dry_run)
    if launch.dry_run:
        for node_plan in plan.nodes:
            print(node_plan.to_json(), flush=True)
        return EXIT_OK
    port_check = lambda rank, host: (  # noqa: E731
        _node_args("node-check", args.run, launch)(rank, host) + (["--master-port", str(launch.master_port)] if rank == 0 else []))
    checks = _on_nodes(launch, nodes, port_check)
    if not all(c.ok for c in checks):
        print("error: preflight failed; nothing was started:", file=sys.stderr)
        for c in checks:
            if not c.ok:
                print(f"  {c.describe_failure()}", file=sys.stderr)
        return EXIT_USER_ERROR if all(c.returncode in (0, EXIT_USER_ERROR) for c in checks) else EXIT_NODE_FAILED
    paths = RunPaths(launch.artifact_root, args.run)
    write_resolved(paths.params_path, plan.resolved)
    paths.failure_file.unlink(missing_ok=True)  # a new start begins without the last one's failure
    by_rank = {p.node_rank: p for p in plan.nodes}
    results = _on_nodes(launch, nodes, lambda rank, host: ["node-start", "--plan", by_rank[rank].to_json()])
    ok = _report(results, lambda r: f"[node{r.node_rank} {r.host}] started torchrun pid {r.payload['pid']}; log {r.payload['log']}")
    if not ok:
        started = [(r.node_rank, r.host) for r in results if r.ok]
        if started:
            print(f"stopping the {len(started)} node(s) that did start, so nothing is left running", file=sys.stderr)
            _on_nodes(launch, started, _node_args("node-stop", args.run, launch))
        return EXIT_NODE_FAILED
    t = plan.resolved.params.training
    checkpoints = RunPaths(launch.artifact_root, args.run).checkpoints_dir
    resume = (f"resuming from iteration {plan.resume_from} (for a fresh start use another RUN name or remove "
              f"{checkpoints})" if plan.resume_from is not None else "fresh start")
    print(
        f"run {args.run} started: {len(nodes)} node(s) x {launch.nproc_per_node} processes, world size "
        f"{launch.world_size}, ZERO_STAGE={t.zero_stage}, engine {t.engine}, {plan.geometry.describe()}, "
        f"{resume}, collective timeout {COLLECTIVE_TIMEOUT_S[launch.device]} s; status: status_training.sh {args.run}; "
        f"stop: {'stop_training.sh' if args.this_node else 'stop_multinode_training.sh'} {args.run}",
        flush=True,
    )
    return EXIT_OK


def cmd_stop(args, launch: LaunchEnv) -> int:
    results = _on_nodes(launch, _nodes(launch, args.this_node),
                        _node_args("node-stop", args.run, launch, "--grace-s", str(args.grace_s)),
                        timeout_s=args.grace_s + 60)

    def describe(r: NodeResult) -> str:
        p = r.payload
        if not p["ok"]:
            return f"[node{r.node_rank} {r.host}] processes still alive after SIGKILL: {p['left']}"
        if not p["was_running"] and not p["swept"]:
            return f"[node{r.node_rank} {r.host}] not running"
        extra = f"; swept {len(p['swept'])} leftover process(es)" if p["swept"] else ""
        extra += f"; SIGKILLed {p['killed']}" if p["killed"] else ""
        return f"[node{r.node_rank} {r.host}] stopped (SIGTERM to process group {p['signalled_group']}){extra}"

    ok = _report(results, describe) and all(r.payload["ok"] for r in results if r.payload)
    return EXIT_OK if ok else EXIT_NODE_FAILED


def cmd_status(args, launch: LaunchEnv) -> int:
    resolved = read_resolved(RunPaths(launch.artifact_root, args.run).params_path)
    seq = ["--seq-length", str(resolved.params.training.seq_length)] if resolved else []
    results = _on_nodes(launch, _nodes(launch, args.this_node), _node_args("node-status", args.run, launch, *seq))
    if args.json:
        for r in results:
            print(json.dumps(r.payload if r.ok else {"node_rank": r.node_rank, "host": r.host, "error": r.describe_failure()}))
        return EXIT_OK if all(r.ok for r in results) else EXIT_NODE_FAILED
    print(f"{'node':<5} {'host':<16} {'state':<11} {'pid':>8} {'iteration':>11} {'tokens/s':>10}  last log line")
    for r in results:
        if not r.ok:
            print(r.describe_failure())
            continue
        p = r.payload
        it = f"{p['last_iteration']}/{p['train_iters']}" if p["last_iteration"] is not None else "-"
        tps = f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] is not None else "-"
        print(f"{p['node_rank']:<5} {p['host']:<16} {p['state']:<11} {p['pid'] or '-':>8} {it:>11} {tps:>10}  {p['last_line']}")
    failure = next((r.payload["run_failure"] for r in results if r.ok and r.payload["run_failure"]), None)
    if failure:
        print(f"run failed: {failure} (details: {RunPaths(launch.artifact_root, args.run).failure_file})")
    return EXIT_OK if all(r.ok for r in results) else EXIT_NODE_FAILED


def cmd_train(args, launch: LaunchEnv) -> int:
    """Foreground training on this node: the same plan as start's for this node, then become
    its torchrun."""
    run = args.run or f"{args.model}_{args.data}"
    plan = plan_start(launch, args.model, args.data, run, _nodes(launch, this_node=True), prepare=not launch.dry_run)
    mine: NodePlan = plan.nodes[0]
    if launch.dry_run:
        print(mine.to_json(), flush=True)
        return EXIT_OK
    if launch.node_rank == 0:
        write_resolved(RunPaths(launch.artifact_root, run).params_path, plan.resolved)
    sys.stdout.flush()
    os.chdir(mine.cwd)
    os.execvpe(mine.argv[0], list(mine.argv), mine.process_environment(os.environ))
    return EXIT_OK  # not reached


def cmd_compare(args, launch: LaunchEnv) -> int:
    from orchestration.compare import compare_runs, format_comparison

    for run in args.runs:
        check_run_name(run)
    print(format_comparison(compare_runs(launch.artifact_root, args.runs)))
    return EXIT_OK


# -- node commands (one JSON line each; arguments only, no launcher variables) ----------------

def cmd_node(args) -> int:
    try:
        if args.command == "node-start":
            payload = node.node_start(NodePlan.from_json(args.plan), os.environ, sys.executable)
        else:
            check_run_name(args.run)
            paths = RunPaths(args.artifact_root, args.run)
            if args.command == "node-check":
                payload = node.node_check(paths, args.node_rank, args.host, args.master_port)
            elif args.command == "node-stop":
                payload = node.node_stop(paths, args.node_rank, args.host, args.grace_s)
            else:
                payload = node.node_status(paths, args.node_rank, args.host, args.seq_length)
    except UserError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return EXIT_USER_ERROR
    except node.NodeError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return EXIT_NODE_FAILED
    print(json.dumps(payload), flush=True)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m orchestration", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a run on every node (or --this-node), detached")
    start.add_argument("model"), start.add_argument("data"), start.add_argument("run")
    start.add_argument("--this-node", action="store_true", help="only this machine, as node NODE_RANK")
    stop = sub.add_parser("stop", help="stop a run on every node (or --this-node)")
    stop.add_argument("run")
    stop.add_argument("--this-node", action="store_true")
    stop.add_argument("--grace-s", type=float, default=DEFAULT_STOP_GRACE_S, help="wait after SIGTERM before the sweep")
    status = sub.add_parser("status", help="per node: alive, pid, last iteration, tokens/s, last log line")
    status.add_argument("run")
    status.add_argument("--this-node", action="store_true")
    status.add_argument("--json", action="store_true", help="one JSON object per node")
    train = sub.add_parser("train", help="train in the foreground on this node (torchrun with a fixed node rank)")
    train.add_argument("model"), train.add_argument("data"), train.add_argument("run", nargs="?")
    compare = sub.add_parser("compare", help="side-by-side table of runs: speed, memory, loss")
    compare.add_argument("runs", nargs="+")
    node_start = sub.add_parser("node-start", help=argparse.SUPPRESS)
    node_start.add_argument("--plan", required=True, help="this node's NodePlan as JSON")
    supervise = sub.add_parser("node-supervise", help=argparse.SUPPRESS)
    supervise.add_argument("--plan-file", required=True)
    for name in ("node-check", "node-stop", "node-status"):
        p = sub.add_parser(name, help=argparse.SUPPRESS)
        p.add_argument("run")
        p.add_argument("--node-rank", type=int, required=True)
        p.add_argument("--host", required=True)
        p.add_argument("--artifact-root", type=Path, required=True)
        if name == "node-check":
            p.add_argument("--master-port", type=int, help="check this port is free here (node 0)")
        if name == "node-stop":
            p.add_argument("--grace-s", type=float, default=DEFAULT_STOP_GRACE_S)
        if name == "node-status":
            p.add_argument("--seq-length", type=int, help="tokens per sequence, for tokens/s")
    return parser


COMMANDS = {"start": cmd_start, "stop": cmd_stop, "status": cmd_status, "train": cmd_train, "compare": cmd_compare}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "node-supervise":
        from orchestration.supervisor import main as supervise

        return supervise(["--plan-file", args.plan_file])
    if args.command.startswith("node-"):
        return cmd_node(args)
    try:
        if hasattr(args, "run") and args.run is not None:
            check_run_name(args.run)
        return COMMANDS[args.command](args, _launch_env(os.environ))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
