"""``python -m orchestration``: start, stop, status, train, compare (and the node-side commands).

    python -m orchestration start gpt_smoke smoke demo              # every node in HOSTS/HOSTFILE
    python -m orchestration start gpt_smoke smoke demo --this-node  # this node only (NODE_RANK)
    python -m orchestration status demo
    python -m orchestration stop demo
    python -m orchestration train gpt2 gpt2_smoke                   # foreground, this node
    python -m orchestration compare demo_z0 demo_z1 demo_z3

Exit codes: 0 ok, 1 a node failed, 2 bad input (nothing started). The entry point is the only
place that configures output; every node command prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from typing import Mapping, Sequence

from megatron_ext.artifacts import artifact_root, check_run_name
from megatron_ext.params import ParamsError, write_resolved_params
from orchestration import node
from orchestration.engines import plan_program
from orchestration.fanout import DEFAULT_NODE_TIMEOUT_S, NodeResult, fan_out
from orchestration.launch_env import LaunchEnv, read_launch_env, visible_gpu_count
from orchestration.plan import (
    build_node_plans, node_environment, orchestration_argv, render_torchrun_argv,
)

EXIT_NODE_FAILED = 1
EXIT_BAD_INPUT = 2


def _launch_env(env: Mapping[str, str]) -> LaunchEnv:
    gpus = 0 if env.get("NPROC_PER_NODE", "").strip() else visible_gpu_count(env)
    return read_launch_env(env, gpus)


def _nodes(launch: LaunchEnv, this_node: bool) -> list[tuple[int, str]]:
    if this_node:
        return [(launch.node_rank, "localhost")]
    return list(enumerate(launch.hosts))


def _env_for(launch: LaunchEnv, env: Mapping[str, str], program_env: dict[str, str | None] | None = None):
    root = str(artifact_root(env))

    def env_for(rank: int) -> dict[str, str]:
        return {**node_environment(launch, rank, program_env), "ARTIFACT_ROOT": root}

    return env_for


def _plan_run(model: str, data: str, run: str, launch: LaunchEnv, env: Mapping[str, str]):
    """Checked params, the run's paths and the program every rank runs (data prepared unless dry)."""
    params = node.validate_run(model, data, launch, env)
    paths = node.run_paths(env, run)
    return params, paths, plan_program(params, model, data, paths, env, prepare=not launch.dry_run)


def _on_nodes(launch: LaunchEnv, nodes: Sequence[tuple[int, str]], env_for, command: str, *args: str,
              extra: Sequence[str] = (), timeout_s: float = DEFAULT_NODE_TIMEOUT_S) -> list[NodeResult]:
    """Run ``python -m orchestration <command> ARGS --node-rank R --host H EXTRA`` on every node."""
    python = sys.executable
    return fan_out(
        launch, nodes,
        lambda rank, host: orchestration_argv(python, command, *args, "--node-rank", str(rank), "--host", host, *extra),
        env_for, os.getcwd(), timeout_s,
    )


def _report(results: Sequence[NodeResult], describe) -> bool:
    for r in results:
        print(describe(r) if r.ok else r.describe_failure(), flush=True)
    return all(r.ok for r in results)


# -- user commands ------------------------------------------------------------------------------

def cmd_start(args, env: Mapping[str, str]) -> int:
    check_run_name(args.run)
    launch = _launch_env(env)
    nodes = _nodes(launch, args.this_node)
    params, paths, program = _plan_run(args.model, args.data, args.run, launch, env)
    python = sys.executable
    env_for = _env_for(launch, env, program.env)
    if program.engine == "megatron-lm" and not launch.dry_run:  # Megatron-LM writes no params file of ours
        write_resolved_params(paths.params_path, params, {
            "run": paths.run, "engine": program.engine, "world_size": launch.nnodes * launch.nproc_per_node,
            "argv": list(program.argv), "env": program.env,
        })
    if launch.dry_run:
        plans = {p.node_rank: p for p in build_node_plans(launch, python, program.argv, program.env)}
        for rank, _ in nodes:
            print(json.dumps({**plans[rank].as_json(), "env": env_for(rank)}), flush=True)
        return 0
    checks = _on_nodes(launch, nodes, env_for, "node-check", args.run)
    if not all(c.ok for c in checks):
        print("error: preflight failed; nothing was started:", file=sys.stderr)
        for c in checks:
            if not c.ok:
                print(f"  {c.describe_failure()}", file=sys.stderr)
        return EXIT_BAD_INPUT if all(c.returncode in (0, EXIT_BAD_INPUT) for c in checks) else EXIT_NODE_FAILED
    run_id = f"{args.run}-{uuid.uuid4().hex[:10]}"
    results = _on_nodes(launch, nodes, env_for, "node-start", args.model, args.data, args.run, extra=("--run-id", run_id))
    ok = _report(results, lambda r: f"[node{r.node_rank} {r.host}] started torchrun pid {r.payload['pid']}; log {r.payload['log']}")
    if not ok:
        started = [(r.node_rank, r.host) for r in results if r.ok]
        if started:
            print(f"stopping the {len(started)} node(s) that did start, so nothing is left running", file=sys.stderr)
            _on_nodes(launch, started, env_for, "node-stop", args.run)
        return EXIT_NODE_FAILED
    print(
        f"run {args.run} started: {len(nodes)} node(s) x {launch.nproc_per_node} processes, world size "
        f"{launch.nproc_per_node * launch.nnodes}, ZERO_STAGE={launch.zero_stage if launch.zero_stage is not None else 'from params'}; "
        f"status: status_training.sh {args.run}; stop: "
        f"{'stop_training.sh' if args.this_node else 'stop_multinode_training.sh'} {args.run}",
        flush=True,
    )
    return 0


