"""Why a node's run failed, read from its log: the one parser of torchrun's error summary.

    python -c "from orchestration.node.failure import failure_reason; print(failure_reason(open('artifacts/logs/demo_node1.log').read()))"

torchrun ends a failed run with a summary whose ``Root Cause (first observed failure)`` block
names the rank, its exit code and, for a signal, ``Signal 9 (SIGKILL) received by PID ...``.
:func:`root_cause` reads that block; :func:`failure_reason` weighs it against the program's own
``error:`` lines and the exceptions the ranks printed (the sweep's and status's reason);
:func:`failure_summary` is a failed torchrun's :class:`Failure` (its kind decides, its text is the failure file). Pure.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from enum import StrEnum

_RANK_PREFIX = re.compile(r"^\[(?:default)?rank(\d+)\]:\s*")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt))(?::\s*(.*))?$")
_ROOT_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")
ROOT_CAUSE = "Root Cause (first observed failure):"
REASON_MAX_CHARS = 300


class FailureKind(StrEnum):
    """What failed, as the supervisor that claimed an attempt's failure knew it."""

    FAILED = "failed"  # a node's torchrun exited with an error (failure_summary)
    HUNG = "hung"  # a rank past its phase's limit: the hang protocol's verdict (hang_protocol.py's hang_summary)
    LOST = "lost"  # node 0 heard nothing from a node for node_lost_s
    DID_NOT_JOIN = "did-not-join"  # nodes not ready for the next attempt within join_s
    ROOT_UNREACHABLE = "root-unreachable"  # a node's artifact root stopped answering: the node cannot go on
    SUPERVISOR = "supervisor"  # a supervisor's own error: its node cannot go on


@dataclass(frozen=True)
class Failure:
    """An attempt's failure as the board keeps it (orchestration/node/board.py) and node 0 records its text."""

    kind: FailureKind
    node: int
    """The node it names first (the failed, hung, lost or missing one; the one that claimed it)."""
    text: str
    """The failure file's text, whole: the first line says what failed first (status shows it)."""
    rank: int | None = None
    """The rank it names first, where it names one."""

    @property
    def summary(self) -> str:
        return self.text.partition("\n")[0]


@dataclass(frozen=True)
class RootCause:
    """torchrun's ``Root Cause (first observed failure)`` block."""

    rank: int | None
    exit_code: int | None
    traceback: str
    """``Signal 9 (SIGKILL) received by PID ...``, or torchrun's "To enable traceback" hint."""

    @property
    def killed_by_signal(self) -> bool:
        """A rank killed by a signal other than a stop's SIGTERM or SIGINT."""
        return self.traceback.startswith("Signal ") and not self.traceback.startswith(("Signal 15 ", "Signal 2 "))

    def describe(self) -> str:
        detail = self.traceback
        if not detail or detail.startswith("To enable traceback"):
            detail = f"exit code {self.exit_code if self.exit_code is not None else '?'}"
        if "SIGKILL" in detail:
            detail += " (SIGKILL: e.g. the kernel's out-of-memory killer)"
        return f"rank {self.rank if self.rank is not None else '?'}: {detail}"


def _clean_lines(log_text: str, last: int = 400) -> list[str]:
    return [_RANK_PREFIX.sub("", line.rstrip()) for line in log_text.splitlines()[-last:]]


def root_cause(log_text: str) -> RootCause | None:
    """The root-cause block of torchrun's last error summary in ``log_text``, or None."""
    lines = _clean_lines(log_text)
    if ROOT_CAUSE not in lines:
        return None
    start = len(lines) - 1 - lines[::-1].index(ROOT_CAUSE)
    fields: dict[str, str] = {}
    for line in lines[start + 1:]:
        m = _ROOT_FIELD.match(line)
        if m:
            fields.setdefault(m.group(1), m.group(2).strip())
    if not fields:
        return None

    def first_int(text: str | None) -> int | None:
        word = (text or "").split(" ")[0]
        return int(word) if word.lstrip("-").isdigit() else None

    return RootCause(first_int(fields.get("rank")), first_int(fields.get("exitcode")), fields.get("traceback", ""))


PEER_CONSEQUENCES = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",  # gloo, when a peer's process is gone
    "remote process exited or there was a network error",  # NCCL
    "NCCL communicator was aborted", "ProcessGroupNCCL's watchdog",
)
"""What a rank raises because another rank died: never the cause while another rank names one."""


def follows_a_peer(reason: str) -> bool:
    """Whether a failure's reason is only what a rank raises because another rank died
    (:data:`PEER_CONSEQUENCES`): the node that failed first is elsewhere."""
    return any(p in reason for p in PEER_CONSEQUENCES)


def _rank_exceptions(log_text: str, last: int = 400) -> list[tuple[int | None, re.Match]]:
    """(rank, match) of every exception line in the log's tail but torchrun's own ChildFailedError,
    in order: the rank from torch's ``[rankN]:`` prefix, None for a line without one."""
    found = []
    for raw in log_text.splitlines()[-last:]:
        prefix = _RANK_PREFIX.match(raw.rstrip())
        m = _EXCEPTION.match(_RANK_PREFIX.sub("", raw.rstrip()).strip())
        if m and not m.group(1).endswith("ChildFailedError"):
            found.append((int(prefix.group(1)) if prefix else None, m))
    return found


