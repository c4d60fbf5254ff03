"""The coordination's load at cluster scale, simulated against one TCPStore on this machine.

    python benchmarks/coordination.py [--nodes 64,512] [--seconds 10] [--procs 4]

N simulated supervisors, each with its own client connection to one ``torch.distributed.TCPStore``
(node 0's, as orchestration/node/board.py opens it), poll as a running attempt's supervisor does
every POLL_S (0.5 s): the save request, the attempt's failure, the hang claim; and every
HEARTBEAT_S the round of its beat thread (orchestration/node/liveness.py): its own counter, and
the counters and exits of the nodes it watches (node 0 all of them, the others node 0 alone).
Reported: store operations per second, the bytes they carry (keys and values; the 16-byte-odd
framing of each request left out), and whether a round of every node's poll kept within POLL_S
(the slowest round). Then what one store serves flat out: one client, then ``--procs`` clients,
doing nothing but ``add`` (the beat) and ``check`` (the failure poll). Side effects: a TCPStore on
a free loopback port and ``--procs`` processes, for the length of the measurement.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

from orchestration.node.board import Board, DeadlineStore  # noqa: E402
from orchestration.node.liveness import Liveness  # noqa: E402
from orchestration.node.run_state import HEARTBEAT_S  # noqa: E402
from orchestration.node.supervisor import POLL_S  # noqa: E402


class CountingStore:
    """A store that counts what passes through it (operations, key and value bytes)."""

    def __init__(self, store) -> None:
        self.store, self.ops, self.bytes = store, 0, 0

    def _count(self, *parts) -> None:
        self.ops += 1
        self.bytes += sum(len(p) if isinstance(p, (str, bytes)) else sum(len(k) for k in p) for p in parts)

    def set(self, key, value):
        self._count(key, value)
        return self.store.set(key, value)

    def get(self, key):
        value = self.store.get(key)
        self._count(key, value)
        return value

    def add(self, key, amount):
        self._count(key, "00000000")
        return self.store.add(key, amount)

    def compare_set(self, key, expected, desired):
        value = self.store.compare_set(key, expected, desired)
        self._count(key, expected, desired, value)
        return value

    def check(self, keys):
        self._count(keys)
        return self.store.check(keys)


def _client(port: int, prefix: str) -> dist.PrefixStore:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    return dist.PrefixStore(prefix, store)


def simulate(port: int, nodes: list[int], total: int, seconds: float, ready, out) -> None:
    """Poll as the supervisors of ``nodes`` (of ``total``) would, for ``seconds`` (from when every
    process has its clients: a process still importing torch is no load on the store)."""
    stores = [CountingStore(_client(port, "run-1/")) for _ in nodes]
    boards = [Board(DeadlineStore(store, 20.0), n) for store, n in zip(stores, nodes)]
    beats = [Liveness(DeadlineStore(store, 20.0), n, 0, node_lost_s=20.0) for store, n in zip(stores, nodes)]
    for liveness in beats:
        liveness.watch({m: 0 for m in range(total)} if liveness.rank == 0 else {0: 0})
    ready.wait()
    slowest, rounds, next_beat = 0.0, 0, 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        beat = start >= next_beat
        for board, liveness in zip(boards, beats):
            board.save_request()
            board.failure(1)
            board.hang_claim(1)
            liveness.lost()  # what the main thread asks: no store call
            if beat:  # the beat thread's round (a connection of its own in a supervisor; one here)
                liveness.tick()
        if beat:
            next_beat = start + HEARTBEAT_S
        took = time.monotonic() - start
        slowest, rounds = max(slowest, took), rounds + 1
        time.sleep(max(0.0, POLL_S - took))
    out.put((sum(s.ops for s in stores), sum(s.bytes for s in stores), slowest, rounds))


def flat_out(port: int, seconds: float, ready, out) -> None:
    store = _client(port, "flat/")
    ready.wait()
    ops, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        store.add("beat/0", 1)
        store.check(["a1/failure"])
        ops += 2
    out.put(ops)


def run_parallel(target, args_per_proc: list[tuple]) -> list:
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Barrier(len(args_per_proc))
    procs = [ctx.Process(target=target, args=(*a, ready, out)) for a in args_per_proc]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="64,512", help="cluster sizes to simulate, comma-separated")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--procs", type=int, default=4, help="processes the simulated supervisors are spread over")
    args = p.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    print(f"one TCPStore on 127.0.0.1:{server.port}; {args.seconds:.0f} s per row; polls every {POLL_S} s, "
          f"a beat every {HEARTBEAT_S} s\n")
    print(f"{'simulated nodes':>15} {'store ops/s':>12} {'KiB/s':>8} {'slowest round':>14} {'kept up':>8}")
    for total in (int(n) for n in args.nodes.split(",")):
        shares = [list(range(i, total, args.procs)) for i in range(args.procs)]
        results = run_parallel(simulate, [(server.port, nodes, total, args.seconds) for nodes in shares if nodes])
        ops = sum(r[0] for r in results) / args.seconds
        kib = sum(r[1] for r in results) / args.seconds / 1024
        slowest = max(r[2] for r in results)
        print(f"{total:>15} {ops:>12,.0f} {kib:>8,.1f} {slowest:>13.3f}s {'yes' if slowest <= POLL_S else 'no':>8}")
    print(f"\n{'flat out':>15} {'store ops/s':>12}")
    for procs in (1, args.procs):
        ops = sum(run_parallel(flat_out, [(server.port, args.seconds / 2)] * procs)) / (args.seconds / 2)
        print(f"{f'{procs} client(s)':>15} {ops:>12,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
