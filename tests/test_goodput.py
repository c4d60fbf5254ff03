"""Goodput (orchestration/analysis/goodput.py): a run's wall clock cut into productive steps and each
loss by cause, on constructed ledgers and logs: each fault's cost lands in its cause, the parts add
up to the wall clock, per attempt and for the run; the logs read back (either engine's lines, a
log of several starts, the saves, the time zone); status's line and compare's columns. The real
runs with injected faults are tests/test_resilience.py's (a crash and a hang) and
tests/test_megatron_lm_loop.py's (Megatron-LM's own lines)."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from megatron_ext.run_spec.engines import MEGATRON_CORE, MEGATRON_LM
from megatron_ext.run_spec.iteration_log import IterationRecord, MetricsWriter, format_iteration_line
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.analysis.compare import summarize
from run_checks import status_line_parts
from orchestration.analysis.goodput import (AttemptLog, GoodputInputs, Part, Save, TimedIteration, attempt_log, compute_goodput,
                                            end_cause, format_duration, format_goodput_line, match_segments, read_goodput,
                                            split_attempts, straggler_seconds, training_started, zone_offset_s)
from orchestration.analysis.tables import format_comparison
from orchestration.node.failure import FailureKind
from orchestration.node.run_state import (AttemptRecord, NodeExit, RunState, begin_attempt, end_attempt, read_ledger, write_exit,
                                          write_ledger)


def ledger_entry(attempt, started, ended, state, reason="x", start=None, end=None, lost=()):
    return AttemptRecord(attempt=attempt, run_id="r-1", started_at=started, checkpoint_at_start=start, ended_at=ended,
                         state=state, reason=reason, checkpoint_at_end=end, lost=tuple(lost))


def lines(first_it, last_it, first_time, step=1.0, gap=None, straggler=0.0):
    """One line per iteration, ``gap`` seconds apart (default: the step), the first printed at ``first_time``."""
    gap = step if gap is None else gap
    return tuple(TimedIteration(it, first_time + (it - first_it) * gap, step, 1, straggler) for it in range(first_it, last_it + 1))


def log(attempt, its, saves=(), node=0, started=None):
    return AttemptLog(attempt=attempt, node=node, iterations=its, saves=tuple(saves), training_started_at=started)


def parts_of(g):
    return {p: round(s, 6) for p, s in g.parts.items() if s}


def assert_adds_up(g):
    assert sum(g.parts.values()) == pytest.approx(g.wall_s, abs=1e-9)
    assert all(s >= 0 for s in g.parts.values()), g.parts
    for a in g.attempts:
        assert sum(a.parts.values()) == pytest.approx(a.wall_s, abs=1e-9) and all(s >= 0 for s in a.parts.values())
    assert sum(a.wall_s for a in g.attempts) == pytest.approx(g.wall_s)


def test_one_attempt_startup_steps_saves_other_and_shutdown():
    # started at 1000; 5 steps of 1 s, a line every 1.2 s from 1010; a 0.1 s save after the third line; ended at 1020
    g = compute_goodput(GoodputInputs(ledger=(ledger_entry(1, 1000.0, 1020.0, RunState.FINISHED),),
                                      logs={1: log(1, lines(1, 5, 1010.0, gap=1.2), [Save(3, 0.1)])}))
    assert_adds_up(g)
    assert g.wall_s == 20.0 and not g.faults and not g.running
    assert parts_of(g) == {"productive": 5.0, "startup": 9.0, "checkpoints": 0.1, "other": 0.7, "shutdown": 5.2}
    assert g.goodput == pytest.approx(0.25)


def test_a_crash_and_a_hang_each_cost_their_detection_restart_and_recomputed_iterations():
    """Attempt 1 (checkpoint at 10) trains 1-15 and crashes; attempt 2 resumes at 10, trains 11-25 and
    hangs; attempt 3 resumes at 20 and finishes at 30. A step takes 1 s and a line comes each second."""
    ledger = (ledger_entry(1, 0.0, 30.0, RunState.FAILED, "node 0 failed: torchrun exit code -9", None, 10),
              ledger_entry(2, 32.0, 78.0, RunState.HUNG, "node 0 hung: rank 0 stopped", 10, 20),
              ledger_entry(3, 80.0, 105.0, RunState.FINISHED, "torchrun exited with code 0", 20, 30))
    logs = {1: log(1, lines(1, 15, 11.0)), 2: log(2, lines(11, 25, 41.0)), 3: log(3, lines(21, 30, 91.0))}
    g = compute_goodput(GoodputInputs(ledger=ledger, logs=logs))
    assert_adds_up(g)
    # startup 10 (0 -> 10); crash: 25 -> 32 in attempt 1, 32 -> 40 in attempt 2; hang: 55 -> 80, 80 -> 90
    assert parts_of(g) == {"productive": 30.0, "startup": 10.0, "recomputed": 10.0, "crash": 15.0, "hang": 35.0, "shutdown": 5.0}
    crash, hang = g.faults
    assert (crash.attempt, crash.cause, crash.detect_s, crash.restart_s, crash.recomputed_s, crash.recomputed_iterations) == \
        (1, Part.CRASH, 7.0, 8.0, 5.0, 5)
    assert (hang.attempt, hang.cause, hang.detect_s, hang.restart_s, hang.recomputed_s, hang.recomputed_iterations) == \
        (2, Part.HANG, 25.0, 10.0, 5.0, 5)
    assert g.seconds(Part.CRASH) == crash.detect_s + crash.restart_s and g.seconds(Part.HANG) == hang.detect_s + hang.restart_s
    by_attempt = {a.attempt: parts_of(a) for a in g.attempts}
    assert by_attempt[1] == {"productive": 10.0, "startup": 10.0, "recomputed": 5.0, "crash": 7.0}
    assert by_attempt[2] == {"productive": 10.0, "crash": 8.0, "recomputed": 5.0, "hang": 25.0}
    assert by_attempt[3] == {"productive": 10.0, "hang": 10.0, "shutdown": 5.0}
    assert [round(a.goodput, 3) for a in g.attempts] == [round(10 / 32, 3), round(10 / 48, 3), 0.4]
    line = format_goodput_line(g)
    assert line == ("goodput 28.6%: 30.0s productive of 1m45.0s since the first start; lost: startup 10.0s, recomputed "
                    "10.0s, crash 15.0s, hang 35.0s, shutdown 5.0s; by attempt 1: 31%, 2: 21%, 3: 40%"), line


def test_an_attempt_that_printed_nothing_gives_its_wall_to_its_end_and_the_next_lead_to_it():
    ledger = (ledger_entry(1, 0.0, 5.0, RunState.FAILED, "rank 1: ImportError"),
              ledger_entry(2, 7.0, 30.0, RunState.FINISHED))
    g = compute_goodput(GoodputInputs(ledger=ledger, logs={2: log(2, lines(1, 5, 20.0))}))
    assert_adds_up(g)
    assert parts_of(g) == {"productive": 5.0, "crash": 7.0 + 12.0, "shutdown": 6.0}
    (crash,) = g.faults
    assert (crash.detect_s, crash.restart_s, crash.recomputed_iterations) == (7.0, 12.0, 0)


def test_a_lost_node_a_preemption_a_straggler_and_the_logs_interval():
    """Log every 5 iterations (a line covers 5 steps); a rank named slow makes the others wait 0.25 s
    a step in attempt 2; node 1 is lost in attempt 1, attempt 2 saves for it to come back."""
    def every5(first, last, t0, straggler=0.0):
        its = [TimedIteration(first, t0, 1.0, 1, straggler)]
        its += [TimedIteration(it, t0 + (it - first), 1.0, 5 if it - first >= 5 else it - first, straggler)
                for it in range(first + 4, last + 1, 5)]
        return tuple(its)

    ledger = (ledger_entry(1, 0.0, 60.0, RunState.FAILED, "node 1 (h1) lost: its supervisor has given no sign", None, 10,
                           lost=(1,)),
              ledger_entry(2, 62.0, 90.0, RunState.PREEMPTED, "saved a checkpoint for node 1 (h1) to come back", 10, 20),
              ledger_entry(3, 91.0, 120.0, RunState.FINISHED, "torchrun exited with code 0", 20, 30))
    logs = {1: log(1, every5(1, 15, 6.0)), 2: log(2, every5(11, 20, 70.0, straggler=0.25), [Save(3, 2.0)]),
            3: log(3, every5(21, 30, 100.0))}
    g = compute_goodput(GoodputInputs(ledger=ledger, logs=logs))
    assert_adds_up(g)
    assert [i.covers for i in logs[1].iterations] == [1, 4, 5, 5]
    p = parts_of(g)
    assert p["recomputed"] == 5.0 and p["straggler"] == 2.5 and p["productive"] == 30.0 - 2.5
    # node 1 lost: attempt 1's last line (20) to attempt 2's first step (69); the save for its return: attempt 2's
    # last line (79) to attempt 3's first step (99), less the save printed after that line
    assert p["lost node"] == (62.0 - 20.0) + (69.0 - 62.0) and p["preemption"] == (91.0 - 79.0 - 2.0) + (99.0 - 91.0)
    assert p["checkpoints"] == 2.0 and p["startup"] == 5.0 and p["shutdown"] == 11.0
    assert [f.cause for f in g.faults] == [Part.LOST_NODE, Part.PREEMPTION]


def test_an_end_counts_as_its_failure_kind_and_an_older_ledger_by_its_words(tmp_path):
    """The ledger keeps the kind of the failure that ended an attempt (a later close without one keeps
    it), and that kind decides, whatever the reason's words; a ledger written before it kept kinds
    (none on its records, as one read back without the key) is read by its reason's words."""
    paths = RunPaths(tmp_path, "r")
    paths.run_state_dir.mkdir(parents=True)
    begin_attempt(paths, 1, "r-1", None)
    end_attempt(paths, 1, RunState.FAILED, "node 1 (h1) lost: no sign", None, failure_kind=FailureKind.LOST)
    end_attempt(paths, 1, RunState.GAVE_UP, "3 attempts in a row made no progress", None)
    (kept,) = read_ledger(paths)
    assert kept.failure_kind == FailureKind.LOST and end_cause(kept, False) == Part.LOST_NODE
    paths.attempts_file.write_text('[{"attempt": 1, "run_id": "r-1", "started_at": 0.0, "checkpoint_at_start": null, '
                                   '"ended_at": 1.0, "state": "gave up", "reason": "the last ended: node 0 hung: rank 0 stopped"}]')
    (older,) = read_ledger(paths)
    assert older.failure_kind is None and end_cause(older, False) == Part.HANG

    def ended(state, reason, kind=None):
        return end_cause(AttemptRecord(attempt=1, run_id="r-1", started_at=0.0, checkpoint_at_start=None, ended_at=1.0,
                                       state=state, reason=reason, failure_kind=kind), True)

    assert ended(RunState.FAILED, "rank 1: ImportError", FailureKind.LOST) == Part.LOST_NODE
    assert ended(RunState.GAVE_UP, "3 attempts in a row made no progress", FailureKind.HUNG) == Part.HANG
    assert ended(RunState.GAVE_UP, "the last ended: node 0 hung: rank 0 stopped", FailureKind.FAILED) == Part.CRASH
    assert ended(RunState.FAILED, "node 1 (h1) lost: its supervisor has given no sign") == Part.LOST_NODE
    assert ended(RunState.FAILED, "node 1 (h1) gone (its machine or its supervisor)") == Part.LOST_NODE
    assert ended(RunState.GAVE_UP, "the last ended: node 0 hung: rank 0 stopped") == Part.HANG
    assert ended(RunState.GAVE_UP, "the last ended: rank 1: ImportError") == Part.CRASH


