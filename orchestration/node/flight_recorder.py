"""A hang named down to the collective: every rank's flight recorder, through torch's own analyser.

    python -m torch.distributed.flight_recorder.fr_trace DIR    # torch's command line for the same analysis

torch records every collective a process issues, per process group, gloo and NCCL alike (its
flight recorder, ``TORCH_FR_BUFFER_SIZE``). At a hang each rank of this project's program writes
its record beside its stack (``hangs/<attempt>/node<N>_rank<R>.flight_recorder.json``:
megatron_ext/training/progress.py). :func:`stuck_collective` hands them to torch's analyser
(``torch.distributed.flight_recorder.components.builder.build_db``, what ``fr_trace`` runs), which
matches the ranks' collectives by process group and sequence number and finds the first that not
every member entered.

A rank that cannot write its record (stopped or dead) leaves torch's analyser undecided. Such a
rank gets a stand-in record before the analysis: the collectives every one of its peers in a group
completed, which it must have entered too (a collective completes only once every member has
entered it). The finding then says which ranks it rests on. A running rank without a record (late
on a shared file system, blocked holding the GIL) gets none: the analyser decides nothing there. Side effects:
reads the records' files (imports torch's analyser when called).
"""

from __future__ import annotations

import ast
import gc
import json
import logging
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class StuckCollective:
    """The first collective that not every member of its process group entered."""

    name: str
    """torch's name for it, e.g. ``gloo:all_reduce``, ``nccl:reduce_scatter``."""
    seq: int
    """Its sequence number in its process group."""
    group: str
    """The process group: its name and description (``0 (default_pg)``)."""
    entered: tuple[int, ...]
    missing: tuple[int, ...]
    """The members that did not enter it (global ranks)."""
    without_record: tuple[int, ...] = ()
    """Ranks that wrote no record (stopped, gone): stood in for by their peers' completed collectives."""

    def describe(self) -> str:
        """The failure line's words."""
        entered = ", ".join(map(str, self.entered)) or "none"
        missing = ", ".join(map(str, self.missing))
        inferred = [r for r in self.missing if r in self.without_record]
        note = (f" (no record from rank(s) {', '.join(map(str, inferred))}: it completed every earlier one, "
                "its peers' records say)" if inferred else "")
        return (f"collective {self.name} #{self.seq} of process group {self.group}: entered by rank(s) {entered}, "
                f"not by rank(s) {missing}{note}")


def read_flight_recorders(reports) -> tuple[dict[int, dict], tuple[int, ...]]:
    """(global rank -> its flight recorder, the ranks that cannot have written one: stopped or gone)
    from the hang's rank reports. A record another node wrote may show late on a shared file
    system: one that does not read is no record, and its rank (running) is not stood in for."""
    out = {}
    for r in reports:
        if r.flight_recorder:
            try:
                out[r.rank] = json.loads(Path(r.flight_recorder).read_text())
            except (OSError, ValueError):
                pass
    silent = tuple(r.rank for r in reports if r.rank not in out and r.process_state in ("T", "Z", "gone"))
    return out, silent


def has_entries(record: dict) -> bool:
    return bool(record.get("entries"))


def stand_in_record(records: dict[int, dict], rank: int) -> dict:
    """A record for ``rank``, which wrote none: for every group the others' records list it in, the
    collectives every other member completed (``retired``), with no frames. Pure."""
    version = next(iter(records.values()))["version"]
    groups: dict[str, dict] = {}
    for record in records.values():
        for name, group in record.get("pg_config", {}).items():
            if rank in ast.literal_eval(group.get("ranks") or "[]"):
                groups[name] = group
    entries = []
    for name, group in groups.items():
        peers = [r for r in ast.literal_eval(group["ranks"]) if r in records and r != rank]
        if not peers:
            continue
        done = set.intersection(*[{e["collective_seq_id"] for e in records[r]["entries"]
                                   if str(e["process_group"][0]) == name and e.get("retired")} for r in peers])
        entries += [dict(e, frames=[], thread_name="no record: stood in for by its peers'")
                    for e in records[peers[0]]["entries"] if str(e["process_group"][0]) == name
                    and e["collective_seq_id"] in done]
    entries.sort(key=lambda e: e["record_id"])
    return {"version": version, "pg_config": groups, "pg_status": {}, "entries": entries}


def stuck_collective(records: dict[int, dict], silent: tuple[int, ...] = ()) -> StuckCollective | str:
    """torch's analyser over every rank's record (``records``: global rank -> the record, an
    ``{"error": ...}`` where the rank could not dump; ``silent``: ranks that cannot write one,
    stopped or gone, stood in for by their peers'): the collective, or why there is none. A rank
    neither in ``records`` nor ``silent`` (running, its record late or not written) is left to the
    analyser, which then decides nothing about its groups."""
    usable = {r: rec for r, rec in records.items() if isinstance(rec, dict) and "entries" in rec and "pg_config" in rec}
    if not any(has_entries(rec) for rec in usable.values()):
        return ("no flight-recorder records (TORCH_FR_BUFFER_SIZE=0, a torch without the recorder, or no rank "
                "answered): the ranks are named from their stacks and progress alone")
    silent = tuple(r for r in silent if r not in usable)
    full = dict(usable) | {r: stand_in_record(usable, r) for r in silent}
    try:
        from torch.distributed.flight_recorder.components.builder import build_db
        from torch.distributed.flight_recorder.components.config_manager import JobConfig
    except ImportError as exc:
        return f"torch's flight-recorder analyser is not importable here ({exc})"
    args = JobConfig().parse_args(["records", "--allow-incomplete-ranks"])
    details = {f"rank{r}": dict(rec, rank=r) for r, rec in full.items()}
    analyser_log = logging.getLogger("Flight Recorder")
    level = analyser_log.level
    analyser_log.setLevel(logging.CRITICAL)  # it prints its findings; the failure line says them
    try:
        db = build_db(details, args, next(iter(full.values()))["version"])
    except Exception as exc:  # torch's internal module: a record it cannot read is a note, not a crash
        return f"torch's flight-recorder analyser could not read the records ({type(exc).__name__}: {exc})"
    finally:
        analyser_log.setLevel(level)
        gc.enable()  # its loader turns the collector off for speed and leaves it so
    hit = next((c for c in db.collectives if c.missing_ranks), None)
    if hit is None:
        return "the flight recorders show no collective that a rank did not enter"
    missing = tuple(sorted(hit.missing_ranks))
    group = next((f"{name} ({g.get('desc', '')})" for rec in full.values()
                  for name, g in rec.get("pg_config", {}).items() if name == str(hit.group_id)), str(hit.pg_desc))
    return StuckCollective(name=hit.collective_name, seq=hit.collective_seq_id, group=group,
                           entered=tuple(sorted(set(hit.expected_ranks) - set(missing))), missing=missing, without_record=silent)
