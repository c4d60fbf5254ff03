"""Checks several test modules make of a real run's records (a test module imports none of
another's: tests/test_structure.py): the model-state bytes against facts.md's formula, status's
goodput line, and the goodput of a run with a crash and a hang against the test's own clock."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED
from megatron_ext.run_spec.params import load_model
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.training.model import count_parameters
from orchestration.analysis.goodput import Part, format_goodput_line, read_goodput
from orchestration.node.run_state import read_ledger


def expected_model_state(psi: int, d: int) -> dict[int, tuple[float, float]]:
    """(between steps, peak) bytes per rank for fp32 AdamW on CPU, from facts.md."""
    return {
        0: (16 * psi, 16 * psi),
        1: (8 * psi + 8 * psi / d, 8 * psi + 8 * psi / d),
        2: (16 * psi / d, 4 * psi + 12 * psi / d),
        3: (16 * psi / d, 16 * psi / d),
    }


def check_memory(records_by_stage: dict[int, list[dict]], d: int) -> None:
    """Each rank's model-state bytes, between steps and at the peak, against facts.md's formula
    for ``d`` data-parallel ranks; with several stages, the peaks fall with the stage."""
    psi = count_parameters(load_model("gpt_smoke"), vocab_size=2048).total
    expected = expected_model_state(psi, d)
    peaks = {}
    for stage, records in records_by_stage.items():
        last = records[-1]
        between, peak = expected[stage]
        assert len(last["model_state_bytes_per_rank"]) == d
        for rank, (now, top) in enumerate(zip(last["model_state_bytes_per_rank"], last["model_state_peak_bytes_per_rank"])):
            # 5% plus padding: FSDP pads every shard to a multiple of d rows (at most d-1 rows each).
            padding = 4 * (d - 1) * 2048 * 8
            assert abs(now - between) <= 0.05 * between + padding, (stage, rank, now, between)
            assert abs(top - peak) <= 0.05 * peak + padding, (stage, rank, top, peak)
        peaks[stage] = max(last["model_state_peak_bytes_per_rank"])
    ordered = [peaks[s] for s in sorted(peaks)]
    assert ordered == sorted(ordered, reverse=True) and len(set(ordered)) == len(ordered), peaks



STATUS_PART = re.compile(r"(?:([\d.]+)h)?(?:([\d.]+)m)?([\d.]+)s")


def status_line_parts(text: str) -> tuple[float, dict[str, float]]:
    """(wall, {part: seconds}) from status's goodput line (the tests of real runs use it)."""
    line = next(l for l in text.splitlines() if l.startswith("goodput "))
    m = re.match(r"goodput [\d.]+%: (\S+) productive of (\S+) since the first start(?:; lost: ([^;(]*))?", line)
    assert m, line

    def seconds(d: str) -> float:
        h, mi, s = STATUS_PART.fullmatch(d).groups()
        return float(h or 0) * 3600 + float(mi or 0) * 60 + float(s)

    parts = {"productive": seconds(m.group(1))}
    for item in (m.group(3) or "").split(", "):
        if item:
            name, _, d = item.strip().rpartition(" ")
            parts[name] = seconds(d)
    return seconds(m.group(2)), parts



ITERATION_LINE = re.compile(r"^ \[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration +(\d+)/", re.M)


def _line_times(text: str) -> list[tuple[float, int]]:
    return [(datetime.strptime(t, "%Y-%m-%d %H:%M:%S.%f").timestamp(), int(it)) for t, it in ITERATION_LINE.findall(text)]


def first_line_after(text: str, marker: str) -> tuple[float, int]:
    """(time, iteration) of the first iteration line after the last ``marker`` in a node log (local time)."""
    return _line_times(text.rpartition(marker)[2])[0]


def longest_line_interval(text: str) -> float:
    """The longest time between two iteration lines of one attempt in a node log (a step, a save)."""
    gaps = [b[0] - a[0] for part in text.split(ATTEMPT_STARTED) for a, b in zip(_line_times(part), _line_times(part)[1:])]
    return max(gaps, default=0.0)


def last_iteration_before(text: str, marker: str, end_marker: str) -> int:
    """The last iteration a node log shows between the last ``marker`` and the ``end_marker`` after it."""
    return _line_times(text.rpartition(marker)[2].partition(end_marker)[0])[-1][1]


def assert_goodput_of_two_faults(status_text: str, root, run: str, of: str, killed_at: float, stopped_at: float,
                                 log_text: str) -> None:
    """A run whose attempt 1 crashed (a worker SIGKILLed at ``killed_at``) and attempt 2 hung (one
    SIGSTOPped at ``stopped_at``), on this machine (node 0: the test's clock is the ledger's): the
    status line's parts add up to its wall clock; the crash costs at least the ledger's restart after
    the kill and at most the next attempt's first line after it, each within the longest interval
    between two lines and 1 s (the last progress came at most that long before the signal, or after
    it: a step the signalled rank had done its part of ends and prints its line; a 3 s line after
    the SIGSTOP on a loaded machine, CI 2026-12-06), the hang the same or, where no attempt
    followed, until the ledger's end; the iterations recomputed are those past each resume point."""
    tolerance_s = longest_line_interval(log_text) + 1.0
    wall, parts = status_line_parts(status_text)
    assert abs(sum(parts.values()) - wall) <= 0.05 * len(parts) + 0.5, (wall, parts, status_text)
    paths = RunPaths(root, run)
    g, ledger = read_goodput(paths), read_ledger(paths)
    print(format_goodput_line(g), *g.faults, f"tolerance {tolerance_s:.1f} s", sep="\n")
    assert sum(g.parts.values()) == pytest.approx(g.wall_s) and all(s >= 0 for s in g.parts.values()), g.parts
    assert g.wall_s == pytest.approx(ledger[-1].ended_at - ledger[0].started_at) and g.seconds(Part.PRODUCTIVE) > 0
    assert [(f.attempt, f.cause) for f in g.faults] == [(1, Part.CRASH), (2, Part.HANG)], g.faults
    assert g.seconds(Part.LOST_NODE) == g.seconds(Part.PREEMPTION) == 0
    crash, hang = g.faults
    assert g.seconds(Part.CRASH) == pytest.approx(crash.detect_s + crash.restart_s)
    assert g.seconds(Part.HANG) == pytest.approx(hang.detect_s + hang.restart_s)
    for fault, signalled_at, following in ((crash, killed_at, 1), (hang, stopped_at, 2)):
        start = f"attempt {fault.attempt} of {of}: starting torchrun"
        if following < len(ledger):
            resumed = f"attempt {fault.attempt + 1} of {of}: starting torchrun"
            first_at, first_it = first_line_after(log_text, resumed)
            cost = fault.detect_s + fault.restart_s
            assert ledger[following].started_at - signalled_at - tolerance_s <= cost <= first_at - signalled_at + tolerance_s, \
                (fault, signalled_at, ledger[following], first_at)
            assert fault.recomputed_iterations == last_iteration_before(log_text, start, resumed) - (first_it - 1) >= 0, fault
        else:  # the run's end: from the last progress to the ledger's
            assert ledger[-1].ended_at - signalled_at - tolerance_s <= fault.detect_s <= ledger[-1].ended_at - signalled_at + tolerance_s
