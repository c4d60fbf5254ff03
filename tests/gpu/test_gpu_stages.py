"""One CUDA GPU: Qwen3-1.7B's shape with fewer layers under ZERO_STAGE 0-3 at data-parallel size 1.

    python -m pytest -s tests/gpu          # or: python tests/gpu/test_gpu_stages.py

Skipped without CUDA (CI has none). Prints TFLOP/s/GPU, MFU and peak memory per stage as a
table; one command, about 2-4 minutes on an H200 (8 layers, sequence 4096, 10 iterations each).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUM_LAYERS = 8
ITERS = 10


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
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
         "-m", "megatron_ext.pretrain", "--model", str(model), "--data", str(data), "--run-name", run],
        cwd=REPO, env={**__import__("os").environ, "ZERO_STAGE": str(stage), "ARTIFACT_ROOT": str(root)},
        capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        return {"stage": stage, "error": (proc.stdout + proc.stderr)[-1500:]}
    records = [json.loads(l) for l in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()][2:]
    last = records[-1]
    return {
        "stage": stage,
        "tflops": sorted(r["tflops_per_gpu"] for r in records)[len(records) // 2],
        "mfu": last["mfu"],
        "peak_gib": last["cuda_peak_allocated_bytes"] / 2**30,
        "loss": last["lm_loss"],
    }


def format_table(rows: list[dict]) -> str:
    out = [f"Qwen3-1.7B shape, {NUM_LAYERS} layers, seq 4096, DP=1, bf16",
           f"{'stage':>5} {'TFLOP/s/GPU':>11} {'MFU':>6} {'peak GiB':>9} {'last loss':>10}"]
    for r in rows:
        if "error" in r:
            out.append(f"{r['stage']:>5} failed: {r['error']}")
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            out.append(f"{r['stage']:>5} {r['tflops']:>11.1f} {mfu:>6} {r['peak_gib']:>9.2f} {r['loss']:>10.4f}")
    return "\n".join(out)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (none on CI machines)")
def test_stages_on_one_gpu(tmp_path):
    rows = [run_stage(stage, tmp_path) for stage in range(4)]
    print("\n" + format_table(rows))
    assert all("error" not in r for r in rows), format_table(rows)
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 0.05 * min(losses)  # bf16: close, not bitwise


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(format_table([run_stage(stage, Path(d)) for stage in range(4)]))
