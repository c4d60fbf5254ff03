"""Side-by-side comparison of runs (e.g. one model under several ZeRO stages): speed, memory, loss.

    python -m orchestration compare demo_z0 demo_z1 demo_z2 demo_z3 [--warmup 2] [--name demo]

Reads each run's ``metrics.jsonl`` (this project's program) or, for Megatron-LM runs, the
iteration lines of its node logs, and its resolved parameters (``<run>_params.yaml``: engine,
nodes, processes, the model for the memory plan). Speed is the median over the iterations after
the warm-up ones; ratios and loss differences are against the first run named that has records,
measured in the same table; the goodput columns from the attempts ledger and the iteration lines
(:mod:`orchestration.analysis.goodput`); "plan" columns come from :mod:`orchestration.analysis.memory_plan` (fp32 AdamW
for CPU runs, Megatron's bf16 figures for GPU runs). Pure apart from reading those files; the
files a comparison writes (PNG, JSON, CSV) are :mod:`orchestration.analysis.comparison_files`'s.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from megatron_ext.run_spec.errors import UserError
from megatron_ext.host.devices import Device
from megatron_ext.run_spec.engines import MEGATRON_CORE, MEGATRON_LM, engine_named
from megatron_ext.run_spec.iteration_log import IterationRecord, read_metrics
from megatron_ext.run_spec.resolved import ResolvedRun, read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.analysis.goodput import Goodput, read_goodput
from orchestration.analysis.memory_plan import plan_for_run
from orchestration.node.run_state import RunState

DEFAULT_WARMUP_ITERATIONS = 2
"""Iterations left out of the medians (allocator warm-up, lazy communicator set-up, first gathers)."""
MB = 1e6
PARTIAL = "partial"
"""A comparison row whose records stop short of the planned iterations."""


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What a sweep knows about a run beyond its files."""

    status: RunState
    """finished, failed or stopped."""
    reason: str | None = None
    """Why it failed or stopped (the node log's last meaningful line)."""
    zero_stage: int | None = None
    """What the run was to be, for a run that left no parameters file (it did not start)."""
    engine: str | None = None
    nnodes: int | None = None
    nproc_per_node: int | None = None


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    run: str
    zero_stage: int
    world_size: int
    iterations: int
    """Last iteration recorded (0 without records)."""
    step_time_s: float | None
    """Median over the steady iterations (seconds)."""
    tokens_per_s: float | None
    tflops_per_gpu: float | None
    first_loss: float | None
    last_loss: float | None
    engine: str = MEGATRON_CORE.name
    model: str | None = None
    data_set: str | None = None
    nnodes: int | None = None
    nproc_per_node: int | None = None
    train_iters: int | None = None
    device: Device = Device.CPU
    """cpu or cuda (from the records: model-state bytes on CPU, CUDA peaks on GPUs; Megatron-LM: cuda)."""
    warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS
    steady_iterations: tuple[int, ...] = ()
    """The iterations the medians are over."""
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    """Per rank, the largest over ranks: peak CUDA allocation (GPUs) or peak model-state bytes (CPU)."""
    peak_memory_per_rank: tuple[int, ...] = ()
    """CPU: peak model-state bytes of every rank; GPUs: the one figure logged (largest over ranks)."""
    model_state_bytes: int | None = None
    """CPU: model-state bytes between steps, the largest over ranks."""
    model_state_bytes_per_rank: tuple[int, ...] = ()
    peak_rss_bytes: int | None = None
    """CPU: rank 0's peak resident set size."""
    planned_model_state_bytes: int | None = None
    planned_peak_bytes: int | None = None
    """Planned model states at their peak, plus (GPUs) the activation estimate: what peak_memory_bytes measures."""
    losses: tuple[tuple[int, float], ...] = ()
    """(iteration, lm loss) of every record."""
    tokens_per_s_series: tuple[tuple[int, float], ...] = ()
    status: str = RunState.FINISHED.value
    """A :class:`RunState` (finished, failed, stopped), or ``partial``: the records stop short of
    the planned iterations (still running, or ended early)."""
    reason: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    wall_clock_s: float | None = None
    """Node 0's clock, the attempts ledger's first start to its end (orchestration/analysis/goodput.py); None
    without a ledger."""
    goodput: float | None = None
    """Productive step time over ``wall_clock_s`` (0-1)."""
    goodput_parts: dict[str, float] = field(default_factory=dict)
    """Seconds of ``wall_clock_s`` by part (productive, then each loss: goodput.Part), adding up to it."""
    goodput_attempts: tuple[tuple[int, float | None], ...] = ()
    """(attempt, its goodput) of every attempt in the ledger."""

    @property
    def has_records(self) -> bool:
        return bool(self.losses)


