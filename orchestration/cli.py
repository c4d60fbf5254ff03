"""``python -m orchestration``: start, stop, status, train, compare (and the node-side commands).

    python -m orchestration start gpt_smoke smoke demo              # every node in HOSTS/HOSTFILE
    python -m orchestration start gpt_smoke smoke demo --this-node  # this node only (NODE_RANK)
    python -m orchestration status demo
    python -m orchestration stop demo
    python -m orchestration train gpt2 gpt2_smoke                   # foreground, this node
    python -m orchestration compare demo_z0 demo_z1 demo_z3 --name demo   # + artifacts/compare/demo.{png,json,csv}
    python -m orchestration sweep gpt_smoke smoke demo                 # ZERO_STAGE 0-3 one after another, then compare
    python -m orchestration plan-memory qwen3_1p7b                     # expected memory per GPU per stage
    python -m orchestration preflight gpt_smoke smoke demo             # the start's checks, nothing started

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
import time
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
from orchestration.launch_env import SOCKET_IFNAME_VARIABLES, LaunchEnv, read_launch_env, visible_gpu_count
from orchestration.plan import NodePlan, StartPlan, build_start_plan, orchestration_argv, rebuild_start_plan
from orchestration.preflight import NodeReport, cluster_problems, format_problems
from orchestration import sweep as zero_sweep
from orchestration.processes import DEFAULT_STOP_GRACE_S


def _launch_env(env: Mapping[str, str]) -> LaunchEnv:
    from orchestration import slurm

    in_allocation = bool(env.get("SLURM_JOB_ID", "").strip())
    return read_launch_env(env, visible_gpu_count(env), slurm.allocation_hosts(env) if in_allocation else None)


def _nodes(launch: LaunchEnv, this_node: bool) -> list[tuple[int, str]]:
    if this_node:
        return [(launch.node_rank, "localhost")]
    return list(enumerate(launch.hosts))


def _run_nodes(launch: LaunchEnv, run: str, this_node: bool) -> list[tuple[int, str]]:
    """The nodes a run lives on: HOSTS/HOSTFILE when given, else the hosts its start recorded."""
    if not this_node and not launch.hosts_explicit:
        resolved = read_resolved(RunPaths(launch.artifact_root, run).params_path)
        if resolved is not None:
            return list(enumerate(resolved.runtime.hosts))
    return _nodes(launch, this_node)


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

def run_preflight(launch: LaunchEnv, plan: StartPlan, nodes: Sequence[tuple[int, str]]):
    """Every check on every node in parallel (orchestration/preflight.py): (reports, problem lines,
    whether every node answered)."""
    params = plan.resolved.params
    required = [*params.data.paths, *([params.data.tokenizer.model_path] if params.data.tokenizer.model_path else [])]
    paths = RunPaths(launch.artifact_root, plan.run)
    token = paths.run_state_dir / f".preflight-{plan.run_id}"
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text(plan.run_id)
    try:
        def check(rank: int, host: str) -> list[str]:
            argv = _node_args("node-check", plan.run, launch)(rank, host) + [
                "--master-addr", launch.master_addr, "--nproc-per-node", str(launch.nproc_per_node),
                "--shared-token", str(token)]
            if launch.master_port_explicit or rank != 0:
                argv += ["--master-port", str(launch.master_port)]
            return argv + [a for p in required for a in ("--require-path", p)]

        results = _on_nodes(launch, nodes, check)
    finally:
        token.unlink(missing_ok=True)
    reports = [NodeReport(**r.payload) for r in results if r.ok and "problems" in r.payload]
    problems = cluster_problems(reports)
    problems += [(r.node_rank, r.host, r.payload["error"] if r.payload and "error" in r.payload else r.describe_failure())
                 for r in results if not (r.ok and "problems" in r.payload)]
    return reports, sorted(problems), all(r.returncode in (0, EXIT_USER_ERROR) for r in results)


def settle_after_preflight(launch: LaunchEnv, plan: StartPlan, reports) -> tuple[LaunchEnv, StartPlan, list[str]]:
    """The port node 0 picked (MASTER_PORT unset) and each node's interface to MASTER_ADDR (socket
    variables unset), applied to the plan; the notes that say so."""
    notes = []
    node0 = next((r for r in reports if r.node_rank == 0), None)
    if not launch.master_port_explicit and node0 and node0.free_port:
        launch = dataclasses.replace(launch, master_port=node0.free_port)
        notes.append(f"MASTER_PORT is not set: using {node0.free_port}, the first free port from 6000 on node 0")
    unset = [v for v in SOCKET_IFNAME_VARIABLES if v not in launch.forwarded] if launch.nnodes > 1 else []
    node_env = {}
    if unset:
        node_env = {r.node_rank: {v: r.interface for v in unset} for r in reports if r.interface}
        if node_env:
            where = ", ".join(f"node{r.node_rank} {r.interface}" for r in reports if r.interface)
            notes.append(f"{' and '.join(unset)} not set: using the interface that routes to MASTER_ADDR on each node ({where})")
    return launch, rebuild_start_plan(launch, plan, node_env), notes


def cmd_start(args, launch: LaunchEnv) -> int:
    nodes = _nodes(launch, args.this_node)
    plan = plan_start(launch, args.model, args.data, args.run, nodes, prepare=not launch.dry_run)
    if launch.dry_run:
        if not launch.master_port_explicit:
            print(f"note: MASTER_PORT is not set: a start takes the first free port from 6000 on node 0 (the dry run "
                  f"shows {launch.master_port}), and the interface that routes to MASTER_ADDR on each node when "
                  f"{' / '.join(SOCKET_IFNAME_VARIABLES)} are unset", file=sys.stderr)
        for node_plan in plan.nodes:
            print(node_plan.to_json(), flush=True)
        return EXIT_OK
    reports, problems, answered = run_preflight(launch, plan, nodes)
    if problems:
        print(f"error: preflight found {len(problems)} problem(s); nothing was started:\n{format_problems(problems)}",
              file=sys.stderr)
        return EXIT_USER_ERROR if answered else EXIT_NODE_FAILED
    launch, plan, notes = settle_after_preflight(launch, plan, reports)
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    paths = RunPaths(launch.artifact_root, args.run)
    write_resolved(paths.params_path, plan.resolved)
    paths.failure_file.unlink(missing_ok=True)  # a new start begins without the last one's failure
    if launch.transport == "srun":
        results = _start_srun_step(launch, plan, paths)
    else:
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
    resume = (f"resuming from iteration {plan.resume_from} (for a fresh start use another RUN name or remove "
              f"{paths.checkpoints_dir})" if plan.resume_from is not None else "fresh start")
    print(
        f"run {args.run} started: {len(nodes)} node(s) x {launch.nproc_per_node} processes, world size "
        f"{launch.world_size}, ZERO_STAGE={t.zero_stage}, engine {t.engine}, {plan.geometry.describe()}, "
        f"{resume}, MASTER_PORT {launch.master_port}, collective timeout {COLLECTIVE_TIMEOUT_S[launch.device]} s; "
        f"status: status_training.sh {args.run}; stop: "
        f"{'stop_training.sh' if args.this_node else 'stop_multinode_training.sh'} {args.run}",
        flush=True,
    )
    return _wait_for_end(paths, [rank for rank, _ in nodes]) if args.wait else EXIT_OK


def _start_srun_step(launch: LaunchEnv, plan: StartPlan, paths: RunPaths) -> list[NodeResult]:
    """Inside a Slurm allocation: one srun step, a task per node, each the node's supervisor; the
    srun client runs detached here. A result per node once its torchrun runs (or the step ended)."""
    from orchestration import processes, slurm
    from orchestration.supervisor import read_exit

    for node_plan in plan.nodes:
        node.write_plan_file(paths, node_plan)
    argv = slurm.srun_step_argv(launch.slurm_job_id, launch.nnodes, sys.executable, os.getcwd(), slurm.plan_file_pattern(paths))
    client = processes.start_detached(argv, dict(os.environ), os.getcwd(), paths.logs_dir / f"{plan.run}_srun.log")
    deadline = time.monotonic() + 120
    results = []
    for node_plan in plan.nodes:
        rank, pid_path = node_plan.node_rank, paths.node_pid_file(node_plan.node_rank)
        while not pid_path.exists() and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        record, ended = processes.read_pid_file(pid_path), read_exit(paths.node_exit_file(rank))
        if record and not (ended and ended.state == "failed"):
            results.append(NodeResult(rank, node_plan.host, argv, 0, {"pid": record.pid, "log": node_plan.log_path}, ""))
        else:
            why = ended.reason if ended else f"srun exited with {client.returncode}" if client.poll() is not None else "no answer"
            log = paths.logs_dir / f"{plan.run}_srun.log"
            results.append(NodeResult(rank, node_plan.host, argv, 1, None, f"{why}; see {log} and {node_plan.log_path}"))
    return results


def _wait_for_end(paths: RunPaths, ranks: Sequence[int], poll_s: float = 2.0) -> int:
    """Block until every node recorded how it ended: 0 if all finished, 1 otherwise (``start --wait``, batch jobs)."""
    from orchestration.supervisor import read_exit

    while True:
        ended = [read_exit(paths.node_exit_file(rank)) for rank in ranks]
        if all(ended):
            states = {e.state for e in ended}
            print(f"run {paths.run} ended: {', '.join(f'node{e.node_rank} {e.state}' for e in ended)}", flush=True)
            return EXIT_OK if states == {"finished"} else EXIT_NODE_FAILED
        time.sleep(poll_s)


def cmd_submit(args, launch: LaunchEnv) -> int:
    """sbatch a batch script that runs the start inside the job (srun transport) and waits for it."""
    from orchestration import slurm

    nodes = args.nodes or launch.nnodes
    nproc = args.gpus_per_node or launch.nproc_per_node
    request = slurm.BatchRequest(nodes=nodes, nproc_per_node=nproc, gpus_per_node=args.gpus_per_node or 0,
                                 time=args.time or launch.slurm_batch.get("time"),
                                 partition=args.partition or launch.slurm_batch.get("partition"),
                                 account=args.account or launch.slurm_batch.get("account"))
    job_launch = dataclasses.replace(launch, nnodes=nodes, nproc_per_node=nproc,
                                     hosts=tuple(f"slurm-node{i}" for i in range(nodes)), transport="srun")
    plan_start(job_launch, args.model, args.data, args.run, list(enumerate(job_launch.hosts)), prepare=False)  # checks only
    paths = RunPaths(launch.artifact_root, args.run)
    earlier = slurm.recorded_job(paths)
    if earlier and slurm.job_state(earlier, os.environ) in ("PENDING", "RUNNING"):
        raise UserError(f"run {args.run!r} is already submitted as slurm job {earlier}; stop it first "
                        f"(stop_multinode_training.sh {args.run}) or choose another RUN name")
    slurm.check_partition(request.partition, os.environ)
    env = {**launch.forwarded, "ARTIFACT_ROOT": str(launch.artifact_root), "NPROC_PER_NODE": str(nproc),
           "NNODES": str(nodes), **({"ZERO_STAGE": str(launch.zero_stage)} if launch.zero_stage is not None else {}),
           **({"ENGINE": launch.overrides.engine} if launch.overrides.engine else {}),
           **({"MASTER_PORT": str(launch.master_port)} if launch.master_port_explicit else {})}
    script = paths.run_state_dir / f"{args.run}.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    paths.logs_dir.mkdir(parents=True, exist_ok=True)
    script.write_text(slurm.render_batch_script(args.model, args.data, args.run, request, sys.executable, os.getcwd(),
                                                env, paths.logs_dir / f"{args.run}_sbatch.log"))
    job = slurm.submit(script, os.environ)
    slurm.record_job(paths, job, script)
    print(f"submitted slurm job {job} for run {args.run}: {nodes} node(s) x {nproc} processes; batch script {script}; "
          f"status: status_training.sh {args.run}; stop: stop_multinode_training.sh {args.run}", flush=True)
    return EXIT_OK


def cmd_preflight(args, launch: LaunchEnv) -> int:
    """The start's checks on every node, on their own: nothing is started."""
    nodes = _nodes(launch, args.this_node)
    plan = plan_start(launch, args.model, args.data, args.run, nodes, prepare=False)
    reports, problems, answered = run_preflight(launch, plan, nodes)
    if problems:
        print(format_problems(problems))
        return EXIT_USER_ERROR if answered else EXIT_NODE_FAILED
    _, _, notes = settle_after_preflight(launch, plan, reports)
    for note in notes:
        print(f"note: {note}")
    print(f"preflight: no problem on {len(nodes)} node(s)")
    return EXIT_OK


