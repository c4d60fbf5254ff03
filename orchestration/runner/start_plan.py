"""The start plan: what every node runs, built once, printed by ``DRY_RUN=1``, executed as printed.

    DRY_RUN=1 HOSTS=node0,node1 python -m orchestration start gpt_smoke smoke demo

Plan, then execute (torchx / NeMo-Run): :func:`plan_start` checks the parameters for the whole
cluster, decides the program every rank runs and whether it resumes, and
:func:`build_start_plan` returns a :class:`StartPlan`
(the run id, and per node the host, the torchrun argv, the full environment the launcher sets
for the node's processes including the run tags, the variables it removes, the working
directory, the log and pid-file paths, the names of the secret variables, never their values). ``DRY_RUN=1`` prints each :class:`NodePlan` as one JSON
line; ``start`` (orchestration/runner/start.py) sends each node its own plan, and the node side
only checks, starts it detached and writes the pid file; ``train`` execs its node's plan in the
foreground. Pure apart from reading the params, the checkpoints' markers and (ENGINE=megatron-lm)
the checkout.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from megatron_ext.data.tokenizers import check_tokenizer
from megatron_ext.run_spec.checkpoints import check_resumable, latest_iteration, read_meta
from megatron_ext.run_spec.params import BatchGeometry, RunParams, load_run_params, with_batch_geometry
from megatron_ext.run_spec.resolved import ResolvedRun, RunRuntime
from megatron_ext.run_spec.run_paths import RunPaths, check_run_name
from orchestration.engines import ProgramPlan, plan_program
from orchestration.launch_env import LaunchEnv
from orchestration.node.attempts import first_attempt
from orchestration.node.node_plan import NODE_TAG, RUN_ID_TAG, RUN_TAG, NodePlan


@dataclass(frozen=True)
class StartPlan:
    run: str
    run_id: str
    resolved: ResolvedRun
    """Written to the run's params file at start."""
    geometry: BatchGeometry
    nodes: tuple[NodePlan, ...] = field(default_factory=tuple)
    resume_from: int | None = None
    """The iteration of the run's latest checkpoint, which the ranks will resume from."""
    program: ProgramPlan | None = None
    python: str = ""
    cwd: str = ""
    notes: tuple[str, ...] = ()
    """What the user should know about this start (how the program was checked, a reshard)."""
    first_attempt: int = 1
    """1, or the next attempt of a requeued Slurm job (its ledger continues)."""

    @property
    def continues_attempts(self) -> bool:
        return self.first_attempt > 1


def render_torchrun_argv(launch: LaunchEnv, node_rank: int, python: str, program: Sequence[str]) -> list[str]:
    """torchrun with a fixed node rank (static rendezvous: stable ranks) running ``program``
    (``-m megatron_ext.pretrain ...`` or ``pretrain_gpt.py ...``, see orchestration.engines)."""
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(launch.nnodes),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(launch.nproc_per_node),
        "--master-addr", launch.master_addr,
        "--master-port", str(launch.master_port),
        *program,
    ]


def node_environment(launch: LaunchEnv, node_rank: int, run: str, run_id: str,
                     program_env: Mapping[str, str | None]) -> tuple[dict[str, str], tuple[str, ...]]:
    """(variables set, variables removed) for every process of the run on node ``node_rank``."""
    env = {k: v for k, v in launch.forwarded.items() if k not in program_env}
    env.update({k: v for k, v in program_env.items() if v is not None})
    env.update(
        NNODES=str(launch.nnodes),
        NODE_RANK=str(node_rank),
        NPROC_PER_NODE=str(launch.nproc_per_node),
        MASTER_ADDR=launch.master_addr,
        MASTER_PORT=str(launch.master_port),
        ARTIFACT_ROOT=str(launch.artifact_root),
        PYTHONUNBUFFERED="1",
        **{RUN_TAG: run, RUN_ID_TAG: run_id, NODE_TAG: str(node_rank)},
    )
    unset = tuple(sorted(k for k, v in program_env.items() if v is None))
    return env, unset