def test_a_save_is_taken_from_its_interval_and_the_rest_is_other():
    its = (TimedIteration(1, 11.0, 1.0), TimedIteration(2, 12.0, 1.0), TimedIteration(3, 16.0, 1.0))
    g = compute_goodput(GoodputInputs(ledger=(ledger_entry(1, 0.0, 20.0, RunState.FINISHED),), logs={1: log(1, its, [Save(2, 2.5)])}))
    assert_adds_up(g)
    assert parts_of(g) == {"productive": 3.0, "startup": 10.0, "checkpoints": 2.5, "other": 0.5, "shutdown": 4.0}


def test_another_node_s_clock_is_never_subtracted_from_node_0_s():
    """Megatron-LM on 2 nodes: the lines are node 1's, whose clock runs 1000 s ahead; the lead ends at
    node 0's own line before the first step; the rest are durations on node 1's clock."""
    ledger = (ledger_entry(1, 0.0, 40.0, RunState.FINISHED),)
    g = compute_goodput(GoodputInputs(ledger=ledger, logs={1: log(1, lines(1, 20, 1012.0), node=1, started=11.0)}))
    assert_adds_up(g)
    assert parts_of(g) == {"productive": 20.0, "startup": 11.0, "shutdown": 9.0}


def test_a_running_run_ends_at_its_last_line_and_late_lines_do_not_break_the_sum():
    running = compute_goodput(GoodputInputs(ledger=(ledger_entry(1, 0.0, None, None),), logs={1: log(1, lines(1, 4, 5.0))}))
    assert running.running and running.wall_s == 8.0 and "(running: as far as its lines go)" in format_goodput_line(running)
    assert_adds_up(running)
    late = compute_goodput(GoodputInputs(ledger=(ledger_entry(1, 0.0, 7.5, RunState.FINISHED),), logs={1: log(1, lines(1, 4, 5.0))}))
    assert_adds_up(late)
    assert late.wall_s == 7.5 and parts_of(late) == {"productive": 4.0, "startup": 3.5}
    nothing = compute_goodput(GoodputInputs(ledger=(ledger_entry(1, 0.0, None, None),)))
    assert nothing.wall_s == 0 and format_goodput_line(nothing) == "goodput: - (no iteration yet)"


