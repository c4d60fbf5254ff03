"""The merged log (``logs_training.sh RUN``) on a large synthetic run: a read from the end against a
full merge.

    python benchmarks/logs.py                       # 4 nodes x 8 ranks, ~1 GB of logs in all
    python benchmarks/logs.py --gb 0.2 --repeats 3  # smaller, the median of 3

Writes, under a temporary artifact root, the node logs of a run of 4 nodes x 8 ranks that trained
for a day (its last line now; as many steps as make the size asked for): on every node local rank 0's
iteration line and progress line per step (the nodes' clocks 0.2 s apart), every so often a warning from each of the node's 8 ranks
(torch's ``[rankN]:`` prefix) and a rank? line, and at two thirds of the day a fault: every rank's
traceback, torchrun's error summary, the supervisors' restart and attempt 2. Then times each
command, as a user runs it (``python -m orchestration logs RUN ...``, HOSTS naming the 4 nodes, the
logs read here, standard output to /dev/null; the interpreter's start included): the last lines,
the last ten minutes, one node's tail, one rank's lines from the whole log, a pattern in the tail,
and the full merge, with the lines printed (repeated lines collapsed), the rate over the logs' size
and the command's largest resident memory. The page cache is warm
(each command once before it is timed). Prints one table; side effects: the temporary folder
(removed at the end).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = "bench_logs"
NODES, RANKS_PER_NODE = 4, 8
DAY_S = 86400.0
BYTES_PER_STEP = 470
"""Bytes of log a step and node (its two lines, the warnings and the fault spread over the steps)."""
WARN_EVERY = 500
"""Steps between two bursts of per-rank warnings."""

TRACEBACK = ["Traceback (most recent call last):", '  File "<frozen runpy>", line 198, in _run_module_as_main',
             '  File "/work/main/megatron_ext/pretrain.py", line 221, in <module>', "    sys.exit(main())",
             '  File "/work/main/megatron_ext/training/loop.py", line 507, in run',
             "RuntimeError: Connection closed by peer [10.0.0.2]:29500"]


def iteration_line(ts: datetime, it: int, total: int) -> str:
    return (f" [{ts.strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {it:8d}/{total:8d} | consumed samples: {it * 512:12d} | "
            f"elapsed time per iteration (ms): {DAY_S / total * 1000:.1f} | throughput per GPU (TFLOP/s/GPU): 312.5 | learning rate: "
            f"3.000000E-04 | global batch size:   512 | lm loss: {7.0 - it * 1e-5:.6E} | loss scale: 1.0 | grad norm: 0.400 | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |")


def write_node_log(path: Path, node: int, steps: int, end: datetime) -> int:
    """Node ``node``'s log of ``steps`` steps over the day before ``end`` (its clock 0.2 s a node ahead); its size."""
    skew = timedelta(seconds=0.2 * node)
    step_s = DAY_S / steps
    start = end - timedelta(seconds=DAY_S)
    fault = steps * 2 // 3
    ranks = range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
    with open(path, "w") as out:
        write = out.write
        for attempt, (first, last) in enumerate(((1, fault), (fault + 1, steps)), start=1):
            write(f"[supervisor node{node}] attempt {attempt} of 4: starting torchrun\n\n" + "*" * 41 + "\nSetting "
                  "OMP_NUM_THREADS environment variable for each process to be 1 in default\n" + "*" * 41 + "\n")
            write(f"run {RUN}: model qwen3_1p7b data qwen3_1p7b_smoke | world size {NODES * RANKS_PER_NODE} | ZERO_STAGE=1\n")
            for it in range(first, last + 1):
                ts = start + timedelta(seconds=it * step_s) + skew
                write(iteration_line(ts, it, steps) + "\n")
                write(f"progress: {it}/{steps} ({100 * it // steps}%) eta {int((steps - it) * step_s)}s | 1,234,567 tokens/s\n")
                if it % WARN_EVERY == 0:
                    for r in ranks:
                        write(f"[rank{r}]: UserWarning: the dataloader's workers are slower than the step (iteration {it})\n")
                    write("NCCL INFO comm 0x5581 rank 0 nranks 32 - Init COMPLETE\n")
            if attempt == 1:
                for r in ranks:
                    write("".join(f"[rank{r}]: {line}\n" for line in TRACEBACK))
                t = (start + timedelta(seconds=fault * step_s + 1) + skew).strftime("%m%d %H:%M:%S.%f")
                write(f"E{t} 4242 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
                      "local_rank: 0 (pid: 4243) of binary: /usr/bin/python3\n")
                write("Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198, in _run_module_as_main\n"
                      "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 40 +
                      "\nRoot Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n" + "=" * 40 + "\n")
                write(f"[supervisor node{node}] restarting as attempt 2 in 5 s: node 0 (node0) failed: torchrun exit code 1\n")
        write(f"[supervisor node{node}] finished: torchrun exited with code 0\n")
    return path.stat().st_size


