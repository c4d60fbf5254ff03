"""The iteration record and Megatron-LM's iteration line: one format, one parser, both engines.

    python -m megatron_ext.run_spec.iteration_log artifacts/logs/run_node0.log --seq-length 4096

This project's program prints Megatron-LM's ``training_log`` line (so existing log readers keep
working) and writes the same :class:`IterationRecord` as JSON lines; Megatron-LM's own runs are
read back from their node logs with the same parser. Format (``training_log`` in Megatron-LM
core_v0.16.1 ``megatron/training/training.py``: a leading space, the timestamp with microseconds
since 0.16, every field ending in `` |``)::

     [2026-01-01 00:00:00.123456] iteration        3/      10 | consumed samples:           48 | elapsed time per
    iteration (ms): 456.7 | throughput per GPU (TFLOP/s/GPU): 12.3 | learning rate: 3.000000E-04 | global
    batch size:    16 | lm loss: 7.500000E+00 | loss scale: 1.0 | grad norm: 1.250 | number of skipped
    iterations:   0 | number of nan iterations:   0 |

Lines that look like iteration lines but do not parse are skipped and counted. Pure, apart from
:class:`MetricsWriter` (one file) and :func:`read_metrics`.
"""

from __future__ import annotations

import argparse
import json
import re
import dataclasses
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

from megatron_ext.run_spec.convert import structure


@dataclass(kw_only=True)
class IterationRecord:
    """One logged iteration: a JSON line of ``metrics.jsonl``, or one parsed iteration line."""

    iteration: int
    """Optimizer steps done."""
    train_iters: int
    """Optimizer steps planned."""
    consumed_samples: int
    """Sequences consumed so far."""
    lm_loss: float
    """Training loss of this step (mean cross-entropy, nats per token)."""
    lr: float
    """Learning rate as Megatron-LM logs it: the scheduler's value after this step."""
    grad_norm: float
    """Global gradient L2 norm before clipping (also with clipping off)."""
    step_time_s: float
    """Wall time of this step (seconds)."""
    tokens_per_s: float
    """Training tokens per second over all ranks."""
    tflops_per_gpu: float
    """Model TFLOP/s per rank (Megatron's formula)."""
    global_batch_size: int
    """Sequences per step."""
    world_size: int
    """Ranks (0 when unknown, e.g. parsed from a log)."""
    zero_stage: int
    """ZeRO stage (-1 when unknown)."""
    skipped_iterations: int = 0
    """Iterations since the previous record whose optimizer step was skipped (non-finite gradients)."""
    nan_iterations: int = 0
    """Skipped iterations since the previous record whose loss was NaN or infinite."""
    mfu: float | None = None
    """Model FLOPs utilisation against the device's peak (GPUs only; 0-1)."""
    cuda_peak_allocated_bytes: int | None = None
    """GPUs: peak CUDA allocation, max over ranks (bytes)."""
    model_state_bytes: int | None = None
    """CPU: parameters + gradients + optimizer state rank 0 holds after the step (bytes)."""
    model_state_peak_bytes: int | None = None
    """CPU: the most model-state bytes rank 0 held so far (bytes)."""
    peak_rss_bytes: int | None = None
    """CPU: rank 0's peak resident set size (bytes)."""
    model_state_bytes_per_rank: list[int] | None = None
    """CPU: model-state bytes after the step, per rank."""
    model_state_peak_bytes_per_rank: list[int] | None = None
    """CPU: peak model-state bytes, per rank."""
    valid_loss: float | None = None
    """Validation loss, on iterations that ran a validation pass."""
    busy_s_per_rank: list[float] | None = None
    """Each rank's busy time per step over the log interval (seconds; its step less its waits for
    the others in collectives: training/busy_clock.py): the slow-rank measure."""
    slow_ranks: list[int] | None = None
    """The ranks named slow at this record (training.resilience.slow_rank_ratio; none: [])."""
    time: float = 0.0
    """Unix time the record was written (seconds)."""


