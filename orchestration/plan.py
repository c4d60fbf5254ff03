"""Plans: what each node runs (torchrun argv + environment) and how the launcher reaches it.

    DRY_RUN=1 HOSTS=node0,node1 python -m orchestration start gpt_smoke smoke demo

Pure: takes a :class:`LaunchEnv`, names and paths, returns argv lists and mappings. Every remote
command is built from argv lists and ``shlex.quote``; a RUN name is checked before it gets here
and is never pasted into a shell unquoted.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Sequence

from orchestration.launch_env import DEFAULT_SSH_CONNECT_TIMEOUT_S, LaunchEnv

RUN_TAG = "LAUNCHER_RUN"
RUN_ID_TAG = "LAUNCHER_RUN_ID"
NODE_TAG = "LAUNCHER_NODE_RANK"


@dataclass(frozen=True)
class NodePlan:
    node_rank: int
    host: str
    argv: tuple[str, ...]
    """The torchrun command this node runs."""
    env: dict[str, str]
    """Variables set for it on top of the node's own environment."""

    def as_json(self) -> dict:
        return {"node_rank": self.node_rank, "host": self.host, "argv": list(self.argv), "env": self.env}


def render_torchrun_argv(launch: LaunchEnv, node_rank: int, python: str, program: Sequence[str]) -> list[str]:
    """torchrun with a fixed node rank (static rendezvous: stable ranks) running ``program``
    (``-m megatron_ext.pretrain ...`` or ``pretrain_gpt.py ...``, see orchestration.engines)."""
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(launch.nnodes),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(launch.nproc_per_node),
        "--master-addr", launch.master_addr,
        "--master-port", str(launch.master_port),
        *program,
    ]


def node_environment(launch: LaunchEnv, node_rank: int, program_env: dict[str, str | None] | None = None) -> dict[str, str]:
    """The environment every node gets: launcher variables + the forwarded ones (+ the
    program's own settings; a None there removes a forwarded variable)."""
    env = dict(launch.forwarded)
    for key, value in (program_env or {}).items():
        env.pop(key, None)
        if value is not None:
            env[key] = value
    env.update(
        NNODES=str(launch.nnodes),
        NODE_RANK=str(node_rank),
        NPROC_PER_NODE=str(launch.nproc_per_node),
        MASTER_ADDR=launch.master_addr,
        MASTER_PORT=str(launch.master_port),
    )
    if launch.zero_stage is not None:
        env["ZERO_STAGE"] = str(launch.zero_stage)
    return env


def build_node_plans(launch: LaunchEnv, python: str, program: Sequence[str],
                     program_env: dict[str, str | None] | None = None) -> list[NodePlan]:
    return [
        NodePlan(rank, host, tuple(render_torchrun_argv(launch, rank, python, program)), node_environment(launch, rank, program_env))
        for rank, host in enumerate(launch.hosts)
    ]


def orchestration_argv(python: str, command: str, *args: str) -> list[str]:
    """A node-side orchestration command (``node-start``, ``node-stop``, ...)."""
    return [python, "-m", "orchestration", command, *args]


def remote_shell_command(argv: Sequence[str], env: dict[str, str], cwd: str) -> str:
    """One quoted shell line: ``cd CWD && exec env K=V ... ARGV`` (for ssh)."""
    assignments = [f"{k}={v}" for k, v in env.items()]
    return f"cd {shlex.quote(cwd)} && exec env " + " ".join(shlex.quote(a) for a in [*assignments, *argv])


def ssh_argv(launch: LaunchEnv, host: str, command: str) -> list[str]:
    return [
        "ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={DEFAULT_SSH_CONNECT_TIMEOUT_S}",
        *launch.ssh_opts, host, "--", command,
    ]


def docker_exec_argv(container: str, argv: Sequence[str], env: dict[str, str], cwd: str) -> list[str]:
    flags: list[str] = ["-w", cwd]
    for k, v in env.items():
        flags += ["-e", f"{k}={v}"]
    return ["docker", "exec", *flags, container, *argv]


def transport_argv(launch: LaunchEnv, host: str, argv: Sequence[str], env: dict[str, str], cwd: str) -> list[str]:
    """How this machine runs ``argv`` with ``env`` in ``cwd`` on ``host``.

    local: the argv itself (env and cwd are applied by the caller); ssh: one quoted command
    line; CONTAINER_NAME: ``docker exec`` into the container, over ssh for remote hosts.
    """
    if launch.container_name:
        inner = docker_exec_argv(launch.container_name, argv, env, cwd)
        if launch.is_local(host):
            return inner
        return ssh_argv(launch, host, " ".join(shlex.quote(a) for a in inner))
    if launch.is_local(host):
        return list(argv)
    return ssh_argv(launch, host, remote_shell_command(argv, env, cwd))