def make_run(root: Path, gb: float) -> int:
    """The run's node logs (and its run folder) under ``root``: ~``gb`` GB in all; the bytes written."""
    (root / "runs" / RUN).mkdir(parents=True)
    (root / "logs").mkdir()
    steps = max(100, int(gb * 1e9 / NODES / BYTES_PER_STEP))
    end = datetime.now()
    return sum(write_node_log(root / "logs" / f"{RUN}_node{n}.log", n, steps, end) for n in range(NODES))


CASES = [
    ("the last 100 lines", ["-n", "100"]),
    ("the last ten minutes", ["--since", "10m"]),
    ("node 1's last 1000 lines", ["--node", "1", "-n", "1000"]),
    ("a pattern in the last 50 matches", ["--grep", "UserWarning", "-n", "50"]),
    ("one rank's lines, whole log", ["--rank", "5"]),
    ("full merge, every line", []),
]


def time_case(root: Path, args: list[str], repeats: int) -> tuple[float, int, float]:
    """(median wall seconds, lines printed, the largest resident memory in MB) of ``logs RUN ARGS``."""
    env = {**os.environ, "ARTIFACT_ROOT": str(root), "HOSTS": ",".join(f"node{n}" for n in range(NODES)),
           "PYTHONPATH": str(REPO)}
    env.pop("CONTAINER_NAME", None)
    argv = [sys.executable, "-m", "orchestration", "logs", RUN, *args]
    lines = 0  # warm, and count, the output streamed (a child's peak memory counts its parent's at the spawn: keep it small)
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE) as warm:
        while block := warm.stdout.read(1 << 20):
            lines += block.count(b"\n")
    assert warm.returncode == 0, warm.returncode
    times, peak_kb = [], 0
    for _ in range(repeats):
        with open(os.devnull, "w") as null:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=null)
            _, status, usage = os.wait4(proc.pid, 0)
            times.append(time.perf_counter() - t0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            assert proc.returncode == 0, proc.returncode
            peak_kb = max(peak_kb, usage.ru_maxrss)
    return statistics.median(times), lines, peak_kb / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="logs in all, GB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each command (the median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_logs_") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        size = make_run(root, args.gb)
        print(f"{NODES} nodes x {RANKS_PER_NODE} ranks, {size / 1e9:.2f} GB of logs ({size / NODES / 1e6:.0f} MB a node), "
              f"written in {time.perf_counter() - t0:.1f} s; each command's median of {args.repeats}, its interpreter included")
        print(f"{'case':<34} {'arguments':<26} {'wall s':>7} {'lines out':>10} {'MB/s of logs':>13} {'peak MB':>8}")
        for name, case_args in CASES:
            wall, lines, peak_mb = time_case(root, case_args, args.repeats)
            rate = f"{size / 1e6 / wall:,.0f}" if case_args in ([], ["--rank", "5"]) else "-"
            print(f"{name:<34} {' '.join(case_args) or '(none)':<26} {wall:>7.2f} {lines:>10,} {rate:>13} {peak_mb:>8.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
