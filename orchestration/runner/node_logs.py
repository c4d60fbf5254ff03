"""Every node's log read for the merged log (``logs``): here, where the artifact root shows it, else on
the node over its own transport (ssh, docker exec, srun); from the end for ``-n`` and ``--since``;
then followed.

    python -m orchestration logs demo                        # every node's log, merged
    python -m orchestration logs demo -n 200 --node 1        # the last 200 lines of node 1's log
    python -m orchestration logs demo --since 10m --follow   # the last ten minutes, then on as it grows
    DRY_RUN=1 python -m orchestration logs demo              # which log is read where, and how

:func:`plan_logs` checks the request and says where each node's log is read (a :class:`LogPlan`);
:func:`read_logs` reads exactly that and yields the merged lines (orchestration/analysis/merged_log.py:
who printed each line, the order, the collapse). Nothing is read whole unless the whole log is asked
for: ``-n N`` reads back from each log's end, block by block, until N lines of what the filters keep;
``--since T`` until a line older than T; the nodes' clock offsets come from their last 256 KiB. A log
read over the transport is read by a Python one-liner on the node (:data:`READ_SCRIPT`: the file's
size, then the bytes asked for), one call a block, the command built by the backend's ``plan`` as a
status's is. Side effects: reads the logs; runs that one-liner on nodes; reads the run's exit records
(to end ``--follow`` with the run).
"""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Iterator, Mapping, Sequence

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.analysis.merged_log import (ATTEMPT_LINE, SUPERVISOR, Collapser, LineFilter, LogLine, NodeLines, classify,
                                               clock_offsets, collapse, compile_pattern, format_group, iteration_times,
                                               line_time, merge, node_stream, parse_since, tail_lines)
from orchestration.cluster.backends import Backend, backend_for, this_start_run_id
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import read_exit
from orchestration.runner.nodes import nodes_of_run

HERE = "here"
"""A log read on this machine (the artifact root's file)."""
BLOCK_BYTES = {True: 1 << 20, False: 8 << 20}
"""Bytes a read takes: here (True) and over the transport (False, one node command each)."""
CLOCK_PROBE_BYTES = 256 << 10
"""The end of each log read for the nodes' clock offsets (a few hundred iteration lines)."""
FOLLOW_POLL_S = {True: 0.5, False: 2.0}
"""How often ``--follow`` reads again: here, and over the transport."""
FOLLOW_DEFAULT_LINES = 20
"""``--follow`` without ``-n`` or ``--since`` starts with this many lines."""
READ_TIMEOUT_S = 60.0
READ_SCRIPT = (
    "import os,sys\n"
    "p,o,n=sys.argv[1],int(sys.argv[2]),int(sys.argv[3])\n"
    "try:\n f=open(p,'rb')\n"
    "except FileNotFoundError:\n sys.stdout.write('-1 0\\n');sys.exit(0)\n"
    "s=os.fstat(f.fileno()).st_size\n"
    "o=max(0,s+o) if o<0 else min(o,s)\n"
    "f.seek(o)\n"
    "sys.stdout.buffer.write(b'%d %d\\n'%(s,o)+f.read(n))\n"
)
"""What reads a log on its node: ``python -c READ_SCRIPT PATH OFFSET LENGTH`` prints ``SIZE START``
and the bytes (OFFSET < 0: from the end); a missing file is ``-1 0``."""


class LogUnreadable(Exception):
    """A node's log could not be read (missing, or the node did not answer)."""


@dataclass(frozen=True)
class NodeProblem:
    """A node whose log the merged log goes without, and why."""

    node: int
    host: str
    why: str

    def describe(self) -> str:
        return f"node {self.node} ({self.host}): {self.why}"


@dataclass(frozen=True)
class NodeLog:
    """Where one node's log is read."""

    node: int
    host: str
    path: str
    via: str
    """:data:`HERE`, or the backend's name (``ssh``, ``docker exec``, ``srun``)."""


@dataclass(frozen=True, kw_only=True)
class LogPlan:
    """What ``logs`` reads and keeps."""

    run: str
    logs: tuple[NodeLog, ...]
    lines: int | None
    """The last N lines (of what the filters keep); None: all."""
    since: float | None
    rank: int | None
    grep: str | None
    follow: bool

    @property
    def hosts(self) -> dict[int, str]:
        return {log.node: log.host for log in self.logs}

    def to_json_lines(self) -> list[str]:
        """The dry run: a header, then a line per node log."""
        head = {"logs": {"run": self.run, "lines": self.lines, "since": self.since, "rank": self.rank, "grep": self.grep,
                         "follow": self.follow}}
        return [json.dumps(head)] + [json.dumps({"node": log.node, "host": log.host, "log": log.path, "read": log.via})
                                     for log in self.logs]


