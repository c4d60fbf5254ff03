"""A run's merged log: every node's log in one stream, in time order, each line named by its node,
host and rank, the lines many ranks print alike shown once.

    python -m orchestration logs demo --since 10m --rank 3      # read by orchestration/runner/node_logs.py

Output (:func:`format_group`)::

    [node1 g0034 rank5] RuntimeError: ... Connection closed by peer ...      a line of rank 5 (torch's ``[rank5]:``)
    [node1 g0034 supervisor] restarting as attempt 2 in 5 s: ...            the node's supervisor (``[supervisor node1]``)
    [node1 g0034 torchrun] E1206 08:22:06.282000 16957 ...] failed ...      torchrun itself
    [node1 g0034 rank?]  [2026-12-06 08:20:52.630221] iteration 10/ 30 ...  a rank of node 1 the line does not name
    [nodes 0-3 ranks 0-31] Traceback (most recent call last):               the same line from 32 ranks, shown once
    [node0 g0033 rank? x8] > building GPT model ...                         the same line 8 times in a row

Who printed a line (:class:`NodeLines`): the ranks share the node log unprefixed, so a line names its
rank only where it says so: torch's ``[rankN]:`` (every rank's uncaught exception, c10d's messages),
the program's ``error: rank N: ...``. The supervisor's lines start ``[supervisor nodeN]``; torchrun's
are its own logger's (``W1206 08:22:06.248000 PID file:line] ...``), its OMP_NUM_THREADS banner and
its error summary. Every other line is ``rank?``: by this program's rule rank 0 or each node's local
rank 0 prints it (warnings: rank 0 alone), under Megatron-LM any rank.

When a line happened (its key): the time it starts with (Megatron-LM's iteration line
``[2026-12-06 08:20:52.630221]``, torchrun's and c10d's loggers, Python's logging), on its node's
clock less that node's offset (:func:`clock_offsets`: the median difference of the iteration lines
every node's local rank 0 prints after the same step, against the first node that prints them; none
measured: 0); a line without a time takes the key of the next line in its node's log that has one
(a rank's traceback, a supervisor's reaction: the torchrun line that follows them, often within a
second, where the last timed line before them can be a step or a hang's minutes earlier); the lines
after a node's last time, that last time. Keys never go down within a node: its own order is the
file's. Order of the merge: by attempt (the supervisors' ``attempt K of M: starting torchrun``
lines: every node's lines of attempt K come before any node's of attempt K+1, however their clocks
run), then by key, then by node. Limits: between two timed lines a node's lines may be shown up to
that gap late against the other nodes' (during training one log interval; a progress line comes
with the next step's); the offsets need iteration lines on two nodes (Megatron-LM prints them on the
last rank only), without them the nodes' clocks are taken as they are.

Repeated lines (:class:`Collapser`): a line whose text (after its prefix) equals an earlier one's
within :data:`COLLAPSE_WINDOW_LINES` merged lines and :data:`COLLAPSE_WINDOW_S` seconds, printed by
another node or rank of the same kind (named ranks with named ranks, ``rank?`` with ``rank?``,
torchrun with torchrun, supervisors with supervisors), or by the same one directly after it, joins
that line: shown once, where the first was, its label naming every node and rank, ``xN`` where it
came more often than from different sources.
Pure: lines in, lines out (the reading, from the end, over the transport: runner/node_logs.py).
"""

from __future__ import annotations

import heapq
import re
import statistics
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Iterator, Mapping, Sequence

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED

SUPERVISOR, TORCHRUN, UNNAMED = "supervisor", "torchrun", "rank?"
"""Who printed a line, when not a named rank (``rank5``)."""
COLLAPSE_WINDOW_LINES = 4000
"""How far (merged lines) a repeated line may come after the first and still join it: 32 ranks x a
traceback of 100 lines, each rank's printed whole one after another."""
COLLAPSE_WINDOW_S = 30.0
"""How late (seconds of key) a repeated line may come after the first and still join it."""
HOLD_LINES = 10_000
"""Lines without a time held for the next time at most (a log of untimed lines goes on at the last time)."""