def format_iteration_line(r: IterationRecord, timestamp: str | None = None) -> str:
    """Megatron-LM's ``training_log`` line, field for field (with ``--log-throughput``)."""
    ts = timestamp or datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
    return (
        f" [{ts}]"
        f" iteration {r.iteration:8d}/{r.train_iters:8d} |"
        f" consumed samples: {r.consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {r.step_time_s * 1000:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {r.tflops_per_gpu:.1f} |"
        f" learning rate: {r.lr:.6E} |"
        f" global batch size: {r.global_batch_size:5d} |"
        f" lm loss: {r.lm_loss:.6E} |"
        f" loss scale: {1.0:.1f} |"
        f" grad norm: {r.grad_norm:.3f} |"
        f" number of skipped iterations: {r.skipped_iterations:3d} |"
        f" number of nan iterations: {r.nan_iterations:3d} |"
    )


def format_progress_line(r: IterationRecord, elapsed_s: float) -> str:
    remaining = r.train_iters - r.iteration
    eta_s = elapsed_s / max(r.iteration, 1) * remaining
    return (f"progress: {r.iteration}/{r.train_iters} ({100 * r.iteration / r.train_iters:.0f}%) "
            f"eta {eta_s:.0f}s | {r.tokens_per_s:,.0f} tokens/s")


_HEAD = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*$")
_KEYS = {
    "consumed samples": "consumed_samples",
    "elapsed time per iteration (ms)": "elapsed_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "lm loss": "lm_loss",
    "grad norm": "grad_norm",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
}


_START = re.compile(r"\biteration\s+\d+/\s*\d+\s*\|")
_LOOKS = re.compile(_START.pattern + r".*consumed samples")


def looks_like_iteration_line(line: str) -> bool:
    """An iteration line, possibly torn or garbled (then counted as malformed)."""
    return bool(_LOOKS.search(line))


def parse_iteration_line(line: str, seq_length: int | None = None, world_size: int = 0,
                         zero_stage: int = -1) -> IterationRecord | None:
    """One record, or None when the line is not a well-formed iteration line. ``seq_length``
    gives tokens/s (the line has no such field)."""
    if not looks_like_iteration_line(line):
        return None
    # From its last head on: another rank's line without its newline may come first in a node log
    # (seen: rank 0's "[Rank 0] (after 1 iterations) memory (MB) | allocated: ..." then the last
    # rank's iteration line, the two processes writing one file).
    line = line[[m.start() for m in _START.finditer(line)][-1]:]
    parts = [p.strip() for p in line.split(" |")]
    head = _HEAD.search(parts[0])
    if not head:
        return None
    values: dict[str, float] = {}
    for part in parts[1:]:
        key, sep, value = part.rpartition(":")
        if sep and key.strip() in _KEYS:
            try:
                values[_KEYS[key.strip()]] = float(value)
            except ValueError:
                return None
    if not {"consumed_samples", "elapsed_ms", "lr", "global_batch_size", "lm_loss"} <= set(values):
        return None
    step_s = values["elapsed_ms"] / 1000
    gbs = int(values["global_batch_size"])
    return IterationRecord(
        iteration=int(head.group(1)), train_iters=int(head.group(2)), consumed_samples=int(values["consumed_samples"]),
        lm_loss=values["lm_loss"], lr=values["lr"], grad_norm=values.get("grad_norm", float("nan")), step_time_s=step_s,
        tokens_per_s=gbs * seq_length / step_s if seq_length and step_s > 0 else 0.0,
        tflops_per_gpu=values.get("tflops", 0.0), global_batch_size=gbs, world_size=world_size, zero_stage=zero_stage,
        skipped_iterations=int(values.get("skipped_iterations", 0)), nan_iterations=int(values.get("nan_iterations", 0)),
    )


