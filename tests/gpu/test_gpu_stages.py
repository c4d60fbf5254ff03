"""One CUDA GPU: Qwen3-1.7B at full depth (28 layers, sequence 4096) under ZERO_STAGE 0-3 at data-parallel size 1.

    python -m pytest -s tests/gpu          # or: python tests/gpu/test_gpu_stages.py

Skipped without CUDA (CI has none). Each stage runs this project's program (megatron_ext.pretrain
under torchrun, one process) on Megatron's mock data for ITERS iterations of one micro batch of
MICRO_BATCH sequences (:func:`micro_batch_for`: 2 on a GPU of less than 100 GiB), and its row
gives TFLOP/s/GPU and MFU (medians after the first two iterations; MFU against the dense BF16
peak, FP8 runs too), peak CUDA memory, the last loss, the first iteration's time with the
fused-kernel warm-up that precedes it (out of the medians), and the program's gradients line
(stages 2-3: Megatron-FSDP's strategy). At data-parallel size 1 nothing is sharded across
ranks: stage 1's distributed optimizer holds the whole state, stages 2-3 run Megatron-FSDP's
``no_shard`` unless MEGATRON_EXT_SHARD_ONE_RANK=1 keeps their own strategy (the GPU check sets it
where the release allows: cuda_trainer.one_rank_strategy), so the rows' memory is about the same
and the sharded memory comes from the planner (plan_memory.sh); their speed is each mode's
single-GPU cost, with no data-parallel traffic overlapped or paid. A row that fails or runs past
STAGE_TIMEOUT_S is reported as such (its process group killed) and the next one runs.
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
activations (the planner's figures), the data set qwen3_1p7b_gbs2048's micro batch; it peaked at
84.78 GiB (91.0 GB) at every stage on 2026-12-04."""
SMALL_GPU_MICRO_BATCH = 2
MICRO_BATCH_MEMORY_GIB = 100.0
"""A GPU with less memory (an H100's 79 GiB) runs micro batch SMALL_GPU_MICRO_BATCH: about 25 GiB of
activations less."""
STAGE_TIMEOUT_S = 150


def micro_batch_for(memory_gib: float | None) -> int:
    """The full rows' micro batch on a GPU of ``memory_gib`` (None: unknown, the H200's)."""
    return SMALL_GPU_MICRO_BATCH if memory_gib is not None and memory_gib < MICRO_BATCH_MEMORY_GIB else MICRO_BATCH


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


PROGRAM = ("-m", "megatron_ext.pretrain")
"""What torchrun runs: the program (tests/gpu/profile_step.py puts a profiler around one of its steps)."""


def pretrain_argv(data: Path, run: str, stage: int, train_iters: int | None = None,
                  program: tuple[str, ...] = PROGRAM) -> list[str]:
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
             *program, "--model", "qwen3_1p7b", "--data", str(data), "--run-name", run,
             "--zero-stage", str(stage)] + (["--train-iters", str(train_iters)] if train_iters else []))


def run_stage(stage: int, root: Path, fp8: str | None = None, timeout_s: float = STAGE_TIMEOUT_S,
              micro: int = MICRO_BATCH, iters: int = ITERS, program: tuple[str, ...] = PROGRAM,
              skip_last: int = 0) -> dict:
    """One stage's row; ``skip_last``: iterations at the end left out of the medians (a profiled one)."""
    from megatron_ext.run_spec.iteration_log import read_metrics

    run = f"gpu_z{stage}" + (f"_{fp8}" if fp8 else "")
    data = data_yaml(root, run, iters=iters, micro=micro, fp8=fp8)
    code, out = run_in_own_group(pretrain_argv(data, run, stage, program=program), timeout_s, cwd=REPO,
                                 env={**os.environ, "ARTIFACT_ROOT": str(root)})
    row = {"stage": stage, "precision": fp8 or "bf16"}
    if code != 0:
        return {**row, "error": out[-1500:]}

    def line(*starts: str, default: str = "") -> str:
        return next((text for text in out.splitlines() if text.startswith(starts)), default)

    every = read_metrics(root / "runs" / run / "metrics.jsonl")
    records = every[2:len(every) - skip_last]
    last = records[-1]
    return {**row, "first_s": every[0].step_time_s, "warm_up": line("fused kernels compiled", default="no warm-up line"),
            "tflops": statistics.median(r.tflops_per_gpu for r in records),
            "mfu": statistics.median(r.mfu for r in records) if last.mfu is not None else None,
            "peak_gib": last.cuda_peak_allocated_bytes / 2**30, "loss": last.lm_loss, "kernels": line("kernels:"),
            "peak": line("MFU against", "no MFU"), "gradients": line("gradients:")}


def format_header(micro: int = MICRO_BATCH) -> str:
    return (f"Qwen3-1.7B, 28 layers, seq 4096, micro batch {micro}, DP=1 (speed = each mode's single-GPU cost)\n"
            f"{'stage':>5} {'prec':>6} {'TFLOP/s/GPU':>11} {'MFU':>6} {'peak GiB':>9} {'last loss':>10}")


HEADER = format_header()


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['stage']:>5} {r['precision']:>6} failed: {r['error']}"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    return (f"{r['stage']:>5} {r['precision']:>6} {r['tflops']:>11.1f} {mfu:>6} {r['peak_gib']:>9.2f} {r['loss']:>10.4f}  "
            f"first iteration {r.get('first_s', float('nan')):.2f} s after: {r.get('warm_up', '-')}; {r['peak']}; "
            f"{r['kernels']}" + (f"; {r['gradients']}" if r.get("gradients") else ""))


def run_stages(root: Path) -> list[dict]:
    """Every stage in turn, each row printed as soon as it is known."""
    import torch

    micro = micro_batch_for(torch.cuda.get_device_properties(0).total_memory / 2**30)
    print(format_header(micro), flush=True)
    rows = []
    for stage in range(4):
        rows.append(run_stage(stage, root, micro=micro))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    return "\n".join(map(format_row, rows))


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
