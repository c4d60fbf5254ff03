"""Attempts of a run: how the nodes' supervisors agree to restart together, and when not to.

    $ARTIFACT_ROOT/run_state/<run>_a<K>.node<N>.end.json   how attempt K ended on node N
    $ARTIFACT_ROOT/run_state/<run>_a<K>.decision.json      node 0's decision: attempt K+1, or the run's end
    $ARTIFACT_ROOT/run_state/<run>_a<K>.node<N>.ready      node N is ready to start attempt K
    $ARTIFACT_ROOT/run_state/<run>_a<K>.hang.json          a hang claimed in attempt K (first claim wins)
    (the ledger, <run>_attempts.json, and its records: orchestration/node/run_state.py)

After a failure or a hang every node stops its torchrun and writes its end; node 0 (the leader:
the rendezvous runs there anyway) waits for every node's end, then decides with
:func:`decide` — restart from the latest complete checkpoint after a backoff, or end the run
(failed, hung, or "gave up" when attempts in a row made no progress: the latest checkpoint did
not advance) — and writes the decision; every node reads it and acts on it; before attempt K
starts each node says it is ready and waits for the others. The ledger keeps every attempt for
``status``. A requeued Slurm job continues the ledger (and the breaker's count); any other start
begins it anew (node 0 resets the files at its start). Side effects: these files.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from megatron_ext.run_spec.errors import FINAL
from megatron_ext.run_spec.resilience import ResilienceParams
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.json_files import read_json, write_json_atomic
from orchestration.node.run_state import AttemptRecord, RunState, state_dict
from orchestration.node.watchdog import Hang

@dataclass(frozen=True)
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
    at: float = 0.0


@dataclass(frozen=True)
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

    @property
    def next_attempt(self) -> int | None:
        return self.attempt + 1 if self.restart else None


# -- the files --------------------------------------------------------------------------------------

def write_end(paths: RunPaths, end: AttemptEnd) -> None:
    write_json_atomic(paths.attempt_file(end.attempt, f"node{end.node_rank}.end.json"), state_dict(end))


def read_end(paths: RunPaths, attempt: int, node_rank: int) -> AttemptEnd | None:
    raw = read_json(paths.attempt_file(attempt, f"node{node_rank}.end.json"))
    try:
        return AttemptEnd(**{**raw, "state": RunState(raw["state"])}) if isinstance(raw, dict) else None
    except (TypeError, KeyError, ValueError):
        return None


def write_decision(paths: RunPaths, decision: Decision) -> None:
    write_json_atomic(paths.attempt_file(decision.attempt, "decision.json"), state_dict(decision))


def read_decision(paths: RunPaths, attempt: int) -> Decision | None:
    raw = read_json(paths.attempt_file(attempt, "decision.json"))
    try:
        return Decision(**{**raw, "state": RunState(raw["state"]), "members": tuple(raw.get("members", ())),
                           "lost": tuple(raw.get("lost", ()))}) if isinstance(raw, dict) else None
    except (TypeError, KeyError, ValueError):
        return None


@dataclass(frozen=True)
class HangClaim(Hang):
    """``<run>_a<K>.hang.json``: the first node whose watchdog found a rank past its limit (its
    :class:`~orchestration.node.watchdog.Hang`, and when it was claimed)."""

    claimed_at: float


def claim_hang(paths: RunPaths, attempt: int, hang: Hang) -> bool:
    """Claim attempt ``attempt``'s hang unless a node already did."""
    path = paths.attempt_file(attempt, "hang.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps({**asdict(hang), "claimed_at": time.time()}))
    return True


def read_hang_claim(paths: RunPaths, attempt: int) -> HangClaim | None:
    raw = read_json(paths.attempt_file(attempt, "hang.json"))
    try:
        return HangClaim(**raw) if isinstance(raw, dict) else None
    except TypeError:
        return None


def write_roster(paths: RunPaths, attempt: int, members: Sequence[int]) -> None:
    """Node 0: the nodes attempt ``attempt`` runs on (those ready in time)."""
    write_json_atomic(paths.attempt_file(attempt, "roster.json"), list(members))


def read_roster(paths: RunPaths, attempt: int) -> tuple[int, ...] | None:
    raw = read_json(paths.attempt_file(attempt, "roster.json"))
    return tuple(int(r) for r in raw) if isinstance(raw, list) else None


def mark_ready(paths: RunPaths, attempt: int, node_rank: int) -> None:
    path = paths.attempt_file(attempt, f"node{node_rank}.ready")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def ready_nodes(paths: RunPaths, attempt: int, members: Sequence[int]) -> list[int]:
    return [rank for rank in members if paths.attempt_file(attempt, f"node{rank}.ready").exists()]


# -- the decision (pure) ----------------------------------------------------------------------------

def decide(attempt: int, ends: dict[int, AttemptEnd | None], ledger: Sequence[AttemptRecord], policy: ResilienceParams,
           restarts_so_far: int, cause: RunState, cause_reason: str, hosts: Sequence[str] = ()) -> Decision:
    """Restart or end after ``attempt``: ``ends`` per node of the attempt (None = no end within
    training.resilience.join_s: the node is lost), ``ledger`` with this attempt's record already
    closed, ``restarts_so_far`` in this start, ``cause``/``cause_reason`` what ended the attempt (the
    failure file's first line); ``hosts`` (by node rank) name the lost nodes. A lost node ends the
    run, unless ``policy.min_nodes`` allows the next attempt on the nodes left (never without node 0,
    the rendezvous host and leader)."""
    missing = sorted(rank for rank, end in ends.items() if end is None)
    members = tuple(rank for rank in sorted(ends) if rank not in missing)
    if missing:
        names = ", ".join(f"node {r}" + (f" ({hosts[r]})" if r < len(hosts) else "") for r in missing)
        gone = (f"{names} gone (its machine or its supervisor: no end of attempt {attempt} and no heartbeat within "
                f"{policy.join_s:.0f} s)")
        if 0 in missing:
            return Decision(attempt, False, RunState.FAILED,
                            f"{gone}; node 0 is the rendezvous host and the leader, so the run ends: start it again without "
                            f"that machine (another HOSTS, the latest checkpoint resumes) ({cause_reason})", lost=tuple(missing))
        if not policy.min_nodes or len(members) < policy.min_nodes:
            rule = (f"{len(members)} node(s) left, fewer than the {policy.min_nodes} it may go on with (NNODES=MIN:MAX)"
                    if policy.min_nodes else "NNODES=MIN:MAX would let it go on with the nodes left")
            return Decision(attempt, False, RunState.FAILED, f"{gone}: the run ends: {rule} ({cause_reason})",
                            lost=tuple(missing))
        cause_reason = f"{gone}: going on with {len(members)} of {len(ends)} nodes ({cause_reason})"
    if any(end.requested for end in ends.values() if end is not None):
        return Decision(attempt, False, RunState.STOPPED, "stopped on request")
    if FINAL in cause_reason:  # a full disk, no checkpoint that verifies: no restart mends it
        return Decision(attempt, False, cause, cause_reason, lost=tuple(missing))
    streak = 0
    for record in reversed(ledger):
        if record.made_progress:
            break
        streak += 1
    if streak >= policy.attempts_without_progress:
        return Decision(attempt, False, RunState.GAVE_UP,
                        f"{streak} attempts in a row made no progress (no new checkpoint); the last ended: {cause_reason}")
    if restarts_so_far >= policy.max_restarts:
        limit = f"after {restarts_so_far} restart(s) (MAX_RESTARTS={policy.max_restarts})" if policy.max_restarts else \
            "(MAX_RESTARTS=0: no restarts)"
        return Decision(attempt, False, cause, f"{cause_reason} {limit}".strip(), lost=tuple(missing))
    return Decision(attempt, True, RunState.RESTARTING,
                    f"restarting as attempt {attempt + 1} in {policy.restart_backoff_s:g} s: {cause_reason}",
                    policy.restart_backoff_s, members, tuple(missing))