def run_records(paths: RunPaths) -> list[IterationRecord]:
    """The run's metrics records: ``metrics.jsonl`` (this project's program), else the
    iteration lines Megatron-LM printed into the node logs (the last rank prints them; its second
    line after each start made the interval's own)."""
    records = read_metrics(paths.metrics_path)
    if records:
        return records
    resolved = read_resolved(paths.params_path)
    seq, world, stage = None, 0, -1
    if resolved:
        t = resolved.params.training
        seq, world, stage = t.seq_length, resolved.runtime.world_size, t.zero_stage
    best: list[IterationRecord] = []
    for log in sorted(paths.logs_dir.glob(f"{paths.run}_node*.log")):
        parsed, _ = MEGATRON_LM.parse_log(log.read_text(errors="replace"), seq, world, stage)
        best = parsed if len(parsed) > len(best) else best
    return best


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(run: str, records: list[IterationRecord], resolved: ResolvedRun | None = None,
              warmup: int = DEFAULT_WARMUP_ITERATIONS, outcome: RunOutcome | None = None,
              goodput: Goodput | None = None) -> RunSummary:
    """One run's row. Without records only a failed or stopped ``outcome`` is a row; else it is
    a UserError saying the run has no metrics. ``goodput``: its breakdown (goodput.py), when it has a ledger."""
    if not records and (outcome is None or outcome.status == RunState.FINISHED):
        raise UserError(f"run {run!r} has no metrics yet (no metrics.jsonl and no iteration lines in its node logs); "
                        "start it and wait for its first iteration, or check ARTIFACT_ROOT")
    runtime = resolved.runtime if resolved else None
    training = resolved.params.training if resolved else None
    last = records[-1] if records else None
    steady = [r for r in records if r.iteration > warmup] or records[1:] or records
    engine = engine_named(runtime.engine if runtime else outcome and outcome.engine)
    cpu = last is not None and last.model_state_bytes_per_rank is not None
    device = Device.of(not cpu and (engine.runs_checkout or bool(last and last.cuda_peak_allocated_bytes)))
    planned_shape = (outcome.nnodes, outcome.nproc_per_node) if outcome and outcome.nnodes else (None, None)
    stage = training.zero_stage if training else (last.zero_stage if last else
                                                  (outcome.zero_stage if outcome and outcome.zero_stage is not None else -1))
    nnodes, nproc = (runtime.nnodes, runtime.nproc_per_node) if runtime else planned_shape
    world = runtime.world_size if runtime else (last.world_size if last else (nnodes or 0) * (nproc or 0))
    peak, per_rank, states, states_per_rank = None, (), None, ()
    if last and cpu:
        per_rank = tuple(last.model_state_peak_bytes_per_rank or ())
        states_per_rank = tuple(last.model_state_bytes_per_rank)
        peak, states = (max(per_rank) if per_rank else None), max(states_per_rank)
    elif records:
        cuda = [r.cuda_peak_allocated_bytes for r in records if r.cuda_peak_allocated_bytes]
        peak = max(cuda) if cuda else None
        per_rank = (peak,) if peak else ()
    planned_states = planned_peak = None
    if resolved and stage in (0, 1, 2, 3):
        plan = plan_for_run(resolved.params, runtime.nnodes, runtime.nproc_per_node, "fp32" if device == Device.CPU else "bf16")
        if plan:
            s = plan.stage(stage)
            planned_states = s.states_bytes
            planned_peak = s.states_peak_bytes if device == Device.CPU else s.total_bytes
    train_iters = training.train_iters if training else (last.train_iters if last else None)
    if outcome and outcome.status != RunState.FINISHED:
        status, reason = outcome.status.value, outcome.reason
    elif last and train_iters and last.iteration < train_iters:
        status, reason = PARTIAL, f"{last.iteration} of {train_iters} iterations recorded (still running, or ended early)"
    else:
        status, reason = RunState.FINISHED.value, None
    mfus = [r.mfu for r in steady if r.mfu is not None]
    return RunSummary(
        run=run, zero_stage=stage, world_size=world, iterations=last.iteration if last else 0,
        step_time_s=_median([r.step_time_s for r in steady]), tokens_per_s=_median([r.tokens_per_s for r in steady]),
        tflops_per_gpu=_median([r.tflops_per_gpu for r in steady]),
        first_loss=records[0].lm_loss if records else None, last_loss=last.lm_loss if last else None,
        engine=engine.name, model=resolved.params.model.name if resolved else None,
        data_set=resolved.params.data_set if resolved else None, nnodes=nnodes, nproc_per_node=nproc,
        train_iters=train_iters, device=device,
        warmup_iterations=warmup, steady_iterations=tuple(r.iteration for r in steady), mfu=_median(mfus),
        peak_memory_bytes=peak, peak_memory_per_rank=per_rank, model_state_bytes=states,
        model_state_bytes_per_rank=states_per_rank, peak_rss_bytes=last.peak_rss_bytes if last else None,
        planned_model_state_bytes=planned_states, planned_peak_bytes=planned_peak,
        losses=tuple((r.iteration, r.lm_loss) for r in records),
        tokens_per_s_series=tuple((r.iteration, r.tokens_per_s) for r in records), status=status, reason=reason,
        wall_clock_s=goodput.wall_s if goodput else None, goodput=goodput.goodput if goodput else None,
        goodput_parts=dict(goodput.parts) if goodput else {},
        goodput_attempts=tuple((a.attempt, a.goodput) for a in goodput.attempts) if goodput else (),
    )


