"""Restarts that leave out the node the evidence names (NNODES=MIN:MAX): which node, why, on what
evidence, and when not. Pure: node 0's supervisor gathers the evidence and follows the choice
(orchestration/node/between_attempts.py, membership.py), the ledger and ``status`` say it.

    NNODES=3:4 HOSTS=g0,g1,g2,g3 MAX_RESTARTS=3 bash training_scripts/start_multinode_training.sh ...
    RESTART_EXCLUDE=0 NNODES=3:4 ...                     # every restart keeps every node; the evidence is still said

The evidence against a node, strongest first:

- **its GPU health** after an attempt that did not finish: a hardware fault its check finds (an
  Xid, uncorrected ECC errors, a row remap pending or failed, pages pending retirement, the
  driver's recovery action, an NVLink or InfiniBand link down: orchestration/node/gpu_health.py).
  An application's Xid (13, 31, 43, 45, 68: the GPU stays in service) or a GPU another process
  holds says nothing against the node. Left out at once.
- **attempts that failed on it**: the node named by the evidence of each of the last
  :data:`FAILED_IN_A_ROW` attempts of this start: a hang's suspects (the ranks stopped, outside a
  collective, behind or silent first: orchestration/node/watchdog.py; a hang where every rank
  waits alike names none) or the node whose own failure ended the attempt (a rank's exception or
  signal, not a peer's "Connection closed by peer" that followed it). One failure may be bad luck
  or a bug every node would meet (the breaker is for those); the same node twice in a row is the
  node.
- **a slow rank** named (training.resilience.slow_rank_ratio) in every metrics record of
  :data:`SLOW_WINDOWS` whole windows in a row (training.resilience.slow_rank_window_s each), when
  the run is faster without its node: every rank waits for the slowest, so N nodes held back by a
  rank r times slower than the others make N/r nodes' worth of progress, and N-1 nodes without it
  make N-1; leaving it out pays once r > N/(N-1) (2 nodes: 2x; 4 nodes: 1.33x; 32 nodes: 1.03x). A
  slow node does not fail: node 0 has every rank save a checkpoint at its next step and restarts
  without it, a restart not counted against MAX_RESTARTS.

Never node 0 (the run's leader, its coordination store and rendezvous host): the evidence against
it is said, in the ledger and the log, with what to do. A node is left out only while at least MIN
nodes stay (NNODES=MIN:MAX); with a fixed NNODES, or RESTART_EXCLUDE=0, the evidence is said and
every node kept. A node left out ends its part of the run (its exit record says why);
``rejoin_multinode_training.sh RUN NODE`` brings it back once mended, like a lost node.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping, Sequence

from megatron_ext.run_spec.iteration_log import IterationRecord
from orchestration.node.attempts import AttemptEnd, Decision, Evidence, node_names
from orchestration.node.failure import Failure, FailureKind
from orchestration.node.gpu_health import APPLICATION_XIDS, GpuFinding, GpuHealth
from orchestration.node.run_state import AttemptRecord, RunState
from orchestration.node.watchdog import RankReport, find_suspects

FAILED_IN_A_ROW = 2
"""A node named by the evidence of this many attempts in a row (of one start) is left out."""
SLOW_WINDOWS = 2
"""A slow rank's node is left out once the rank was named in every record of this many whole
slow-rank windows in a row (training.resilience.slow_rank_window_s each)."""
ChargeKind = StrEnum("ChargeKind", {"GPU_HEALTH": "gpu health", "FAILED_ATTEMPTS": "failed attempts", "SLOW": "slow"})
"""The kinds of evidence, strongest first: left out first where MIN lets only some go."""
NOT_THE_NODE = ("already runs on it", "of its memory in use by no process visible here")
"""gpu_health's findings of a GPU held by another program (its ``what``): the node is fine."""


@dataclass(frozen=True)
class Charge:
    """One piece of evidence against one node."""

    node: int
    """Its rank in the start's plan."""
    kind: ChargeKind
    why: str
    """What the evidence says, in words."""


@dataclass(frozen=True)
class Exclusion:
    """The policy's choice for the next attempt."""

    nodes: tuple[int, ...] = ()
    """Left out of it."""
    said: str = ""
    """The ledger's and the log's words: who is left out and why, and evidence not acted on (node 0,
    RESTART_EXCLUDE=0, a fixed NNODES, MIN); empty when no evidence names a node."""


