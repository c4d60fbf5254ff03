"""A run's goodput: the share of its wall clock that trained, and where the rest went, by cause.

    python -m orchestration status demo                  # one line: goodput, productive of wall, each loss
    python -m orchestration compare demo_a demo_b        # the wall, goodput and largest-loss columns

Inputs: the attempts ledger (``run_state/<run>_attempts.json``, node 0's: when each attempt began,
on node 0's clock, and how it ended) and, per attempt, the iteration lines of the node that prints
them, cut out of its log at its supervisor's ``attempt K of M: starting torchrun`` line (this
program: node 0, whose local rank 0 is global rank 0; Megatron-LM: the node of the attempt's last
rank), the checkpoint saves between them (this program's ``saved checkpoint at iteration N ... in S
s``, or what training waited for of an asynchronous one; Megatron-LM's ``save-checkpoint ...: (min,
max)`` timer in ms, which times its synchronous part), and, from ``metrics.jsonl``, the
ranks named slow with every rank's busy time.

Each attempt's wall (its start to the next attempt's start, or to its end; a running one: as far as
its lines go) is cut into parts that add up to it:

- the lead, its start to its first step's start (the first line's time less its step time): startup
  for the run's first attempt, else the cause that ended the attempt before (a fault's recovery);
- each line's interval (since the line before; the first: its own step): its iterations at their
  measured step time, productive, or recomputed where a later attempt resumed before them (the
  first run of an iteration run twice is the lost one); of the productive time, what the other
  ranks waited for a rank named slow (its busy time less the others' median, per step) is
  straggler; the saves printed in the interval are checkpoints; the rest (evaluation, logging,
  waits for data) is other;
- the tail, the last line to the attempt's end: the cause of that end (crash, hang, lost node,
  preemption; the run's end after its last line: shutdown), less the saves printed there.

An attempt that printed no line gives all of its wall to how it ended. So a fault costs its tail
(from the last progress before it to the next attempt's start), the next attempt's lead (to its
first iteration) and the iterations it had done past the checkpoint the next attempt resumed from.

Clocks: no time of one machine is subtracted from another's. The ledger's times are node 0's; this
program's lines are node 0's too; Megatron-LM's lines are the printing node's, which on more than one
node is not node 0: there the lead ends at node 0's own ``[before the start of training step]`` line
and the rest of the attempt is measured in durations on the printing node's clock. The lines' local
times are read in this machine's time zone, corrected by whole quarter hours to ``metrics.jsonl``'s
epoch times where there are some. Tolerance: a line's time is taken when it is printed (after its
step, and this program's log collective), so each boundary is good to one log interval.

Pure, apart from :func:`read_goodput_inputs` (the ledger, the logs, ``metrics.jsonl``).
"""

from __future__ import annotations

import enum
import re
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from megatron_ext.run_spec.engines import Engine, engine_named
from megatron_ext.run_spec.iteration_log import IterationRecord, looks_like_iteration_line, parse_iteration_line, read_metrics
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.analysis.merged_log import ATTEMPT_LINE, line_time
from orchestration.node.run_state import AttemptRecord, FailureKind, RunState, read_exit, read_ledger


class Part(str, enum.Enum):
    """Where a second of the wall clock went."""

    PRODUCTIVE = "productive"
    """Steps of iterations that count (not recomputed later), at their measured step time."""
    STARTUP = "startup"
    """The run's first attempt: its start to its first step (launch, imports, data, model, resume)."""
    CHECKPOINTS = "checkpoints"
    """Saves on the training path, as the saving program timed them."""
    RECOMPUTED = "recomputed"
    """Iterations done again after a restart: their first run, from the resume point to the furthest reached."""
    CRASH = "crash"
    HANG = "hang"
    LOST_NODE = "lost node"
    PREEMPTION = "preemption"
    """A save on request and its restart (preemption, a time limit, the save a restart asks for so that a node
    rejoins or a slow one is left out)."""
    STRAGGLER = "straggler"
    """Of the productive steps, the time the other ranks waited for a rank named slow."""
    SHUTDOWN = "shutdown"
    """After the run's last line: the final evaluation, teardown, or a stop."""
    OTHER = "other"
    """Between lines, beyond their steps and saves: evaluation, logging, waits for data."""

    def __str__(self) -> str:
        return self.value