def compare_runs(root: Path, runs: list[str], warmup: int = DEFAULT_WARMUP_ITERATIONS,
                 outcomes: Mapping[str, RunOutcome] | None = None) -> list[RunSummary]:
    outcomes = outcomes or {}
    paths = [RunPaths(root, run) for run in runs]
    return [summarize(p.run, run_records(p), read_resolved(p.params_path), warmup, outcomes.get(p.run), read_goodput(p))
            for p in paths]


# -- against the first run ----------------------------------------------------------------------

@dataclass(frozen=True)
class LossDifference:
    max_abs: float
    max_rel: float
    at_iteration: int | None
    """Where the largest absolute difference is."""
    compared: int
    """Iterations both runs recorded."""


def base_run(rows: list[RunSummary]) -> RunSummary | None:
    """The first run with records: ratios and loss differences are against it."""
    return next((r for r in rows if r.has_records), None)


def loss_difference(base: RunSummary, row: RunSummary) -> LossDifference | None:
    """Largest loss difference at the iterations both runs recorded; None when there are none."""
    ref = dict(base.losses)
    pairs = [(it, loss, ref[it]) for it, loss in row.losses if it in ref]
    if not pairs:
        return None
    it, loss, r = max(pairs, key=lambda p: abs(p[1] - p[2]))
    return LossDifference(
        max_abs=abs(loss - r), max_rel=max(abs(a - b) / abs(b) if b else abs(a - b) for _, a, b in pairs),
        at_iteration=it, compared=len(pairs),
    )


def ratio(value: float | int | None, base: float | int | None) -> float | None:
    return value / base if value and base else None