def plan_logs(launch: LaunchEnv, run: str, *, node: int | None = None, rank: int | None = None, since: str | None = None,
              grep: str | None = None, lines: int | None = None, follow: bool = False, via_nodes: bool = False,
              now: datetime | None = None) -> LogPlan:
    """The request checked (each bad value one UserError) and where each node's log is read: here
    where this machine shows the file (the artifact root on the shared file system), else on the node
    over the backend's transport; ``via_nodes``: on every node this machine does not answer for."""
    paths = RunPaths(launch.artifact_root, run)
    nodes = nodes_of_run(launch, run, only_this_node=False)
    if node is not None:
        if node not in dict(nodes):
            raise UserError(f"--node {node}: run {run} has node(s) {', '.join(f'{r} ({h})' for r, h in nodes)}")
        nodes = [(r, h) for r, h in nodes if r == node]
    resolved = read_resolved(paths.params_path)
    world = resolved.runtime.world_size if resolved else None
    if rank is not None and (rank < 0 or (world is not None and rank >= world)):
        raise UserError(f"--rank {rank}: run {run} has ranks 0-{world - 1}" if world else f"--rank {rank} must be at least 0")
    if lines is not None and lines < 1:
        raise UserError(f"-n/--lines {lines} must be at least 1")
    compile_pattern(grep)
    since_s = parse_since(since, now or datetime.now()) if since is not None else None
    if follow and lines is None and since is None:
        lines = FOLLOW_DEFAULT_LINES
    backend = backend_for(launch, nodes)
    logs = []
    for r, host in nodes:
        path = paths.node_log(r)
        here = backend.in_process(host) or (not via_nodes and path.exists())
        logs.append(NodeLog(node=r, host=host, path=str(path), via=HERE if here else backend.name))
    return LogPlan(run=run, logs=tuple(logs), lines=lines, since=since_s, rank=rank, grep=grep, follow=follow)


# -- reading one log --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chunk:
    size: int
    """The file's size when read."""
    offset: int
    data: bytes


class LogSource:
    """One node's log: ``read(offset, length)`` (offset < 0: from the end)."""

    here: bool = True

    def read(self, offset: int, length: int) -> Chunk:
        raise NotImplementedError


class FileHere(LogSource):
    """The log as this machine shows it (opened at every read: a shared file system shows what another
    node wrote at an open, NFS's close-to-open)."""

    def __init__(self, path: str):
        self.path = path

    def read(self, offset: int, length: int) -> Chunk:
        try:
            with open(self.path, "rb") as fh:
                size = fh.seek(0, 2)
                start = max(0, size + offset) if offset < 0 else min(offset, size)
                fh.seek(start)
                return Chunk(size, start, fh.read(length))
        except FileNotFoundError:
            raise LogUnreadable(f"no log at {self.path} (not started there yet?)") from None
        except OSError as exc:
            raise LogUnreadable(f"cannot read {self.path}: {exc.strerror}") from None