FAULTS = (Part.CRASH, Part.HANG, Part.LOST_NODE, Part.PREEMPTION)
"""The causes that end an attempt and cost a detection, a restart and recomputed iterations."""
SHOWN_FROM_S = 0.05
"""A part smaller than this is left out of the status line (it is still in the totals)."""


# -- inputs -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TimedIteration:
    """One iteration line of an attempt, with its time."""

    iteration: int
    time: float
    """When the line was printed (seconds since the epoch, on the printing node's clock)."""
    step_time_s: float
    """The mean step time over the iterations the line covers."""
    covers: int = 1
    """Iterations since the attempt's line before (its first line: 1, the first step after its start)."""
    straggler_s: float = 0.0
    """Per iteration: how long the others waited for a rank named slow (0: none named)."""


@dataclass(frozen=True)
class Save:
    """A checkpoint save on the training path."""

    after: int
    """How many of the attempt's iteration lines were printed before it."""
    seconds: float


@dataclass(frozen=True, kw_only=True)
class AttemptLog:
    """What the printing node's log says of one attempt."""

    attempt: int
    node: int = 0
    """The node whose log (and clock) ``iterations`` are: node 0 shares the ledger's clock."""
    iterations: tuple[TimedIteration, ...] = ()
    saves: tuple[Save, ...] = ()
    training_started_at: float | None = None
    """Node 0's clock: where the lead ends when ``node`` is another node (Megatron-LM's rank 0 line)."""


@dataclass(frozen=True, kw_only=True)
class GoodputInputs:
    ledger: tuple[AttemptRecord, ...]
    logs: Mapping[int, AttemptLog] = field(default_factory=dict)
    """attempt -> its log (an attempt without one printed nothing readable)."""
    notes: tuple[str, ...] = ()


# -- the breakdown ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Fault:
    """What one attempt's end cost."""

    attempt: int
    cause: Part
    reason: str
    detect_s: float
    """Its last line to the next attempt's start (the run's end, when none followed)."""
    restart_s: float
    """The next attempt's start to its first step (0 when it printed none: its own end takes it)."""
    recomputed_s: float
    recomputed_iterations: int


@dataclass(frozen=True, kw_only=True)
class AttemptGoodput:
    attempt: int
    state: str | None
    """How it ended (None: running)."""
    wall_s: float
    parts: dict[str, float]
    """Every :class:`Part`'s seconds, in that order; they add up to ``wall_s``."""

    @property
    def goodput(self) -> float | None:
        return self.parts[Part.PRODUCTIVE.value] / self.wall_s if self.wall_s > 0 else None


@dataclass(frozen=True, kw_only=True)
class Goodput:
    wall_s: float
    """Node 0's clock: the first attempt's start to the last one's end (running: as far as the lines go)."""
    parts: dict[str, float]
    """Every :class:`Part`'s seconds, in that order; they add up to ``wall_s``."""
    attempts: tuple[AttemptGoodput, ...]
    faults: tuple[Fault, ...]
    running: bool
    notes: tuple[str, ...] = ()

    @property
    def goodput(self) -> float | None:
        return self.parts[Part.PRODUCTIVE.value] / self.wall_s if self.wall_s > 0 else None

    def seconds(self, part: Part) -> float:
        return self.parts[part.value]


def _zero() -> dict[str, float]:
    return {p.value: 0.0 for p in Part}