def test_straggler_time_is_the_slow_rank_s_busy_time_less_the_others_median():
    def rec(it, busy, slow):
        return IterationRecord(iteration=it, train_iters=10, consumed_samples=0, lm_loss=1.0, lr=0.0, grad_norm=0.0, step_time_s=1.0,
                               tokens_per_s=0.0, tflops_per_gpu=0.0, global_batch_size=8, world_size=len(busy), zero_stage=0,
                               busy_s_per_rank=busy, slow_ranks=slow)
    assert straggler_seconds([rec(1, [0.5, 0.9, 0.5, 0.6], [1]), rec(2, [0.5, 0.5], []), rec(3, [0.5, 0.5], None)]) == \
        {1: pytest.approx(0.4)}


def test_goodput_parses_the_records_naming_a_slow_rank_and_a_sample_for_the_time_zone(tmp_path):
    """A run of days writes hundreds of thousands of metrics records (status took 3.4 s over 100,000,
    2.3 s of it parsing them; 1.5 s now): goodput parses those naming a slow rank, every 100th and the
    last 100, decided on the text as MetricsWriter writes it; the straggler time is the same."""
    from megatron_ext.run_spec.iteration_log import MetricsWriter, read_metrics
    from orchestration.analysis.goodput import goodput_reads

    def rec(it, slow):
        return IterationRecord(iteration=it, train_iters=1000, consumed_samples=0, lm_loss=1.0, lr=0.0, grad_norm=0.0,
                               step_time_s=1.0, tokens_per_s=0.0, tflops_per_gpu=0.0, global_batch_size=8, world_size=2,
                               zero_stage=0, busy_s_per_rank=[0.5, 0.9 if slow else 0.5], slow_ranks=[1] if slow else [])
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for it in range(1, 1001):
        writer.write(rec(it, slow=it in (150, 151, 777)))
    writer.close()
    kept = read_metrics(path, goodput_reads)
    assert straggler_seconds(kept) == straggler_seconds(read_metrics(path)) == {150: pytest.approx(0.4), 151: pytest.approx(0.4),
                                                                                  777: pytest.approx(0.4)}
    assert sorted(r.iteration for r in kept) == sorted({*range(1, 1001, 100), *range(901, 1001), 150, 151, 777})


