"""Launcher costs, measured side by side in one invocation.

    python benchmarks/launcher.py [--repeats 4]   # root + iproute2 + openssh-server for the 1-vs-2-node rows

1. Start command to first iteration, against bare torchrun of the same training (ratio).
2. Stop latency of a running run, and processes left carrying the run afterwards.
3. Start command time on 1 node vs 2 nodes over ssh in network namespaces (the fan-out is
   parallel, so the ratio should stay near 1).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import clean_env, last_iteration, tagged_pids, write_data_set  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_in_file(path: Path, start: float, timeout_s: float = 300) -> float:
    while time.time() - start < timeout_s:
        if last_iteration(path) >= 1:
            return time.time() - start
        time.sleep(0.05)
    raise TimeoutError(path)


def script(name: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "training_scripts" / name), *args], env=env, capture_output=True, text=True)


def launcher_first_iteration(env: dict, data: str, run: str, root: Path) -> tuple[float, float, int]:
    start = time.time()
    assert script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
    first = _wait_in_file(root / "logs" / f"{run}_node0.log", start)
    stop_start = time.time()
    script("stop_training.sh", run, env=env)
    return first, time.time() - stop_start, len(tagged_pids(run))


def bare_first_iteration(env: dict, data: str, root: Path) -> float:
    log = root / f"bare_{time.time_ns()}.log"
    start = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                                 "--master-port", str(_port()), "-m", "megatron_ext.pretrain", "--model", "gpt_smoke", "--data", data,
                                 "--run-name", "bare"], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _wait_in_file(log, start)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait()


def multinode_start_times(root: Path, data: str) -> tuple[float, float] | None:
    from netns_cluster import NamespaceCluster, missing_prerequisites

    if missing_prerequisites():
        return None
    cluster = NamespaceCluster(2, Path(tempfile.mkdtemp())).open()
    try:
        times = []
        for hosts in ("node0", "node0,node1"):
            env = clean_env(HOSTS=hosts, SSH_OPTS=cluster.ssh_opts, MASTER_ADDR=cluster.nodes[0].address, MASTER_PORT=str(_port()),
                            NPROC_PER_NODE="2", GLOO_SOCKET_IFNAME=cluster.interface, ARTIFACT_ROOT=str(root))
            run = f"bench_nodes{hosts.count(',') + 1}"
            start = time.time()
            assert script("start_multinode_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
            times.append(time.time() - start)
            script("stop_multinode_training.sh", run, env=env)
        return times[0], times[1]
    finally:
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="alternating bare/launcher pairs (default 4)")
    repeats = parser.parse_args().repeats
    root = Path(tempfile.mkdtemp(prefix="bench_launcher_"))
    data = write_data_set(root / "long.yaml", train_iters=5000)
    # Like for like: the scripts run this interpreter, as bare torchrun does (not a shim on PATH,
    # such as pyenv's, which adds ~0.15 s a call), from compiled bytecode, as any second run does
    # (not so where PYTHONDONTWRITEBYTECODE is set: each process compiles the project again).
    env = clean_env(ARTIFACT_ROOT=str(root), MASTER_PORT=str(_port()), LAUNCHER_PYTHON=sys.executable)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "orchestration"), str(REPO / "megatron_ext")], check=True)
    bare_first_iteration(env, data, root)  # warm the data cache and the page cache once, unmeasured
    rows = []
    for rep in range(repeats):
        bare = bare_first_iteration(env, data, root)
        first, stop_s, left = launcher_first_iteration({**env, "MASTER_PORT": str(_port())}, data, f"bench_start{rep}", root)
        rows.append((bare, first, stop_s, left))
    print("start to first iteration (gpt_smoke, 1 node x 2 CPU processes)")
    print(f"{'rep':>3} {'bare torchrun s':>15} {'start_training.sh s':>19} {'ratio':>6} {'stop s':>7} {'left after stop':>15}")
    for i, (bare, first, stop_s, left) in enumerate(rows):
        print(f"{i:>3} {bare:>15.2f} {first:>19.2f} {first / bare:>6.2f} {stop_s:>7.2f} {left:>15}")
    print(f"median ratio {statistics.median(first / bare for bare, first, _, _ in rows):.2f}, median launcher cost "
          f"{statistics.median(first - bare for bare, first, _, _ in rows):.2f} s")
    nodes = multinode_start_times(root, data)
    if nodes is None:
        print("1 vs 2 nodes: skipped (needs root, iproute2, openssh-server)")
    else:
        print(f"start command, 1 node: {nodes[0]:.2f}s; 2 nodes: {nodes[1]:.2f}s (with the link test); ratio {nodes[1] / nodes[0]:.2f}")


if __name__ == "__main__":
    main()