def end_cause(record: AttemptRecord, restarted: bool) -> Part:
    """What an attempt's end (its tail, and the next attempt's lead) is counted as: its state and the
    kind of the failure that ended it."""
    reason = record.reason or ""  # a ledger written before it kept the failure's kind: the kind from its reason's words
    kind = record.failure_kind or (FailureKind.LOST if " lost: " in reason or " gone (its machine" in reason
                                   else FailureKind.HUNG if " hung" in reason else None)
    if record.lost or kind == FailureKind.LOST:
        return Part.LOST_NODE
    if record.state == RunState.HUNG or (record.state == RunState.GAVE_UP and kind == FailureKind.HUNG):
        return Part.HANG
    if record.state in (RunState.FAILED, RunState.GAVE_UP):
        return Part.CRASH
    if record.state == RunState.PREEMPTED:
        return Part.PREEMPTION
    if record.state in (RunState.FINISHED, RunState.STOPPED) and not restarted:
        return Part.SHUTDOWN
    return Part.OTHER


def _take(parts: dict[str, float], amount: float, order: Sequence[Part]) -> None:
    """Take ``amount`` seconds out of ``parts``, from the first of ``order`` on (clock granularity)."""
    for part in order:
        cut = min(amount, parts[part.value])
        parts[part.value] -= cut
        amount -= cut
        if amount <= 0:
            return


def _line_intervals(lines: Sequence[TimedIteration], saves: Mapping[int, float],
                    redo_from: int | None) -> tuple[dict[Part, float], float, int]:
    """An attempt's line intervals (the first: its own steps) cut into productive, recomputed (its
    iterations past ``redo_from``), straggler, checkpoints (``saves``: line index -> seconds printed
    before it) and other: (those sums, the intervals' total, the iterations recomputed). Sums first,
    parts once: a day's lines at status's every call."""
    productive = recomputed = slow = stalls = other = active = 0.0
    redone = 0
    redo = redo_from if redo_from is not None else lines[-1].iteration
    before = None
    for j, line in enumerate(lines):
        covers = line.covers if line.covers > 1 else 1
        steps = covers * line.step_time_s if line.step_time_s > 0 else 0.0
        span = steps if before is None else (line.time - before if line.time > before else 0.0)
        before = line.time
        if steps > span:
            steps = span
        lost = line.iteration - redo
        lost = 0 if lost <= 0 else (covers if lost > covers else lost)
        redone += lost
        share = steps * lost / covers
        counted = steps - share
        straggled = min(counted, (covers - lost) * line.straggler_s) if line.straggler_s > 0 else 0.0
        recomputed += share
        slow += straggled
        productive += counted - straggled
        stall = min(saves.get(j, 0.0), span - steps) if j else 0.0
        stalls += stall
        other += span - steps - stall
        active += span
    sums = {Part.PRODUCTIVE: productive, Part.RECOMPUTED: recomputed, Part.STRAGGLER: slow, Part.CHECKPOINTS: stalls,
            Part.OTHER: other}
    return sums, active, redone