def _line(ts: datetime, it: int, step_s: float, loss: float = 7.0) -> str:
    r = IterationRecord(iteration=it, train_iters=100, consumed_samples=16 * it, lm_loss=loss, lr=1e-3, grad_norm=1.0,
                        step_time_s=step_s, tokens_per_s=0.0, tflops_per_gpu=0.0, global_batch_size=16, world_size=2, zero_stage=0)
    return format_iteration_line(r, ts.strftime("%Y-%m-%d %H:%M:%S.%f"))


def _at(s: float) -> datetime:
    return datetime.fromtimestamp(1_800_000_000 + s)


def test_each_ledger_attempt_finds_its_own_part_of_a_log_of_several_starts():
    log_lines = ["[supervisor node0] attempt 1 of 1: starting torchrun", _line(_at(1), 1, 0.5),  # an earlier start
                 "[supervisor node0] attempt 1 of 4: starting torchrun", _line(_at(10), 1, 0.5), _line(_at(11), 2, 0.5),
                 "saved checkpoint at iteration 2 to /c/iter_0000002 in 0.4 s (checksums 0.01 s of it)",
                 _line(_at(12), 3, 0.5),
                 "saved checkpoint at iteration 4 to /c/iter_0000004 in 3.0 s (checksums 0.01 s of it; training waited 0.25 s)",
                 "progress: 3/100 (3%) eta 1s | 1 tokens/s", "[supervisor node0] attempt 2 of 4: starting torchrun",
                 "resuming from iteration 2", _line(_at(30), 3, 0.5)]
    segments = split_attempts(log_lines)
    assert [s.attempt for s in segments] == [1, 1, 2]
    mine = match_segments(segments, [1, 2])
    assert mine[1] is segments[1] and mine[2] is segments[2]
    first = attempt_log(mine[1], MEGATRON_CORE, 0)
    assert [(i.iteration, i.covers) for i in first.iterations] == [(1, 1), (2, 1), (3, 1)]
    assert first.iterations[0].time == pytest.approx(1_800_000_010) and first.saves == (Save(2, 0.4), Save(3, 0.25))
    assert match_segments(segments, [3]) == {}


