"""The GPU check for a lent machine (one GPU): what matters most first, inside a time budget.

    python tests/gpu/gpu_check.py [--budget-s 450]      # what tests/gpu/device_check.sh runs

1. Throughput: Qwen3-1.7B's shape with 8 layers under ZERO_STAGE 0-3 (tests/gpu/test_gpu_stages.py):
   TFLOP/s/GPU, MFU, peak memory, last loss, the kernels chosen.
2. Resume at stages 1 and 3, then 0 and 2 (tests/cuda_on_cpu/worker.py on the GPU, NCCL, no shim):
   6 steps, a checkpoint after 3, a new model and optimizer loading it and training on; the losses
   of steps 4-6 against the run never stopped (bf16 on a GPU: equal, or within bf16 noise; no jump).
3. A NaN loss at the second step: the run stops before the update (stages 0 and 2: megatron-core's
   bucket check, and the norm check before the step under Megatron-FSDP).
4. Megatron-FSDP's parameter all-gathers per step at stage 2 (1 and 4 micro-batches; the adapter's
   default units against TransformerLayer units).

Each section prints its lines as it finishes; a section starts only if the budget still holds its
estimate, so a slow machine cuts the tail, not the head. The table also goes to $OUT/gpu_check.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from test_gpu_stages import HEADER, STAGE_TIMEOUT_S, format_row, run_stage  # noqa: E402

WORKER = REPO / "tests" / "cuda_on_cpu" / "worker.py"
WORKER_TIMEOUT_S = 120


def worker(mode: str, stage: int, out: Path) -> tuple[int, str]:
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                               str(29500 + stage), str(WORKER), mode, "--stage", str(stage), "--out", str(out),
                               "--device", "cuda"], cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
                              env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {WORKER_TIMEOUT_S} s"
    return proc.returncode, (proc.stdout + proc.stderr)[-1200:]


def resume_row(stage: int, out: Path) -> str:
    code, tail = worker("resume", stage, out)
    path = out / f"resume_z{stage}.json"
    if code or not path.exists():
        return f"resume z{stage}: failed ({code}): {tail}"
    r = json.loads(path.read_text())
    steps = sorted(r["resumed"], key=int)
    diffs = [abs(r["resumed"][s] - r["uninterrupted"][s]) / abs(r["uninterrupted"][s]) for s in steps]
    resumed = ", ".join(f"{r['resumed'][s]:.5f}" for s in steps)
    never = ", ".join(f"{r['uninterrupted'][s]:.5f}" for s in steps)
    return (f"resume z{stage}: steps {', '.join(steps)} resumed {resumed} vs never stopped {never}: max relative "
            f"difference {max(diffs):.2e}; files {', '.join(r['files'])}")


def nan_row(stage: int, out: Path) -> str:
    code, tail = worker("nan", stage, out)
    told = out / "nan_rank0.json"
    if not told.exists():
        return f"NaN z{stage}: no answer ({code}): {tail}"
    r = json.loads(told.read_text())
    return f"NaN z{stage}: exit {code}, update applied: {'no' if r.get('unchanged') else 'YES'}; {r['error'][:240]}"


def gathers_row(out: Path) -> str:
    code, tail = worker("gathers", 2, out)
    path = out / "gathers_z2.json"
    if code or not path.exists():
        return f"gathers z2: failed ({code}): {tail}"
    r = json.loads(path.read_text())
    return (f"gathers z2 per step (1 / 4 micro-batches): default units {r['default'][0]} / {r['default'][1]}, "
            f"TransformerLayer units {r['layers'][0]} / {r['layers'][1]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=450.0)
    args = p.parse_args()
    started = time.monotonic()
    lines: list[str] = []

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        say(HEADER)
        sections = [(lambda s=s: format_row(run_stage(s, root)), STAGE_TIMEOUT_S) for s in range(4)]
        sections += [(lambda s=s: resume_row(s, root), WORKER_TIMEOUT_S) for s in (1, 3, 0, 2)]
        sections += [(lambda s=s: nan_row(s, root), WORKER_TIMEOUT_S) for s in (0, 2)]
        sections += [(lambda: gathers_row(root), WORKER_TIMEOUT_S)]
        for i, (section, estimate_s) in enumerate(sections):
            if left() < estimate_s * 0.6:
                say(f"budget spent ({args.budget_s:.0f} s): {len(sections) - i} section(s) not run")
                break
            say(section())
    say(f"total {time.monotonic() - started:.0f} s")
    Path(os.environ.get("OUT", "/tmp"), "gpu_check.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