def compute_goodput(inputs: GoodputInputs) -> Goodput:
    """The breakdown of the ledger's wall clock (see the module); pure."""
    ledger = sorted(inputs.ledger, key=lambda r: r.attempt)
    logs = dict(inputs.logs)
    resumes = {a: log.iterations[0].iteration - log.iterations[0].covers for a, log in logs.items() if log.iterations}
    totals, attempts, notes = _zero(), [], list(inputs.notes)
    leads: dict[int, float] = {}
    """attempt -> its lead, where counted to the attempt before's end"""
    tails: dict[int, float] = {}
    redone: dict[int, int] = {}
    """attempt -> its iterations a later attempt did again"""
    running = False
    for i, record in enumerate(ledger):
        following = ledger[i + 1:]
        log = logs.get(record.attempt) or AttemptLog(attempt=record.attempt)
        lines = log.iterations
        redo_from = min((resumes[r.attempt] for r in following if r.attempt in resumes), default=None)
        lead_part = Part.STARTUP if i == 0 else end_cause(ledger[i - 1], True)
        cause = end_cause(record, bool(following))
        end = following[0].started_at if following else record.ended_at
        saves: dict[int, float] = {}
        for save in log.saves:
            at = min(save.after, len(lines))
            saves[at] = saves.get(at, 0.0) + save.seconds
        parts = _zero()
        lead = lead_share = active = 0.0
        redone[record.attempt] = 0
        if lines:
            first_start = lines[0].time - lines[0].covers * lines[0].step_time_s
            if log.node == 0:
                lead = first_start - record.started_at
            elif log.training_started_at is not None:
                lead = log.training_started_at - record.started_at
            lead = max(0.0, lead)
            saved = min(saves.get(0, 0.0), lead)
            parts[Part.CHECKPOINTS.value] += saved
            lead_share = lead - saved
            sums, active, redone[record.attempt] = _line_intervals(lines, saves, redo_from)
            for part, seconds in sums.items():
                parts[part.value] += seconds
        if end is None:  # running: as far as its lines go
            running = True
            end = record.started_at + lead + active
            if not lines:
                notes.append(f"attempt {record.attempt} has printed no iteration yet: its time so far is not counted")
        tail = end - record.started_at - lead - active
        if tail < 0:  # the lines' clock ran past the ledger's end (clock granularity, a late line)
            cut = min(-tail, lead_share)
            lead_share -= cut
            _take(parts, -tail - cut, (Part.OTHER, Part.CHECKPOINTS, Part.STRAGGLER, Part.RECOMPUTED, Part.PRODUCTIVE))
            tail = 0.0
        parts[lead_part.value] += lead_share
        saved = min(saves.get(len(lines), 0.0) if lines else sum(saves.values()), tail)
        parts[Part.CHECKPOINTS.value] += saved
        parts[cause.value] += tail - saved
        leads[record.attempt] = lead_share if lines and i else 0.0
        tails[record.attempt] = tail - saved
        wall = end - record.started_at
        attempts.append(AttemptGoodput(attempt=record.attempt, state=record.state.value if record.state else None, wall_s=wall,
                                       parts=parts))
        for p, s in parts.items():
            totals[p] += s
    faults = []
    for i, (record, attempt) in enumerate(zip(ledger, attempts)):
        following = ledger[i + 1] if i + 1 < len(ledger) else None
        cause = end_cause(record, following is not None)
        if cause in FAULTS:
            faults.append(Fault(attempt=record.attempt, cause=cause, reason=record.reason or "", detect_s=tails[record.attempt],
                                restart_s=leads[following.attempt] if following else 0.0,
                                recomputed_s=attempt.parts[Part.RECOMPUTED.value], recomputed_iterations=redone[record.attempt]))
    wall = sum(a.wall_s for a in attempts)
    return Goodput(wall_s=wall, parts=totals, attempts=tuple(attempts), faults=tuple(faults), running=running, notes=tuple(notes))


# -- the text -----------------------------------------------------------------------------------------

def format_duration(seconds: float) -> str:
    """``12.3s``, ``4m05.2s``, ``3h12m07s`` (a tenth of a second up to an hour, then seconds)."""
    tenths = round(seconds * 10)
    if tenths < 600:
        return f"{tenths / 10:.1f}s"
    if tenths < 36000:
        minutes, rest = divmod(tenths, 600)
        return f"{minutes}m{rest // 10:02d}.{rest % 10}s"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s"


def format_losses(parts: Mapping[str, float]) -> str:
    """``startup 14.2s, hang 12.5s, ...``: every loss of at least :data:`SHOWN_FROM_S`, in :class:`Part` order."""
    return ", ".join(f"{p} {format_duration(s)}" for p, s in parts.items()
                     if p != Part.PRODUCTIVE.value and s >= SHOWN_FROM_S)


