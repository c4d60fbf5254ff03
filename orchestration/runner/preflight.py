"""Preflight, the launcher side: every node's checks at once, one list of every problem, and the
answers a plan settles on (the port node 0 picked, each node's interface to MASTER_ADDR and
node-local directory: :func:`orchestration.runner.start_plan.plan_start` takes them).

    python -m orchestration preflight gpt_smoke smoke demo       # the checks start runs, on their own

The node side is :func:`orchestration.node.preflight.inspect_node` (``node-check``). Side
effects: the node commands, and one token file in the run_state folder (the shared-root check),
removed again (with the folders the check created).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron_ext.run_spec.errors import EXIT_USER_ERROR
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster.fanout import call_nodes
from orchestration.launch_env import LaunchEnv
from orchestration.node.wire import CheckRequest, NodeReport, check_call
from orchestration.runner.start_plan import StartInputs

Problem = tuple[int, str, str]
"""(node rank, host, what is wrong and how to fix it)."""


@dataclass(frozen=True)
class Preflight:
    reports: tuple[NodeReport, ...]
    """Every node that answered."""
    problems: tuple[Problem, ...]
    answered: bool
    """Every node answered (else a problem is a node failure, not the user's input)."""

    @property
    def answers(self) -> tuple[NodeReport, ...] | None:
        """The reports a plan settles on: every node's, or None when a node did not answer."""
        return self.reports if self.answered and not self.unreachable else None

    @property
    def unreachable(self) -> bool:
        return not self.answered


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


def check_request(launch: LaunchEnv, inputs: StartInputs, shared_token: Path | None) -> CheckRequest:
    """What every node checks for this start: the data, tokenizer and model directory the ranks read,
    the tokenizer loading, the optional modules, the shared artifact root."""
    params = inputs.params
    tok = params.data.tokenizer
    required = [*params.data.paths, *([tok.model_path] if tok.model_path else []),
                *([params.model.hf_checkpoint] if params.model.hf_checkpoint else [])]  # MODEL = a Hugging Face directory
    return CheckRequest(launch.master_addr, launch.nproc_per_node, shared_token, tuple(required),
                        (tok.type, tok.model_path) if tok.model_path else None, required_modules(launch))


def run_preflight(launch: LaunchEnv, inputs: StartInputs) -> Preflight:
    """Every check on every node of ``inputs`` in parallel."""
    root = launch.artifact_root
    state_dir = RunPaths(root, inputs.run).run_state_dir  # where the nodes share the run's state: they must see it
    created = [p for p in (state_dir, *state_dir.parents) if not p.exists()]
    token = state_dir / f".preflight-{inputs.run_id}"
    state_dir.mkdir(parents=True, exist_ok=True)
    token.write_text(inputs.run_id)
    request = check_request(launch, inputs, token)
    try:
        results = call_nodes(launch, inputs.nodes, lambda rank, host: check_call(
            inputs.run, rank, host, root, request,
            master_port=launch.master_port if launch.master_port_explicit or rank != 0 else None), NodeReport)
    finally:
        token.unlink(missing_ok=True)
        for path in created:  # a dry run leaves no folder behind (a start creates them again)
            try:
                path.rmdir()
            except OSError:
                break
    reports = tuple(r.value for r in results if r.ok)
    problems = cluster_problems(reports)
    problems += [(r.node_rank, r.host, r.error if r.error is not None else r.describe_failure())
                 for r in results if not r.ok]
    return Preflight(reports, tuple(sorted(problems)), all(r.returncode in (0, EXIT_USER_ERROR) for r in results))
