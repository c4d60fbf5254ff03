"""Attempts of a run: what the nodes' supervisors agree on to restart together, and when not to.

After a failure or a hang every node stops its torchrun and says how its attempt ended; node 0
(the leader: it holds the run's coordination store) waits for every node's end, then decides with
:func:`decide` — restart from the latest complete checkpoint after a backoff, or end the run
(failed, hung, or "gave up" when attempts in a row made no progress: the latest checkpoint did
not advance) — and every node acts on its decision; before attempt K starts each node says it is
ready and node 0 names the attempt's nodes. All of that goes through the store
(orchestration/node/board.py), never through files. The ledger (``<run>_attempts.json``, written
by node 0 alone: orchestration/node/run_state.py) keeps every attempt for ``status``. A requeued
Slurm job continues the ledger (and the breaker's count); any other start begins it anew.
This module is the data and the pure decision; which node a restart leaves out on the evidence
against it is orchestration/node/exclusion.py's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence

from megatron_ext.run_spec.errors import FINAL
from megatron_ext.run_spec.resilience import ResilienceParams
from orchestration.node.failure import Failure
from orchestration.node.run_state import AttemptRecord, RunState


class Evidence(enum.IntEnum):
    """How much a node's own failure says about what went wrong (node 0 records the strongest)."""

    NONE = 0
    """Stopped because another node failed, or on request: its own failure, if any, is not the cause."""
    CONSEQUENCE = 1
    """A rank failed because a peer did (gloo's "Connection closed by peer", NCCL's abort:
    orchestration/node/failure.py's PEER_CONSEQUENCES)."""
    RANK = 2
    """A rank failed on its own (an exception, a signal, the hang protocol's suspects, a lost node)."""
    NODE = 3
    """The node itself: its share of the artifact root gone, its supervisor's own error."""


@dataclass(frozen=True, kw_only=True)
class AttemptEnd:
    """How one attempt ended on one node."""

    node_rank: int
    attempt: int
    state: RunState
    """finished, failed (this node's torchrun), hung (this node's watchdog), stopped (a peer's failure,
    or a stop request), preempted."""
    reason: str
    requested: bool = False
    """Stopped because someone asked (stop, Ctrl-C): no restart."""
    failure: Failure | None = None
    """This node's own failure, when it had one."""
    evidence: Evidence = Evidence.NONE
    """How much ``failure`` says (node 0 records the strongest of the attempt)."""
    leaves: bool = False
    """This node cannot go on (its share of the artifact root is gone, or its supervisor failed): it
    ends after this attempt, whatever node 0 decides for the others."""
    health: tuple[str, ...] = ()
    """The hardware faults this node's GPU health check found after an attempt that did not finish
    (Xid, ECC, NVLink, InfiniBand: orchestration/node/gpu_health.py), one line each: evidence against
    the node (orchestration/node/exclusion.py)."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Node 0's decision after attempt ``attempt``."""

    attempt: int
    restart: bool
    state: RunState
    """restarting, or how the run ends (failed, hung, gave up, stopped)."""
    reason: str
    backoff_s: float = 0.0
    members: tuple[int, ...] = ()
    """The nodes (their ranks in the start's plan) the next attempt runs on."""
    lost: tuple[int, ...] = ()
    """Nodes that ended no attempt within training.resilience.join_s: left out from here on."""
    joined: tuple[int, ...] = ()
    """Nodes brought back (``rejoin``) that the next attempt takes again."""
    restarts: int = 0
    """Restarts of this start counted against MAX_RESTARTS, this one included (a rejoin's is not)."""
    rejoins: int = 0
    """Restarts of this start made for nodes to rejoin or to leave out a slow one, this one included."""
    excluded: tuple[int, ...] = ()
    """Nodes the next attempt leaves out on the evidence against them (orchestration/node/exclusion.py):
    each ends its part of the run, ``left out``."""
    exclusion: str = ""
    """Who is left out and why, and evidence not acted on (node 0 named; RESTART_EXCLUDE=0): the
    ledger's and the log's words."""


