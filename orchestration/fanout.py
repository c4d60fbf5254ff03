"""Run one node command on every node in parallel, with a timeout each, and collect the results.

Side effects: subprocesses (the local command, ``ssh`` or ``docker exec``). Each node command
prints one JSON line on success; a node that fails yields a :class:`NodeResult` with its exit
code and the tail of what it printed, and every failure is reported together.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from orchestration.launch_env import LaunchEnv
from orchestration.transports import runs_here, transport_argv

DEFAULT_NODE_TIMEOUT_S = 120.0
SSH_UNREACHABLE = 255


@dataclass
class NodeResult:
    node_rank: int
    host: str
    argv: list[str]
    returncode: int
    payload: dict | None
    """The node command's JSON line, when it printed one."""
    output: str
    """stderr + stdout tail, for failures."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.payload is not None

    def describe_failure(self) -> str:
        """Node, what went wrong, exit code, and the command (shortened) that was run."""
        prefix = f"[node{self.node_rank} {self.host}]"
        command = shlex.join(self.argv)
        command = f"\n    command: {command[:300]}{' ...' if len(command) > 300 else ''}"
        if self.returncode == SSH_UNREACHABLE and self.argv and self.argv[0] == "ssh":
            return (f"{prefix} unreachable over ssh (exit 255): {self.output.strip()}; "
                    f"check HOSTS/HOSTFILE, SSH_OPTS and ~/.ssh/config{command}")
        if self.returncode == 124:
            return f"{prefix} timed out: {self.output.strip()}{command}"
        if self.argv and self.argv[0] == "docker" and self.payload is None:
            return (f"{prefix} docker exec into CONTAINER_NAME failed (exit {self.returncode}): {self.output.strip()}; "
                    f"start the container on that node, or unset CONTAINER_NAME to run without docker{command}")
        if self.payload and "error" in self.payload:  # the node said what is wrong: no command needed
            return f"{prefix} exit {self.returncode}: {self.payload['error']}"
        return f"{prefix} exit {self.returncode}: {self.output.strip()}{command}"


def _run_one(launch: LaunchEnv, rank: int, host: str, argv: Sequence[str], env: dict[str, str], cwd: str,
             timeout_s: float) -> NodeResult:
    full = transport_argv(launch, host, argv, env, cwd)
    local = runs_here(launch, host)  # else ssh/docker carry env and cwd
    try:
        proc = subprocess.run(
            full, cwd=cwd if local else None, env={**os.environ, **env} if local else None,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return NodeResult(rank, host, full, 124, None, f"no answer within {timeout_s:.0f}s")
    except FileNotFoundError as exc:
        return NodeResult(rank, host, full, 127, None, f"{exc.filename}: command not found")
    payload = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                payload = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    output = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-15:])
    return NodeResult(rank, host, full, proc.returncode, payload, output)


def fan_out(launch: LaunchEnv, nodes: Sequence[tuple[int, str]], argv_for: Callable[[int, str], Sequence[str]],
            env: dict[str, str], cwd: str, timeout_s: float = DEFAULT_NODE_TIMEOUT_S) -> list[NodeResult]:
    """Run ``argv_for(rank, host)`` with ``env`` in ``cwd`` on every node at once; results in
    node-rank order."""
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        futures = [
            pool.submit(_run_one, launch, rank, host, argv_for(rank, host), env, cwd, timeout_s)
            for rank, host in nodes
        ]
        return [f.result() for f in futures]
