"""The links between the nodes, measured before a multi-node start: what each node moves to and
from its ring neighbours with the backend the run will use (gloo on CPU, NCCL on GPUs).

    python -m orchestration.node.linktest --rank 1 --nnodes 3 --master-addr 10.0.0.1 --port 6001 --backend gloo

Every node runs one process (``node-linktest`` starts this module as a child, so a node command
never holds a process group); they meet at MASTER_ADDR:port (a TCP store on node 0), then each
exchanges a buffer with both ring neighbours at once — sends to the next and the previous, receives
from both — for a bounded time, and reports the bytes per second of each exchange (the slower
direction of the pair bounds it, as it bounds a ring all-reduce). With NCCL the transport each
peer uses is read from NCCL_DEBUG=INFO's lines (IB, Socket, P2P), and one 256 MB all-reduce per
pair of ring neighbours is timed (skipped on gloo: the table says so). The launcher puts the nodes'
answers side by side (orchestration/runner/preflight.py). Side effects: a process group, a TCP
store on node 0, the network, for a few seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

from megatron_ext.host.devices import Device
from orchestration.node.wire import LINKTEST_TIMEOUT_S, LinkReport, LinktestRequest

DEFAULT_BYTES = {"gloo": 8 * 2**20, "nccl": 256 * 2**20}
"""The buffer each exchange moves (CPU: 8 MiB; GPUs: 256 MiB, large enough for the link's rate)."""
MEASURE_S = 1.5
"""How long each node keeps exchanging by default (LINK_TEST_S sets it; the first exchange is a
warm-up, not counted; at least one exchange is measured however short)."""
_TRANSPORT = re.compile(r"\bvia (NET/[A-Za-z0-9_]+|P2P/[A-Za-z0-9_/]+|SHM)")


def neighbours(rank: int, nnodes: int) -> tuple[int, ...]:
    """The ring neighbours of ``rank`` (one for two nodes, none alone)."""
    return tuple(sorted({(rank + 1) % nnodes, (rank - 1) % nnodes} - {rank}))


ALLREDUCE_BYTES = 256 * 2**20
"""NCCL only: one all-reduce of this size per pair of ring neighbours, timed (a collective's own
path: NCCL's algorithm and protocol choice, not only the link)."""


def ring_pairs(nnodes: int) -> list[tuple[int, int]]:
    """Every pair of ring neighbours once, in the same order on every node (each pair is a process
    group every node creates, members or not). Pure."""
    return sorted({tuple(sorted((r, (r + 1) % nnodes))) for r in range(nnodes) if nnodes > 1})


def time_pair_allreduces(rank: int, nnodes: int, device, nbytes: int = ALLREDUCE_BYTES) -> dict[int, float]:
    """NCCL: neighbour -> seconds of one all-reduce of ``nbytes`` in the pair's own group (after one
    warm-up), every pair in turn. A collective of the process group: every node calls it."""
    import torch
    import torch.distributed as dist

    out = {}
    buffer = None
    for pair in ring_pairs(nnodes):
        group = dist.new_group(list(pair))
        if rank not in pair:
            continue
        if buffer is None:
            buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buffer, group=group)  # warm-up: the pair's communicator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        torch.cuda.synchronize()
        out[pair[1] if pair[0] == rank else pair[0]] = time.perf_counter() - t0
    return out