def _batch_job(launch: LaunchEnv, run: str, this_node: bool) -> str | None:
    """The Slurm batch job ``submit`` recorded for ``run``, when this command is not inside it."""
    from orchestration import slurm

    job = None if this_node or launch.hosts_explicit else slurm.recorded_job(RunPaths(launch.artifact_root, run))
    return job if job and job != launch.slurm_job_id else None


def cmd_stop(args, launch: LaunchEnv) -> int:
    from orchestration import slurm

    job = _batch_job(launch, args.run, args.this_node)
    if job:  # a batch job: Slurm ends every step of it (SIGTERM, then SIGKILL after KillWait)
        state = slurm.cancel(job, os.environ)
        print(f"slurm job {job} of run {args.run}: {state}", flush=True)
        return EXIT_OK if state in (*slurm.TERMINAL_STATES, "UNKNOWN") else EXIT_NODE_FAILED
    results = _on_nodes(launch, _run_nodes(launch, args.run, args.this_node),
                        _node_args("node-stop", args.run, launch, "--grace-s", str(args.grace_s)),
                        timeout_s=args.grace_s + 60)
    if launch.transport == "srun":  # a node srun could not reach: cancel its step instead
        from orchestration import processes

        paths = RunPaths(launch.artifact_root, args.run)
        for r in results:
            record = processes.read_pid_file(paths.node_pid_file(r.node_rank))
            if not r.ok and record and record.slurm_step and slurm.cancel_step(record.slurm_step, os.environ):
                print(f"[node{r.node_rank} {r.host}] srun could not reach it: cancelled step {record.slurm_step}", flush=True)

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
    from orchestration import slurm

    paths = RunPaths(launch.artifact_root, args.run)
    resolved = read_resolved(paths.params_path)
    seq = ["--seq-length", str(resolved.params.training.seq_length)] if resolved else []
    job = _batch_job(launch, args.run, args.this_node)
    if job:  # a batch job, seen from outside it: its state, and each node from the shared run_state files
        state = slurm.job_state(job, os.environ)
        print(f"slurm job {job}: {state}" if not args.json else json.dumps({"slurm_job": job, "state": state}), flush=True)
        ranks = range(resolved.runtime.nnodes) if resolved and state != "PENDING" else range(0)
        results = [NodeResult(rank, resolved.runtime.hosts[rank], [], 0, node.node_status(
            paths, rank, resolved.runtime.hosts[rank], resolved.params.training.seq_length, by_heartbeat=True), "")
            for rank in ranks]
    else:
        results = _on_nodes(launch, _run_nodes(launch, args.run, args.this_node), _node_args("node-status", args.run, launch, *seq))
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


