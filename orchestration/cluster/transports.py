"""How the launcher reaches a node: this machine, ``ssh``, ``srun`` inside a Slurm allocation, or
``docker exec`` (over ssh or srun for remote nodes when CONTAINER_NAME is set).

    HOSTS=node0,node1 SSH_OPTS="-F cluster.cfg" python -m orchestration status demo

Pure: argv lists built with ``shlex.quote``; a RUN name is checked before it gets here and is
never pasted into a shell unquoted. ``env`` (the forwarded variables) goes into the argv; secrets
never do: they travel on the command's standard input, which ssh and ``docker exec -i`` pass on
(``stdin=True`` asks for ``-i``), or in srun's inherited environment.
"""

from __future__ import annotations

import shlex
from typing import Sequence

from orchestration.launch_env import DEFAULT_SSH_CONNECT_TIMEOUT_S, LaunchEnv


def remote_shell_command(argv: Sequence[str], env: dict[str, str], cwd: str) -> str:
    """One quoted shell line: ``cd CWD && exec env K=V ... ARGV`` (for ssh)."""
    assignments = [f"{k}={v}" for k, v in env.items()]
    return f"cd {shlex.quote(cwd)} && exec env " + " ".join(shlex.quote(a) for a in [*assignments, *argv])


def ssh_argv(launch: LaunchEnv, host: str, command: str) -> list[str]:
    return [
        "ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={DEFAULT_SSH_CONNECT_TIMEOUT_S}",
        *launch.ssh_opts, host, "--", command,
    ]


def docker_exec_argv(container: str, argv: Sequence[str], env: dict[str, str], cwd: str, stdin: bool = False) -> list[str]:
    """``docker exec`` (``-i`` when the command reads its standard input)."""
    flags: list[str] = [*(["-i"] if stdin else []), "-w", cwd]
    for k, v in env.items():
        flags += ["-e", f"{k}={v}"]
    return ["docker", "exec", *flags, container, *argv]


def is_this_machine(launch: LaunchEnv, host: str) -> bool:
    """Whether a node command for ``host`` can run in this very process: this machine, no
    container, no srun task (whose node may be another machine sharing the files)."""
    return launch.transport != "srun" and launch.is_local(host) and not launch.container_name


def runs_here(launch: LaunchEnv, host: str) -> bool:
    """Whether the caller applies env and cwd to the command for ``host`` itself: a plain
    subprocess on this machine, or ``srun`` (which exports the caller's environment)."""
    return launch.transport == "srun" or (launch.is_local(host) and not launch.container_name)


def srun_argv(launch: LaunchEnv, host: str, argv: Sequence[str], cwd: str) -> list[str]:
    """One task on ``host`` inside the allocation, beside the steps already running there."""
    return ["srun", f"--jobid={launch.slurm_job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
            f"--chdir={cwd}", "--kill-on-bad-exit=1", "--quiet", *argv]


def transport_argv(launch: LaunchEnv, host: str, argv: Sequence[str], env: dict[str, str], cwd: str,
                   stdin: bool = False) -> list[str]:
    """How this machine runs ``argv`` with ``env`` in ``cwd`` on ``host``; ``stdin``: the command
    reads what the caller writes to its standard input.

    local: the argv itself (env and cwd are applied by the caller); ssh: one quoted command
    line; CONTAINER_NAME: ``docker exec`` into the container, over ssh for remote hosts.
    """
    if launch.transport == "srun":
        inner = docker_exec_argv(launch.container_name, argv, env, cwd, stdin) if launch.container_name else list(argv)
        return srun_argv(launch, host, inner, cwd)
    if launch.container_name:
        inner = docker_exec_argv(launch.container_name, argv, env, cwd, stdin)
        if launch.is_local(host):
            return inner
        return ssh_argv(launch, host, shlex.join(inner))
    if launch.is_local(host):
        return list(argv)
    return ssh_argv(launch, host, remote_shell_command(argv, env, cwd))
