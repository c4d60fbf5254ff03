"""Faults and their cost, measured side by side in one invocation (one node, 2 CPU processes, gpt_smoke).

    python benchmarks/resilience.py                  # the watchdog's default limits (30 s step floor)
    python benchmarks/resilience.py --floor-s 10     # a shorter floor
    python benchmarks/resilience.py --only checksums,links   # parts 3 and 4 alone (a minute)

1. The progress reporting's cost per step: the training program under torchrun with what the
   supervisor gives it (the progress directory: a progress file per phase, the per-step save-flag
   agreement; torch's flight recorder) and without, alternating, median step time after the
   warm-up; the ratio.
2. Per fault kind, through start_training.sh with MAX_RESTARTS=1: the time from the fault to every
   process of the attempt gone, and to the first iteration of the next attempt. Faults: a worker
   SIGKILLed, a worker SIGSTOPped (a hang: the watchdog's step limit, the stack dumps), torchrun
   SIGKILLed (orphaned workers), and ``stop --save`` (request to every process ended, saved).
3. Checkpoint checksums: the seconds each save spends recording them (every rank a share of the
   files, read back), against the save's whole time, from the program's own log lines.
4. The link test a multi-node start runs first: its wall time for 3 processes on this machine
   (loopback), from start to every report.
5. A node lost for good (``--only lost``; root, iproute2, openssh-server, sshfs): NNODES=1:2 on a
   2-node namespace cluster (tests/netns_cluster.py; node 1 sees the artifact root through sshfs),
   1 process each; node 1's processes, sshd and namespace deleted after a checkpoint; the time
   from that to node 0's next attempt's first iteration (node_lost_s 6 s, join_s 12 s, backoff
   1 s). Then (``--only lost,rejoin``) the machine back and rejoin_multinode_training.sh: the
   command's own time, and the time from its start to the first iteration on both nodes again.
7. A hang across nodes (``--only hang``, the same cluster): node 1's worker SIGSTOPped; the time
   to every worker of the attempt gone on both nodes (HANG_STEP_FLOOR_S 10 s: the watchdog's
   limit, then the dumps, the suspects and the stop).
6. A slow rank (``--only slow``, the same cluster): node 1's worker stopped 3/4 of the time in a
   duty cycle; the time from the first stop to rank 0's warning naming it, in log intervals too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import clean_env, free_port, last_iteration, tagged_pids, write_data_set  # noqa: E402
from megatron_ext.run_spec.iteration_log import parse_log, read_metrics  # noqa: E402
from megatron_ext.run_spec.resilience import Phase  # noqa: E402
from megatron_ext.host.procfs import process_environ  # noqa: E402


def script(name: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "training_scripts" / name), *args], env=env, capture_output=True, text=True)


def wait(predicate, timeout_s: float, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError


def progress_cost(root: Path, data: str, repeats: int) -> tuple[float, float]:
    """Median step time without and with what the supervisor gives the ranks, in ABBA order (a
    drift of the machine's speed hits both arms alike)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(repeats):
        for reporting in ((False, True) if rep % 2 == 0 else (True, False)):
            run = f"bench_progress_{int(reporting)}_{rep}"
            env = clean_env(ARTIFACT_ROOT=str(root))
            if reporting:  # what the supervisor sets: the progress directory, and the flight recorder
                env["LAUNCHER_PROGRESS_DIR"] = tempfile.mkdtemp(prefix="progress_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
                env["TORCH_FR_BUFFER_SIZE"] = "2000"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                            "--master-port", str(free_port()), "-m", "megatron_ext.pretrain", "--model", "gpt_smoke",
                            "--data", data, "--run-name", run], cwd=REPO, env=env, check=True, capture_output=True)
            times[reporting].append(statistics.median(r.step_time_s for r in read_metrics(root / "runs" / run / "metrics.jsonl")[3:]))
    return statistics.median(times[False]), statistics.median(times[True])