# -- the evidence, from what node 0 has (pure) -------------------------------------------------------

def suspect_nodes(failure: Failure | None, reports: list[RankReport], ends: Mapping[int, AttemptEnd | None]) -> tuple[int, ...]:
    """The nodes this attempt's evidence names: a hang's suspects' nodes, from every node's ``reports``
    (none where every rank waits alike), else the node whose own failure (a rank's, or the node's)
    is the one recorded (``failure``), not a peer's consequence of it."""
    if failure is not None and failure.kind == FailureKind.HUNG:
        suspects = find_suspects(reports)
        return tuple(sorted({r.node_rank for r in suspects.ranks})) if suspects.named else ()
    return tuple(sorted(end.node_rank for end in ends.values() if end is not None and failure and end.failure == failure
                        and end.evidence >= Evidence.RANK))


def hardware_findings(health: GpuHealth | None) -> tuple[GpuFinding, ...]:
    """The findings of a node's GPU check that say the node itself is at fault: all but an
    application's Xid and a GPU held by another program. None (no nvidia-smi: no GPU node): none."""
    if health is None:
        return ()
    app = tuple(f"Xid {code} logged" for code in APPLICATION_XIDS)
    return tuple(f for f in health.findings if not f.what.startswith(app) and not any(s in f.what for s in NOT_THE_NODE))


def health_charges(ends: Mapping[int, AttemptEnd | None]) -> list[Charge]:
    """Each node whose end of the attempt carries hardware findings (:attr:`AttemptEnd.health`)."""
    return [Charge(end.node_rank, ChargeKind.GPU_HEALTH, f"its GPU health check after attempt {end.attempt} found "
                   + "; ".join(end.health)) for end in ends.values() if end is not None and end.health]


def failed_attempts_charges(ledger: Sequence[AttemptRecord], run_id: str, in_a_row: int = FAILED_IN_A_ROW) -> list[Charge]:
    """The nodes named (:attr:`AttemptRecord.suspects`) by each of the last ``in_a_row`` attempts of
    the start ``run_id`` (the ledger as node 0 closed the attempt just ended)."""
    last = [r for r in ledger if r.run_id == run_id][-in_a_row:]
    if len(last) < in_a_row:
        return []
    named = set(last[0].suspects).intersection(*(r.suspects for r in last[1:]))
    how = ", ".join(f"attempt {r.attempt} {r.state or 'ended'}" for r in last)
    return [Charge(node, ChargeKind.FAILED_ATTEMPTS, f"the evidence named it in {in_a_row} attempts in a row ({how}: "
                   "a hang's suspect or the failure's own node each time)") for node in sorted(named)]