def cmd_stop(args, env: Mapping[str, str]) -> int:
    check_run_name(args.run)
    launch = _launch_env(env)
    results = _on_nodes(launch, _nodes(launch, args.this_node), _env_for(launch, env), "node-stop", args.run,
                        extra=("--grace-s", str(args.grace_s)), timeout_s=args.grace_s + 60)

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
    return 0 if ok else EXIT_NODE_FAILED


def cmd_status(args, env: Mapping[str, str]) -> int:
    check_run_name(args.run)
    launch = _launch_env(env)
    results = _on_nodes(launch, _nodes(launch, args.this_node), _env_for(launch, env), "node-status", args.run)
    if args.json:
        for r in results:
            print(json.dumps(r.payload if r.ok else {"node_rank": r.node_rank, "host": r.host, "error": r.describe_failure()}))
        return 0 if all(r.ok for r in results) else EXIT_NODE_FAILED
    print(f"{'node':<5} {'host':<16} {'alive':<6} {'pid':>8} {'iteration':>11} {'tokens/s':>10}  last log line")
    for r in results:
        if not r.ok:
            print(r.describe_failure())
            continue
        p = r.payload
        it = f"{p['last_iteration']}/{p['train_iters']}" if p["last_iteration"] is not None else "-"
        tps = f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] is not None else "-"
        print(f"{p['node_rank']:<5} {p['host']:<16} {'yes' if p['alive'] else 'no':<6} {p['pid'] or '-':>8} {it:>11} {tps:>10}  {p['last_line']}")
    return 0 if all(r.ok for r in results) else EXIT_NODE_FAILED


def cmd_train(args, env: Mapping[str, str]) -> int:
    """Foreground training on this node: validate, then become torchrun."""
    run = args.run or f"{args.model}_{args.data}"
    check_run_name(run)
    launch = _launch_env(env)
    params, paths, program = _plan_run(args.model, args.data, run, launch, env)
    argv = render_torchrun_argv(launch, launch.node_rank, sys.executable, program.argv)
    if launch.dry_run:
        print(json.dumps({"node_rank": launch.node_rank, "host": "localhost", "argv": argv,
                          "env": node_environment(launch, launch.node_rank, program.env)}))
        return 0
    child = node.program_environment(env, program, run, f"{run}-{uuid.uuid4().hex[:10]}", launch.node_rank, paths)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, child)
    return 0  # not reached


def cmd_compare(args, env: Mapping[str, str]) -> int:
    from orchestration.compare import compare_runs, format_comparison

    for run in args.runs:
        check_run_name(run)
    print(format_comparison(compare_runs(artifact_root(env), args.runs)))
    return 0


# -- node commands (one JSON line each) ---------------------------------------------------------

def _node_command(fn) -> int:
    try:
        print(json.dumps(fn()), flush=True)
        return 0
    except ParamsError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return EXIT_BAD_INPUT
    except node.NodeError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return EXIT_NODE_FAILED


def cmd_node(args, env: Mapping[str, str]) -> int:
    try:
        launch = _launch_env(env)
    except ParamsError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return EXIT_BAD_INPUT
    if args.command == "node-check":
        return _node_command(lambda: node.node_check(args.run, args.node_rank, args.host, launch, env))
    if args.command == "node-start":
        return _node_command(lambda: node.node_start(
            args.model, args.data, args.run, args.run_id, args.node_rank, args.host, launch, env, sys.executable, os.getcwd()))
    if args.command == "node-stop":
        return _node_command(lambda: node.node_stop(args.run, args.node_rank, args.host, env, args.grace_s))
    return _node_command(lambda: node.node_status(args.run, args.node_rank, args.host, env))


def build_parser() -> argparse.ArgumentParser:
    from orchestration.processes import DEFAULT_STOP_GRACE_S

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
    for name in ("node-check", "node-start", "node-stop", "node-status"):
        p = sub.add_parser(name, help=argparse.SUPPRESS)
        if name == "node-start":
            p.add_argument("model"), p.add_argument("data")
        p.add_argument("run")
        p.add_argument("--node-rank", type=int, required=True)
        p.add_argument("--host", required=True)
        if name == "node-start":
            p.add_argument("--run-id", required=True)
        if name == "node-stop":
            p.add_argument("--grace-s", type=float, default=DEFAULT_STOP_GRACE_S)
    return parser


COMMANDS = {"start": cmd_start, "stop": cmd_stop, "status": cmd_status, "train": cmd_train, "compare": cmd_compare}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    if args.command.startswith("node-"):
        return cmd_node(args, env)
    try:
        return COMMANDS[args.command](args, env)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