# -- node commands (one JSON line each; arguments only, no launcher variables) ----------------

def cmd_node(args) -> int:
    try:
        if args.command == "node-start":
            payload = node.node_start(NodePlan.from_json(args.plan), os.environ, sys.executable)
        else:
            check_run_name(args.run)
            paths = RunPaths(args.artifact_root, args.run)
            if args.command == "node-check":
                payload = node.node_check(paths, args, visible_gpu_count(os.environ))
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
    start.add_argument("--wait", action="store_true", help="stay until the run ends; exit 0 if every node finished")
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
    submit = sub.add_parser("submit", help="sbatch a job that runs MODEL DATA RUN on its nodes and waits for it")
    submit.add_argument("model"), submit.add_argument("data"), submit.add_argument("run")
    submit.add_argument("--nodes", type=int, help="nodes (default NNODES, 1)")
    submit.add_argument("--gpus-per-node", type=int, help="GPUs (and processes) per node (default: CPUs, NPROC_PER_NODE)")
    submit.add_argument("--time", help="time limit (default SBATCH_TIMELIMIT, else the partition's)")
    submit.add_argument("--partition", help="partition (default SBATCH_PARTITION, else the cluster's default)")
    submit.add_argument("--account", help="account (default SBATCH_ACCOUNT)")
    preflight = sub.add_parser("preflight", help="the start's checks on every node, nothing started")
    preflight.add_argument("model"), preflight.add_argument("data"), preflight.add_argument("run")
    preflight.add_argument("--this-node", action="store_true")
    compare = sub.add_parser("compare", help="side-by-side table of runs: speed, memory, loss")
    compare.add_argument("runs", nargs="+")
    zero_sweep.add_commands(sub)  # sweep, plan-memory, and compare's report options
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
            p.add_argument("--master-addr", required=True)
            p.add_argument("--master-port", type=int, help="node 0: must be free; others: node 0 must answer there")
            p.add_argument("--nproc-per-node", type=int, required=True)
            p.add_argument("--shared-token", type=Path, help="a file node 0 wrote: the artifact root is shared")
            p.add_argument("--require-path", action="append", default=[], help="a data or tokenizer path the run reads")
        if name == "node-stop":
            p.add_argument("--grace-s", type=float, default=DEFAULT_STOP_GRACE_S)
        if name == "node-status":
            p.add_argument("--seq-length", type=int, help="tokens per sequence, for tokens/s")
    return parser


COMMANDS = {"start": cmd_start, "stop": cmd_stop, "status": cmd_status, "train": cmd_train, "preflight": cmd_preflight,
            "submit": cmd_submit,
            **zero_sweep.COMMANDS}


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