def measure(rank: int, nnodes: int, master_addr: str, port: int, backend: str, nbytes: int,
            seconds: float = MEASURE_S) -> tuple[dict[int, float], dict[int, float]]:
    """(neighbour -> GB/s of the exchanges, neighbour -> seconds of one 256 MB all-reduce with it:
    NCCL only), in this process (a process group of one process per node)."""
    import torch
    import torch.distributed as dist

    device = torch.device(Device.of(backend == "nccl"))  # NCCL: GPU 0, set below
    if backend == "nccl":
        torch.cuda.set_device(0)
    store = dist.TCPStore(master_addr, port, nnodes, rank == 0, timeout=datetime.timedelta(seconds=LINKTEST_TIMEOUT_S))
    dist.init_process_group(backend, store=store, rank=rank, world_size=nnodes,
                            timeout=datetime.timedelta(seconds=LINKTEST_TIMEOUT_S))
    try:
        peers = neighbours(rank, nnodes)
        send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        recv = {peer: torch.empty_like(send) for peer in peers}
        moved = {peer: 0 for peer in peers}
        busy = {peer: 0.0 for peer in peers}

        def exchange() -> dict[int, float]:
            """One exchange with every neighbour at once: each pair's own time (each pair waited for in
            a thread of its own, so that a slow neighbour does not stretch a fast one's figure)."""
            t0 = time.perf_counter()
            pending = {peer: (dist.isend(send, peer), dist.irecv(recv[peer], peer)) for peer in peers}
            took: dict[int, float] = {}

            def finish(peer: int) -> None:
                for work in pending[peer]:
                    work.wait()
                took[peer] = time.perf_counter() - t0

            threads = [threading.Thread(target=finish, args=(peer,)) for peer in peers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if device.type == Device.CUDA:
                torch.cuda.synchronize()
            return took

        exchange()  # warm-up: connections, allocations
        dist.barrier()
        deadline = time.perf_counter() + seconds
        while True:
            for peer, took in exchange().items():
                moved[peer] += 2 * nbytes  # both directions
                busy[peer] += took
            done = torch.tensor([1.0 if time.perf_counter() > deadline else 0.0], device=device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)  # every node stops at the same exchange
            if done.item() > 0:
                break
        rates = {peer: moved[peer] / busy[peer] / 1e9 for peer in peers if busy[peer] > 0}
        return rates, time_pair_allreduces(rank, nnodes, device) if backend == "nccl" else {}
    finally:
        dist.destroy_process_group()


def run_linktest(request: LinktestRequest, environ: Mapping[str, str], python: str = sys.executable) -> LinkReport:
    """This node's part, in a child process (NCCL_DEBUG=INFO read for the transport), over the
    request's ``interface`` where the preflight chose one (the ranks get the same: without it gloo
    may take the address the host name resolves to, 127.0.0.1 on many machines), exchanging for its
    ``seconds`` (LINK_TEST_S; :data:`MEASURE_S` when None)."""
    node_rank, host, backend, port = request.target.node_rank, request.target.host, request.backend, request.port
    interface, seconds = request.interface, request.seconds
    t0 = time.monotonic()
    env = {**environ, **({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"} if backend == "nccl" else {})}
    if interface:
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    argv = [python, "-m", "orchestration.node.linktest", "--rank", str(node_rank), "--nnodes", str(request.nnodes),
            "--master-addr", request.master_addr, "--port", str(port), "--backend", backend,
            *(("--seconds", repr(seconds)) if seconds is not None else ())]
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=LINKTEST_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return LinkReport(node_rank=node_rank, host=host, seconds=time.monotonic() - t0,
                          error=f"no link measurement within {LINKTEST_TIMEOUT_S:.0f} s (a peer unreachable on port {port}?)")
    line = next((l for l in reversed(proc.stdout.splitlines()) if l.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])[-300:]
        return LinkReport(node_rank=node_rank, host=host, seconds=time.monotonic() - t0, error=f"the link test failed: {tail}")
    answer = json.loads(line)
    transports = sorted(set(_TRANSPORT.findall(proc.stderr)))
    transport = ", ".join(transports) if transports else ("TCP (gloo)" if backend == "gloo" else "")
    return LinkReport(node_rank=node_rank, host=host, rates_gbs={str(k): v for k, v in answer["rates"].items()}, transport=transport,
                      seconds=time.monotonic() - t0, allreduce_s={str(k): v for k, v in answer["allreduce_s"].items()})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", choices=sorted(DEFAULT_BYTES), required=True)
    p.add_argument("--bytes", type=int, help="buffer per exchange (default by backend)")
    p.add_argument("--seconds", type=float, default=MEASURE_S, help=f"how long to keep exchanging (default {MEASURE_S})")
    args = p.parse_args(argv)
    rates, allreduce_s = measure(args.rank, args.nnodes, args.master_addr, args.port, args.backend,
                                 args.bytes or DEFAULT_BYTES[args.backend], args.seconds)
    print(json.dumps({"rates": rates, "allreduce_s": allreduce_s}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
