"""What a checkpoint save stops training for when the write is bandwidth-bound, as at a user's size:
written in the background against written before training goes on, side by side in one invocation,
on the namespace cluster (tests/netns_cluster.py: 2 nodes, node 1 sees the artifact root only through
sshfs) with node 1's link to the file server held to a low rate. Needs what the multi-node tests
need: root, iproute2, OpenSSH, sshfs and /dev/fuse.

    python benchmarks/checkpoint_save_cluster.py             # 2 rounds: 450 steps, a save every 150, 2 Mbit/s
    python benchmarks/checkpoint_save_cluster.py --rate 4mbit --iters 240 --save-every 80 --rounds 1

gpt_smoke at ZeRO stage 3 (--zero-stage), 2 nodes x 1 rank (--nproc 2: x 2), CPU, gloo. A short run
without saves prepares the corpus first. Then each round starts the same run twice
(start_multinode_training.sh), ``training.async_save`` true and false and the data set otherwise the
same, alternating which goes first, and reads rank 0's own lines (node 0's log): ``saved checkpoint
at iteration N to ... in S s (checksums C s of it; training waited W s)``. Training stopped for W
when the save was written in the background (the copy to host memory, plus any wait for it at the
next save), for the whole S (one decimal) when it was not (W is then the same save less rank 0's
commit). The last save of a run is waited for in both modes and is left out. Rank 0 is on node 0,
whose disk holds the share; a save is done when node 1's part, over the throttled link, is, so S is
node 1's write. Per save the table gives S, the stop, the stop in steps (the run's median step), the
median step of the run and of the steps during background writes, and the run's wall time (start
command to its last process gone). A save marked * was still being written when the next began, so
training waited for it there: the interval was shorter than the write (raise --save-every).

How the rate maps to a user's size: a save's write takes (bytes a node writes) / (the node's rate to
the file system). A Qwen3-32B checkpoint with AdamW's state is about 450 GB, 112 GB per node of 4; at
1 GB/s that is 112 s, while the copy of the same bytes to host memory takes seconds. Here node 1
writes its part of the gpt_smoke checkpoint (the benchmark prints it: 6.9 MB at stage 3, 2 x 1 rank)
through 2 Mbit/s (0.25 MB/s): about 28 s, a quarter of the user's write and, at this model's steps of
a quarter second, about a hundred steps, where the user's two minutes are tens of steps of seconds.
A save interval long enough for the write is the user's case too (saves every 30-60 minutes). The
link is held for the whole invocation (node 1's log and records on the share go through it too; the
runs allow the share NODE_LOST_S to answer, which says why); only node 1's link: node 0 writes its
part to its own disk. The cores (2 here, shared by both nodes'
ranks and the writer) are not the user's.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from checkpoint_save import SAVED  # noqa: E402
from conftest import clean_env, free_port, tagged_pids  # noqa: E402
from megatron_ext.run_spec.checksums import writer_rank  # noqa: E402
from megatron_ext.run_spec.iteration_log import looks_like_iteration_line, parse_iteration_line, parse_log  # noqa: E402
from netns_cluster import NamespaceCluster, missing_prerequisites  # noqa: E402

STILL_WRITING = re.compile(r"the checkpoint of iteration (\d+) was still being written when the next save began")
"""Rank 0's warning when a save begins before the one before it is on disk: training waits for it
(counted in that save's ``training waited``); a longer --save-every leaves the write its time."""


NODE_LOST_S = 90
"""training.resilience.node_lost_s for these runs (default 20): node 1's heartbeat record goes to the
share behind the checkpoint's bytes already queued on its one sshfs stream (ssh's window, TCP's send
buffer: a few MB, most of a 7 MB part), so at 2 Mbit/s it waits most of the write, past 20 s, and node
1's supervisor ends its part ("the artifact root ... is unreachable: did not return within 10 s
(writing the heartbeat record)"). At 1 GB/s the same few MB wait milliseconds: the scaled link's
artifact, not the user's case."""


def write_data_set(path: Path, iters: int, save_every: int, background: bool, zero_stage: int) -> str:
    """gpt_smoke's schedule with a save every ``save_every`` steps; only ``async_save`` differs."""
    path.write_text(
        "data:\n  source: embedded\n  split: \"95,5,0\"\n  tokenizer: {type: sentencepiece, vocab_size: 2048}\n"
        f"training:\n  seq_length: 128\n  micro_batch_size: 1\n  global_batch_size: 4\n  train_iters: {iters}\n"
        f"  lr: 3.0e-4\n  min_lr: 3.0e-5\n  lr_warmup_iters: 1\n  eval_iters: 0\n  save_interval: {save_every}\n"
        f"  keep_checkpoints: 2\n  log_interval: 1\n  zero_stage: {zero_stage}\n"
        f"  async_save: {str(background).lower()}\n  resilience: {{node_lost_s: {NODE_LOST_S}}}\n")
    return str(path)


def script(name: str, *args: str, env: dict[str, str], timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "training_scripts" / name), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def steps_while_writing(log: str, iters: int, save_every: int) -> list[float]:
    """Step times of the iterations between a save's start and its commit line (rank 0's log order),
    the last save left out."""
    out, writing = [], False
    for line in log.splitlines():
        saved = SAVED.search(line)
        if saved:
            writing = False
        elif looks_like_iteration_line(line):
            record = parse_iteration_line(line)
            if record is None:
                continue
            if writing:
                out.append(record.step_time_s)
            elif record.iteration % save_every == 0 and record.iteration != iters:
                writing = True
    return out


def node_bytes(checkpoint: Path, node: int, nproc: int) -> int:
    """Bytes the ranks of ``node`` wrote into ``checkpoint`` (by the writers' names)."""
    return sum(p.stat().st_size for p in checkpoint.rglob("*")
               if p.is_file() and writer_rank(p.name) // nproc == node and "checksums" not in p.parts)


def one_run(run: str, data: str, env: dict[str, str], root: Path, iters: int, save_every: int, background: bool,
            nproc: int, saves: bool = True) -> dict:
    """``run`` started on the cluster and waited for: its saves, step times and wall time (``saves``
    False: a run without checkpoints, nothing read)."""
    log_path = root / "logs" / f"{run}_node0.log"
    started = time.monotonic()
    try:
        start = script("start_multinode_training.sh", "gpt_smoke", data, run, env=env)
        if start.returncode != 0:
            raise SystemExit(f"{run}: the start failed ({start.returncode}): {start.stdout[-2000:]}{start.stderr[-2000:]}")
        deadline = time.monotonic() + 1800
        while tagged_pids(run) and time.monotonic() < deadline:
            time.sleep(0.5)
        wall_s = time.monotonic() - started
    finally:
        if tagged_pids(run):
            script("stop_multinode_training.sh", run, env=env)
    log = log_path.read_text(errors="replace")
    if f"done: {iters} iterations" not in log:
        raise SystemExit(f"{run} did not finish: {log[-3000:]}")
    if not saves:
        return {"wall_s": wall_s}
    saved = [(int(i), float(s), float(w)) for i, s, _, w in SAVED.findall(log)]
    overran = {int(i) for i in STILL_WRITING.findall(log)}
    records, _ = parse_log(log)
    steps = [r.step_time_s for r in records if r.iteration > 1]
    during = steps_while_writing(log, iters, save_every) if background else []
    checkpoint = root / "runs" / run / "checkpoints" / f"iter_{iters:07d}"
    return {"mode": "background" if background else "before training goes on", "background": background,
            "saves": [(i, s, w if background else s) for i, s, w in saved if i != iters],
            "step_s": statistics.median(steps), "during_s": statistics.median(during) if during else None,
            "lines": [line for line in log.splitlines() if SAVED.search(line)], "overran": overran, "wall_s": wall_s,
            "node1_bytes": node_bytes(checkpoint, 1, nproc)}


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"gpt_smoke, 2 nodes x {args.nproc} rank(s), stage {args.zero_stage}, {args.iters} steps, a save every "
          f"{args.save_every}, node 1's link to the file server at {args.rate}; the last save left out")
    print(f"{'round':>5} | {'mode':<24} | {'save at':>7} | {'save s':>6} | {'stopped s':>9} | {'x step':>6} "
          f"| {'step s':>6} | {'step s writing':>14} | {'wall s':>6}")
    for n, row in enumerate(rows):
        during = f"{row['during_s']:.3f}" if row["during_s"] is not None else "-"
        for i, whole, stopped in row["saves"]:
            print(f"{n // 2 + 1:>5} | {row['mode']:<24} | {i:>7} | {whole:>6.1f} | {stopped:>9.2f} "
                  f"| {stopped / row['step_s']:>6.1f} | {row['step_s']:>6.3f} | {during:>14} | {row['wall_s']:>6.1f}"
                  + (" *" if i in row["overran"] else ""))
    stopped = {}
    for mode in ("background", "before training goes on"):
        mine = [row for row in rows if row["mode"] == mode]
        stopped[mode] = statistics.mean(s for row in mine for _, _, s in row["saves"])
        step_s = statistics.median(row["step_s"] for row in mine)
        print(f"{mode}: stopped {stopped[mode]:.2f} s a save ({stopped[mode] / step_s:.1f} steps of {step_s:.3f} s), "
              f"wall {statistics.mean(r['wall_s'] for r in mine):.1f} s (mean of {len(mine)} runs"
              + (f"; * {sum(len(r['overran']) for r in mine)} save(s) still written when the next began: raise "
                 "--save-every)" if any(r["overran"] for r in mine) else ")"))
    ratio = stopped["background"] / stopped["before training goes on"]
    node1 = statistics.median(row["node1_bytes"] for row in rows)
    rate_bps = parse_rate(args.rate)
    print(f"stopped, background / before training goes on: {ratio:.3f}")
    print(f"node 1 writes {node1 / 1e6:.1f} MB a save: {node1 * 8 / rate_bps:.0f} s at {args.rate}, as a node's "
          f"112 GB of a Qwen3-32B checkpoint take 112 s at 1 GB/s")


def parse_rate(rate: str) -> float:
    """tc's rate (``4mbit``, ``500kbit``, ``1gbit``) in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise SystemExit(f"--rate {rate!r}: give a rate as tc does, e.g. 4mbit or 500kbit")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="2mbit", help="node 1's link to the file server (tc rate, e.g. 4mbit)")
    p.add_argument("--iters", type=int, default=450)
    p.add_argument("--save-every", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, choices=(1, 2), help="ranks per node")
    p.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    args = p.parse_args()
    parse_rate(args.rate)
    missing = missing_prerequisites(share=True)
    if missing:
        raise SystemExit(f"checkpoint_save_cluster.py runs a namespace cluster as the multi-node tests do, and {missing}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_cluster_") as tmp:
        work = Path(tmp)
        root = work / "artifacts"
        root.mkdir()
        (work / "cluster").mkdir()
        cluster = NamespaceCluster(2, work / "cluster", share=root).open()
        try:
            cluster.throttle_share(cluster.nodes[1], args.rate)
            env = clean_env(ARTIFACT_ROOT=str(root), NPROC_PER_NODE=str(args.nproc), HOSTS="node0,node1",
                            SSH_OPTS=cluster.ssh_opts, MASTER_ADDR=cluster.nodes[0].address,
                            GLOO_SOCKET_IFNAME=cluster.interface, LINK_TEST_S="0.3")
            warm_up = write_data_set(work / "warm_up.yaml", 3, 0, False, args.zero_stage)
            env["MASTER_PORT"] = str(free_port())
            one_run("warm_up", warm_up, env, root, 3, 0, False, args.nproc, saves=False)  # the corpus prepared once
            for r in range(args.rounds):
                for background in ((True, False) if r % 2 == 0 else (False, True)):
                    run = f"save_{'bg' if background else 'sync'}_{r + 1}"
                    data = write_data_set(work / f"{run}.yaml", args.iters, args.save_every, background, args.zero_stage)
                    env["MASTER_PORT"] = str(free_port())
                    rows.append(one_run(run, data, env, root, args.iters, args.save_every, background, args.nproc))
                    print(f"{run}: wall {rows[-1]['wall_s']:.1f} s; rank 0:", *rows[-1]["lines"], sep="\n  ", flush=True)
        finally:
            with contextlib.suppress(Exception):
                cluster.unthrottle(cluster.nodes[1])
            cluster.close()
    print_table(rows, args)


if __name__ == "__main__":
    main()
