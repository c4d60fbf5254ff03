"""One CUDA GPU: Qwen3-1.7B at full depth (28 layers, sequence 4096) under ZERO_STAGE 0-3 at data-parallel size 1.

    python -m pytest -s tests/gpu          # or: python tests/gpu/test_gpu_stages.py

Skipped without CUDA (CI has none). Each stage runs this project's program (megatron_ext.pretrain
under torchrun, one process) on Megatron's mock data for ITERS iterations of one micro batch of
MICRO_BATCH sequences, and its row gives TFLOP/s/GPU and MFU (medians after the first two
iterations; MFU against the dense BF16 peak, FP8 runs too), peak CUDA memory, the last loss, and
the first iteration's time with the fused-kernel warm-up that precedes it (out of the medians).
At data-parallel size 1 nothing is sharded: stage 1's distributed optimizer holds the whole
state, stages 2-3 run Megatron-FSDP's ``no_shard`` (cuda_trainer.wrap_cuda says why), so the
rows' memory is about the same and the sharded memory comes from the planner (plan_memory.sh);
their speed is each mode's single-GPU cost, with no data-parallel traffic overlapped or paid.
A row that fails or runs past STAGE_TIMEOUT_S is reported as such (its process group killed) and
the next one runs.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ITERS = 6
MICRO_BATCH = 4
"""Qwen3-1.7B at sequence 4096 on one H200: 31 GB of model states at stage 0 plus ~48 GB of
activations (the planner's figures), the data set qwen3_1p7b_gbs2048's micro batch."""
STAGE_TIMEOUT_S = 150


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUNNING: list[subprocess.Popen] = []
"""The row running now (for a caller that must kill its group when it is itself stopped)."""


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_in_own_group(argv: list[str], timeout_s: float, **kwargs) -> tuple[int, str]:
    """Run ``argv`` in a session of its own; past ``timeout_s`` its whole process group is killed.
    Returns (exit code or 124, stdout + stderr)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **kwargs)
    RUNNING.append(proc)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\ntimed out after {timeout_s:.0f} s: process group {proc.pid} killed"
    finally:
        RUNNING.remove(proc)


def data_yaml(root: Path, name: str, *, iters: int, micro: int, fp8: str | None = None, save_interval: int = 0) -> Path:
    """Megatron's mock data at sequence 4096 (no tokenizer, no corpus to prepare)."""
    path = root / f"{name}.yaml"
    path.write_text("data:\n  source: mock\n  tokenizer:\n    type: \"null\"\n    vocab_size: 2048\n"
                    f"training:\n  seq_length: 4096\n  micro_batch_size: {micro}\n  global_batch_size: {micro}\n"
                    f"  train_iters: {iters}\n  log_interval: 1\n  eval_iters: 0\n  save_interval: {save_interval}\n"
                    f"  lr_warmup_iters: 1\n" + (f"  fp8: {fp8}\n" if fp8 else ""))
    return path


def pretrain_argv(data: Path, run: str, stage: int, train_iters: int | None = None) -> list[str]:
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
             "-m", "megatron_ext.pretrain", "--model", "qwen3_1p7b", "--data", str(data), "--run-name", run,
             "--zero-stage", str(stage)] + (["--train-iters", str(train_iters)] if train_iters else []))


def run_stage(stage: int, root: Path, fp8: str | None = None, timeout_s: float = STAGE_TIMEOUT_S) -> dict:
    from megatron_ext.run_spec.iteration_log import read_metrics

    run = f"gpu_z{stage}" + (f"_{fp8}" if fp8 else "")
    data = data_yaml(root, run, iters=ITERS, micro=MICRO_BATCH, fp8=fp8)
    code, out = run_in_own_group(pretrain_argv(data, run, stage), timeout_s, cwd=REPO,
                                 env={**os.environ, "ARTIFACT_ROOT": str(root)})
    row = {"stage": stage, "precision": fp8 or "bf16"}
    if code != 0:
        return {**row, "error": out[-1500:]}
    kernels = next((line for line in out.splitlines() if line.startswith("kernels:")), "")
    peak = next((line for line in out.splitlines() if line.startswith(("MFU against", "no MFU"))), "")
    warm_up = next((line for line in out.splitlines() if line.startswith("fused kernels compiled")), "no warm-up line")
    every = read_metrics(root / "runs" / run / "metrics.jsonl")
    records = every[2:]
    last = records[-1]
    return {**row, "first_s": every[0].step_time_s, "warm_up": warm_up,
            "tflops": statistics.median(r.tflops_per_gpu for r in records),
            "mfu": statistics.median(r.mfu for r in records) if last.mfu is not None else None,
            "peak_gib": last.cuda_peak_allocated_bytes / 2**30, "loss": last.lm_loss, "kernels": kernels, "peak": peak}


HEADER = (f"Qwen3-1.7B, 28 layers, seq 4096, micro batch {MICRO_BATCH}, DP=1 (speed = each mode's single-GPU cost)\n"
          f"{'stage':>5} {'prec':>6} {'TFLOP/s/GPU':>11} {'MFU':>6} {'peak GiB':>9} {'last loss':>10}")


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['stage']:>5} {r['precision']:>6} failed: {r['error']}"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    return (f"{r['stage']:>5} {r['precision']:>6} {r['tflops']:>11.1f} {mfu:>6} {r['peak_gib']:>9.2f} {r['loss']:>10.4f}  "
            f"first iteration {r.get('first_s', float('nan')):.2f} s after: {r.get('warm_up', '-')}; {r['peak']}; "
            f"{r['kernels']}")


def run_stages(root: Path) -> list[dict]:
    """Every stage in turn, each row printed as soon as it is known."""
    print(HEADER, flush=True)
    rows = []
    for stage in range(4):
        rows.append(run_stage(stage, root))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    return "\n".join([HEADER, *map(format_row, rows)])


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (none on CI machines)")
def test_stages_on_one_gpu(tmp_path):
    rows = run_stages(tmp_path)
    assert all("error" not in r for r in rows), format_table(rows)
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 0.05 * min(losses)  # bf16: close, not bitwise


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        run_stages(Path(d))