_SUPERVISOR = re.compile(r"\[supervisor node(\d+)\] ")
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]: ?")
_ERROR_OF_RANK = re.compile(r"error: rank (\d+): ")
ATTEMPT_LINE = re.compile(rf"attempt (\d+) of \d+: {re.escape(ATTEMPT_STARTED)}")
_ISO_TIME = re.compile(r" ?\[?(\d{4}-\d\d-\d\d)[ T_](\d\d:\d\d:\d\d)(?:[.,](\d{1,6}))?")
_GLOG_TIME = re.compile(r"\[?[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d)\.(\d{1,9})[ \]]")
_GLOG_LINE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
_ITERATION = re.compile(r" ?\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\] iteration +(\d+)/")
_GLOG_FIRST = frozenset("IWEF")
_ISO_FIRST = frozenset(" [0123456789")
_TIME_FIRST = _GLOG_FIRST | _ISO_FIRST
_BANNER = "*" * 20
_OMP_NOTE = "Setting OMP_NUM_THREADS environment variable for each process"
_ROOT_CAUSE = "Root Cause (first observed failure):"
_SINCE_SPAN = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_SPAN_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# -- one line ---------------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class LogLine:
    """One line of a node's log, named and placed."""

    node: int
    who: str
    """``rank5``, ``rank?``, ``supervisor`` or ``torchrun``."""
    rank: int | None
    """The global rank the line names, else None."""
    text: str
    """The line less the prefix its label replaces (``[rank5]: ``, ``[supervisor node1] ``)."""
    key: float
    """Where the merge places it (seconds since the epoch, on the reference clock; see the module)."""
    attempt: int
    """The attempt it belongs to, as an ordinal (a new start of the run counts on from the last)."""
    seq: int
    """Its place in its node's log, as read."""


_HOUR_EPOCH: dict[str, float] = {}


def _epoch(day: str, clock: str) -> float:
    """``2026-12-06`` ``08:20:52`` as seconds since the epoch (local time, as the nodes print it); the
    hour's start converted once (a clock change falls on an hour), its minutes and seconds added."""
    hour = day + clock[:2]
    base = _HOUR_EPOCH.get(hour)
    if base is None:
        if len(_HOUR_EPOCH) > 100_000:
            _HOUR_EPOCH.clear()
        base = _HOUR_EPOCH[hour] = datetime.strptime(hour, "%Y-%m-%d%H").timestamp()
    minutes, seconds = int(clock[3:5]), int(clock[6:8])
    if minutes > 59 or seconds > 60:
        raise ValueError(clock)
    return base + minutes * 60 + seconds


def line_time(text: str, year: int) -> tuple[float | None, int | None]:
    """(the time ``text`` starts with, in seconds since the epoch, or None; the year it names, or None):
    ``[2026-12-06 08:20:52.630221]``, ``2026-12-06 08:20:52,630``, or torchrun's ``W1206
    08:22:06.248000 PID`` and c10d's ``[W1206 08:57:36.557564534 socket.cpp:207]`` (which name no
    year: ``year``'s)."""
    first = text[:1]
    if first in _GLOG_FIRST or (first == "[" and text[1:2] in _GLOG_FIRST):
        m = _GLOG_TIME.match(text)
        if m:
            try:
                return _epoch(f"{year:04d}-{m.group(1)}-{m.group(2)}", m.group(3)) + int(m.group(4)) / 10 ** len(m.group(4)), None
            except ValueError:
                return None, None
    if first in _ISO_FIRST:
        m = _ISO_TIME.match(text)
        if m:
            try:
                t = _epoch(m.group(1), m.group(2)) + (int(m.group(3)) / 10 ** len(m.group(3)) if m.group(3) else 0.0)
            except ValueError:
                return None, None
            return t, int(m.group(1)[:4])
    return None, None


