"""Preflight, the launcher side: every node's checks at once, one list of every problem, and what
the start takes from the answers (the port node 0 picked, each node's interface to MASTER_ADDR).

    python -m orchestration preflight gpt_smoke smoke demo       # the checks start runs, on their own

The node side is :func:`orchestration.node.preflight.inspect_node` (``node-check``). Side
effects: the node commands, and one token file under the artifact root (shared root check).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from megatron_ext.run_spec.errors import EXIT_USER_ERROR
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster.fanout import call_nodes
from orchestration.launch_env import SOCKET_IFNAME_VARIABLES, LaunchEnv
from orchestration.node.node_plan import check_call
from orchestration.node.preflight import NodeReport
from orchestration.runner.start_plan import StartPlan, rebuild_start_plan

Problem = tuple[int, str, str]
"""(node rank, host, what is wrong and how to fix it)."""


@dataclass(frozen=True)
class Preflight:
    reports: tuple[NodeReport, ...]
    """Every node that answered."""
    problems: tuple[Problem, ...]
    answered: bool
    """Every node answered (else a problem is a node failure, not the user's input)."""


def cluster_problems(reports: Sequence[NodeReport]) -> list[Problem]:
    """Every node's own problems, and software that differs from node 0's."""
    out = [(r.node_rank, r.host, p) for r in reports for p in r.problems]
    if reports:
        base = reports[0]
        for r in reports[1:]:
            for name, version in r.software.items():
                if version != base.software.get(name):
                    out.append((r.node_rank, r.host, f"{name} {version or 'absent'} here but {base.software.get(name) or 'absent'} "
                                                     f"on node 0; every node needs the same {name}"))
    return sorted(out)


def required_modules(launch: LaunchEnv) -> tuple[str, ...]:
    """The optional modules the ranks will import: wandb when WANDB_PROJECT is set (and WANDB_MODE is not disabled)."""
    return ("wandb",) if launch.wandb and launch.wandb.enabled else ()


def run_preflight(launch: LaunchEnv, plan: StartPlan, nodes: Sequence[tuple[int, str]]) -> Preflight:
    """Every check on every node in parallel."""
    params = plan.resolved.params
    tok = params.data.tokenizer
    required = [*params.data.paths, *([tok.model_path] if tok.model_path else []),
                *([params.model.hf_checkpoint] if params.model.hf_checkpoint else [])]  # MODEL = a Hugging Face directory
    paths = RunPaths(launch.artifact_root, plan.run)
    token = paths.run_state_dir / f".preflight-{plan.run_id}"
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text(plan.run_id)
    try:
        results = call_nodes(launch, nodes, lambda rank, host: check_call(
            plan.run, rank, host, launch.artifact_root, master_addr=launch.master_addr,
            master_port=launch.master_port if launch.master_port_explicit or rank != 0 else None,
            nproc_per_node=launch.nproc_per_node, shared_token=token, required_paths=required,
            tokenizer=(tok.type, tok.model_path) if tok.model_path else None,
            required_modules=required_modules(launch)), NodeReport)
    finally:
        token.unlink(missing_ok=True)
    reports = tuple(r.value for r in results if r.ok)
    problems = cluster_problems(reports)
    problems += [(r.node_rank, r.host, r.error if r.error is not None else r.describe_failure())
                 for r in results if not r.ok]
    return Preflight(reports, tuple(sorted(problems)), all(r.returncode in (0, EXIT_USER_ERROR) for r in results))


def settle_after_preflight(launch: LaunchEnv, plan: StartPlan,
                           reports: Sequence[NodeReport]) -> tuple[LaunchEnv, StartPlan, list[str]]:
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