def test_megatron_lm_s_lines_its_save_timer_and_rank_0_s_start_line():
    log_lines = ["[supervisor node0] attempt 1 of 2: starting torchrun",
                 f"[before the start of training step] datetime: {_at(5).strftime('%Y-%m-%d %H:%M:%S.%f')} ",
                 _line(_at(6), 1, 0.8, 7.6), _line(_at(6.5), 2, 0.65, 7.5),  # printed: the mean of 0.8 and 0.5
                 "(min, max) time across ranks (ms):", "    save-checkpoint ................................: (1200.50, 1234.00)",
                 _line(_at(8.5), 3, 0.5)]
    (segment,) = split_attempts(log_lines)
    lm = attempt_log(segment, MEGATRON_LM, 0)
    assert [i.step_time_s for i in lm.iterations] == pytest.approx([0.8, 0.5, 0.5])  # its second line made its own
    assert lm.saves == (Save(2, 1.234),)
    assert training_started(segment) == pytest.approx(1_800_000_005)
    g = compute_goodput(GoodputInputs(ledger=(ledger_entry(1, 1_800_000_000.0, 1_800_000_010.0, RunState.FINISHED),),
                                      logs={1: lm}))
    assert_adds_up(g)
    assert parts_of(g) == pytest.approx({"productive": 1.8, "startup": 5.2, "checkpoints": 1.234, "other": 2.0 - 0.5 - 1.234,
                                         "shutdown": 1.5})


def test_the_log_s_time_zone_is_corrected_to_the_metrics_epoch_times_in_quarter_hours():
    its = lines(1, 3, 1000.0)
    def rec(it, t):
        return IterationRecord(iteration=it, train_iters=3, consumed_samples=0, lm_loss=1.0, lr=0.0, grad_norm=0.0, step_time_s=1.0,
                               tokens_per_s=0.0, tflops_per_gpu=0.0, global_batch_size=8, world_size=1, zero_stage=0, time=t)
    assert zone_offset_s(its, [rec(1, 1000.003), rec(2, 1001.002)]) == 0.0
    assert zone_offset_s(its, [rec(1, 1000.003 + 3600), rec(3, 1002.01 + 3600)]) == 3600.0
    assert zone_offset_s(its, []) == 0.0


