"""The wall time of start, status and stop on 2, 4 and 8 nodes, for one or more checkouts side by side.

    python benchmarks/cluster_commands.py                          # this checkout; 2, 4 and 8 nodes
    git -C /work/main worktree add /tmp/before effa641             # a "before", once
    python benchmarks/cluster_commands.py --repo /tmp/before --repo . --one-disk [--nodes 2,4,8] [--repeats 2]

Needs root, iproute2, openssh-server and sshfs: one namespace cluster (tests/netns_cluster.py) of
as many nodes as the largest count, node 0 keeping the artifact root and every other node seeing
it only through sshfs, as the multi-node tests have it; a count of N runs on node0..node(N-1)
(HOSTS), 1 process per node, gpt_smoke, a data set of 100000 iterations (global batch 4 x N: one
micro-batch a rank and step at every count) and no checkpoints, so the run is still going while
it is measured. Per node count, per repository (alternating, ABBA over ``--repeats``, so a drift
of the machine's load hits every repository alike), each command's wall time, from its start to
its return:

- start: start_multinode_training.sh (preflight, link test, every node started);
- status: status_training.sh, 3 times, the median; measured once node 0 logged an iteration (every
  rank running), with the ranks reniced to 19 (this machine's few cores are shared by every node's
  ranks; on a real cluster each node has its own, and the commands measured do not queue behind
  the training);
- stop: stop_multinode_training.sh; then the run's processes left (tagged LAUNCHER_RUN): at the
  stop's return, and after up to 30 s more (any then left are SIGKILLed, by pid, and reported).

Each repository runs its own training_scripts/ with its own cwd and PYTHONPATH (the nodes run the
node commands from that cwd too), from bytecode compiled here first (as launcher.py: like for
like), after one unmeasured start/stop on the smallest count (the data cache, the page cache). Its
short name: the folder's name @ its commit, ``+`` when it has uncommitted changes to tracked files.
Printed: a row per node count and repository (the median over the repeats), and per repository a
ratio per command: its time at the largest count over its time at the smallest (the fan-out to the
nodes is parallel, so near 1 is the expectation; each node's commands still start a Python on the
same few cores here). Side effects: the namespaces, sshd and sshfs processes (removed at the end,
also after a failure or SIGTERM), a temporary folder with the artifact roots (kept: the logs).
"""

from __future__ import annotations

import argparse
import contextlib
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

from conftest import clean_env, free_port, last_iteration, tagged_pids, wait_for, write_data_set  # noqa: E402
from megatron_ext.host.procfs import process_environ  # noqa: E402

STATUS_RUNS = 3
COMMAND_TIMEOUT_S = 300
FIRST_ITERATION_TIMEOUT_S = 600