ATTEMPT_STARTED = "starting torchrun"
"""The supervisor's line at the start of every attempt (orchestration/node/supervisor.py), in every node log."""
MEGATRON_LM_STARTS = (ATTEMPT_STARTED, "[before the start of training step]")
"""Lines that mark a start of Megatron-LM's training in a node log: the supervisor's, before every
attempt (every node's log has it), and Megatron-LM's own (rank 0's)."""


def undo_first_interval_mean(first: IterationRecord, second: IterationRecord) -> IterationRecord:
    """Megatron-LM's second iteration line after a start averages the first logged iteration in (its
    training.py logs the first iteration and then does not reset its totals: the loss and time
    totals of core_v0.16.1's training_log, ~L2064-2087, with is_first_iteration at ~L2577): this
    line's own mean, of the iterations after the first line's."""
    n = second.iteration - (first.iteration - 1)  # iterations the printed means cover
    if n < 2:
        return second
    loss = (n * second.lm_loss - first.lm_loss) / (n - 1)
    step_s = (n * second.step_time_s - first.step_time_s) / (n - 1)
    if step_s <= 0:
        step_s = second.step_time_s
    scale = second.step_time_s / step_s
    return dataclasses.replace(second, lm_loss=loss, step_time_s=step_s, tokens_per_s=second.tokens_per_s * scale,
                               tflops_per_gpu=second.tflops_per_gpu * scale)


def parse_log(text: str, seq_length: int | None = None, world_size: int = 0,
              zero_stage: int = -1, starts: tuple[str, ...] = ()) -> tuple[list[IterationRecord], int]:
    """(records, number of malformed iteration lines skipped). ``starts`` (Megatron-LM's
    :data:`MEGATRON_LM_STARTS`): the second line after each is that interval's own mean
    (:func:`undo_first_interval_mean`), not Megatron-LM's printed one."""
    records, skipped = [], 0
    since_start: list[IterationRecord] | None = None
    for line in text.splitlines():
        if any(marker in line for marker in starts):
            since_start = []
            continue
        if not looks_like_iteration_line(line):
            continue
        record = parse_iteration_line(line, seq_length, world_size, zero_stage)
        if record is None:
            skipped += 1
            continue
        if since_start is not None and len(since_start) < 2:
            if len(since_start) == 1:
                record = undo_first_interval_mean(since_start[0], record)
            since_start.append(record)
        records.append(record)
    return records, skipped


class MetricsWriter:
    """Writes :class:`IterationRecord` objects as JSON lines. Side effect: one file.

    A fresh start starts the file anew; a resumed one (``resume_after`` = the checkpoint's
    iteration) keeps the records up to that iteration and appends after them."""

    def __init__(self, path: Path, resume_after: int = 0):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(path) if r.iteration <= resume_after] if resume_after else []
        self._fh = path.open("w", buffering=1)
        for record in kept:
            self.write(record)

    def write(self, record: IterationRecord) -> None:
        self._fh.write(json.dumps(asdict(record)) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path, keep: Callable[[int, int, str], bool] | None = None) -> list[IterationRecord]:
    """The records of a ``metrics.jsonl``; unreadable lines are skipped. ``keep(i, lines, text)``: only
    the lines it keeps are parsed (a run of days has hundreds of thousands: ~25 us each)."""
    if not path.is_file():
        return []
    out = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if keep is not None and not keep(i, len(lines), line):
            continue
        try:
            out.append(structure(IterationRecord, json.loads(line)))
        except ValueError:  # JSONDecodeError too
            continue
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--seq-length", type=int)
    args = p.parse_args()
    with open(args.log, errors="replace") as fh:
        records, skipped = parse_log(fh.read(), args.seq_length)
    for r in records:
        print(json.dumps(asdict(r)))
    print(f"# {len(records)} records, {skipped} malformed lines skipped")


if __name__ == "__main__":
    main()
