"""Side-by-side comparison of runs (e.g. one run under several ZeRO stages): speed, memory, loss.

    python -m orchestration compare demo_z0 demo_z1 demo_z2 demo_z3

Reads each run's ``metrics.jsonl`` (either engine writes the same records). Pure apart from
reading those files. Speed is the median over iterations after the first (warm-up excluded);
ratios are against the first run named, measured in the same table.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.spec.errors import UserError
from megatron_ext.spec.iteration_log import IterationRecord, parse_log, read_metrics
from megatron_ext.spec.resolved import read_resolved
from megatron_ext.spec.run_paths import RunPaths


@dataclass(frozen=True)
class RunSummary:
    run: str
    zero_stage: int
    world_size: int
    iterations: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    memory_bytes: int | None
    """Peak model-state bytes per rank (CPU) or peak CUDA allocation (GPU), max over ranks."""
    first_loss: float
    last_loss: float


def summarize(run: str, records: list[IterationRecord]) -> RunSummary:
    if not records:
        raise UserError(f"run {run!r} has no metrics yet; start it first or check ARTIFACT_ROOT")
    steady = records[1:] or records
    last = records[-1]
    memory = last.cuda_peak_allocated_bytes
    if memory is None and last.model_state_peak_bytes_per_rank:
        memory = max(last.model_state_peak_bytes_per_rank)
    return RunSummary(
        run=run, zero_stage=last.zero_stage, world_size=last.world_size, iterations=last.iteration,
        step_time_s=statistics.median(r.step_time_s for r in steady),
        tokens_per_s=statistics.median(r.tokens_per_s for r in steady),
        tflops_per_gpu=statistics.median(r.tflops_per_gpu for r in steady),
        memory_bytes=memory, first_loss=records[0].lm_loss, last_loss=last.lm_loss,
    )


def run_records(paths: RunPaths) -> list[IterationRecord]:
    """The run's metrics records: ``metrics.jsonl`` (this project's program), else the
    iteration lines Megatron-LM printed into the node logs (the last rank prints them)."""
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
        parsed, _ = parse_log(log.read_text(errors="replace"), seq, world, stage)
        best = parsed if len(parsed) > len(best) else best
    return best


def compare_runs(root: Path, runs: list[str]) -> list[RunSummary]:
    return [summarize(run, run_records(RunPaths(root, run))) for run in runs]


def format_comparison(rows: list[RunSummary]) -> str:
    base = rows[0]
    header = (f"{'run':<24} {'stage':>5} {'world':>5} {'iters':>5} {'step ms':>9} {'tokens/s':>10} {'x base':>7} "
              f"{'TFLOP/s/GPU':>11} {'memory MiB':>10} {'x base':>7} {'first loss':>10} {'last loss':>10}")
    out = [header]
    for r in rows:
        mem = f"{r.memory_bytes / 2**20:.1f}" if r.memory_bytes else "-"
        mem_ratio = f"{r.memory_bytes / base.memory_bytes:.2f}" if r.memory_bytes and base.memory_bytes else "-"
        out.append(
            f"{r.run:<24} {r.zero_stage:>5} {r.world_size:>5} {r.iterations:>5} {r.step_time_s * 1000:>9.1f} "
            f"{r.tokens_per_s:>10,.0f} {r.tokens_per_s / base.tokens_per_s:>7.2f} {r.tflops_per_gpu:>11.4f} "
            f"{mem:>10} {mem_ratio:>7} {r.first_loss:>10.4f} {r.last_loss:>10.4f}"
        )
    return "\n".join(out)