class FileOnNode(LogSource):
    """The log read on its node by :data:`READ_SCRIPT`, through the backend (ssh, docker exec, srun)."""

    here = False

    def __init__(self, launch: LaunchEnv, backend: Backend, host: str, path: str):
        self.launch, self.backend, self.host, self.path = launch, backend, host, path

    def argv(self, offset: int, length: int) -> list[str]:
        return self.backend.plan(self.host, [self.launch.python, "-c", READ_SCRIPT, self.path, str(offset), str(length)],
                                 {}, self.launch.cwd)

    def read(self, offset: int, length: int) -> Chunk:
        argv = self.argv(offset, length)
        local = self.backend.caller_sets_env
        try:
            proc = subprocess.run(argv, cwd=self.launch.cwd if local else None, env=dict(self.launch.environ) if local else None,
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=READ_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise LogUnreadable(f"no answer within {READ_TIMEOUT_S:.0f} s ({self.backend.name})") from None
        except FileNotFoundError as exc:
            raise LogUnreadable(f"{exc.filename}: command not found") from None
        head, _, data = proc.stdout.partition(b"\n")
        words = head.split()
        if proc.returncode != 0 or len(words) != 2:
            said = (proc.stderr or proc.stdout).decode(errors="replace").strip().splitlines()[-3:]
            raise LogUnreadable(f"{self.backend.name} read failed (exit {proc.returncode}): {' '.join(said)}")
        size, start = int(words[0]), int(words[1])
        if size < 0:
            raise LogUnreadable(f"no log at {self.path} on {self.host} (not started there yet?)")
        return Chunk(size, start, data)


def _decode(data: bytes) -> list[str]:
    return data.decode(errors="replace").split("\n")


@dataclass
class Window:
    """Where a read from the end starts, and the attempts (the supervisor's ``attempt K of M`` lines)
    it holds."""

    start: int
    first_attempt: int | None = None
    last_attempt: int | None = None


def find_window(source: LogSource, size: int, last: Chunk | None, lines: int | None, since: float | None,
                offset_s: float, keeps: Callable[[int | None, str], bool]) -> Window:
    """Back from ``size``, block by block (``last``: the end already read), to the line where the
    window starts: the ``lines``-th line from the end that ``keeps`` takes, or the last line older
    than ``since`` (its key seeds the next ones'); the log's start otherwise."""
    window, count, pos, carry = Window(0), 0, size, b""
    year = datetime.now().year
    block = BLOCK_BYTES[source.here]
    while pos > 0:
        if last is not None and last.offset + len(last.data) == pos and last.data:
            lo, data, last = last.offset, last.data, None
        else:
            lo = max(0, pos - block)
            data = source.read(lo, pos - lo).data
        data += carry
        parts = data.split(b"\n")
        if lo > 0:
            carry, parts = parts[0], parts[1:]
            first_start = lo + len(carry) + 1
        else:
            carry, first_start = b"", 0
        starts = []
        at = first_start
        for part in parts:
            starts.append(at)
            at += len(part) + 1
        for part, start in zip(reversed(parts), reversed(starts)):
            if not part:
                continue
            who, rank, text = classify(part.decode(errors="replace"))
            if who == SUPERVISOR:
                m = ATTEMPT_LINE.match(text)
                if m:
                    window.first_attempt = int(m.group(1))
                    window.last_attempt = window.last_attempt or window.first_attempt
            if since is not None:
                t, _ = line_time(text, year)
                if t is not None and t - offset_s < since:
                    window.start = start
                    return window
            if lines is not None and keeps(rank, text):
                count += 1
                if count >= lines:
                    window.start = start
                    return window
        pos = lo
    return window


class Cursor:
    """A log read forward: its complete lines, and where the next read starts."""

    def __init__(self, source: LogSource, offset: int):
        self.source, self.offset, self.partial = source, offset, b""
        self.failed: LogUnreadable | None = None
        """Why the reading stopped early (the node stopped answering): the lines before stand."""

    def take(self, chunk: Chunk) -> list[str]:
        """The complete lines of ``chunk`` (read at the cursor), the rest kept for the next."""
        data = self.partial + chunk.data
        self.offset = chunk.offset + len(chunk.data)
        cut = data.rfind(b"\n")
        if cut < 0:
            self.partial = data
            return []
        self.partial = data[cut + 1:]
        return _decode(data[:cut])

    def batches(self, end: int, keep_partial: bool) -> Iterator[list[str]]:
        """Every line up to ``end``; the last, unfinished one too unless ``keep_partial`` (a follow
        waits for its end)."""
        block = BLOCK_BYTES[self.source.here]
        while self.offset < end:
            try:
                chunk = self.source.read(self.offset, min(block, end - self.offset))
            except LogUnreadable as exc:
                self.failed = exc
                return
            if not chunk.data:
                break
            yield self.take(chunk)
        if self.partial and not keep_partial:
            yield _decode(self.partial)
            self.partial = b""


# -- the merged log ---------------------------------------------------------------------------------

def _each(logs: Sequence[NodeLog], work: Callable[[NodeLog], object]) -> dict[int, object]:
    """``work`` for every node log at once (over the transport each is a node command); a node whose
    log cannot be read gets its LogUnreadable."""
    def guarded(log: NodeLog):
        try:
            return work(log)
        except LogUnreadable as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(len(logs), 32))) as pool:
        return dict(zip((log.node for log in logs), pool.map(guarded, logs)))