def format_goodput_line(g: Goodput) -> str:
    """Status's line: ``goodput 71.2%: 2m12.0s productive of 3m05.3s since the first start; lost:
    startup 14.2s, ...; by attempt 1: 80%, 2: 65%``."""
    if g.goodput is None:
        return "goodput: - (no iteration yet)"
    text = (f"goodput {g.goodput:.1%}: {format_duration(g.seconds(Part.PRODUCTIVE))} productive of "
            f"{format_duration(g.wall_s)} since the first start")
    losses = format_losses(g.parts)
    if losses:
        text += f"; lost: {losses}"
    if len(g.attempts) > 1:
        text += "; by attempt " + ", ".join(f"{a.attempt}: {a.goodput:.0%}" if a.goodput is not None else f"{a.attempt}: -"
                                            for a in g.attempts)
    if g.running:
        text += " (running: as far as its lines go)"
    return text + "".join(f" ({note})" for note in g.notes)


# -- the logs (pure: lines in) --------------------------------------------------------------------------

_SAVED = re.compile(r"saved checkpoint at iteration (\d+) to .* in ([0-9.]+) s")
"""This program's rank 0 after a save (megatron_ext/training/loop.py)."""
_WAITED = re.compile(r"training waited ([0-9.]+) s")
"""The part of an asynchronous save (training.async_save) that training waited for: its stall."""
_SAVE_TIMER = re.compile(r"^\s+save-checkpoint(?:-non-persistent)? \.*: \(?([0-9.]+)(?:, ([0-9.]+))?\)?")
"""Megatron-LM's timer after a save (its last rank; ms, the max over ranks last)."""
TRAINING_STARTED = "[before the start of training step] datetime: "
"""Megatron-LM's rank 0 (node 0), right before its first step."""
_STEP = re.compile(r" ?\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\] iteration +(\d+)/ *\d+ \| consumed samples: +\d+ \| "
                   r"elapsed time per iteration \(ms\): ([0-9.]+) \|")
"""The two fields of an iteration line read here, fast (a day's lines at status's every call); a
line that looks like one and does not match is read by the project's parser (iteration_log.py)."""
HEAD_LINES = 2
"""The first lines of an attempt read by the engine's own parser: Megatron-LM prints as its second
line the mean of the first two (iteration_log.undo_first_interval_mean)."""


@dataclass(frozen=True)
class LogSegment:
    """The lines of one attempt in a node's log (from its supervisor's start line on), those that matter here."""

    attempt: int
    lines: tuple[str, ...]


def split_attempts(raws: Iterable[str]) -> list[LogSegment]:
    """A node's log cut at its supervisor's ``attempt K of M: starting torchrun`` lines (the lines
    before the first are dropped); only the lines this module reads are kept."""
    out: list[LogSegment] = []
    number, kept = None, []
    for raw in raws:
        if "iteration" not in raw and "save" not in raw and not raw.startswith("[supervisor node") and \
                TRAINING_STARTED not in raw:
            continue
        if raw.startswith("[supervisor node"):
            m = ATTEMPT_LINE.search(raw)
            if m:
                if number is not None:
                    out.append(LogSegment(number, tuple(kept)))
                number, kept = int(m.group(1)), []
        if number is not None:
            kept.append(raw)
    if number is not None:
        out.append(LogSegment(number, tuple(kept)))
    return out


def match_segments(segments: Sequence[LogSegment], attempts: Sequence[int]) -> dict[int, LogSegment]:
    """Each ledger attempt's segment: the last one of its number before the next attempt's (a log
    holds every start of the run; each start counts from 1 again, a requeued job counts on)."""
    out, before = {}, len(segments)
    for attempt in sorted(attempts, reverse=True):
        at = next((i for i in range(before - 1, -1, -1) if segments[i].attempt == attempt), None)
        if at is not None:
            out[attempt], before = segments[at], at
    return out