def build_start_plan(launch: LaunchEnv, params: RunParams, geometry: BatchGeometry, program: ProgramPlan,
                     run: str, run_id: str, nodes: Sequence[tuple[int, str]], python: str, cwd: str,
                     node_env: Mapping[int, Mapping[str, str]] | None = None, first_attempt: int = 1) -> StartPlan:
    """The plan for ``nodes`` ((node rank, host) pairs) of a run of ``params`` (global batch
    already applied) running ``program``; ``node_env`` adds variables per node (e.g. the socket
    interface preflight found); ``first_attempt`` > 1 continues a requeued job's attempts."""
    paths = RunPaths(launch.artifact_root, run)
    node_plans = []
    for rank, host in nodes:
        env, unset = node_environment(launch, rank, run, run_id, program.env)
        env.update((node_env or {}).get(rank, {}))
        node_plans.append(NodePlan(
            run=run, run_id=run_id, node_rank=rank, host=host,
            argv=tuple(render_torchrun_argv(launch, rank, python, program.argv)), env=env, unset=unset, cwd=cwd,
            log_path=str(paths.node_log(rank)), pid_path=str(paths.node_pid_file(rank)), engine=program.engine,
            resilience=dataclasses.asdict(params.training.resilience), first_attempt=first_attempt,
            save_signal=program.save_signal, secret_names=tuple(sorted(launch.secrets)),
        ))
    runtime = RunRuntime(
        run=run, run_id=run_id, engine=program.engine, nnodes=launch.nnodes, nproc_per_node=launch.nproc_per_node,
        hosts=tuple(launch.hosts), gradient_accumulation_steps=geometry.accumulation_steps,
        program_argv=tuple(program.argv), program_env=dict(program.env),
    )
    return StartPlan(run, run_id, ResolvedRun(params, runtime), geometry, tuple(node_plans), program=program,
                     python=python, cwd=cwd, first_attempt=first_attempt)


def rebuild_start_plan(launch: LaunchEnv, plan: StartPlan, node_env: Mapping[int, Mapping[str, str]]) -> StartPlan:
    """``plan`` for another launch (e.g. the port preflight picked) with per-node variables; same run id."""
    nodes = [(p.node_rank, p.host) for p in plan.nodes]
    rebuilt = build_start_plan(launch, plan.resolved.params, plan.geometry, plan.program, plan.run, plan.run_id, nodes,
                               plan.python, plan.cwd, node_env, plan.first_attempt)
    return dataclasses.replace(rebuilt, resume_from=plan.resume_from, notes=plan.notes)


def plan_start(launch: LaunchEnv, model: str, data: str, run: str, nodes: Sequence[tuple[int, str]],
               prepare: bool) -> StartPlan:
    """Checked params for the whole cluster (world = NNODES x NPROC_PER_NODE), the program every
    rank runs (data prepared first when ``prepare``), whether it resumes, and the plan of every
    node in ``nodes``; a UserError before anything starts."""
    check_run_name(run)
    params = load_run_params(model, data, launch.overrides)
    check_tokenizer(params.data.tokenizer)
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
    run_id = f"{run}-{uuid.uuid4().hex[:10]}"
    first = first_attempt(paths, continue_ledger=launch.slurm_restart_count > 0)
    r = params.training.resilience
    if r.max_restarts and not params.training.save_interval:
        notes.append(f"MAX_RESTARTS={r.max_restarts} without checkpoints (training.save_interval is 0): a restart "
                     f"starts again from iteration 0, and the breaker ends the run after {r.attempts_without_progress} "
                     "attempts without a new checkpoint; set save_interval")
    plan = build_start_plan(launch, params, geometry, program, run, run_id, nodes, launch.python, launch.cwd,
                            first_attempt=first)
    return dataclasses.replace(plan, resume_from=resume_from, notes=(*program.notes, *notes))
