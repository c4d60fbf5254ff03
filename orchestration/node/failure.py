"""Why a node's run failed, read from its log: the one parser of torchrun's error summary.

    python -c "from orchestration.node.failure import failure_reason; print(failure_reason(open('artifacts/logs/demo_node1.log').read()))"

torchrun ends a failed run with a summary whose ``Root Cause (first observed failure)`` block
names the rank, its exit code and, for a signal, ``Signal 9 (SIGKILL) received by PID ...``.
:func:`root_cause` reads that block; :func:`failure_reason` weighs it against the program's own
``error:`` lines and the exceptions the ranks printed (the sweep's and status's reason);
:func:`failure_summary` is the failure file's text (the supervisor's). Pure.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt))(?::\s*(.*))?$")
_ROOT_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")
ROOT_CAUSE = "Root Cause (first observed failure):"
REASON_MAX_CHARS = 300


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


def _cut(text: str) -> str:
    return text if len(text) <= REASON_MAX_CHARS else text[:REASON_MAX_CHARS - 3] + "..."


def failure_reason(log_text: str) -> tuple[int, str]:
    """(how telling, reason) from a node log's tail: a program ``error:`` line (3); else a rank
    killed by a signal other than SIGTERM/SIGINT, from torchrun's root cause (2: the other ranks'
    errors follow from it); else the last exception line other than torchrun's own (2: e.g.
    ``torch.OutOfMemoryError: CUDA out of memory...``); else torchrun's root cause or the signal
    it got (1); else the last line (0)."""
    lines = _clean_lines(log_text)
    errors = [line for line in lines if line.startswith("error: ")]
    exceptions = [m for m in (_EXCEPTION.match(line.strip()) for line in lines)
                  if m and not m.group(1).endswith("ChildFailedError")]
    cause = root_cause(log_text)
    torchrun = cause.describe() if cause else ""
    if errors:
        return 3, _cut(errors[-1])
    if cause and cause.killed_by_signal:
        return 2, _cut(torchrun)
    real = [m for m in exceptions if not m.group(1).endswith("SignalException")]
    if real:
        m = real[-1]
        text = f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
        return 2, _cut(text + (f" (torchrun: {torchrun})" if torchrun else ""))
    if exceptions:  # torchrun itself got a signal: someone stopped it
        return 1, _cut(f"{exceptions[-1].group(1).rsplit('.', 1)[-1]}: {exceptions[-1].group(2) or ''}".strip())
    if torchrun:
        return 1, _cut(torchrun)
    meaningful = [line for line in lines if line.strip() and not set(line.strip()) <= set("=-")]
    if meaningful:
        return 0, _cut(meaningful[-1].strip())
    return 0, "the run ended before its last iteration and its log is empty"


def describe_returncode(code: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) of a Popen return code."""
    if code < 0:
        return None, signal.Signals(-code).name
    return code, None


def failure_summary(node_rank: int, host: str, code: int, log_tail: str, excerpt_lines: int = 25) -> str:
    """The failure file's text: node, rank (torchrun's root cause), exit and, where the log says it
    (a rank's exception, a program error line, a signal), why — all on the first line, which status
    and the supervisors show; then the log's last ``excerpt_lines`` lines."""
    exit_code, sig = describe_returncode(code)
    cause = root_cause(log_tail)
    what = f"exit code {exit_code}" if sig is None else f"signal {sig}"
    rank = f"rank {cause.rank}" if cause and cause.rank is not None else "rank unknown"
    score, reason = failure_reason(log_tail)
    why = f": {reason.split(' (torchrun: ')[0]}" if score >= 2 and not (cause and cause.killed_by_signal) else ""
    excerpt = "\n".join(log_tail.splitlines()[-excerpt_lines:])
    return (f"node {node_rank} ({host}) failed: torchrun {what}; {rank}{why}\n"
            f"--- last lines of node {node_rank}'s log ---\n{excerpt}\n")
