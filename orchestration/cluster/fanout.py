"""Run one node command on every node in parallel, with a timeout each, and collect typed results.

Side effects: subprocesses (``ssh``, ``docker exec`` or ``srun``: the backend's argv,
orchestration/cluster/backends.py), or, for this machine, the node command in this very process
(:func:`orchestration.node.local.answer_here`: no interpreter to start).
Each node command answers one JSON line (orchestration/node/wire.py): read back as the answer
dataclass the caller names, or ``{"error": ...}``. A node that fails yields a :class:`NodeResult`
with its exit code and the tail of what it printed, and every failure is reported together.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, Protocol, Sequence, TypeVar

from megatron_ext.run_spec.errors import Outcome
from orchestration.launch_env import LaunchEnv
from orchestration.node.local import answer_here
from orchestration.node.wire import NodeCall, decode_payload, node_label

log = logging.getLogger(__name__)

DEFAULT_NODE_TIMEOUT_S = 120.0
SSH_UNREACHABLE = 255
T = TypeVar("T")


class Route(Protocol):
    """How a node command reaches its host: what each backend supplies (cluster/backends.py)."""

    caller_sets_env: bool

    def in_process(self, host: str) -> bool: ...
    def plan(self, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]: ...


@dataclass(frozen=True, kw_only=True)
class NodeResult(Outcome, Generic[T]):
    node_rank: int
    host: str
    argv: list[str]
    returncode: int
    value: T | None
    """The node command's answer, typed, when it printed one."""
    error: str | None
    """What the node said went wrong (its ``{"error": ...}`` line)."""
    output: str
    """stderr + stdout tail, for failures."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.value is not None

    @property
    def label(self) -> str:
        return node_label(self.node_rank, self.host)

    def describe_failure(self) -> str:
        """Node, what went wrong, exit code, and the command (shortened) that was run."""
        command = shlex.join(self.argv)
        command = f"\n    command: {command[:300]}{' ...' if len(command) > 300 else ''}"
        if self.returncode == SSH_UNREACHABLE and self.argv and self.argv[0] == "ssh":
            return (f"{self.label} unreachable over ssh (exit 255): {self.output.strip()}; "
                    f"check HOSTS/HOSTFILE, SSH_OPTS and ~/.ssh/config{command}")
        if self.returncode == 124:
            return f"{self.label} timed out: {self.output.strip()}{command}"
        if self.argv and self.argv[0] == "docker" and self.error is None and self.value is None:
            return (f"{self.label} docker exec into CONTAINER_NAME failed (exit {self.returncode}): {self.output.strip()}; "
                    f"start the container on that node, or unset CONTAINER_NAME to run without docker{command}")
        if self.error is not None:  # the node said what is wrong: no command needed
            return f"{self.label} exit {self.returncode}: {self.error}"
        return f"{self.label} exit {self.returncode}: {self.output.strip()}{command}"


def _last_json_line(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _result(rank: int, host: str, argv: list[str], returncode: int, stdout: str, stderr: str,
            decode: type[T] | None) -> NodeResult[T]:
    raw = _last_json_line(stdout)
    error = raw.get("error") if raw and set(raw) == {"error"} else None
    value = decode_payload(decode, raw) if raw is not None and error is None and decode is not None else None
    output = "\n".join((stderr + stdout).strip().splitlines()[-15:])
    return NodeResult(node_rank=rank, host=host, argv=argv, returncode=returncode, value=value, error=error, output=output)


def _answer_within(call: NodeCall, environ: dict[str, str], timeout_s: float | None) -> tuple[int, str] | None:
    """This machine's answer to ``call`` in this process, or None when it took longer than
    ``timeout_s`` (None: no deadline; the command then finishes on its own thread; its answer is
    dropped, as a remote one's would be)."""
    box: dict = {}

    def run() -> None:
        try:
            box["answer"] = answer_here(call, environ)
        except BaseException as exc:  # raised again on the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=run, name=f"node-call-{call.command}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if "error" in box:
        raise box["error"]
    return box.get("answer")


def _run_one(route: Route, launch: LaunchEnv, rank: int, host: str, call: NodeCall, decode: type[T] | None,
             timeout_s: float | None) -> NodeResult[T]:
    argv = call.argv(launch.python)
    started = time.monotonic()
    if route.in_process(host):  # the same request, under the same timeout
        answered = _answer_within(call, {**launch.environ, **launch.forwarded}, timeout_s)
        if answered is None:
            return NodeResult(node_rank=rank, host=host, argv=argv, returncode=124, value=None, error=None,
                              output=f"no answer within {timeout_s:.0f}s")
        returncode, line = answered
        log.debug("%s %s in this process: exit %d in %.2f s", node_label(rank, host), call.command, returncode,
                  time.monotonic() - started)
        return _result(rank, host, argv, returncode, line, "", decode)
    full = route.plan(host, argv, launch.forwarded, launch.cwd, stdin=call.stdin is not None)
    local = route.caller_sets_env  # else ssh/docker carry env and cwd
    try:  # the call's stdin (secrets) goes down the pipe: ssh and docker exec -i pass it on, no argv shows it
        proc = subprocess.run(
            full, cwd=launch.cwd if local else None, env={**launch.environ, **launch.forwarded} if local else None,
            input=call.stdin, stdin=None if call.stdin is not None else subprocess.DEVNULL,
            capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return NodeResult(node_rank=rank, host=host, argv=full, returncode=124, value=None, error=None,
                          output=f"no answer within {timeout_s:.0f}s")
    except FileNotFoundError as exc:
        return NodeResult(node_rank=rank, host=host, argv=full, returncode=127, value=None, error=None,
                          output=f"{exc.filename}: command not found")
    log.debug("%s %s: exit %d in %.2f s: %s", node_label(rank, host), call.command, proc.returncode,
              time.monotonic() - started, shlex.join(full)[:300])
    return _result(rank, host, full, proc.returncode, proc.stdout, proc.stderr, decode)


def call_nodes(route: Route, launch: LaunchEnv, nodes: Sequence[tuple[int, str]], call_for: Callable[[int, str], NodeCall],
               decode: type[T], timeout_s: float | None = DEFAULT_NODE_TIMEOUT_S) -> list[NodeResult[T]]:
    """The node command ``call_for(rank, host)`` on every node at once, each answer read as
    ``decode`` (``timeout_s`` None: a command that bounds its own wait); results in node-rank order."""
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        futures = [pool.submit(_run_one, route, launch, rank, host, call_for(rank, host), decode, timeout_s)
                   for rank, host in nodes]
        return [f.result() for f in futures]
