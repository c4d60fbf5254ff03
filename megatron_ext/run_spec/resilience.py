"""Runs that finish unattended: the watchdog's limits, the restart policy, and the progress every
rank reports — the one place both programs read them from.

    MAX_RESTARTS=3 HANG_STEP_FLOOR_S=60 bash training_scripts/start_multinode_training.sh qwen3_1p7b qwen3_1p7b_smoke q32

A data set sets them under ``training.resilience`` (every field below); the environment overrides
``max_restarts`` (MAX_RESTARTS), ``hang_step_floor_s`` (HANG_STEP_FLOOR_S), ``hang_setup_s``
(HANG_SETUP_S), ``hang_checkpoint_s`` (HANG_CHECKPOINT_S) and ``hang_watchdog`` (HANG_WATCHDOG=0
turns it off). Each rank of this project's program writes a :class:`RankProgress` (rank, host,
pid, iteration, phase, when the phase began, the slowest recent step) into a node-local directory
at every phase change; the node's supervisor reads them and applies :func:`phase_limit_s`. Pure
apart from :func:`write_progress` / :func:`read_progress` (that directory).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Mapping

from megatron_ext.run_spec.convert import structure
from megatron_ext.run_spec.errors import UserError
from megatron_ext.host.json_files import write_text_atomic

class Phase(StrEnum):
    """What a rank is doing: preparing data (no limit: a large corpus takes as long as it takes), setting
    up (process group, model, datasets, resume), an optimizer step, a validation pass, a save, ended."""

    PREPARE = "prepare"
    SETUP = "setup"
    STEP = "step"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    DONE = "done"
    PREEMPTED = "preempted"


ENDED_PHASES = (Phase.DONE, Phase.PREEMPTED)
"""A rank past its last step (it has no signal handler left)."""
RECENT_STEPS = 20
"""How many recent steps the learned step limit looks at."""
PROGRESS_DIR_ENV = "LAUNCHER_PROGRESS_DIR"
"""Set by the node's supervisor for its torchrun: the node-local directory the ranks report into."""
ATTEMPT_ENV = "LAUNCHER_ATTEMPT"
"""Set by the node's supervisor: the attempt of the run (1, then 2 after the first restart, ...)."""
FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's flight recorder (every collective of every process group, gloo and NCCL alike): the
supervisor sets the first to FLIGHT_RECORDER_ENTRIES unless either is set."""
FLIGHT_RECORDER_ENTRIES = 2000
DUMP_REQUEST = "dump_request"
"""Touched in the progress directory by the supervisor on a hang: every rank that still runs
writes its flight recorder to ``rank<R>.fr.json`` beside its progress file."""


@dataclass(frozen=True, kw_only=True)
class ResilienceParams:
    """Hangs, restarts and their limits (``training.resilience`` in a data set)."""

    hang_watchdog: bool = True
    """Watch every rank's progress and end a run whose rank is stuck (HANG_WATCHDOG=0: off)."""
    hang_step_floor_s: float = 30.0
    """A step may always take this long (seconds) before it counts as hung (HANG_STEP_FLOOR_S)."""
    hang_step_factor: float = 5.0
    """... or this many times the slowest of the recent steps, whichever is longer."""
    hang_warmup_steps: int = 3
    """The first steps of each attempt are timed against hang_setup_s, not learned (lazy set-up,
    first collectives, allocator warm-up)."""
    hang_setup_s: float = 600.0
    """Start of a rank to its first step (process group, model, datasets, resume), seconds
    (HANG_SETUP_S)."""
    hang_checkpoint_s: float = 600.0
    """One checkpoint save, seconds (HANG_CHECKPOINT_S)."""
    hang_eval_s: float = 600.0
    """One validation pass, seconds."""
    max_restarts: int = 0
    """Restarts after a failure or a hang, every node at once, from the latest complete checkpoint
    (MAX_RESTARTS; 0 like torchrun: a failure ends the run)."""
    restart_backoff_s: float = 5.0
    """Pause before each restart, seconds."""
    attempts_without_progress: int = 2
    """The breaker: after this many attempts in a row whose latest checkpoint did not advance, the
    run ends as "gave up" instead of restarting (a run that crashes at iteration 1 every time
    must not loop)."""
    min_nodes: int = 0
    """A lost node (unreachable, its supervisor gone, its processes dead): the next attempt goes on
    with the nodes left, if at least this many, with the same global batch (NNODES=MIN:MAX sets it);
    0 = every node, a lost node ends the run. Node 0 (the rendezvous host and leader) cannot be lost."""
    node_lost_s: float = 20.0
    """A node whose supervisor's heartbeat is this old (seconds) is taken as lost."""
    join_s: float = 120.0
    """How long node 0 waits for every node's end of an attempt, and for the nodes of the next one
    to be ready (seconds); a node later than that is lost."""
    slow_rank_ratio: float = 1.25
    """A rank whose busy time (its training steps less its waits for the others in collectives:
    training/busy_clock.py) is at least this many times the median of the other ranks' ..."""
    slow_rank_window_s: float = 20.0
    """... summed over the log intervals of the last this many seconds (at least one interval), and
    so for a quarter of it in a row, is named as slow: a warning in the log, in status and in the
    metrics (this project's program; the run goes on: every rank waits for it). Summed, so a rank
    slow in bursts is named as surely as a steadily slow one."""

    def describe(self) -> str:
        """The start line's words for it."""
        watchdog = (f"hang watchdog: step {self.hang_step_factor:g} x slowest recent, at least {self.hang_step_floor_s:g} s "
                    f"(after {self.hang_warmup_steps} steps), setup {self.hang_setup_s:g} s, checkpoint "
                    f"{self.hang_checkpoint_s:g} s" if self.hang_watchdog else "hang watchdog off")
        restarts = (f"restarts: up to {self.max_restarts} (backoff {self.restart_backoff_s:g} s; gives up after "
                    f"{self.attempts_without_progress} attempts without a new checkpoint)" if self.max_restarts
                    else "restarts: none (MAX_RESTARTS=0)")
        return f"{watchdog}; {restarts}"