def first_cause(found: list[tuple[int | None, re.Match]],
                exited_first: int | None = None) -> tuple[int | None, re.Match] | None:
    """The exception that started a failure, whichever rank it was on, among ``found``
    (:func:`_rank_exceptions`; a SignalException is torchrun being stopped, never a cause): each
    rank's last exception (the end of its traceback chain) that is not a consequence of a peer's
    death (:data:`PEER_CONSEQUENCES`; every rank of a dead world raises one, and the one printed
    last used to be named): the one of ``exited_first`` (torchrun's root-cause rank) if it has such,
    else the first in the log; else the last exception. None without any."""
    real = [(rank, m) for rank, m in found if not m.group(1).endswith("SignalException")]
    if not real:
        return None
    last_of_rank: dict[int | None, tuple[int, re.Match]] = {}
    for index, (rank, m) in enumerate(real):
        last_of_rank[rank] = (index, m)
    ordered = sorted((index, rank, m) for rank, (index, m) in last_of_rank.items())
    causes = [(rank, m) for _, rank, m in ordered if not follows_a_peer(m.group(2) or "")]
    own = [c for c in causes if c[0] == exited_first and exited_first is not None]
    return (own or causes)[0] if causes else real[-1]


def _cut(text: str) -> str:
    return text if len(text) <= REASON_MAX_CHARS else text[:REASON_MAX_CHARS - 3] + "..."


@dataclass(frozen=True)
class _Reason:
    score: int
    """How telling (see :func:`failure_reason`)."""
    text: str
    rank: int | None = None
    """The rank the cause was on, where it is not the one torchrun's root cause names."""
    torchrun: str = ""
    """torchrun's root cause, beside a rank's exception."""


def _reason(log_text: str) -> _Reason:
    lines = _clean_lines(log_text)
    errors = [line for line in lines if line.startswith("error: ")]
    found = _rank_exceptions(log_text)
    cause = root_cause(log_text)
    torchrun = cause.describe() if cause else ""
    if errors:
        return _Reason(3, errors[-1])
    if cause and cause.killed_by_signal:
        return _Reason(2, torchrun)
    cause_found = first_cause(found, cause.rank if cause else None)
    if cause_found:
        rank, m = cause_found
        return _Reason(2, f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1),
                       rank if rank is not None and (cause is None or cause.rank != rank) else None, torchrun)
    if found:  # torchrun itself got a signal: someone stopped it
        m = found[-1][1]
        return _Reason(1, f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2) or ''}".strip())
    if torchrun:
        return _Reason(1, torchrun)
    meaningful = [line for line in lines if line.strip() and not set(line.strip()) <= set("=-")]
    if meaningful:
        return _Reason(0, meaningful[-1].strip())
    return _Reason(0, "the run ended before its last iteration and its log is empty")


def failure_reason(log_text: str) -> tuple[int, str]:
    """(how telling, reason) from a node log's tail: a program ``error:`` line (3); else a rank
    killed by a signal other than SIGTERM/SIGINT, from torchrun's root cause (2: the other ranks'
    errors follow from it); else the first cause among the ranks' exceptions (2: e.g.
    ``torch.OutOfMemoryError: CUDA out of memory...``, :func:`first_cause`; its rank named when
    torchrun's root cause is another); else torchrun's root cause or the signal it got (1); else the
    last line (0)."""
    r = _reason(log_text)
    where = f"rank {r.rank}: " if r.rank is not None else ""
    return r.score, _cut(where + r.text + (f" (torchrun: {r.torchrun})" if r.torchrun else ""))


def describe_returncode(code: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) of a Popen return code."""
    if code < 0:
        return None, signal.Signals(-code).name
    return code, None


def failure_summary(node_rank: int, host: str, code: int, log_tail: str, excerpt_lines: int = 25) -> Failure:
    """A failed torchrun's failure, its text: node, rank (torchrun's root cause), exit and, where the log says it
    (a rank's exception, a program error line, a signal), why — all on the first line, which status
    and the supervisors show; then the log's last ``excerpt_lines`` lines."""
    exit_code, sig = describe_returncode(code)
    cause = root_cause(log_tail)
    what = f"exit code {exit_code}" if sig is None else f"signal {sig}"
    rank = f"rank {cause.rank}" if cause and cause.rank is not None else "rank unknown"
    r = _reason(log_tail)
    why = ""
    if r.score >= 2 and not (cause and cause.killed_by_signal):
        why = (f": {_cut(r.text)}" if r.rank is None  # the cause was on another rank than the one that exited first
               else f" exited first; the cause, on {_cut(f'rank {r.rank}: {r.text}')}")
    excerpt = "\n".join(log_tail.splitlines()[-excerpt_lines:])
    return Failure(FailureKind.FAILED, node_rank, f"node {node_rank} ({host}) failed: torchrun {what}; {rank}{why}\n"
                   f"--- last lines of node {node_rank}'s log ---\n{excerpt}\n", cause.rank if cause else None)