def read_logs(launch: LaunchEnv, plan: LogPlan, paths: RunPaths | None = None) -> Iterator[str | NodeProblem]:
    """The merged log as ``plan`` asks: its lines (str), and a :class:`NodeProblem` for each node
    whose log could not be read (the others go on). With ``follow``, on until the run has ended (every
    node's exit record of its latest start) or the caller stops (Ctrl-C)."""
    paths = paths or RunPaths(launch.artifact_root, plan.run)
    sources = {log.node: FileHere(log.path) if log.via == HERE else
               FileOnNode(launch, backend_for(launch, [(log.node, log.host)]), log.host, log.path) for log in plan.logs}
    hosts = plan.hosts
    live = dict(sources)

    def drop(node: int, exc: Exception) -> NodeProblem:
        live.pop(node, None)
        return NodeProblem(node, hosts[node], str(exc))

    ends = _each(plan.logs, lambda log: sources[log.node].read(-CLOCK_PROBE_BYTES, CLOCK_PROBE_BYTES))
    for node, end in ends.items():
        if isinstance(end, LogUnreadable):
            yield drop(node, end)
    probes: dict[int, Chunk] = {n: e for n, e in ends.items() if isinstance(e, Chunk)}
    offsets = clock_offsets({n: iteration_times(_decode(c.data)) for n, c in probes.items()})
    flt = LineFilter(rank=plan.rank, pattern=compile_pattern(plan.grep), since=plan.since)
    windowed = plan.lines is not None or plan.since is not None
    windows: dict[int, object] = {n: Window(0) for n in probes}
    if windowed:
        windows = _each([log for log in plan.logs if log.node in probes], lambda log: find_window(
            sources[log.node], probes[log.node].size, probes[log.node], plan.lines, plan.since, offsets[log.node], flt.keeps))
        for node, window in windows.items():
            if isinstance(window, LogUnreadable):
                yield drop(node, window)
    found = {n: w for n, w in windows.items() if isinstance(w, Window)}
    latest = max((w.last_attempt for w in found.values() if w.last_attempt is not None), default=0)
    parsers, cursors, streams = {}, {}, []
    for node, window in sorted(found.items()):
        seed = 0 if window.start == 0 else (window.first_attempt - 1 if window.first_attempt is not None else latest)
        parsers[node] = NodeLines(node, offsets[node], attempt=seed)
        cursors[node] = Cursor(sources[node], window.start)
        streams.append(node_stream(parsers[node], cursors[node].batches(probes[node].size, keep_partial=plan.follow)))
    merged = tail_lines(filter(flt, merge(streams)), plan.lines)
    for group in collapse(merged, Collapser()):
        yield format_group(group, hosts)
    for node, cursor in cursors.items():
        if cursor.failed is not None:  # stopped answering halfway: what it gave stands
            yield drop(node, LogUnreadable(f"read stopped at byte {cursor.offset}: {cursor.failed}"))
    if plan.follow:
        yield from _follow(live, parsers, cursors, flt, hosts, paths, drop)


def _follow(sources: Mapping[int, LogSource], parsers: Mapping[int, NodeLines], cursors: Mapping[int, Cursor],
            flt: LineFilter, hosts: Mapping[int, str], paths: RunPaths,
            drop: Callable[[int, Exception], NodeProblem]) -> Iterator[str | NodeProblem]:
    """Each log's new lines as they come, merged within each read (by attempt and key; repeats joined
    within it; a line waits for no later time), until the run has ended and nothing new came."""
    poll_s = min((FOLLOW_POLL_S[s.here] for s in sources.values()), default=FOLLOW_POLL_S[True])
    ended = False  # every node's exit record seen: one more read of every log, then the end
    while True:
        batch: list[LogLine] = []
        more = False
        for node in list(sources):
            cursor = cursors[node]
            block = BLOCK_BYTES[cursor.source.here]
            try:
                chunk = cursor.source.read(cursor.offset, block)
            except LogUnreadable as exc:
                yield drop(node, exc)
                continue
            if chunk.size < cursor.offset:  # the log was replaced: from its start again
                cursor.offset, cursor.partial = 0, b""
                more = True
                continue
            more = more or len(chunk.data) >= block
            batch += parsers[node].feed(cursor.take(chunk)) + parsers[node].flush()
        if batch:
            batch.sort(key=lambda line: (line.attempt, line.key, line.node, line.seq))
            collapser = Collapser()
            for line in filter(flt, batch):
                for group in collapser.feed(line):
                    yield format_group(group, hosts)
            for group in collapser.flush():
                yield format_group(group, hosts)
        elif not more:
            if ended:
                return
            run_id = this_start_run_id(paths)  # read again: the run may have been started again meanwhile
            if run_id and all(read_exit(paths, node, run_id) is not None for node in hosts):
                ended = True  # a line written just before the record may have come after this pass's read
                continue
        if not more:
            time.sleep(poll_s)
