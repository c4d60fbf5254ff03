"""Megatron-LM's iteration log lines -> the same metrics records the project's program writes.

    python -m megatron_ext.megatron_lm_log artifacts/logs/run_node1.log --seq-length 4096

Format (Megatron-LM ``training_log``, fields joined by `` |``)::

    [2026-01-01 00:00:00] iteration        3/      10 | consumed samples:           48 | elapsed time per
    iteration (ms): 456.7 | throughput per GPU (TFLOP/s/GPU): 12.3 | learning rate: 3.000000E-04 | global
    batch size:    16 | lm loss: 7.500000E+00 | loss scale: 1.0 | grad norm: 1.250 | number of skipped
    iterations:   0 | number of nan iterations:   0 |

Lines that look like iteration lines but do not parse are skipped and counted. Pure.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict

from megatron_ext.metrics import IterationRecord

_HEAD = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*$")
_KEYS = {
    "consumed samples": "consumed_samples",
    "elapsed time per iteration (ms)": "elapsed_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "lm loss": "lm_loss",
    "grad norm": "grad_norm",
}


def looks_like_iteration_line(line: str) -> bool:
    return "iteration" in line and "consumed samples" in line


def parse_iteration_line(line: str, seq_length: int | None = None, world_size: int = 0, zero_stage: int = -1) -> IterationRecord | None:
    """One record, or None when the line is not a well-formed iteration line."""
    if not looks_like_iteration_line(line):
        return None
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
    )


def parse_log(text: str, seq_length: int | None = None, world_size: int = 0, zero_stage: int = -1) -> tuple[list[IterationRecord], int]:
    """(records, number of malformed iteration lines skipped)."""
    records, skipped = [], 0
    for line in text.splitlines():
        if not looks_like_iteration_line(line):
            continue
        record = parse_iteration_line(line, seq_length, world_size, zero_stage)
        if record is None:
            skipped += 1
        else:
            records.append(record)
    return records, skipped


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
