"""Tokens/s of this program against Megatron-LM's own pretrain_gpt.py: same model, data, ranks, stage.

    python benchmarks/engines.py --megatron-lm-dir /opt/Megatron-LM --repeats 3 --iters 20 [--model qwen3_smoke --stage 1]
    python benchmarks/engines.py --megatron-lm-dir core_v0.16.1/ --megatron-lm-dir core_v0.19.0/ \
        --python python3 --python .venv-py312/bin/python          # both releases, each on its own Python

Both engines start through the launcher (``python -m orchestration train``: ENGINE=megatron-core, then
ENGINE=megatron-lm), alternating, on the same prepared data set (the smoke corpus), the same number
of processes and the same ZeRO stage. Per run, the median of the iterations' tokens/s without the
first two (warm-up: the first holds the lazy initialisations, the second the optimizer state's);
per engine, the median over runs. Megatron-LM's iterations come from its node log through the
project's reader (its line of iteration 2 averages iterations 1 and 2; the reader takes that apart).
Prints one table with the ratio this program / Megatron-LM,
measured side by side in this one invocation. Several checkouts (``--megatron-lm-dir`` again, each
with its ``--python``: the launcher's and the ranks' Python, for both engines, so that this program
runs on the megatron-core of that Python) give a pair of rows and a ratio per release.

On a machine without a GPU, Megatron-LM's ranks run through the CUDA-on-CPU shim of the tests
(tests/megatron_lm_shim: every torch call passes its TorchFunctionMode), with megatron-core's
DotProductAttention and DDP where this program uses SDPA and torch's DDP: the ratio there is of
those programs as they run on a CPU, not of their GPU kernels. Side effects: an artifact root
(ARTIFACT_ROOT, else a temporary folder) with the runs' logs and metrics.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import write_data_set  # noqa: E402
sys.path.insert(0, str(REPO))

from megatron_ext.run_spec.engines import MEGATRON_CORE, MEGATRON_LM, Engine  # noqa: E402
from megatron_ext.run_spec.iteration_log import read_metrics  # noqa: E402

SHIM = REPO / "tests" / "megatron_lm_shim"
SKIPPED_ITERATIONS = 2
DROP = ("ZERO_STAGE", "ENGINE", "CONTAINER_NAME", "DRY_RUN", "MEGATRON_LM_DIR", "HOSTS", "HOSTFILE", "NNODES", "MASTER_PORT")


def run_engine(engine: Engine, model: str, data: str, run: str, args, root: Path, checkout: str, python: str) -> list[float]:
    """One run through the launcher; the tokens/s of its iterations after the first two."""
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    env.update(ARTIFACT_ROOT=str(root), NPROC_PER_NODE=str(args.nproc), ZERO_STAGE=str(args.stage), ENGINE=engine.name)
    if engine.runs_checkout:
        env.update(MEGATRON_LM_DIR=checkout)
        if not _has_gpu():
            env.update(MEGATRON_LM_CPU_SHIM="1", PYTHONPATH=os.pathsep.join(filter(None, [str(SHIM), env.get("PYTHONPATH")])))
    proc = subprocess.run([python, "-m", "orchestration", "train", model, data, run], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    log = root / "logs" / f"{run}_node0.log"
    if proc.returncode != 0:
        raise SystemExit(f"{engine.label} run {run} failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n"
                         f"{log.read_text(errors='replace')[-3000:] if log.exists() else ''}")
    records = (engine.parse_log(log.read_text(errors="replace"), seq_length=128)[0] if engine.runs_checkout
               else read_metrics(root / "runs" / run / "metrics.jsonl"))
    return [r.tokens_per_s for r in records if r.iteration > SKIPPED_ITERATIONS]


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm-dir", action="append", default=[],
                   help="a Megatron-LM checkout (default $MEGATRON_LM_DIR); again for another release")
    p.add_argument("--python", action="append", default=[],
                   help="the ranks' Python for each checkout, in order (default this one)")
    p.add_argument("--model", default="gpt_smoke")
    p.add_argument("--stage", type=int, default=0, choices=(0, 1), help="ZeRO stage (Megatron-LM's 2-3 hang at the save)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="runs per engine, alternating (medians)")
    args = p.parse_args()
    checkouts = args.megatron_lm_dir or [c for c in [os.environ.get("MEGATRON_LM_DIR")] if c]
    if not checkouts:
        raise SystemExit("give --megatron-lm-dir (or MEGATRON_LM_DIR): a Megatron-LM checkout with pretrain_gpt.py")
    if len(args.python) > len(checkouts):
        raise SystemExit(f"{len(args.python)} --python for {len(checkouts)} --megatron-lm-dir: give one per checkout, in order")
    pythons = args.python + [sys.executable] * (len(checkouts) - len(args.python))
    root = Path(os.environ.get("ARTIFACT_ROOT") or tempfile.mkdtemp(prefix="bench_engines_"))
    data = write_data_set(root / "engines.yaml", args.iters)  # the smoke corpus and schedule, a global batch of 16
    rows = []
    for checkout, python in zip(checkouts, pythons):
        per_run: dict[Engine, list[float]] = {MEGATRON_CORE: [], MEGATRON_LM: []}
        for attempt in range(args.repeats):  # alternating, so drift on a shared machine hits both alike
            for engine in per_run:
                run = f"bench_{engine.name}_{len(rows)}_{attempt}_{os.getpid()}"
                per_run[engine].append(statistics.median(run_engine(engine, args.model, data, run, args, root, checkout, python)))
        rows.append((release_of(checkout), per_run))
    print(f"{args.model} on the embedded corpus, {args.nproc} processes, ZeRO stage {args.stage}, {args.iters} iterations "
          f"(the first {SKIPPED_ITERATIONS} left out), {args.repeats} runs per engine alternating, medians; "
          f"{'GPUs' if _has_gpu() else 'CPU (Megatron-LM through the CUDA-on-CPU shim)'}")
    print(f"{'release':<14} {'engine':<28} {'tokens/s':>10} {'per run':<30}")
    for release, per_run in rows:
        median = {engine: statistics.median(runs) for engine, runs in per_run.items()}
        for engine, runs in per_run.items():
            print(f"{release:<14} {engine.label:<28} {median[engine]:>10,.0f} {', '.join(f'{r:,.0f}' for r in runs):<30}")
        print(f"{release:<14} {'ratio this program / Megatron-LM':<28} {median[MEGATRON_CORE] / median[MEGATRON_LM]:>10.2f}")


def release_of(checkout: str) -> str:
    """The checkout's megatron-core version, as the launcher reads it."""
    from orchestration.megatron_lm.checkout import read_checkout

    return read_checkout(Path(checkout)).version_text


if __name__ == "__main__":
    main()
