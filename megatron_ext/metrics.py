"""FLOPs, MFU and the log formats: Megatron-LM's iteration line and the JSONL metrics records.

Pure formatting and arithmetic; :class:`MetricsWriter` is the one piece that writes a file.
The FLOPs formula is Megatron's >= 0.12 one (causal attention halved), per token:
``6*L*h*(3F or 2F) + 6*L*(h*(q+2k) + q*h) + 6*L*q*s + 6*h*V``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext.params import ModelPreset

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense BF16 peak per device name fragment (SXM), for MFU."""


def flops_per_token(m: ModelPreset, seq_length: int, padded_vocab: int) -> float:
    """Training FLOPs (forward + backward) per token."""
    L, h, F, s, V = m.num_layers, m.hidden_size, m.ffn_hidden_size, seq_length, padded_vocab
    q = m.num_attention_heads * m.head_dim
    k = m.query_groups * m.head_dim
    mlp = 6 * L * h * (3 if m.swiglu else 2) * F
    attn_linear = 6 * L * (h * (q + 2 * k) + q * h)
    attn_core = 6 * L * q * s
    logits = 6 * h * V
    return float(mlp + attn_linear + attn_core + logits)


def tflops_per_gpu(flops_per_iteration: float, iteration_s: float, world_size: int) -> float:
    return flops_per_iteration / (iteration_s * 1e12 * world_size)


def peak_tflops_for(device_name: str) -> float | None:
    for fragment, peak in PEAK_BF16_TFLOPS.items():
        if fragment in device_name:
            return peak
    return None


@dataclass
class IterationRecord:
    """One JSONL line per logged iteration (the same for both engines)."""

    iteration: int
    train_iters: int
    consumed_samples: int
    lm_loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    global_batch_size: int
    world_size: int
    zero_stage: int
    mfu: float | None = None
    """Model FLOPs utilisation against the device's peak (GPUs only)."""
    cuda_peak_allocated_bytes: int | None = None
    model_state_bytes: int | None = None
    """CPU: parameters + gradients + optimizer state this rank holds after the step."""
    model_state_peak_bytes: int | None = None
    """CPU: the most model-state bytes seen so far (forward end or after a step)."""
    peak_rss_bytes: int | None = None
    model_state_bytes_per_rank: list[int] | None = None
    model_state_peak_bytes_per_rank: list[int] | None = None
    valid_loss: float | None = None
    time: float = 0.0


def format_iteration_line(r: IterationRecord, timestamp: str | None = None) -> str:
    """Megatron-LM's training_log line, field for field (with --log-throughput)."""
    ts = timestamp or time.strftime("%Y-%m-%d %H:%M:%S")
    fields = [
        f"[{ts}] iteration {r.iteration:8d}/{r.train_iters:8d}",
        f"consumed samples: {r.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {r.step_time_s * 1000:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {r.tflops_per_gpu:.1f}",
        f"learning rate: {r.lr:.6E}",
        f"global batch size: {r.global_batch_size:5d}",
        f"lm loss: {r.lm_loss:.6E}",
        f"loss scale: {1.0:.1f}",
        f"grad norm: {r.grad_norm:.3f}",
        f"number of skipped iterations: {0:3d}",
        f"number of nan iterations: {0:3d}",
    ]
    return " |".join(f" {f}" if i else f for i, f in enumerate(fields)) + " |"


def format_progress_line(r: IterationRecord, elapsed_s: float) -> str:
    remaining = r.train_iters - r.iteration
    eta_s = elapsed_s / max(r.iteration, 1) * remaining
    return (
        f"progress: {r.iteration}/{r.train_iters} ({100 * r.iteration / r.train_iters:.0f}%) "
        f"eta {eta_s:.0f}s | {r.tokens_per_s:,.0f} tokens/s"
    )


class MetricsWriter:
    """Writes :class:`IterationRecord` objects as JSON lines. Side effect: one file."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("w", buffering=1)  # a new start of the run starts its metrics anew

    def write(self, record: IterationRecord) -> None:
        self._fh.write(json.dumps(asdict(record)) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