def per_step_work() -> str:
    """The two things a step does more, timed directly in 2 gloo ranks: the progress file's
    rewrite and the save flag's all-reduce (microseconds each)."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), __file__, "--per-step-work"], cwd=REPO,
                         env={**clean_env(), "TORCH_FR_BUFFER_SIZE": "2000"}, check=True, capture_output=True, text=True)
    return next(line for line in out.stdout.splitlines() if line.startswith("per step:"))


def _per_step_work_rank() -> None:
    import torch.distributed as dist

    from megatron_ext.training.progress import ProgressReporter, SaveRequest

    dist.init_process_group("gloo")
    reporter = ProgressReporter(Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)),
                                dist.get_rank(), dist.get_rank(), 1)
    flag, n = SaveRequest(True), 2000
    started = time.perf_counter()
    for i in range(n):
        reporter.phase(Phase.STEP, i)
        reporter.step_done(0.1)
    write_us = 1e6 * (time.perf_counter() - started) / n
    dist.barrier()
    started = time.perf_counter()
    for _ in range(n):
        flag.agreed()
    agree_us = 1e6 * (time.perf_counter() - started) / n
    if dist.get_rank() == 0:
        print(f"per step: progress file {write_us:.0f} us, save-flag all-reduce {agree_us:.0f} us", flush=True)
    dist.destroy_process_group()


def workers(run: str) -> dict[int, int]:
    out = {}
    for pid in tagged_pids(run):
        rank = process_environ(pid).get("RANK")
        if rank is not None:
            out[int(rank)] = pid
    return out


def fault(root: Path, data: str, kind: str, floor_s: float) -> tuple[float, float | None]:
    """(fault -> the attempt's processes gone, fault -> the next attempt's first iteration)."""
    run = "bench_fault_" + "".join(c if c.isalnum() else "_" for c in kind).strip("_")
    env = clean_env(ARTIFACT_ROOT=str(root), MASTER_PORT=str(free_port()), MAX_RESTARTS="1", HANG_STEP_FLOOR_S=str(floor_s))
    log = root / "logs" / f"{run}_node0.log"
    assert script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
    try:
        wait(lambda: last_iteration(log) >= 25, 300)
        before = workers(run)
        record_pid = int(json.loads((root / "run_state" / f"{run}_node0.pid").read_text())["pid"])
        at = time.monotonic()
        if kind == "worker SIGKILL":
            os.kill(before[1], signal.SIGKILL)
        elif kind == "worker SIGSTOP (hang)":
            os.kill(before[1], signal.SIGSTOP)
        elif kind == "torchrun SIGKILL":
            os.kill(record_pid, signal.SIGKILL)
        else:
            subprocess.Popen(["bash", str(REPO / "training_scripts" / "stop_training.sh"), run, "--save"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait(lambda: not (set(before.values()) & set(tagged_pids(run))), 300)
        gone = time.monotonic() - at
        if kind.startswith("stop"):
            return gone, None
        marker = "attempt 2 of 2: starting torchrun"
        wait(lambda: marker in log.read_text(errors="replace"), 300)
        wait(lambda: any(r.iteration for r in parse_log(log.read_text(errors="replace").split(marker, 1)[1])[0]), 300)
        return gone, time.monotonic() - at
    finally:
        script("stop_training.sh", run, env=env)


def checksum_cost(root: Path, data: str) -> list[tuple[float, float, int]]:
    """(save s, checksums s, bytes) of every save of one run (2 ranks, gpt_smoke)."""
    import re

    run = "bench_checksums"
    env = clean_env(ARTIFACT_ROOT=str(root), MASTER_PORT=str(free_port()))
    assert script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
    wait(lambda: not tagged_pids(run), 600)
    text = (root / "logs" / f"{run}_node0.log").read_text()
    out = []
    for m in re.finditer(r"saved checkpoint at iteration \d+ to (\S+) in ([\d.]+) s \(checksums ([\d.]+) s of it", text):
        folder = Path(m.group(1))
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
        out.append((float(m.group(2)), float(m.group(3)), size))
    return out


def linktest_seconds(nnodes: int = 3) -> float:
    """Wall time of the link test for ``nnodes`` processes on loopback (gloo)."""
    port = free_port()
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "orchestration.node.linktest", "--rank", str(r), "--nnodes",
                               str(nnodes), "--master-addr", "127.0.0.1", "--port", str(port), "--backend", "gloo"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
             for r in range(nnodes)]
    for proc in procs:
        proc.communicate(timeout=120)
    return time.monotonic() - started


def _cluster_run(work: Path, run: str, train_iters: int, resilience: str, nnodes: str):
    """A 2-node namespace cluster, and the start of ``run`` on it (2 x 1 process): (cluster, env, data)."""
    from netns_cluster import NamespaceCluster

    (work / f"{run}_cluster").mkdir(parents=True, exist_ok=True)
    root = work / f"{run}_artifacts"
    root.mkdir(parents=True, exist_ok=True)
    cluster = NamespaceCluster(2, work / f"{run}_cluster", share=root).open()
    data = work / f"{run}.yaml"
    data.write_text(Path(write_data_set(work / f"{run}_base.yaml", train_iters=train_iters, save_interval=5)).read_text()
                    + f"  resilience: {{{resilience}}}\n")
    env = clean_env(HOSTS="node0,node1", SSH_OPTS=cluster.ssh_opts, MASTER_ADDR=cluster.nodes[0].address,
                    MASTER_PORT=str(free_port()), NPROC_PER_NODE="1", GLOO_SOCKET_IFNAME=cluster.interface,
                    ARTIFACT_ROOT=str(root), NNODES=nnodes, HANG_STEP_FLOOR_S="10")
    try:
        started = script("start_multinode_training.sh", "gpt_smoke", str(data), run, env=env)
        assert started.returncode == 0, started.stdout + started.stderr
    except BaseException:
        cluster.close()
        raise
    return cluster, env


def _first_iteration_after(log: Path, marker: str) -> None:
    """Until ``log`` shows ``marker`` and an iteration line after it."""
    wait(lambda: marker in log.read_text(errors="replace"), 300)
    wait(lambda: any(r.iteration for r in parse_log(log.read_text(errors="replace").split(marker, 1)[1])[0]), 300)


def lost_node_seconds(work: Path, rejoin: bool) -> tuple[float, float | None, float | None]:
    """Seconds from node 1's loss to node 0's next attempt's first iteration; with ``rejoin``, the
    machine back: the rejoin command's seconds, and from its start to attempt 3's first iteration."""
    from megatron_ext.run_spec.checkpoints import latest_iteration

    run = "bench_lost"
    cluster, env = _cluster_run(work, run, 4000, "max_restarts: 2, restart_backoff_s: 1, node_lost_s: 6, join_s: 12", "1:2")
    root = Path(env["ARTIFACT_ROOT"])
    log = root / "logs" / f"{run}_node0.log"
    try:
        wait(lambda: (latest_iteration(root / "runs" / run / "checkpoints") or 0) >= 10, 300)
        at = time.monotonic()
        cluster.lose(cluster.nodes[1])
        _first_iteration_after(log, "attempt 2 of 3: starting torchrun")
        lost = time.monotonic() - at
        if not rejoin:
            return lost, None, None
        cluster.restore(cluster.nodes[1])
        at = time.monotonic()
        back = script("rejoin_multinode_training.sh", run, "1", env=env)
        command = time.monotonic() - at
        assert back.returncode == 0, back.stdout + back.stderr
        _first_iteration_after(log, "attempt 3 of 4: starting torchrun")
        return lost, command, time.monotonic() - at
    finally:
        if not Path(f"/run/netns/{cluster.nodes[1].namespace}").exists():
            cluster.restore(cluster.nodes[1])
        script("stop_multinode_training.sh", run, env=env)
        cluster.close()


def cluster_hang_seconds(work: Path) -> float:
    """Seconds from node 1's worker SIGSTOPped to every worker of the attempt gone on both nodes."""
    from test_multinode import _workers_on

    run = "bench_hang"
    cluster, env = _cluster_run(work, run, 5000, "max_restarts: 0", "2")
    root = Path(env["ARTIFACT_ROOT"])
    try:
        wait(lambda: last_iteration(root / "logs" / f"{run}_node0.log") >= 3, 300)
        workers = {**_workers_on(run, 0), **_workers_on(run, 1)}
        at = time.monotonic()
        os.kill(workers[1], signal.SIGSTOP)
        wait(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers.values()), 300, poll_s=0.1)
        return time.monotonic() - at
    finally:
        script("stop_multinode_training.sh", run, env=env)
        cluster.close()