# -- the decision (pure) ----------------------------------------------------------------------------

def node_names(nodes: Sequence[int], hosts: Sequence[str]) -> str:
    """``node 1 (g0034), node 3 (g0036)``."""
    return ", ".join(f"node {r}" + (f" ({hosts[r]})" if r < len(hosts) else "") for r in nodes)


def choose_failure(first: Failure | None, ends: Mapping[int, AttemptEnd | None]) -> Failure | None:
    """The attempt's failure as node 0 records it: the board's first claim (what stopped every
    node), unless a node's own failure carries stronger evidence (a node whose share went away
    beats the peers' "Connection closed by peer" that followed, whichever was claimed first). A
    first claim no end carries (a hang's summary, a lost node, a node that did not join) counts as
    :attr:`Evidence.RANK`."""
    own = [end for end in ends.values() if end is not None and end.failure]
    first_evidence = next((end.evidence for end in own if end.failure == first), Evidence.RANK)
    strongest = max(own, key=lambda end: (end.evidence, -end.node_rank), default=None)
    if strongest is not None and (first is None or strongest.evidence > first_evidence):
        return strongest.failure
    return first


def trained_to_the_end(ends: Mapping[int, AttemptEnd | None]) -> bool:
    """Whether the attempt ended with nothing to restart: every node saved (finished, or preempted on
    request), or one finished (its ranks took every step with the others, the last checkpoint with
    them) and the others failed only as its peers went (Evidence.CONSEQUENCE: a teardown's "Connection
    closed by peer") or were stopped for that."""
    if any(end is None or end.leaves or end.requested for end in ends.values()):
        return False
    if all(end.state in (RunState.FINISHED, RunState.PREEMPTED) for end in ends.values()):
        return True
    return (any(end.state == RunState.FINISHED for end in ends.values())
            and all(end.evidence <= Evidence.CONSEQUENCE and end.state != RunState.HUNG for end in ends.values()))