def classify(raw: str) -> tuple[str, int | None, str]:
    """(who, rank, text) of one line on its own, without the context of the lines before it (a
    torchrun summary's inner lines are ``rank?`` here; :class:`NodeLines` knows better)."""
    if raw.startswith("[supervisor node"):
        m = _SUPERVISOR.match(raw)
        if m:
            return SUPERVISOR, None, raw[m.end():]
    elif raw.startswith("[rank"):
        m = _RANK_PREFIX.match(raw)
        if m:
            rank = int(m.group(1))
            return f"rank{rank}", rank, raw[m.end():]
    elif raw.startswith("error: rank "):
        m = _ERROR_OF_RANK.match(raw)
        if m:
            rank = int(m.group(1))
            return f"rank{rank}", rank, raw
    if (raw[:1] in _GLOG_FIRST and _GLOG_LINE.match(raw)) or raw.startswith((_BANNER, _OMP_NOTE)):
        return TORCHRUN, None, raw
    return UNNAMED, None, raw


class NodeLines:
    """One node's lines, in its log's order, named and keyed (the module's rules). Feed it raw lines
    (:meth:`feed`), then :meth:`flush` at the end of what is read; ``attempt`` is the attempt the first
    line belongs to (0 at the log's start; a read from the middle gives the one it found)."""

    def __init__(self, node: int, offset_s: float = 0.0, attempt: int = 0, year: int | None = None):
        self.node, self.offset_s, self.attempt = node, offset_s, attempt
        self.last_attempt_number = attempt
        self.year = year or datetime.now().year
        self.key: float | None = None
        self.held: list[LogLine] = []
        self.seq = 0
        self.in_summary = False
        self.after_torchrun = False
        self.root_cause_seen = False

    def _who(self, raw: str) -> tuple[str, int | None, str]:
        who, rank, text = classify(raw)
        if who == UNNAMED and (self.in_summary or (self.after_torchrun and raw.startswith(("Traceback (most recent", "=====")))):
            self.in_summary = True  # torchrun's own traceback and error summary, after its error line
            if raw.startswith(_ROOT_CAUSE):
                self.root_cause_seen = True
            elif self.root_cause_seen and raw.startswith("=====") and not raw.strip("="):
                self.in_summary = self.root_cause_seen = False  # the summary's last line
            return TORCHRUN, None, raw
        self.in_summary = self.root_cause_seen = False
        self.after_torchrun = who == TORCHRUN
        if who == SUPERVISOR:
            m = ATTEMPT_LINE.match(text)
            if m:
                number = int(m.group(1))
                # a new start of the run counts its attempts from 1 again: ordinal on from the last
                self.attempt += number - self.last_attempt_number if number > self.last_attempt_number else 1
                self.last_attempt_number = number
        return who, rank, text

    def feed(self, raws: Iterable[str]) -> list[LogLine]:
        """The lines ready to merge: a line without a time is held until the next line with one (whose
        time it takes), or until :data:`HOLD_LINES` wait (then, as at :meth:`flush`, the last time)."""
        out: list[LogLine] = []
        for raw in raws:
            if not raw:
                continue  # blank lines (torchrun's before its banner) say nothing
            who, rank, text = self._who(raw)
            t, year = line_time(text, self.year) if text[:1] in _TIME_FIRST else (None, None)
            line = LogLine(node=self.node, who=who, rank=rank, text=text, key=0.0, attempt=self.attempt, seq=self.seq)
            self.seq += 1
            if t is None:
                self.held.append(line)
                if len(self.held) >= HOLD_LINES:
                    out += self.flush()
                continue
            self.year = year or self.year
            t -= self.offset_s
            self.key = t if self.key is None or t > self.key else self.key
            line.key = self.key
            if self.held:
                for h in self.held:
                    h.key = self.key
                out += self.held
                self.held = []
            out.append(line)
        return out

    def flush(self) -> list[LogLine]:
        """The lines still held for want of a next time: at the last time before them, else first in
        their attempt (a log without any time)."""
        out, self.held = self.held, []
        for h in out:
            h.key = self.key if self.key is not None else float("-inf")
        return out


def node_stream(node: NodeLines, batches: Iterable[Sequence[str]]) -> Iterator[LogLine]:
    """Every line of ``batches`` (raw lines, in order) as :class:`NodeLines` makes them."""
    for batch in batches:
        yield from node.feed(batch)
    yield from node.flush()