def slow_charges(records: Sequence[IterationRecord], window_s: float, members: Sequence[int], nproc_per_node: int,
                 windows: int = SLOW_WINDOWS) -> list[Charge]:
    """The nodes of the ranks named slow in every record (this attempt's, oldest first) of the last
    ``windows`` x ``window_s`` seconds, where the run is faster without the node (a rank ``r``
    times slower than the others' median, ``r`` > N/(N-1) for the attempt's N nodes)."""
    n = len(members)
    world = n * nproc_per_node
    records = [r for r in records if r.world_size == world]
    if n < 2 or not records or not records[-1].slow_ranks:
        return []
    out: list[Charge] = []
    for rank in sorted(set(records[-1].slow_ranks)):
        streak = 0
        while streak < len(records) and rank in (records[-1 - streak].slow_ranks or ()):
            streak += 1
        run = records[len(records) - streak:]
        since = records[-1 - streak].time if streak < len(records) else run[0].time - run[0].step_time_s
        covered = run[-1].time - since
        busy = [r.busy_s_per_rank for r in run if r.busy_s_per_rank and len(r.busy_s_per_rank) == world]
        if covered < windows * window_s or not busy:
            continue
        sums = [sum(b[k] for b in busy) for k in range(world)]
        median = statistics.median(sums[:rank] + sums[rank + 1:])
        ratio = sums[rank] / median if median > 0 else float("inf")
        if ratio <= n / (n - 1):
            continue
        node = members[rank // nproc_per_node]
        out.append(Charge(node, ChargeKind.SLOW, f"its rank {rank} was named slow in every record for {covered:.0f} s ({windows} "
                          f"windows of {window_s:g} s): busy {ratio:.1f}x the median of the other ranks, so {n - 1} node(s) "
                          f"without it train faster than {n} held back by it (above {n / (n - 1):.2f}x)"))
    return out


# -- the choice (pure) --------------------------------------------------------------------------------

def choose_exclusion(charges: Sequence[Charge], members: Sequence[int], min_nodes: int, enabled: bool,
                     hosts: Sequence[str] = ()) -> Exclusion:
    """Which of ``members`` (the nodes of the attempt just ended, less those lost) the next attempt
    leaves out on ``charges``: never node 0; none when not ``enabled`` (RESTART_EXCLUDE=0) or
    ``min_nodes`` is 0 (a fixed NNODES); only while ``min_nodes`` stay, the strongest evidence first.
    What is not acted on is said too; an attempt of one node has nothing to leave out or say."""
    if len(members) < 2:
        return Exclusion()
    by_node: dict[int, list[Charge]] = {}
    for charge in charges:
        if charge.node in members:
            by_node.setdefault(charge.node, []).append(charge)
    left: list[int] = []
    said: list[str] = []
    staying = len(members)
    for node, found in sorted(by_node.items(), key=lambda item: (min(list(ChargeKind).index(c.kind) for c in item[1]), item[0])):
        name, why = node_names([node], hosts), "; ".join(c.why for c in found)
        if node == 0:
            said.append(f"{name} is named ({why}), but node 0 is the run's leader and rendezvous host and is never left "
                        "out: if it goes on failing, stop the run and start it again without that machine (another "
                        "HOSTS; the latest checkpoint resumes)")
        elif not enabled:
            said.append(f"RESTART_EXCLUDE=0: {name} kept, though {why}")
        elif not min_nodes:
            said.append(f"{name} kept, though {why}: a run started with a fixed NNODES keeps every node (with "
                        "NNODES=MIN:MAX it would be left out)")
        elif staying - 1 < min_nodes:
            said.append(f"{name} kept, though {why}: without it {staying - 1} node(s) would be left, fewer than the "
                        f"{min_nodes} the run may go on with (NNODES=MIN:MAX)")
        else:
            left.append(node)
            staying -= 1
            said.append(f"{name} left out ({why})")
    return Exclusion(tuple(sorted(left)), "; ".join(said))


def apply_exclusion(decision: Decision, exclusion: Exclusion) -> Decision:
    """Node 0's restart decision without the nodes left out, saying so; any other decision, or no
    evidence, as it is."""
    if not decision.restart or not exclusion.said:
        return decision
    members = tuple(n for n in decision.members if n not in exclusion.nodes)
    on = f"; attempt {decision.attempt + 1} runs on {len(members)} node(s)" if exclusion.nodes else ""
    return dataclasses.replace(decision, members=members, excluded=exclusion.nodes, exclusion=exclusion.said,
                               reason=f"{decision.reason}; {exclusion.said}{on}")


def decide_leaving(attempt: int, ends: Mapping[int, AttemptEnd | None], leaving: Exclusion, restarts_so_far: int,
                   rejoins_so_far: int, checkpoint: int | None) -> Decision | None:
    """After an attempt every node of which saved so that ``leaving`` (a slow node) is left out: the
    next attempt on the others at once, from that checkpoint (not counted against MAX_RESTARTS:
    nothing failed); the run's end when a node reached its last iteration first. None when the
    attempt ended otherwise on a node (:func:`~orchestration.node.attempts.decide` decides)."""
    if not ends or any(end is None or end.state not in (RunState.PREEMPTED, RunState.FINISHED) for end in ends.values()):
        return None
    if any(end.state == RunState.FINISHED for end in ends.values()):
        return Decision(attempt=attempt, restart=False, state=RunState.FINISHED,
                        reason="torchrun exited with code 0 (the last iteration came before a node could be left out)")
    members = tuple(n for n in sorted(ends) if n not in leaving.nodes)
    return Decision(attempt=attempt, restart=True, state=RunState.RESTARTING,
                    reason=f"{leaving.said}: restarting as attempt {attempt + 1} on {len(members)} node(s) from the checkpoint "
                    f"of iteration {checkpoint}", members=members, excluded=leaving.nodes, exclusion=leaving.said,
                    restarts=restarts_so_far, rejoins=rejoins_so_far + 1)