def test_durations_and_the_comparison_s_columns():
    assert [format_duration(s) for s in (0.04, 12.34, 65.0, 3599.96, 3600.4, 90061.0)] == \
        ["0.0s", "12.3s", "1m05.0s", "1h00m00s", "1h00m00s", "25h01m01s"]
    ledger = (ledger_entry(1, 0.0, 30.0, RunState.FAILED, "crash", None, 10), ledger_entry(2, 32.0, 60.0, RunState.FINISHED, "ok", 10, 20))
    g = compute_goodput(GoodputInputs(ledger=ledger, logs={1: log(1, lines(1, 15, 11.0)), 2: log(2, lines(11, 20, 41.0))}))
    records = [IterationRecord(iteration=i, train_iters=20, consumed_samples=8 * i, lm_loss=5.0, lr=0.0, grad_norm=0.0,
                               step_time_s=1.0, tokens_per_s=100.0, tflops_per_gpu=0.0, global_batch_size=8, world_size=1,
                               zero_stage=0) for i in range(1, 21)]
    row = summarize("faulted", records, goodput=g)
    assert row.wall_clock_s == 60.0 and row.goodput == pytest.approx(20 / 60) and sum(row.goodput_parts.values()) == 60.0
    table = format_comparison([row, summarize("plain", records)])
    header = next(l for l in table.splitlines() if l.startswith("run "))
    assert re.search(r"max \|dloss\| +wall +goodput +largest loss +status$", header), header
    faulted = next(l for l in table.splitlines() if l.startswith("faulted "))
    assert re.search(r" 1m00\.0s +33\.3 +crash 15\.0s +finished$", faulted), faulted
    assert re.search(r" - +- +- +finished$", next(l for l in table.splitlines() if l.startswith("plain "))), table
    assert table.splitlines()[-1] == ("goodput of faulted: 33.3% of 1m00.0s; startup 10.0s, recomputed 5.0s, crash 15.0s, "
                                      "shutdown 10.0s; by attempt 1: 31%, 2: 36%")


def test_the_status_line_reads_back():
    ledger = (ledger_entry(1, 0.0, 30.0, RunState.FAILED, "crash", None, 10), ledger_entry(2, 32.0, 60.0, RunState.FINISHED, "ok", 10, 20))
    g = compute_goodput(GoodputInputs(ledger=ledger, logs={1: log(1, lines(1, 15, 11.0)), 2: log(2, lines(11, 20, 41.0))}))
    wall, parts = status_line_parts(format_goodput_line(g))
    assert wall == 60.0 and parts == {"productive": 20.0, "startup": 10.0, "recomputed": 5.0, "crash": 15.0, "shutdown": 10.0}


def test_the_run_s_files_are_read_at_the_edge(tmp_path):
    """The ledger (its last attempt left open by a stop: node 0's exit record ends it), node 0's log with
    two starts of the run, metrics.jsonl whose epoch times put the log's local times an hour off (another
    time zone: corrected), and a rank named slow in it."""
    paths = RunPaths(tmp_path, "r")
    t0 = _at(0).timestamp()
    paths.run_state_dir.mkdir(parents=True)
    write_ledger(paths, [AttemptRecord(attempt=1, run_id="r-1", started_at=t0 + 3600, checkpoint_at_start=None)])
    write_exit(paths, NodeExit(node_rank=0, state=RunState.STOPPED, exit_code=None, signal=None, reason="stopped on request",
                               ended_at=t0 + 3600 + 20, run_id="r-1"))
    paths.logs_dir.mkdir(parents=True)
    paths.node_log(0).write_text("\n".join([
        "[supervisor node0] attempt 1 of 1: starting torchrun", _line(_at(-50), 1, 0.5),  # an earlier start
        "[supervisor node0] attempt 1 of 1: starting torchrun", "building the model", _line(_at(10), 1, 1.0),
        _line(_at(11), 2, 1.0), _line(_at(12), 3, 1.0), "progress: 3/100 (3%) eta 1s | 1 tokens/s"]) + "\n")
    writer = MetricsWriter(paths.metrics_path)
    for it in (1, 2, 3):
        writer.write(IterationRecord(iteration=it, train_iters=100, consumed_samples=16 * it, lm_loss=7.0, lr=1e-3, grad_norm=1.0,
                                     step_time_s=1.0, tokens_per_s=0.0, tflops_per_gpu=0.0, global_batch_size=16, world_size=2,
                                     zero_stage=0, busy_s_per_rank=[0.5, 0.9] if it == 3 else None,
                                     slow_ranks=[1] if it == 3 else None, time=t0 + 3600 + 10 + it - 1 + 0.002))
    writer.close()
    g = read_goodput(paths)
    assert_adds_up(g)
    assert not g.running and g.wall_s == pytest.approx(20.0) and g.attempts[0].state == "stopped"
    assert parts_of(g) == pytest.approx({"productive": 3.0 - 0.4, "straggler": 0.4, "startup": 9.0, "shutdown": 8.0})
    assert g.notes == ("the logs' times read +1.00 h off metrics.jsonl's (another time zone): corrected",)
    assert read_goodput(RunPaths(tmp_path, "none")) is None