ENVIRONMENT_OVERRIDES = {
    "MAX_RESTARTS": "max_restarts", "HANG_STEP_FLOOR_S": "hang_step_floor_s", "HANG_SETUP_S": "hang_setup_s",
    "HANG_CHECKPOINT_S": "hang_checkpoint_s", "HANG_WATCHDOG": "hang_watchdog",
}


def read_resilience_overrides(env: Mapping[str, str]) -> dict[str, object]:
    """The environment's changes to :class:`ResilienceParams` (each program's edge calls this)."""
    types = {f.name: f.type for f in fields(ResilienceParams)}
    out: dict[str, object] = {}
    for name, key in ENVIRONMENT_OVERRIDES.items():
        text = env.get(name, "").strip()
        if not text:
            continue
        kind = types[key]
        try:
            if kind == "bool":
                if text.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(text)
                out[key] = text.lower() in ("1", "true", "yes", "on")
            else:
                value = int(text) if kind == "int" else float(text)
                if value < 0:
                    raise ValueError(text)
                out[key] = value
        except ValueError:
            rule = {"bool": "0 or 1", "int": "a whole number >= 0, e.g. 3"}.get(kind, "a number of seconds >= 0, e.g. 60")
            raise UserError(f"{name}={text!r} must be {rule}") from None
    return out


def with_overrides(params: ResilienceParams, overrides: Mapping[str, object]) -> ResilienceParams:
    return replace(params, **overrides) if overrides else params


def check_resilience(p: ResilienceParams, where: str) -> None:
    for key in ("hang_step_floor_s", "hang_step_factor", "hang_setup_s", "hang_checkpoint_s", "hang_eval_s"):
        if getattr(p, key) <= 0:
            raise UserError(f"{where}.{key}={getattr(p, key)} must be > 0 (turn the watchdog off with hang_watchdog: false)")
    for key in ("node_lost_s", "join_s"):
        if getattr(p, key) <= 0:
            raise UserError(f"{where}.{key}={getattr(p, key)} must be > 0 (seconds)")
    for key in ("hang_warmup_steps", "max_restarts", "restart_backoff_s", "min_nodes"):
        if getattr(p, key) < 0:
            raise UserError(f"{where}.{key}={getattr(p, key)} must be >= 0")
    if p.attempts_without_progress < 1:
        raise UserError(f"{where}.attempts_without_progress={p.attempts_without_progress} must be >= 1")
    if not p.slow_rank_ratio > 1:
        raise UserError(f"{where}.slow_rank_ratio={p.slow_rank_ratio} must be > 1 (a rank this many times slower than "
                        "the median of the others is named), e.g. 1.5")
    if not p.slow_rank_window_s > 0:
        raise UserError(f"{where}.slow_rank_window_s={p.slow_rank_window_s} must be > 0 (seconds of log intervals "
                        "summed), e.g. 20")