# -- the nodes' clocks -------------------------------------------------------------------------------

def iteration_times(raws: Iterable[str]) -> dict[int, float]:
    """iteration -> the time of its last iteration line in ``raws`` (this node's clock)."""
    out: dict[int, float] = {}
    for raw in raws:
        if "] iteration " in raw:
            m = _ITERATION.match(raw)
            if m:
                day, _, clock = m.group(1).partition(" ")
                whole, _, frac = clock.partition(".")
                out[int(m.group(2))] = _epoch(day, whole) + (int(frac) / 10 ** len(frac) if frac else 0.0)
    return out


def clock_offsets(times: Mapping[int, Mapping[int, float]]) -> dict[int, float]:
    """node -> how far its clock runs ahead of the first node's with iteration lines: the median, over
    the iterations both logged, of the difference of their lines' times (every node's local rank 0
    prints an iteration's line right after the step all ranks took together); 0 without any."""
    nodes = sorted(n for n, t in times.items() if t)
    if not nodes:
        return {n: 0.0 for n in times}
    reference = times[nodes[0]]
    out = {}
    for n in times:
        common = [times[n][k] - reference[k] for k in times[n].keys() & reference.keys()]
        out[n] = statistics.median(common) if common else 0.0
    return out


# -- merge, filter ---------------------------------------------------------------------------------

def merge(streams: Sequence[Iterable[LogLine]]) -> Iterator[LogLine]:
    """Every node's lines in one order: by attempt, key, node, then the node's own order."""
    return heapq.merge(*streams, key=lambda line: (line.attempt, line.key, line.node, line.seq))


@dataclass(frozen=True)
class LineFilter:
    """What ``--rank``, ``--grep`` and ``--since`` keep (``--node`` picks the logs read)."""

    rank: int | None = None
    pattern: re.Pattern | None = None
    since: float | None = None
    """Keys from this one on (seconds since the epoch)."""

    def keeps(self, rank: int | None, text: str) -> bool:
        """Whether a line of that source and text may pass (its time aside)."""
        return (self.rank is None or rank == self.rank) and (self.pattern is None or self.pattern.search(text) is not None)

    def __call__(self, line: LogLine) -> bool:
        return (self.since is None or line.key >= self.since) and self.keeps(line.rank, line.text)


