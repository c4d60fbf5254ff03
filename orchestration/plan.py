"""The start plan: what every node runs, built once, printed by ``DRY_RUN=1``, executed as printed.

    DRY_RUN=1 HOSTS=node0,node1 python -m orchestration start gpt_smoke smoke demo

Plan, then execute (torchx / NeMo-Run): :func:`build_start_plan` returns a :class:`StartPlan`
(the run id, and per node the host, the torchrun argv, the full environment the launcher sets
for the node's processes including the run tags, the variables it removes, the working
directory, the log and pid-file paths). ``DRY_RUN=1`` prints each :class:`NodePlan` as one JSON
line; ``start`` sends each node its own plan, and the node side only checks, starts it detached
and writes the pid file; ``train`` execs its node's plan in the foreground. Pure.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from megatron_ext.spec.params import BatchGeometry, RunParams
from megatron_ext.spec.resolved import ResolvedRun, RunRuntime
from megatron_ext.spec.run_paths import RunPaths
from orchestration.engines import ProgramPlan
from orchestration.launch_env import LaunchEnv

RUN_TAG = "LAUNCHER_RUN"
RUN_ID_TAG = "LAUNCHER_RUN_ID"
NODE_TAG = "LAUNCHER_NODE_RANK"


@dataclass(frozen=True)
class NodePlan:
    """One node's part of a start: everything the node side needs, nothing it works out again."""

    run: str
    run_id: str
    node_rank: int
    host: str
    argv: tuple[str, ...]
    """The torchrun command this node runs."""
    env: dict[str, str]
    """Variables set for every process of the run on this node, on top of the node's own
    environment (launcher variables, forwarded variables, the program's, the run tags)."""
    unset: tuple[str, ...]
    """Variables removed from the node's own environment (e.g. CUDA_DEVICE_MAX_CONNECTIONS for
    Megatron-FSDP)."""
    cwd: str
    log_path: str
    pid_path: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "NodePlan":
        raw = json.loads(text)
        raw["argv"], raw["unset"] = tuple(raw["argv"]), tuple(raw["unset"])
        return cls(**raw)

    def process_environment(self, node_env: Mapping[str, str]) -> dict[str, str]:
        """The environment of torchrun on the node: the node's own, less ``unset``, plus ``env``."""
        return {**{k: v for k, v in node_env.items() if k not in self.unset}, **self.env}


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
                     node_env: Mapping[int, Mapping[str, str]] | None = None) -> StartPlan:
    """The plan for ``nodes`` ((node rank, host) pairs) of a run of ``params`` (global batch
    already applied) running ``program``; ``node_env`` adds variables per node (e.g. the socket
    interface preflight found)."""
    paths = RunPaths(launch.artifact_root, run)
    node_plans = []
    for rank, host in nodes:
        env, unset = node_environment(launch, rank, run, run_id, program.env)
        env.update((node_env or {}).get(rank, {}))
        node_plans.append(NodePlan(
            run=run, run_id=run_id, node_rank=rank, host=host,
            argv=tuple(render_torchrun_argv(launch, rank, python, program.argv)), env=env, unset=unset, cwd=cwd,
            log_path=str(paths.node_log(rank)), pid_path=str(paths.node_pid_file(rank)),
        ))
    runtime = RunRuntime(
        run=run, run_id=run_id, engine=program.engine, nnodes=launch.nnodes, nproc_per_node=launch.nproc_per_node,
        hosts=tuple(launch.hosts), gradient_accumulation_steps=geometry.accumulation_steps,
        program_argv=tuple(program.argv), program_env=dict(program.env),
    )
    return StartPlan(run, run_id, ResolvedRun(params, runtime), geometry, tuple(node_plans), program=program,
                     python=python, cwd=cwd)


def rebuild_start_plan(launch: LaunchEnv, plan: StartPlan, node_env: Mapping[int, Mapping[str, str]]) -> StartPlan:
    """``plan`` for another launch (e.g. the port preflight picked) with per-node variables; same run id."""
    nodes = [(p.node_rank, p.host) for p in plan.nodes]
    rebuilt = build_start_plan(launch, plan.resolved.params, plan.geometry, plan.program, plan.run, plan.run_id, nodes,
                               plan.python, plan.cwd, node_env)
    return dataclasses.replace(rebuilt, resume_from=plan.resume_from)


def orchestration_argv(python: str, command: str, *args: str) -> list[str]:
    """A node-side orchestration command (``node-start``, ``node-stop``, ...)."""
    return [python, "-m", "orchestration", command, *args]
