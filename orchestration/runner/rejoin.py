"""A node brought back to a run that went on without it (NNODES=MIN:MAX).

    python -m orchestration rejoin demo 1            # node 1 (its host as the start recorded it)
    python -m orchestration rejoin demo 1 --host g0042   # a replacement machine in node 1's place
    DRY_RUN=1 python -m orchestration rejoin demo 1  # the checks, and the node command it would send

torchrun's elastic agent takes a node that comes back at its next rendezvous; here node 0's
supervisor does (orchestration/node/membership.py): the node's own plan from the start (the
plan file its first start left under the artifact root) goes back to its host with
``rejoin`` set, through the backend every node command takes (ssh, ``docker exec``); its
supervisor asks node 0 for a place over the run's coordination store, every node saves a
checkpoint at the next step, and the next attempt runs on the nodes of the run again with the
same global batch. A node node 0 left out on the evidence against it (orchestration/node/exclusion.py:
a hang's suspect twice in a row, its GPU health, a slow rank) comes back the same way, once mended;
the plan says why it was out. :func:`plan_rejoin` checks and plans (the dry run stops there, every refusal
one UserError); :func:`rejoin_node` sends it. Side effects: the status call to node 0, the node
command.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.run_spec.errors import UserError
from megatron_ext.host.json_files import read_json_settled
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster.backends import backend_for
from orchestration.cluster.fanout import NodeResult
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import RunState, left_out_nodes, read_ledger
from orchestration.node.wire import NodeCall, NodePlan, NodeStarted, decode_payload, start_call
from orchestration.runner.control import node_statuses

GOING = (RunState.RUNNING, RunState.RESTARTING)


@dataclass(frozen=True)
class RejoinPlan:
    """What ``rejoin`` sends: the node's plan (``rejoin`` set) and the node command carrying it."""

    plan: NodePlan
    call: NodeCall
    attempt: int
    """The attempt going on without the node."""
    nodes: tuple[int, ...]
    """The nodes it runs on."""
    out: str = ""
    """Why the run went on without the node (lost, or left out on the evidence against it), as the ledger says."""


def plan_rejoin(launch: LaunchEnv, run: str, node_rank: int, host: str | None = None) -> RejoinPlan:
    """Check that ``node_rank`` can come back to ``run`` and plan its start (``host``: a
    replacement machine; default the host the start recorded). Every refusal is one UserError."""
    if backend_for(launch, [(node_rank, host)] if host else ()).fixed_nodes:
        raise UserError("rejoin reaches a node over ssh or docker exec; inside a Slurm allocation a job step's nodes "
                        "are fixed: stop the run with --save and submit it again on the repaired allocation (the latest "
                        "checkpoint resumes)")
    paths = RunPaths(launch.artifact_root, run)
    resolved = read_resolved(paths.params_path)
    if resolved is None:
        raise UserError(f"no run {run!r} under ARTIFACT_ROOT={launch.artifact_root} (its parameters file "
                        f"{paths.params_path} is missing); give the run name a start printed")
    hosts, run_id = resolved.runtime.hosts, resolved.runtime.run_id
    if not 0 < node_rank < len(hosts):
        raise UserError(f"node {node_rank} is not a node run {run!r} can take back: its nodes are 0-{len(hosts) - 1}, and "
                        "node 0 (the leader and rendezvous host) never leaves a run that goes on; give 1-"
                        f"{len(hosts) - 1}" if len(hosts) > 1 else f"run {run!r} runs on one node: no node to bring back")
    if not resolved.params.training.resilience.min_nodes:
        raise UserError(f"run {run!r} was started with NNODES={len(hosts)}: only a run started with NNODES=MIN:MAX goes "
                        "on without a node and takes it back; stop it and start it again with NNODES=MIN:MAX (the latest "
                        "checkpoint resumes)")
    this_start = [r for r in read_ledger(paths) if r.run_id == run_id]
    current = this_start[-1] if this_start else None
    if current is None or current.nodes == () or node_rank in current.nodes:
        raise UserError(f"node {node_rank} ({hosts[node_rank]}) is in run {run!r}" + (
            f" (attempt {current.attempt} runs on it)" if current else "") + ": only a node the run went on without "
            "comes back; see status_training.sh " + run)
    leader = node_statuses(launch, run, [(0, hosts[0])], resolved.params.training.seq_length)[0]
    if not leader.ok or leader.value.state not in GOING:
        state = leader.value.state if leader.ok else f"no answer ({leader.describe_failure()})"
        raise UserError(f"run {run!r} is not going on node 0 ({hosts[0]}: {state}): there is nothing to come back to; "
                        "start it again (the latest checkpoint resumes)")
    raw = read_json_settled(paths.node_plan_file(node_rank))
    try:
        plan = decode_payload(NodePlan, raw) if isinstance(raw, dict) else None
    except ValueError:  # written by another checkout
        plan = None
    if plan is None or plan.run_id != run_id:
        raise UserError(f"node {node_rank}'s plan of this start ({paths.node_plan_file(node_rank)}) is "
                        + ("missing or torn" if plan is None else f"of another start ({plan.run_id})")
                        + f": start run {run!r} again instead (the latest checkpoint resumes)")
    plan = dataclasses.replace(plan, rejoin=True, host=host or plan.host)
    return RejoinPlan(plan, start_call(plan, launch.secrets), current.attempt, current.nodes,
                      left_out_nodes(this_start).get(node_rank, ""))


def rejoin_node(launch: LaunchEnv, planned: RejoinPlan) -> NodeResult[NodeStarted]:
    """Send the node its plan: its supervisor runs, ``joining``, once the answer comes back."""
    node = [(planned.plan.node_rank, planned.plan.host)]
    return backend_for(launch, node).call(launch, node, lambda *_: planned.call, NodeStarted)[0]
