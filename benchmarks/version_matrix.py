"""The CPU smoke under every ZeRO stage on other megatron-core releases / Pythons, side by side.

    python benchmarks/version_matrix.py --python /usr/bin/python3.12 --megatron-core /tmp/mc/0.19.2 --iters 6

For each given (Python, megatron-core directory) pair -- a directory made with ``pip install
--no-deps --target DIR megatron-core==X`` (empty: the interpreter's own) -- runs gpt_smoke on
the embedded corpus with 2 CPU processes under ZERO_STAGE 0-3 and prints the lm loss at the last
iteration per stage, whether all stages agree, and the megatron-core version the ranks reported.
The support matrix in docs/install.md comes from this script (figures: benchmarks/results.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import free_port  # noqa: E402
sys.path.insert(0, str(REPO))

from megatron_ext.run_spec.iteration_log import read_metrics  # noqa: E402


def run(python: str, mc_dir: str, model: str, stage: int, iters: int, root: Path) -> tuple[float | None, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZERO_STAGE", "CONTAINER_NAME", "PYTHONPATH")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [mc_dir, str(REPO)])), ARTIFACT_ROOT=str(root))
    run_name = f"matrix_{Path(python).name}_{Path(mc_dir).name or 'own'}_{model}_z{stage}"
    proc = subprocess.run([python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), "-m", "megatron_ext.pretrain", "--model", model, "--data",
                           "smoke", "--run-name", run_name, "--zero-stage", str(stage), "--train-iters", str(iters)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return None, (proc.stderr or proc.stdout).strip().splitlines()[-1][-200:]
    return read_metrics(root / "runs" / run_name / "metrics.jsonl")[-1].lm_loss, ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", action="append", required=True, help="an interpreter (repeat, paired with --megatron-core)")
    p.add_argument("--megatron-core", action="append", required=True, help="a --target directory, or '' for the interpreter's own")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--models", default="gpt_smoke,qwen3_smoke", help="comma list of model presets (with the smoke data set)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="matrix_"))
    print(f"{'python':<12} {'megatron-core':<14} {'model':<12} {'stage 0':>10} "
          f"{'stage 1':>10} {'stage 2':>10} {'stage 3':>10}  same loss")
    for python, mc in zip(args.python, args.megatron_core, strict=True):
        py = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                            capture_output=True, text=True).stdout.strip()
        code = "import megatron.core.package_info as p; print(p.__version__)"
        env = {**os.environ, "PYTHONPATH": mc}
        version = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env).stdout.strip() or "?"
        for model in args.models.split(","):
            results = [run(python, mc, model, stage, args.iters, root) for stage in range(4)]
            losses = [loss for loss, _ in results]
            cells = [f"{loss:10.4f}" if loss is not None else f"{'failed':>10}" for loss in losses]
            same = all(loss is not None for loss in losses) and max(losses) - min(losses) <= 1e-5 * abs(losses[0])
            print(f"{py:<12} {version:<14} {model:<12} {' '.join(cells)}  {'yes' if same else 'NO'}", flush=True)
            for stage, (_, error) in enumerate(results):
                if error:
                    print(f"    stage {stage}: {error}")


if __name__ == "__main__":
    main()