SLOW_KINDS = (("a CPU hog beside the run (nobody slow)", None, None),
              ("rank 1 uniformly ~1.5x (stopped 10 ms of every 30 ms)", 0.01, 0.02),
              ("rank 1 in bursts (stopped 0.4 s of every 0.8 s)", 0.4, 0.4))
SLOW_PHASE_S = 40.0
"""How long each kind lasts: past the default window (20 s) and its quarter in a row, so a kind
never named was judged."""


def slow_rank_seconds(work: Path) -> list[tuple[str, float | None, float, str | None]]:
    """For each kind (gpt_smoke, one node, 2 CPU processes, the default rule): seconds from its start
    to rank 0's warning (None: not named in SLOW_PHASE_S), rank 1's busy time over rank 0's over the
    kind's log intervals, and the warning. Each kind starts from a window with nobody slow in it
    (21 s free before)."""
    from conftest import slowed

    run = "bench_slow"
    root = work / f"{run}_artifacts"
    env = clean_env(ARTIFACT_ROOT=str(root), MASTER_PORT=str(free_port()))
    data = write_data_set(work / f"{run}.yaml", train_iters=50000, global_batch=8)
    log = root / "logs" / f"{run}_node0.log"
    metrics = root / "runs" / run / "metrics.jsonl"
    said = lambda: [l for l in log.read_text(errors="replace").splitlines()  # noqa: E731
                    if l.startswith(("warning: slow rank", "note: no slow rank"))]
    out = []
    assert script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
    try:
        wait(lambda: last_iteration(log) >= 3, 300)
        worker = next(p for p in tagged_pids(run) if process_environ(p).get("RANK") == "1")
        for kind, stopped_s, running_s in SLOW_KINDS:
            time.sleep(21)
            before, since = len(said()), time.time()
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if stopped_s is None else None
            slowing = slowed(worker, stopped_s, running_s) if stopped_s is not None else contextlib.nullcontext()
            named_after = None
            try:
                with slowing:
                    at = time.monotonic()
                    try:
                        wait(lambda: len(said()) > before and said()[-1].startswith("warning: slow rank"), SLOW_PHASE_S,
                             poll_s=0.2)
                        named_after = time.monotonic() - at
                    except TimeoutError:
                        pass
                    time.sleep(max(0.0, SLOW_PHASE_S - (time.monotonic() - at)))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            spans = [r.busy_s_per_rank for r in read_metrics(metrics) if r.time >= since and r.busy_s_per_rank]
            ratio = sum(b[1] for b in spans) / max(1e-9, sum(b[0] for b in spans))
            out.append((kind, named_after, ratio, said()[-1] if named_after is not None else None))
            if named_after is not None:
                wait(lambda: said()[-1].startswith("note: no slow rank"), 300)
        return out
    finally:
        script("stop_training.sh", run, env=env)