# -- what each rank reports ---------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RankProgress:
    """``<progress dir>/rank<R>.json``, rewritten at every phase change (atomically)."""

    rank: int
    local_rank: int
    host: str
    pid: int
    attempt: int
    """The supervisor's attempt this process belongs to (1 = the first)."""
    iteration: int
    """The optimizer step being worked on (in ``step``), or the last one done."""
    phase: Phase
    phase_started_at: float
    """time.time() when the phase began."""
    steps_done: int = 0
    """Steps this process finished (this attempt)."""
    slowest_recent_step_s: float | None = None
    """The longest of the last :data:`RECENT_STEPS` steps, seconds."""


def progress_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.json"


def write_progress(directory: Path, p: RankProgress) -> None:
    write_text_atomic(progress_path(directory, p.rank), json.dumps(asdict(p)))


def read_progress(directory: Path) -> dict[int, RankProgress]:
    """Every rank's last report in ``directory`` (a report being replaced is read whole or not at all)."""
    out = {}
    for path in directory.glob("rank*.json"):
        try:
            p = structure(RankProgress, json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
        out[p.rank] = p
    return out


CHECKPOINT_READ_FLOOR_BPS = 250e6
"""The slowest rate, bytes a second, at which the watchdog expects one process to read a whole
checkpoint through: a quarter of a cluster file system's ~1 GB/s per node. At a resume the ranks
load it, and Megatron-LM's ``--verify-integrity`` hashes every file on rank 0 first; at a save
Megatron-LM's manifest hashes every file on rank 0 again."""


def for_checkpoint(r: ResilienceParams, checkpoint_bytes: int, save_bytes: int | None = None) -> ResilienceParams:
    """``r`` with the setup limit raised by the time the checkpoint to load, ``checkpoint_bytes``,
    takes at :data:`CHECKPOINT_READ_FLOOR_BPS` (450 GB: 30 minutes more; 24 GB: 96 s), and the save
    limit by the larger of that and ``save_bytes`` (what a save will write: a fresh start has nothing
    on disk to measure), so that a large checkpoint's load or save is never taken for a hang. Pure."""
    extra = checkpoint_bytes / CHECKPOINT_READ_FLOOR_BPS
    save_extra = max(checkpoint_bytes, save_bytes or 0) / CHECKPOINT_READ_FLOOR_BPS
    return replace(r, hang_setup_s=r.hang_setup_s + extra, hang_checkpoint_s=r.hang_checkpoint_s + save_extra)


@dataclass(frozen=True, kw_only=True)
class PauseSchedule:
    """When a run pauses between two iteration lines by itself (Megatron-LM's training.py ``train``:
    after an iteration's line, its validation pass, then its save): a save every ``save_interval``
    iterations and at the last, ``train_iters`` (``--save-interval``, and the save after the loop);
    a validation pass every ``eval_interval`` and at the end (``--eval-interval``, and the passes
    after the loop)."""

    save_interval: int
    train_iters: int
    eval_interval: int = 0
    background: bool = False
    """The saves end in the background (Megatron-LM's ``--async-save``): a save's finalize may stop
    a later step than its own."""
    log_interval: int = 1
    """Megatron-LM prints an iteration's line where it is a multiple of this (and an attempt's first)."""

    def next_line(self, iteration: int) -> int:
        """The iteration of the line after ``iteration``'s (training.py ``training_log``: every
        ``log_interval``). Pure."""
        step = max(self.log_interval, 1)
        return (iteration // step + 1) * step

    def saves_in(self, first: int, end: int) -> bool:
        """Whether an iteration in [first, end) saves. Pure."""
        return _due_in(self.save_interval, self.train_iters, first, end)

    def evaluates_in(self, first: int, end: int) -> bool:
        """Whether a validation pass follows an iteration in [first, end). Pure."""
        return _due_in(self.eval_interval, self.train_iters, first, end)


def _due_in(interval: int, last: int, first: int, end: int) -> bool:
    """Whether an iteration in [first, end) is a multiple of ``interval`` (> 0) or is ``last``."""
    if interval <= 0:
        return False
    first = max(first, 1)  # nothing at iteration 0
    return first <= last < end or -(-first // interval) * interval < end


def phase_limit_s(p: RankProgress, r: ResilienceParams) -> float | None:
    """How long ``p``'s current phase may last before the rank counts as hung; None = no limit."""
    if p.phase in (Phase.PREPARE, *ENDED_PHASES):
        return None
    if p.phase == Phase.SETUP or (p.phase == Phase.STEP and p.steps_done < r.hang_warmup_steps):
        return r.hang_setup_s
    if p.phase == Phase.CHECKPOINT:
        return r.hang_checkpoint_s
    if p.phase == Phase.EVAL:
        return r.hang_eval_s
    return max(r.hang_step_floor_s, r.hang_step_factor * (p.slowest_recent_step_s or 0.0))


# -- a slow rank: named while it happens ----------------------------------------------------------

SLOW_RANK_WARNING = "warning: slow rank"
"""How rank 0's log line naming slow ranks begins (status shows the latest one)."""
SLOW_RANK_CLEARED = "note: no slow rank"
"""How the line saying they caught up begins."""


@dataclass(frozen=True)
class BusyInterval:
    """One log interval as the slow-rank rule sees it."""

    steps: int
    seconds: float
    """Its wall time."""
    busy: tuple[float, ...]
    """Every rank's busy seconds in it (training/busy_clock.py), by global rank."""


@dataclass(frozen=True)
class SlowRank:
    """A rank whose busy time over the window is at least the ratio x the others' median."""

    rank: int
    seconds: float
    """Its busy time per step over the window."""
    others_median_s: float
    """The median of the other ranks' busy time per step over the window."""
    window_s: float
    """The wall time the window covers."""

    @property
    def ratio(self) -> float:
        return self.seconds / self.others_median_s if self.others_median_s > 0 else float("inf")


def window_of(intervals: list[BusyInterval], window_s: float) -> list[BusyInterval]:
    """The newest intervals that together cover at least ``window_s`` (all of them while they do
    not yet: a start's first seconds). Pure."""
    out, covered = [], 0.0
    for interval in reversed(intervals):
        out.append(interval)
        covered += interval.seconds
        if covered >= window_s:
            break
    return out[::-1]


def slow_ranks(intervals: list[BusyInterval], ratio: float, window_s: float) -> list[SlowRank]:
    """The ranks whose busy time summed over the last ``window_s`` seconds of log intervals is at
    least ``ratio`` x the median of the *other* ranks' sums. Summed over time, not judged step by
    step or interval by interval: a rank stopped for 0.4 s of every 0.8 s is slow in some steps and
    not in others, and what it costs the others is the sum. Busy time leaves out each rank's waits
    for the others, so the ranks that wait for a slow one are never named; a ratio, not seconds, so
    a machine that slows every rank alike (a CPU hog beside the run) names none. Against the
    others' median, not everyone's: with 2 ranks a rank 3x slower is 3x its peer. Nothing until the
    intervals cover the window: a start's first seconds are no pattern. Pure."""
    recent = window_of(intervals, window_s)
    covered = sum(i.seconds for i in recent)
    if covered < window_s or len(recent[-1].busy) < 2:
        return []
    steps = max(1, sum(i.steps for i in recent))
    sums = [sum(i.busy[rank] for i in recent if rank < len(i.busy)) for rank in range(len(recent[-1].busy))]
    out = []
    for rank, mine in enumerate(sums):
        median = statistics.median(sums[:rank] + sums[rank + 1:])
        if median > 0 and mine >= ratio * median:
            out.append(SlowRank(rank, mine / steps, median / steps, covered))
    return out


PERSIST_SHARE = 0.25
"""A rank is named once it has stayed slow (by :func:`slow_ranks`) through this share of the window
of step time in a row: a machine that shares its CPU unfairly for a moment (one rank descheduled
more than the other for a few seconds) names no one; a slow rank, steady or in bursts, stays."""


def still_slow(slow: list[SlowRank], slow_for_s: dict[int, float], interval_s: float) -> dict[int, float]:
    """Seconds of steps each rank of ``slow`` has stayed slow through, this interval's
    ``interval_s`` added to the count ``slow_for_s`` kept so far (a rank not slow now starts again). Pure."""
    return {s.rank: slow_for_s.get(s.rank, 0.0) + interval_s for s in slow}


def describe_slow_ranks(slow: list[SlowRank], ranks_per_node: int, hosts: list[str], ratio: float) -> str:
    """Rank 0's log line for them (node, host, local rank / GPU, the time against the median)."""
    def one(s: SlowRank) -> str:
        node = s.rank // ranks_per_node
        host = f", {hosts[s.rank]}" if s.rank < len(hosts) and hosts[s.rank] else ""
        return (f"{s.rank} (node {node}{host}, local rank {s.rank % ranks_per_node}): busy {s.seconds:.3f} s per step, "
                f"{s.ratio:.1f}x the median of the other ranks ({s.others_median_s:.3f} s)")
    window = max(s.window_s for s in slow)
    return (f"{SLOW_RANK_WARNING}{'s' if len(slow) > 1 else ''} {'; '.join(one(s) for s in slow)}, over the last "
            f"{window:.0f} s (busy: its steps less its waits for the others); every rank waits for it "
            f"(training.resilience.slow_rank_ratio {ratio:g})")
