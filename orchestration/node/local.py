"""This machine's node commands answered in the caller's own process: the launcher's way to its
own machine (no interpreter to start, no connection), beside ssh, docker exec and srun.

    python -c "from orchestration.node.local import answer_here; from orchestration.node.wire import *; \\
        print(answer_here(node_call(StatusRequest(NodeTarget('r', 0, 'localhost', '/tmp/a'))), {}))"

The launcher imports this, :mod:`orchestration.node.wire` and the run-state readers of the node
side, nothing else; the node's dispatcher is imported at the first call only (a launcher command
that reaches no local node loads none of it).
"""

from __future__ import annotations

from typing import Mapping

from orchestration.node.wire import NodeCall


def answer_here(call: NodeCall, environ: Mapping[str, str]) -> tuple[int, str]:
    """``call`` answered in this process, as this machine's node would: (exit code, its JSON line)."""
    from orchestration.node.commands import answer

    return answer([call.command, *call.args], environ, call.stdin or "")
