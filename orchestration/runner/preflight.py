"""Preflight, the launcher side: every node's checks at once, one list of every problem, the links
between the nodes (several nodes: orchestration/runner/links.py), and the answers a plan settles on
(the port node 0 picked, each node's interface to MASTER_ADDR and
node-local directory: :func:`orchestration.runner.start_plan.plan_start` takes them).

    python -m orchestration preflight gpt_smoke smoke demo       # the checks start runs, on their own

The node side is :func:`orchestration.node.preflight.inspect_node` (``node-check``). Side
effects: the node commands, and one token file in the run_state folder (the shared-root check),
removed again (with the folders the check created).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, EXIT_OK, EXIT_USER_ERROR
from megatron_ext.run_spec.model_size import parameters_to_save
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster.backends import backend_for
from orchestration.launch_env import LaunchEnv
from orchestration.node.wire import (LINKTEST_TIMEOUT_S, CheckpointSpace, CheckRequest, LinkReport, LinktestRequest,
                                     NodeCheckRequest, NodeReport, NodeTarget, TokenizerFile, node_call)
from orchestration.runner.links import LinkRow, Problem, link_rows, slow_link_problems
from orchestration.runner.start_plan import StartInputs, checkpoint_target


@dataclass(frozen=True)
class Preflight:
    reports: tuple[NodeReport, ...]
    """Every node that answered."""
    problems: tuple[Problem, ...]
    answered: bool
    """Every node answered (else a problem is a node failure, not the user's input)."""
    links: tuple[LinkRow, ...] = ()
    """Several nodes: every node's links to its ring neighbours, measured with the run's backend."""

    @property
    def answers(self) -> tuple[NodeReport, ...] | None:
        """The reports a plan settles on: every node's, or None when a node did not answer."""
        return self.reports if self.answered else None

    @property
    def exit_code(self) -> int:
        """A start's, on these problems: 0 none, 2 the answers refuse it (the user's to fix), 1 a node did not answer."""
        return EXIT_OK if not self.problems else EXIT_USER_ERROR if self.answered else EXIT_NODE_FAILED


def leave_out(preflight: Preflight, min_nodes: int | None, nnodes: int) -> tuple[Preflight, tuple[Problem, ...]]:
    """NNODES=MIN:MAX: the nodes whose preflight found problems are left out of the start while at
    least MIN nodes are left, node 0 (the rendezvous host and leader) among them, and every node
    answered; (the preflight without their problems, their problems). Otherwise nothing is left
    out: the start refuses as ever. Pure."""
    bad = {rank for rank, _, _ in preflight.problems}
    if not bad or min_nodes is None or not preflight.answered or 0 in bad or nnodes - len(bad) < min_nodes:
        return preflight, ()
    return dataclasses.replace(preflight, problems=()), preflight.problems


def cluster_problems(reports: Sequence[NodeReport], master_addr: str | None = None) -> list[Problem]:
    """Every node's own problems, software that differs from node 0's, and MASTER_ADDR resolved
    to another address than node 0 resolves it to (a stale /etc/hosts: that node's rendezvous goes
    elsewhere). Pure."""
    out = [Problem(r.node_rank, r.host, p) for r in reports for p in r.problems]
    node0 = next((r for r in reports if r.node_rank == 0), None)
    if master_addr is not None and node0 is not None and node0.master_address is not None:
        for r in reports:
            if r.master_address not in (None, node0.master_address) and not (r.master_address or "").startswith("127."):
                out.append(Problem(r.node_rank, r.host, f"MASTER_ADDR={master_addr} resolves to {r.master_address} here but "
                                                        f"to {node0.master_address} on node 0: this node would look for the "
                                                        "rendezvous elsewhere; make every node resolve it alike (/etc/hosts, "
                                                        "DNS), or set MASTER_ADDR to node 0's IP address"))
    if reports:
        base = reports[0]
        for r in reports[1:]:
            for name, version in r.software.items():
                if version != (theirs := base.software.get(name)):
                    out.append(Problem(r.node_rank, r.host, f"{name} {version or 'absent'} here but {theirs or 'absent'} "
                                                            f"on node 0; every node needs the same {name}"))
    return sorted(out)


def required_modules(launch: LaunchEnv) -> tuple[str, ...]:
    """The optional modules the ranks will import: wandb when WANDB_PROJECT is set (and WANDB_MODE is not disabled)."""
    return ("wandb",) if launch.wandb and launch.wandb.enabled else ()


def check_request(launch: LaunchEnv, inputs: StartInputs, shared_token: Path | None) -> CheckRequest:
    """What every node checks for this start: the data, tokenizer and model directory the ranks read,
    the tokenizer loading, the optional modules, the shared artifact root, and the Python a
    Megatron-LM checkout needs."""
    params = inputs.params
    tok = params.data.tokenizer
    required = [*params.data.paths, *([tok.model_path] if tok.model_path else []),
                *([params.model.hf_checkpoint] if params.model.hf_checkpoint else [])]  # MODEL = a Hugging Face directory
    size = parameters_to_save(params)
    return CheckRequest(master_addr=launch.master_addr, nproc_per_node=launch.nproc_per_node, nnodes=launch.nnodes,
                        shared_token=str(shared_token) if shared_token is not None else None, required_paths=tuple(required),
                        tokenizer=TokenizerFile(tok.type, tok.model_path) if tok.model_path else None,
                        required_modules=required_modules(launch), needs_cuda=engine_named(params.training.engine).runs_checkout,
                        checkpoints=CheckpointSpace(str(checkpoint_target(launch, inputs.run)), size,
                                                    params.training.keep_checkpoints, params.training.zero_stage)
                        if size else None, fp8=params.training.fp8,
                        python=inputs.checkout.python_requirement if inputs.checkout is not None else None)


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
        results = backend_for(launch, inputs.nodes).call(launch, inputs.nodes, lambda rank, host: node_call(NodeCheckRequest(
            NodeTarget(inputs.run, rank, host, root), request,
            master_port=launch.master_port if launch.master_port_explicit or rank != 0 else None)), NodeReport)
    finally:
        token.unlink(missing_ok=True)
        for path in created:  # a dry run leaves no folder behind (a start creates them again)
            try:
                path.rmdir()
            except OSError:
                break
    reports = tuple(r.value for r in results if r.ok)
    problems = cluster_problems(reports, launch.master_addr)
    problems += [Problem(r.node_rank, r.host, r.error if r.error is not None else r.describe_failure())
                 for r in results if not r.ok]
    answered = all(r.returncode in (0, EXIT_USER_ERROR) for r in results)
    links: tuple[LinkRow, ...] = ()
    if launch.nnodes > 1 and len(reports) == len(inputs.nodes) == launch.nnodes and not problems:
        links = tuple(measure_links(launch, inputs, reports))
        problems += [p for p in slow_link_problems(links) if not (launch.allow_slow_links and "slow link" in p.what)]
    return Preflight(reports, tuple(sorted(problems)), answered, links)


def measure_links(launch: LaunchEnv, inputs: StartInputs, reports: Sequence[NodeReport]) -> list[LinkRow]:
    """Every node's links, all nodes at once, with the run's backend, at the port the run will take
    (free on node 0: the run's torchrun binds it after this test has closed it)."""
    node0 = next(r for r in reports if r.node_rank == 0)
    port = launch.master_port if launch.master_port_explicit or not node0.free_port else node0.free_port
    backend = "nccl" if all(r.visible_gpus for r in reports) else "gloo"
    interfaces = {r.node_rank: r.interface for r in reports}
    results = backend_for(launch, inputs.nodes).call(launch, inputs.nodes, lambda rank, host: node_call(LinktestRequest(
        target=NodeTarget(inputs.run, rank, host, launch.artifact_root), nnodes=launch.nnodes, master_addr=launch.master_addr,
        port=port, backend=backend, interface=interfaces.get(rank), seconds=launch.link_test_s)),
        LinkReport, timeout_s=LINKTEST_TIMEOUT_S + 30)
    answers = [r.value if r.ok else LinkReport(node_rank=r.node_rank, host=r.host, error=r.error or r.describe_failure()) for r in results]
    return link_rows(answers, interfaces)