def busy_clock_cost() -> float:
    """The CPU busy clock's own cost: CPU seconds of this process per second while it samples and
    the main thread sleeps (what a waiting rank pays)."""
    from megatron_ext.training.busy_clock import SampledBusyClock, process_cpu_s

    clock = SampledBusyClock()
    before, at = process_cpu_s(), time.monotonic()
    with clock.counting():
        time.sleep(5)
    return (process_cpu_s() - before) / (time.monotonic() - at)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--floor-s", type=float, default=30.0, help="HANG_STEP_FLOOR_S (default: the watchdog's own, 30)")
    p.add_argument("--repeats", type=int, default=6, help="runs with and without progress reporting (ABBA order)")
    p.add_argument("--progress-only", action="store_true", help="only the progress reporting's cost")
    p.add_argument("--only", default="", help="comma-separated parts to run: progress, checksums, links, faults, "
                   "lost, rejoin (with lost), hang (these three: a namespace cluster, root), slow")
    p.add_argument("--per-step-work", action="store_true", help=argparse.SUPPRESS)  # a rank of per_step_work()
    args = p.parse_args()
    if args.per_step_work:
        return _per_step_work_rank()
    root = Path(tempfile.mkdtemp(prefix="bench_resilience_"))
    parts = set(filter(None, args.only.split(","))) or ({"progress"} if args.progress_only else
                                                         {"progress", "checksums", "links", "faults"})
    short = write_data_set(root / "short.yaml", train_iters=40)
    long = write_data_set(root / "long.yaml", train_iters=5000, save_interval=20)
    if "progress" in parts:
        without, with_ = progress_cost(root, short, args.repeats)
        print("progress reporting (gpt_smoke, 1 node x 2 CPU processes, median step after 3 warm-up steps)")
        print(f"  without {without * 1000:.1f} ms, with {with_ * 1000:.1f} ms per step: ratio {with_ / without:.3f} "
              f"(medians of {args.repeats} runs each, ABBA order)")
        print(f"  {per_step_work()}, against a {without * 1000:.1f} ms step")
    if "checksums" in parts:
        saves = checksum_cost(root, write_data_set(root / "saving.yaml", train_iters=40, save_interval=5))
        print("\ncheckpoint checksums (gpt_smoke, 2 CPU processes, a save every 5 iterations)")
        for save_s, checksum_s, size in saves:
            print(f"  save {save_s:.2f} s, checksums {checksum_s:.3f} s ({checksum_s / save_s:.1%} of it), "
                  f"{size / 2**20:.1f} MiB")
        if saves:
            print(f"  median share: {statistics.median(c / s for s, c, _ in saves):.1%}")
    if "links" in parts:
        print(f"\nlink test, 3 processes on loopback (gloo): {linktest_seconds():.1f} s from start to every report")
    if "lost" in parts:
        lost, command, back = lost_node_seconds(root, "rejoin" in parts)
        print(f"\na node lost for good (NNODES=1:2, namespace cluster on sshfs, 2 x 1): {lost:.1f} s from its loss to node "
              "0's next attempt's first iteration (node_lost_s 6 s, join_s 12 s, backoff 1 s)")
        if command is not None:
            print(f"  brought back: rejoin_multinode_training.sh {command:.1f} s; {back:.1f} s from it to the first "
                  "iteration on both nodes")
    if "hang" in parts:
        print(f"\na hang across nodes (node 1's worker SIGSTOPped, HANG_STEP_FLOOR_S 10): {cluster_hang_seconds(root):.1f} s "
              "to every worker gone on both nodes")
    if "slow" in parts:
        print("\na slow rank (gpt_smoke, 1 node x 2 CPU processes; default rule: 1.25x over 20 s, a log every iteration; "
              f"each kind {SLOW_PHASE_S:.0f} s); the busy clock costs {busy_clock_cost():.2%} of a core")
        print(f"  {'kind':<56} {'named after s':>13} {'busy rank 1 / rank 0':>21}")
        lines = []
        for kind, took, ratio, line in slow_rank_seconds(root):
            print(f"  {kind:<56} {'-' if took is None else f'{took:.1f}':>13} {ratio:>21.2f}")
            lines += [line] if line else []
        for line in lines:
            print(f"  {line}")
    if "faults" in parts:
        print(f"\nfaults (MAX_RESTARTS=1, HANG_STEP_FLOOR_S={args.floor_s:g}, checkpoint every 20 iterations)")
        print(f"{'fault':<24} {'to every process gone s':>23} {'to next attempt first iteration s':>34}")
        for kind in ("worker SIGKILL", "worker SIGSTOP (hang)", "torchrun SIGKILL", "stop --save"):
            gone, next_first = fault(root, long, kind, args.floor_s)
            print(f"{kind:<24} {gone:>23.1f} {'-' if next_first is None else f'{next_first:.1f}':>34}")


if __name__ == "__main__":
    main()