def _time(raw: str) -> float | None:
    """The time a line starts with (seconds since the epoch; every line read here names its year)."""
    return line_time(raw, 1970)[0]


def attempt_log(segment: LogSegment, engine: Engine, node: int, zone_s: float = 0.0,
                straggler_s: Mapping[int, float] | None = None, training_started_at: float | None = None) -> AttemptLog:
    """One attempt's lines as the engine's parser reads them (Megatron-LM: its second line after a start
    made that interval's own), each with its time (``zone_s`` added: the log's time zone against
    the epoch), and the saves between them."""
    found: list[tuple[int, float, float | None]] = []  # (iteration, step time, time)
    head: list[str] = []
    saves = []
    for raw in segment.lines:
        if len(found) < HEAD_LINES:
            head.append(raw)
        m = _STEP.match(raw)
        if m:
            found.append((int(m.group(1)), float(m.group(2)) / 1000, _time(raw)))
            continue
        if looks_like_iteration_line(raw):
            record = parse_iteration_line(raw)
            if record is not None:
                found.append((record.iteration, record.step_time_s, _time(raw)))
            continue
        seen = len(found)
        saved = _SAVED.search(raw)
        timer = _SAVE_TIMER.match(raw) if saved is None else None
        if saved:
            waited = _WAITED.search(raw, saved.end())
            saves.append(Save(seen, float((waited or saved).group(1 if waited else 2))))
        elif timer:
            saves.append(Save(seen, float(timer.group(2) or timer.group(1)) / 1000))
    own = {r.iteration: r.step_time_s for r in engine.parse_log("\n".join(head))[0]}
    straggler_s = straggler_s or {}
    lines, previous = [], None
    for k, (iteration, step_s, t) in enumerate(found):
        if t is None:
            continue
        covers = 1 if previous is None else max(1, iteration - previous)
        step_s = own.get(iteration, step_s) if k < HEAD_LINES else step_s
        lines.append(TimedIteration(iteration, t + zone_s, step_s, covers, straggler_s.get(iteration, 0.0)))
        previous = iteration
    return AttemptLog(attempt=segment.attempt, node=node, iterations=tuple(lines), saves=tuple(saves),
                      training_started_at=training_started_at)


def training_started(segment: LogSegment, zone_s: float = 0.0) -> float | None:
    """Megatron-LM's rank 0 line before its first step, on node 0's clock (epoch seconds)."""
    for raw in segment.lines:
        at = raw.find(TRAINING_STARTED)
        if at >= 0:
            t = _time(raw[at + len(TRAINING_STARTED):])
            return None if t is None else t + zone_s
    return None


def straggler_seconds(records: Iterable[IterationRecord]) -> dict[int, float]:
    """iteration -> per step, how long the others waited for the slowest rank named slow at that record:
    its busy time less the median of the others' (``metrics.jsonl``'s slow_ranks, busy_s_per_rank)."""
    out = {}
    for r in records:
        if not r.slow_ranks or not r.busy_s_per_rank:
            continue
        busy = r.busy_s_per_rank
        others = [b for rank, b in enumerate(busy) if rank not in r.slow_ranks]
        slow = [busy[rank] for rank in r.slow_ranks if rank < len(busy)]
        if others and slow:
            out[r.iteration] = max(0.0, max(slow) - statistics.median(others))
    return out


def zone_offset_s(lines: Iterable[TimedIteration], records: Iterable[IterationRecord]) -> float:
    """What to add to the log's times (read in this machine's time zone) to make them epoch seconds:
    the median difference to ``metrics.jsonl``'s times of the same iterations, in whole quarter hours
    (a time zone; the writer's own clock is the same machine's); 0 without any to compare."""
    last = {line.iteration: line.time for line in lines}
    diffs = [r.time - last[r.iteration] for r in records if r.time and r.iteration in last]
    return round(statistics.median(diffs) / 900) * 900.0 if diffs else 0.0


# -- the edge: the run's files -------------------------------------------------------------------------