def compile_pattern(pattern: str | None) -> re.Pattern | None:
    """``--grep``'s regular expression (Python's syntax), or a UserError naming what is wrong."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UserError(f"--grep {pattern!r} is not a regular expression: {exc}") from None


def parse_since(text: str, now: datetime) -> float:
    """``--since``: a span back from ``now`` (``30s``, ``10m``, ``2h``, ``1d``) or a time in the nodes'
    local time (``2026-12-06 08:20``, ``2026-12-06T08:20:30``, today's ``08:20``), as seconds since
    the epoch; a UserError with the accepted forms otherwise."""
    value = text.strip()
    m = _SINCE_SPAN.fullmatch(value)
    if m:
        return (now - timedelta(seconds=float(m.group(1)) * _SPAN_S[m.group(2)])).timestamp()
    try:
        if re.fullmatch(r"\d\d:\d\d(:\d\d(\.\d+)?)?", value):
            return datetime.fromisoformat(f"{now.date().isoformat()}T{value}").timestamp()
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        pass
    raise UserError(f"--since {text!r} is neither a span back from now (30s, 10m, 2h, 1d) nor a time "
                    "(2026-12-06 08:20, 2026-12-06T08:20:30, 08:20 for today)")


# -- repeated lines --------------------------------------------------------------------------------

class Group:
    """Lines of one text from one or more sources, shown once."""

    __slots__ = ("first", "index", "family", "sources", "count")

    def __init__(self, first: LogLine, index: int, family: str):
        self.first, self.index, self.family = first, index, family
        """The first line, its place in the merged stream, what may join it: named ranks (``rank``),
        ``rank?``, ``supervisor`` or ``torchrun`` lines."""
        self.sources: dict[tuple[int, str], int | None] = {}
        """(node, who) -> rank, in the order they came."""
        self.count = 0

    def add(self, line: LogLine) -> None:
        self.sources.setdefault((line.node, line.who), line.rank)
        self.count += 1


class Collapser:
    """Merged lines in, groups out (:data:`COLLAPSE_WINDOW_LINES`, :data:`COLLAPSE_WINDOW_S`): each
    group is let out once nothing more can join it, in the order of its first line. A line joins the
    earliest open group of its kind and text that its source has not joined yet (a banner's two
    identical lines from each of 4 nodes: two groups of 4), or the group its node's previous line
    joined, when it is the same text again."""

    def __init__(self, window_lines: int = COLLAPSE_WINDOW_LINES, window_s: float = COLLAPSE_WINDOW_S):
        self.window_lines, self.window_s = window_lines, window_s
        self.pending: deque[Group] = deque()
        self.open: dict[tuple[str, str], list[Group]] = {}
        self.last_of_node: dict[int, Group] = {}
        self.index = 0

    def _expired(self, group: Group, i: int, key: float) -> bool:
        return i - group.index >= self.window_lines or key - group.first.key > self.window_s

    def feed(self, line: LogLine) -> list[Group]:
        i = self.index
        self.index += 1
        family = line.who if line.rank is None else "rank"  # ranks join ranks; torchrun torchrun; ...
        groups = self.open.get((family, line.text))
        source = (line.node, line.who)
        group = None
        if groups is not None:
            previous = self.last_of_node.get(line.node)
            for g in groups:
                if not self._expired(g, i, line.key) and (source not in g.sources or g is previous):
                    group = g
                    break
        if group is None:
            group = Group(line, i, family)
            if groups is None:
                self.open[(family, line.text)] = [group]
            else:
                groups.append(group)
            self.pending.append(group)
        group.add(line)
        self.last_of_node[line.node] = group
        out = []
        while self.pending and self._expired(self.pending[0], i, line.key):
            out.append(self._let_out())
        return out

    def _let_out(self) -> Group:
        group = self.pending.popleft()
        groups = self.open[(group.family, group.first.text)]
        groups.remove(group)
        if not groups:
            del self.open[(group.family, group.first.text)]
        return group

    def flush(self) -> list[Group]:
        """Every group still open (the end of what is read, or a pause while following)."""
        out = [self._let_out() for _ in range(len(self.pending))]
        self.last_of_node.clear()
        return out


def ranges(numbers: Iterable[int]) -> str:
    """``0-3,8,10-11``."""
    values = sorted(set(numbers))
    parts, start = [], None
    for i, n in enumerate(values):
        if start is None:
            start = n
        if i + 1 == len(values) or values[i + 1] != n + 1:
            parts.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def format_group(group: Group, hosts: Mapping[int, str]) -> str:
    """``[node1 g0034 rank5] text``; a group: ``[nodes 0-3 ranks 0-31] text``, ``[node0 g0033 rank? x8]``."""
    first = group.first
    if group.count == 1:
        return f"[node{first.node} {hosts.get(first.node, '?')} {first.who}] {first.text}"
    nodes = {node for node, _ in group.sources}
    where = f"node{first.node} {hosts.get(first.node, '?')}" if len(nodes) == 1 else f"nodes {ranges(nodes)}"
    named = [rank for rank in group.sources.values() if rank is not None]
    who = (f"rank{named[0]}" if len(named) == 1 else f"ranks {ranges(named)}") if named else first.who
    times = f" x{group.count}" if group.count > len(group.sources) else ""
    return f"[{where} {who}{times}] {first.text}"


def collapse(lines: Iterable[LogLine], collapser: Collapser | None = None) -> Iterator[Group]:
    """``lines`` (merged, filtered) as groups, the repeated ones joined."""
    collapser = collapser or Collapser()
    for line in lines:
        yield from collapser.feed(line)
    yield from collapser.flush()


def tail_lines(lines: Iterable[LogLine], count: int | None) -> Iterable[LogLine]:
    """The last ``count`` of ``lines`` (all when None)."""
    return lines if count is None else deque(lines, maxlen=count)
