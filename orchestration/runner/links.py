"""The links between the nodes, put side by side: which node's links are far slower than the others'.

    HOSTS=node0,node1,node2 bash training_scripts/preflight_training.sh gpt_smoke smoke demo   # the table

Every node measured its exchanges with its ring neighbours (orchestration/node/linktest.py). A
node's figure is its best link (a healthy node has at least one fast neighbour, a node with a
wrong NCCL_IB_HCA, NCCL_SOCKET_IFNAME, a bad cable or a slow port has none); a node whose figure is
below :data:`SLOW_LINK_FRACTION` of the median of all nodes' is named, with the likely fixes. A
ratio to the median, not an absolute figure: equal links on a noisy machine are never named. Two
nodes share their one link: nothing can say which side is slow, so nothing is named (the table
still shows it). Pure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from orchestration.node.wire import LinkReport

SLOW_LINK_FRACTION = 0.25
"""A node is named when its best link moves less than this fraction of the median node's."""
FIXES = ("check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (the interface every node should use), NCCL_IB_HCA "
         "(the InfiniBand adapters), NCCL_NET (IB, not Socket), and the node's cable and port speed")
Problem = NamedTuple("Problem", [("node_rank", int), ("host", str), ("what", str)])
"""What is wrong on one node, and how to fix it (the preflight's, the link test's)."""


@dataclass(frozen=True, kw_only=True)
class LinkRow:
    node_rank: int
    host: str
    interface: str | None
    """The interface that routes to MASTER_ADDR on the node (its preflight's answer)."""
    best_gbs: float | None
    """The node's fastest ring link (GB/s, both directions at once); None when not measured."""
    links: dict[str, float]
    transport: str
    slow: bool
    error: str | None = None
    allreduce_s: dict[str, float] | None = None
    """NCCL: neighbour -> seconds of one 256 MB all-reduce with it; None: skipped (gloo)."""


def link_rows(reports: Sequence[LinkReport], interfaces: Mapping[int, str | None] | None = None) -> list[LinkRow]:
    """One row per node; the slow ones marked."""
    best = {r.node_rank: max(r.rates_gbs.values()) for r in reports if r.rates_gbs and not r.error}
    median = statistics.median(best.values()) if best else None
    compare = len(best) >= 3 and median
    return [LinkRow(node_rank=r.node_rank, host=r.host, interface=(interfaces or {}).get(r.node_rank), best_gbs=best.get(r.node_rank),
                    links=dict(r.rates_gbs), transport=r.transport,
                    slow=bool(compare and best.get(r.node_rank, median) < SLOW_LINK_FRACTION * median), error=r.error,
                    allreduce_s=dict(r.allreduce_s) or None)
            for r in sorted(reports, key=lambda r: r.node_rank)]


def slow_link_problems(rows: Sequence[LinkRow]) -> list[Problem]:
    """A problem for every node named slow, and every node whose test failed."""
    median = statistics.median([r.best_gbs for r in rows if r.best_gbs is not None] or [0.0])
    out = []
    for r in rows:
        if r.error:
            out.append(Problem(r.node_rank, r.host, f"link test: {r.error}"))
        elif r.slow:
            out.append(Problem(r.node_rank, r.host, f"slow link: its best link moves {r.best_gbs:.3f} GB/s, "
                                                    f"{r.best_gbs / median:.0%} of the median node's {median:.3f} GB/s "
                                                    f"(transport {r.transport or 'unknown'}); {FIXES}; or go on anyway with "
                                                    "ALLOW_SLOW_LINKS=1"))
    return out


def format_links(rows: Sequence[LinkRow]) -> str:
    """The table; then the 256 MB all-reduce per neighbour pair (NCCL), or that it was skipped (gloo)."""
    lines = [f"{'node':<5} {'host':<16} {'interface':<10} {'transport':<16} {'best GB/s':>10}  links (neighbour: GB/s)"]
    for r in rows:
        links = ", ".join(f"node{k}: {v:.3f}" for k, v in sorted(r.links.items()))
        best = f"{r.best_gbs:.3f}" if r.best_gbs is not None else "-"
        flag = "  <- slow" if r.slow else ""
        lines.append(f"{r.node_rank:<5} {r.host:<16} {r.interface or '-':<10} {r.transport or '-':<16} {best:>10}  "
                     f"{links or r.error or '-'}{flag}")
    timed = {tuple(sorted((r.node_rank, int(k)))): v for r in rows for k, v in (r.allreduce_s or {}).items()}
    if timed:
        lines.append("one 256 MB NCCL all-reduce per neighbour pair: " + ", ".join(
            f"node{a}-node{b} {s * 1000:.1f} ms" for (a, b), s in sorted(timed.items())))
    elif rows:
        lines.append("one 256 MB NCCL all-reduce per neighbour pair: skipped (gloo: no GPUs)")
    return "\n".join(lines)