def _read_segments(path: Path) -> list[LogSegment] | None:
    """A node log's attempts (:func:`split_attempts`), read line by line; None when it cannot be read."""
    try:
        with open(path, errors="replace") as fh:
            return split_attempts(line.rstrip("\n") for line in fh)
    except OSError:
        return None


ZONE_SAMPLE = 100
"""Of ``metrics.jsonl``'s records without a slow rank, goodput reads every 100th and the last 100:
enough for the time zone's median (:func:`zone_offset_s`); a run of days has hundreds of thousands."""


def goodput_reads(i: int, lines: int, text: str) -> bool:
    """Whether goodput needs line ``i`` of ``metrics.jsonl`` (of ``lines``): a record naming a slow
    rank (:func:`straggler_seconds`), or one of the time zone's sample; decided on the text, unparsed."""
    unnamed = '"slow_ranks": []' in text or '"slow_ranks": null' in text
    return not unnamed or i % ZONE_SAMPLE == 0 or i >= lines - ZONE_SAMPLE


def read_goodput_inputs(paths: RunPaths) -> GoodputInputs | None:
    """The ledger and each attempt's lines from the run's files (this machine's view of the artifact
    root); None without a ledger. Side effects: reads the ledger (its last attempt still open: node 0's
    exit record, if any, ends it), the printing nodes' logs (whole: only their iteration, save and
    attempt lines are kept) and ``metrics.jsonl`` (the records :func:`goodput_reads` keeps)."""
    ledger = tuple(read_ledger(paths))
    if not ledger:
        return None
    ended = read_exit(paths, 0, ledger[-1].run_id) if ledger[-1].ended_at is None else None
    if ended is not None:  # a stop ends node 0's supervisor before it closes the ledger: its exit record (its clock too)
        ledger = (*ledger[:-1], replace(ledger[-1], ended_at=ended.ended_at, state=ended.state, reason=ended.reason))
    resolved = read_resolved(paths.params_path)
    engine = engine_named(resolved.runtime.engine if resolved else None)
    nnodes = resolved.runtime.nnodes if resolved else 1
    printers = {r.attempt: (max(r.nodes) if r.nodes else nnodes - 1) if engine.progress_from_log else 0 for r in ledger}
    segments: dict[int, dict[int, LogSegment]] = {}
    notes = []
    for node in sorted({*printers.values(), 0}):
        found = _read_segments(paths.node_log(node))
        if found is None:
            if node in printers.values():
                notes.append(f"node {node}'s log ({paths.node_log(node)}) is not readable here: its attempts count as "
                             "printing nothing")
            continue
        segments[node] = match_segments(found, [r.attempt for r in ledger])
    metrics = read_metrics(paths.metrics_path, goodput_reads) if not engine.progress_from_log else []
    slow = straggler_seconds(metrics)
    logs = {a: attempt_log(segments[n][a], engine, n, 0.0, slow) for a, n in printers.items()
            if a in segments.get(n, {})}
    zone = zone_offset_s([line for log in logs.values() for line in log.iterations], metrics)
    if zone:
        notes.append(f"the logs' times read {zone / 3600:+.2f} h off metrics.jsonl's (another time zone): corrected")
        logs = {a: replace(log, iterations=tuple(replace(line, time=line.time + zone) for line in log.iterations))
                for a, log in logs.items()}
    for a, log in logs.items():
        if log.node != 0 and a in segments.get(0, {}):
            logs[a] = replace(log, training_started_at=training_started(segments[0][a], zone))
    return GoodputInputs(ledger=ledger, logs=logs, notes=tuple(notes))


def read_goodput(paths: RunPaths) -> Goodput | None:
    """The run's goodput from its files (:func:`read_goodput_inputs`, :func:`compute_goodput`), or None without a ledger."""
    inputs = read_goodput_inputs(paths)
    return compute_goodput(inputs) if inputs is not None else None