def short_name(repo: Path) -> str:
    """``folder@commit``, ``+`` when tracked files have uncommitted changes."""
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    name = repo.name + (f"@{commit.stdout.strip()}" if commit.returncode == 0 else "")
    return name + ("+" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def script(repo: Path, name: str, *args: str, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    """One of ``repo``'s training_scripts/*.sh, from ``repo``: (wall seconds, the process)."""
    started = time.monotonic()
    try:
        proc = subprocess.run(["bash", str(repo / "training_scripts" / name), *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        proc = subprocess.CompletedProcess(e.cmd, 124, e.stdout or "", f"timed out after {COMMAND_TIMEOUT_S} s")
    return time.monotonic() - started, proc


def check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        tail = ((proc.stdout or "") + (proc.stderr or ""))[-3000:]
        raise RuntimeError(f"{what}: exit {proc.returncode}\n{tail}")


def until_gone(run: str, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the run's processes to go (what is left is measured, not an error)."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not tagged_pids(run), timeout_s, interval_s=0.2, what=f"{run}'s processes to go")


def renice_ranks(run: str) -> None:
    """The run's ranks (and what they started) to nice 19, by pid."""
    for pid in tagged_pids(run):
        if "LOCAL_RANK" in process_environ(pid):
            try:
                os.setpriority(os.PRIO_PROCESS, pid, 19)
            except OSError:
                pass


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def interrupted(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Bench:
    def __init__(self, cluster, work: Path, roots: dict[Path, Path], renice: bool):
        self.cluster, self.work, self.roots, self.renice = cluster, work, roots, renice
        self.data: dict[int, str] = {}
        self.started: list[tuple[Path, str, dict]] = []  # (repo, run, env): stopped at the end if still running

    def env(self, repo: Path, nodes: int) -> dict[str, str]:
        return clean_env(HOSTS=",".join(n.alias for n in self.cluster.nodes[:nodes]), SSH_OPTS=self.cluster.ssh_opts,
                         MASTER_ADDR=self.cluster.nodes[0].address, MASTER_PORT=str(free_port()), NPROC_PER_NODE="1",
                         GLOO_SOCKET_IFNAME=self.cluster.interface, ARTIFACT_ROOT=str(self.roots[repo]),
                         PYTHONPATH=str(repo), LAUNCHER_PYTHON=sys.executable)

    def data_set(self, nodes: int) -> str:
        if nodes not in self.data:
            self.data[nodes] = write_data_set(self.work / f"long_{nodes}n.yaml", train_iters=100000, global_batch=4 * nodes)
        return self.data[nodes]

    def measure(self, repo: Path, nodes: int, run: str) -> tuple[float, float, float, int, int]:
        """(start s, status s (median of 3), stop s, processes left at the stop's return, after 30 s more)."""
        env = self.env(repo, nodes)
        self.started.append((repo, run, env))
        start_s, proc = script(repo, "start_multinode_training.sh", "gpt_smoke", self.data_set(nodes), run, env=env)
        check(proc, f"{run}: start")
        log = self.roots[repo] / "logs" / f"{run}_node0.log"
        wait_for(lambda: last_iteration(log) >= 1, FIRST_ITERATION_TIMEOUT_S, interval_s=0.2, what=f"an iteration in {log}")
        if self.renice:
            renice_ranks(run)
        status = []
        for _ in range(STATUS_RUNS):
            took, proc = script(repo, "status_training.sh", run, env=env)
            check(proc, f"{run}: status")
            status.append(took)
        stop_s, proc = script(repo, "stop_multinode_training.sh", run, env=env)
        check(proc, f"{run}: stop")
        at_return = len(tagged_pids(run))
        until_gone(run, 30)
        left = tagged_pids(run)
        kill_pids(left)
        return start_s, statistics.median(status), stop_s, at_return, len(left)

    def warm_up(self, repo: Path, nodes: int, run: str) -> None:
        """One start to the first iteration and a stop, unmeasured (prepares the data cache)."""
        self.measure(repo, nodes, run)

    def stop_leftovers(self) -> None:
        for repo, run, env in self.started:
            if tagged_pids(run):
                script(repo, "stop_multinode_training.sh", run, env=env)
                until_gone(run, 30)
                kill_pids(tagged_pids(run))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", action="append", type=Path, default=None,
                   help="a checkout of the project (repeatable; default: this one), e.g. a worktree of an older commit")
    p.add_argument("--nodes", default="2,4,8", help="node counts, comma-separated (default 2,4,8)")
    p.add_argument("--repeats", type=int, default=1, help="measurements per node count and repository (default 1)")
    p.add_argument("--no-renice", action="store_true", help="leave the ranks at their nice level during status and stop")
    p.add_argument("--one-disk", action="store_true", help="every node on this machine's disk, no sshfs (a checkout "
                   "from before issue 38 cannot train on a network file system: its nodes raced for the data cache)")
    args = p.parse_args()
    from netns_cluster import NamespaceCluster, missing_prerequisites

    missing = missing_prerequisites(share=not args.one_disk)
    if missing:
        print(f"cluster_commands: cannot build the namespace cluster: it {missing}", file=sys.stderr)
        return 2
    repos = [r.resolve() for r in (args.repo or [REPO])]
    for repo in repos:
        if not (repo / "training_scripts" / "start_multinode_training.sh").is_file():
            p.error(f"{repo}: no training_scripts/start_multinode_training.sh (not a checkout of this project)")
    if len(set(repos)) != len(repos):
        p.error("a --repo given twice")
    counts = sorted({int(n) for n in args.nodes.split(",") if n.strip()})
    if not counts or counts[0] < 1:
        p.error("--nodes: positive counts")
    names = {repo: short_name(repo) for repo in repos}

    signal.signal(signal.SIGTERM, interrupted)  # timeout, a CI runner: the cleanup below still runs
    for repo in repos:  # like for like: every repository from bytecode (PYTHONDONTWRITEBYTECODE may be set)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(repo / "orchestration"), str(repo / "megatron_ext")],
                       capture_output=True)
    work = Path(tempfile.mkdtemp(prefix="bench_cluster_commands_"))
    share = work / "artifacts"
    roots = {repo: share / f"repo{i}" for i, repo in enumerate(repos)}
    for root in roots.values():  # made before the nodes mount the share
        root.mkdir(parents=True)
    (work / "cluster").mkdir()
    where = "one disk" if args.one_disk else "node 0's artifact root through sshfs on the others"
    print(f"{max(counts)}-node namespace cluster ({where}); work folder {work}", flush=True)
    cluster = NamespaceCluster(max(counts), work / "cluster", share=None if args.one_disk else share).open()
    bench = Bench(cluster, work, roots, renice=not args.no_renice)
    times: dict[tuple[int, Path], list[tuple[float, float, float, int, int]]] = {}
    try:
        for i, repo in enumerate(repos):
            bench.warm_up(repo, counts[0], f"cc{i}_warmup")
        for nodes in counts:
            for rep in range(args.repeats):
                order = list(enumerate(repos)) if rep % 2 == 0 else list(reversed(list(enumerate(repos))))
                for i, repo in order:
                    row = bench.measure(repo, nodes, f"cc{i}_{nodes}n_r{rep}")
                    times.setdefault((nodes, repo), []).append(row)
                    print(f"  {nodes} nodes, {names[repo]}: start {row[0]:.2f} s, status {row[1]:.2f} s, stop {row[2]:.2f} s, "
                          f"left {row[3]}/{row[4]}", flush=True)
    finally:
        bench.stop_leftovers()
        cluster.close()

    width = max(len("repo"), *(len(n) for n in names.values()))
    print(f"\nstart, status, stop wall time (gpt_smoke, 1 process per node, namespace nodes on sshfs; median of "
          f"{args.repeats} run(s); status: median of {STATUS_RUNS} calls; left: the run's processes at the stop's "
          f"return / 30 s later)")
    print(f"{'nodes':>5}  {'repo':<{width}} {'start s':>8} {'status s':>9} {'stop s':>7} {'left':>6}")
    medians: dict[tuple[int, Path], tuple[float, float, float]] = {}
    for nodes in counts:
        for repo in repos:
            rows = times[(nodes, repo)]
            med = tuple(statistics.median(r[k] for r in rows) for k in range(3))
            medians[(nodes, repo)] = med
            left = f"{max(r[3] for r in rows)}/{max(r[4] for r in rows)}"
            print(f"{nodes:>5}  {names[repo]:<{width}} {med[0]:>8.2f} {med[1]:>9.2f} {med[2]:>7.2f} {left:>6}")
    if len(counts) > 1:
        low, high = counts[0], counts[-1]
        print(f"\nratio {high} nodes / {low} nodes (the fan-out is parallel: near 1 expected)")
        for repo in repos:
            ratios = [medians[(high, repo)][k] / medians[(low, repo)][k] for k in range(3)]
            print(f"  {names[repo]:<{width}}  start {ratios[0]:.2f}  status {ratios[1]:.2f}  stop {ratios[2]:.2f}")
    else:
        print("\n(one node count: no ratio; give --nodes 2,4,8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