def decide(attempt: int, ends: dict[int, AttemptEnd | None], ledger: Sequence[AttemptRecord], policy: ResilienceParams,
           restarts_so_far: int, cause: RunState, cause_reason: str, hosts: Sequence[str] = (),
           joiners: Sequence[int] = (), rejoins_so_far: int = 0) -> Decision:
    """Restart or end after ``attempt``: ``ends`` per node of the attempt (None = no end within
    training.resilience.join_s: the node is lost), ``ledger`` with this attempt's record already
    closed, ``restarts_so_far`` in this start, ``cause``/``cause_reason`` what ended the attempt (its
    Failure's summary line); ``hosts`` (by node rank) name the lost nodes. A lost node ends the
    run, unless ``policy.min_nodes`` allows the next attempt on the nodes left (never without node 0,
    the rendezvous host and leader). ``joiners``: nodes brought back and asking for a place
    (``rejoin``), which a restart takes."""
    if any(end.requested for end in ends.values() if end is not None):  # a stop asked: whoever else ended how
        return Decision(attempt=attempt, restart=False, state=RunState.STOPPED, reason="stopped on request")
    missing = sorted(rank for rank, end in ends.items() if end is None)
    leaving = {rank: end.reason for rank, end in ends.items() if end is not None and end.leaves}
    members = tuple(rank for rank in sorted(ends) if rank not in missing and rank not in leaving)
    if missing or leaving:
        reasons = []
        if missing:
            reasons.append(f"{node_names(missing, hosts)} gone (its machine or its supervisor: no end of attempt "
                           f"{attempt} and no heartbeat within {policy.join_s:.0f} s)")
        reasons += [f"{node_names([rank], hosts)} cannot go on ({why})" for rank, why in sorted(leaving.items())]
        gone = "; ".join(reasons)
        missing = sorted({*missing, *leaving})
        if 0 in missing:
            return Decision(attempt=attempt, restart=False, state=RunState.FAILED,
                            reason=f"{gone}; node 0 is the rendezvous host and the leader, so the run ends: start it again without "
                            f"that machine (another HOSTS, the latest checkpoint resumes) ({cause_reason})", lost=tuple(missing))
        if not policy.min_nodes or len(members) < policy.min_nodes:
            rule = (f"{len(members)} node(s) left, fewer than the {policy.min_nodes} it may go on with (NNODES=MIN:MAX)"
                    if policy.min_nodes else "NNODES=MIN:MAX would let it go on with the nodes left")
            return Decision(attempt=attempt, restart=False, state=RunState.FAILED, reason=f"{gone}: the run ends: {rule} ({cause_reason})",
                            lost=tuple(missing))
        cause_reason = f"{gone}: going on with {len(members)} of {len(ends)} nodes ({cause_reason})"
    if FINAL in cause_reason:  # a full disk, no checkpoint that verifies: no restart mends it
        return Decision(attempt=attempt, restart=False, state=cause, reason=cause_reason, lost=tuple(missing))
    streak = 0
    for record in reversed(ledger):
        if record.made_progress:
            break
        streak += 1
    if streak >= policy.attempts_without_progress:
        return Decision(attempt=attempt, restart=False, state=RunState.GAVE_UP,
                        reason=f"{streak} attempts in a row made no progress (no new checkpoint); the last ended: {cause_reason}")
    if restarts_so_far >= policy.max_restarts:
        limit = f"after {restarts_so_far} restart(s) (MAX_RESTARTS={policy.max_restarts})" if policy.max_restarts else \
            "(MAX_RESTARTS=0: no restarts)"
        return Decision(attempt=attempt, restart=False, state=cause, reason=f"{cause_reason} {limit}".strip(), lost=tuple(missing))
    joined = tuple(sorted(set(joiners) - set(members)))
    back = f"; {node_names(joined, hosts)} back" if joined else ""
    return Decision(attempt=attempt, restart=True, state=RunState.RESTARTING,
                    reason=f"restarting as attempt {attempt + 1} in {policy.restart_backoff_s:g} s{back}: {cause_reason}",
                    backoff_s=policy.restart_backoff_s, members=tuple(sorted({*members, *joined})), lost=tuple(missing), joined=joined,
                    restarts=restarts_so_far + 1, rejoins=rejoins_so_far)


def decide_rejoin(attempt: int, ends: dict[int, AttemptEnd | None], joiners: Sequence[int], restarts_so_far: int,
                  rejoins_so_far: int, checkpoint: int | None, hosts: Sequence[str] = ()) -> Decision | None:
    """After an attempt every node of which saved and ended so that ``joiners`` come back: the next
    attempt on the attempt's nodes and theirs, at once, from that checkpoint (not counted against
    MAX_RESTARTS: nothing failed); the run's end when a node reached its last iteration first. An
    attempt that ended otherwise on a node (a failure, a node lost meanwhile) is decided by
    :func:`decide` instead: None."""
    if not ends or any(end is None or end.state not in (RunState.PREEMPTED, RunState.FINISHED) for end in ends.values()):
        return None
    if any(end.state == RunState.FINISHED for end in ends.values()):
        return Decision(attempt=attempt, restart=False, state=RunState.FINISHED,
                        reason="torchrun exited with code 0 (the last iteration came before "
                               f"{node_names(joiners, hosts)} could come back)")
    members = tuple(sorted({*ends, *joiners}))
    return Decision(attempt=attempt, restart=True, state=RunState.RESTARTING,
                    reason=f"{node_names(joiners, hosts)} back: restarting as attempt {attempt + 1} on {len(members)} nodes from "
                    f"the checkpoint of iteration {checkpoint}", backoff_s=0.0, members=members, lost=(), joined=tuple(joiners),
                    restarts=restarts_so_far, rejoins=rejoins_so_far + 1)
