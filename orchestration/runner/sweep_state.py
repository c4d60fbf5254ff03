"""A ZeRO sweep's own files: its record and its stop request (launcher-side state; the runs' state
is orchestration/node/run_state.py's).

    $ARTIFACT_ROOT/run_state/<prefix>.sweep.json   a ZeRO sweep in progress (SweepRecord)
    $ARTIFACT_ROOT/run_state/<prefix>.sweep.stop   ``stop PREFIX`` asked it to stop

Side effects: those two files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext.host.json_files import read_json, write_json_atomic
from megatron_ext.run_spec.run_paths import RunPaths


@dataclass(frozen=True, kw_only=True)
class SweepRecord:
    """``run_state/<prefix>.sweep.json``: written by a sweep when it starts, before each stage and
    when it ends. ``stop PREFIX`` writes ``<prefix>.sweep.stop`` (a file of its own, so the two
    writers never overwrite each other) and stops the current stage; the sweep checks for it
    before each stage, after each start and at every poll, so a sweep is stoppable at any moment."""

    prefix: str
    pid: int
    """The sweep's process, on the machine where it was given (``hostname``)."""
    start_time: int
    """The sweep process's start time (clock ticks since boot), to recognise it."""
    hostname: str
    stages: tuple[int, ...]
    current_run: str | None = None
    """The stage run now starting or running (None before the first and after the last)."""
    ended: bool = False


def _sweep_file(root: Path, prefix: str, suffix: str) -> Path:
    return RunPaths(root, prefix).run_state_dir / f"{prefix}.{suffix}"


def write_sweep_record(root: Path, record: SweepRecord) -> None:
    write_json_atomic(_sweep_file(root, record.prefix, "sweep.json"), asdict(record))


def read_sweep_record(root: Path, prefix: str) -> SweepRecord | None:
    raw = read_json(_sweep_file(root, prefix, "sweep.json"))
    try:
        return SweepRecord(**{**raw, "stages": tuple(raw["stages"])}) if isinstance(raw, dict) else None
    except (TypeError, KeyError):
        return None


def request_sweep_stop(root: Path, prefix: str, why: str) -> None:
    path = _sweep_file(root, prefix, "sweep.stop")
    if not path.exists():
        path.write_text(why)


def sweep_stop_request(root: Path, prefix: str) -> str | None:
    """Why ``stop PREFIX`` asked the sweep to stop, or None."""
    try:
        return _sweep_file(root, prefix, "sweep.stop").read_text().strip() or "stop requested"
    except FileNotFoundError:
        return None


def clear_sweep_stop(root: Path, prefix: str) -> None:
    _sweep_file(root, prefix, "sweep.stop").unlink(missing_ok=True)
