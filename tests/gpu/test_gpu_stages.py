"""One CUDA GPU: Qwen3-1.7B's shape with fewer layers under ZERO_STAGE 0-3 at data-parallel size 1.

    python -m pytest -s tests/gpu          # or: python tests/gpu/test_gpu_stages.py

Skipped without CUDA (CI has none). Prints each stage's row (TFLOP/s/GPU and MFU as medians
after the first two iterations, peak memory, last loss) as soon as that stage finishes; a stage
that fails or runs past STAGE_TIMEOUT_S is reported as such and the next one runs. At most
4 x STAGE_TIMEOUT_S = 7.3 minutes in all (8 layers, sequence 4096, 10 iterations each).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_ext.run_spec.iteration_log import read_metrics  # noqa: E402
NUM_LAYERS = 8
ITERS = 10
STAGE_TIMEOUT_S = 110


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_stage(stage: int, root: Path) -> dict:
    model = root / "qwen3_1p7b_short.yaml"
    text = (REPO / "params" / "models" / "qwen3_1p7b.yaml").read_text().replace("num_layers: 28", f"num_layers: {NUM_LAYERS}")
    model.write_text(text)
    data = root / "gpu_check.yaml"
    data.write_text((REPO / "params" / "data" / "qwen3_1p7b_smoke.yaml").read_text()
                    .replace("train_iters: 50", f"train_iters: {ITERS}").replace("global_batch_size: 32", "global_batch_size: 8"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = f"gpu_z{stage}"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
             "-m", "megatron_ext.pretrain", "--model", str(model), "--data", str(data), "--run-name", run,
             "--zero-stage", str(stage)],
            cwd=REPO, env={**os.environ, "ARTIFACT_ROOT": str(root)}, capture_output=True, text=True,
            timeout=STAGE_TIMEOUT_S, start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return {"stage": stage, "error": f"timed out after {STAGE_TIMEOUT_S}s"}
    if proc.returncode != 0:
        return {"stage": stage, "error": (proc.stdout + proc.stderr)[-1500:]}
    kernels = next((l for l in proc.stdout.splitlines() if l.startswith("kernels:")), "")
    records = read_metrics(root / "runs" / run / "metrics.jsonl")[2:]
    last = records[-1]
    return {
        "stage": stage,
        "tflops": statistics.median(r.tflops_per_gpu for r in records),
        "mfu": statistics.median(r.mfu for r in records) if last.mfu is not None else None,
        "peak_gib": last.cuda_peak_allocated_bytes / 2**30,
        "loss": last.lm_loss,
        "kernels": kernels,
    }


HEADER = (f"Qwen3-1.7B shape, {NUM_LAYERS} layers, seq 4096, DP=1, bf16\n"
          f"{'stage':>5} {'TFLOP/s/GPU':>11} {'MFU':>6} {'peak GiB':>9} {'last loss':>10}")


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['stage']:>5} failed: {r['error']}"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    return f"{r['stage']:>5} {r['tflops']:>11.1f} {mfu:>6} {r['peak_gib']:>9.2f} {r['loss']:>10.4f}  {r['kernels']}"


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
