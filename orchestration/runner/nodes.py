"""Which nodes a command reaches: (node rank, host) pairs; the run a command names, checked.

    HOSTS=node0,node1 python -m orchestration stop demo    # the hosts given
    python -m orchestration stop demo                      # the hosts the run's start recorded

Reads the run's folder and its resolved-parameters file (the hosts a start recorded); nothing else.
"""

from __future__ import annotations

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths, runs_under
from orchestration.launch_env import LaunchEnv

Nodes = list[tuple[int, str]]


def this_node(launch: LaunchEnv) -> Nodes:
    """This machine, as node NODE_RANK."""
    return [(launch.node_rank, "localhost")]


def nodes_to_start(launch: LaunchEnv, only_this_node: bool) -> Nodes:
    """The nodes a start reaches: this one (``--this-node``), or every host."""
    return this_node(launch) if only_this_node else list(enumerate(launch.hosts))


def nodes_of_run(launch: LaunchEnv, run: str, only_this_node: bool) -> Nodes:
    """The nodes a run lives on: HOSTS/HOSTFILE when given, else the hosts its start recorded."""
    if not only_this_node and not launch.hosts_explicit:
        resolved = read_resolved(RunPaths(launch.artifact_root, run).params_path)
        if resolved is not None:
            return list(enumerate(resolved.runtime.hosts))
    return nodes_to_start(launch, only_this_node)


def require_run(launch: LaunchEnv, run: str) -> RunPaths:
    """The run's paths; a UserError naming the runs there when it was never started under ARTIFACT_ROOT."""
    paths = RunPaths(launch.artifact_root, run)
    if not paths.exists():
        known = runs_under(launch.artifact_root)
        raise UserError(f"no run {run!r} under ARTIFACT_ROOT={launch.artifact_root}; "
                        + (f"runs there: {', '.join(known)}" if known else "no run was started there")
                        + " (give the run name a start printed, or set ARTIFACT_ROOT to where it ran)")
    return paths
