"""How the launcher reaches a node: this machine, ``ssh``, ``srun`` inside a Slurm allocation, or
``docker exec`` (into CONTAINER_NAME, over ssh or srun for other machines) — one typed object per
host (:func:`transport_for`).

    HOSTS=node0,node1 SSH_OPTS="-F cluster.cfg" python -m orchestration status demo

Pure: argv lists built with ``shlex.quote``; a RUN name is checked before it gets here and is
never pasted into a shell unquoted. ``env`` (the forwarded variables) goes into the argv; secrets
never do: they travel on the command's standard input, which ssh and ``docker exec -i`` pass on
(``stdin=True`` asks for ``-i``), or in srun's inherited environment.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from orchestration.launch_env import DEFAULT_SSH_CONNECT_TIMEOUT_S, LaunchEnv


def remote_shell_command(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """One quoted shell line: ``cd CWD && exec env K=V ... ARGV`` (for ssh)."""
    assignments = [f"{k}={v}" for k, v in env.items()]
    return f"cd {shlex.quote(cwd)} && exec env " + " ".join(shlex.quote(a) for a in [*assignments, *argv])


@dataclass(frozen=True)
class ThisMachine:
    """A node command on this machine: a subprocess (the caller sets its env and cwd), or a call in
    this very process."""

    in_process = True
    """The node command can run in the launcher's own process (no container, no srun task)."""
    caller_sets_env = True
    """The caller applies ``env`` and ``cwd`` to the process it starts (else the argv carries them)."""

    def argv(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:
        return list(argv)


@dataclass(frozen=True)
class Ssh:
    """``ssh HOST -- 'cd CWD && exec env K=V ... ARGV'`` with BatchMode and a connect timeout."""

    host: str
    options: tuple[str, ...] = ()
    """SSH_OPTS: ``-F cfg``, ``-p 2222``, ..."""
    in_process = False
    caller_sets_env = False

    def command(self, line: str) -> list[str]:
        return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={DEFAULT_SSH_CONNECT_TIMEOUT_S}", *self.options,
                self.host, "--", line]

    def argv(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:
        return self.command(remote_shell_command(argv, env, cwd))


@dataclass(frozen=True)
class Srun:
    """One task on ``host`` inside the allocation, beside the steps already running there (srun
    exports the caller's environment: the caller sets env and cwd)."""

    job_id: str
    host: str
    in_process = False
    caller_sets_env = True

    def argv(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:
        return ["srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={self.host}",
                f"--chdir={cwd}", "--kill-on-bad-exit=1", "--quiet", *argv]


@dataclass(frozen=True)
class DockerExec:
    """``docker exec`` into ``container`` (``-i`` when the command reads its standard input), run
    here, over ssh, or as an srun task, as ``via`` says."""

    container: str
    via: Union[ThisMachine, Ssh, Srun]
    in_process = False

    @property
    def caller_sets_env(self) -> bool:
        return isinstance(self.via, Srun)

    def argv(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdin: bool = False) -> list[str]:
        flags: list[str] = [*(["-i"] if stdin else []), "-w", cwd]
        for k, v in env.items():
            flags += ["-e", f"{k}={v}"]
        inner = ["docker", "exec", *flags, self.container, *argv]
        if isinstance(self.via, Ssh):
            return self.via.command(shlex.join(inner))
        return self.via.argv(inner, env, cwd, stdin)


Transport = Union[ThisMachine, Ssh, Srun, DockerExec]


def transport_for(launch: LaunchEnv, host: str) -> Transport:
    """How this machine runs a node command on ``host``: srun inside an allocation (LAUNCHER_TRANSPORT),
    else this machine for a local host and ssh for any other; CONTAINER_NAME wraps either in
    ``docker exec``."""
    if launch.use_srun:
        base: Union[ThisMachine, Ssh, Srun] = Srun(launch.slurm_job_id or "", host)
    elif launch.is_local(host):
        base = ThisMachine()
    else:
        base = Ssh(host, launch.ssh_opts)
    return DockerExec(launch.container_name, base) if launch.container_name else base
