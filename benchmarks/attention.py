"""SDPA core attention against megatron-core's DotProductAttention on CPU, side by side.

    python benchmarks/attention.py --repeats 5 --models gpt_smoke,qwen3_smoke

The bare training loop (benchmarks/bare_loop.py: the same megatron-core model, data and DDP loop
as the program's stage 0) with each attention, alternating run by run so that a noisy machine's
drift hits both alike; medians of tokens/s over the runs, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import free_port  # noqa: E402


def bare_loop(model: str, attention: str, iters: int, nproc: int, env: dict) -> float:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "benchmarks/bare_loop.py", "--iters", str(iters),
                          "--model", model, "--attention", attention], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt_smoke,qwen3_smoke")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    root = os.environ.get("ARTIFACT_ROOT") or tempfile.mkdtemp(prefix="bench_attention_")
    env = {**{k: v for k, v in os.environ.items() if k not in ("ZERO_STAGE", "CONTAINER_NAME")}, "ARTIFACT_ROOT": root,
           "PYTHONPATH": str(REPO)}
    print(f"bare loop, smoke data set, {args.nproc} CPU processes, {args.iters} iterations, medians of {args.repeats} "
          "alternating runs")
    print(f"{'model':<12} {'SDPA tokens/s':>14} {'DotProductAttention':>20} {'SDPA / DPA':>11}")
    for model in args.models.split(","):
        runs = {"sdpa": [], "local": []}
        for _ in range(args.repeats):
            for attention in runs:
                runs[attention].append(bare_loop(model, attention, args.iters, args.nproc, env))
        sdpa, local = statistics.median(runs["sdpa"]), statistics.median(runs["local"])
        print(f"{model:<12} {sdpa:>14,.0f} {local:>20,.0f} {sdpa / local:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
