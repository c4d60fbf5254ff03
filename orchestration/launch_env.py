"""The launcher's inputs, read once from the environment into one typed object.

    HOSTS=node0,node1 NPROC_PER_NODE=8 ZERO_STAGE=1 python -m orchestration start ...

Every default lives here: NNODES = number of hosts (1), NODE_RANK = 0, NPROC_PER_NODE = visible
GPUs or 2, MASTER_ADDR = the first host (``localhost`` alone), MASTER_PORT = 6000,
ZERO_STAGE and ENGINE = the data set's, ARTIFACT_ROOT = ``<repo>/artifacts``; also what single
commands read (STAGES for the sweep, GPU_MEMORY_GB for the memory plan, MEGATRON_DEVICE_ARCH for
Megatron-LM's argument check, the SBATCH_* defaults, the Slurm allocation). This is the only
place the launcher reads its environment (:func:`launch_env_from_process`, called once by the
entry point); everything after it takes a :class:`LaunchEnv`. :func:`read_launch_env` is pure:
it takes the environment mapping as an argument. Forwarded variables are split in two: the plain
ones (:func:`forwarded_environment`, which may appear in an ssh command line and a plan) and the
secrets (:func:`secret_environment`: WANDB_API_KEY, HF_TOKEN, any ``*_TOKEN``, ``*_KEY``,
``*_SECRET``, ``*_PASSWORD``), which reach the nodes only through standard input or an inherited
environment and are never shown (``repr`` included). WANDB_PROJECT and friends are read here too
(:class:`~megatron_ext.run_spec.wandb_run.WandbSettings`: Megatron-LM's W&B flags, the preflight's
check that wandb imports on every node).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from megatron_ext.host.devices import Device, visible_gpu_count
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import RunOverrides, read_overrides
from megatron_ext.run_spec.run_paths import artifact_root
from megatron_ext.run_spec.wandb_run import WandbSettings, read_wandb_settings

DEFAULT_MASTER_PORT = 6000
DEFAULT_NPROC_WITHOUT_GPUS = 2
DEFAULT_SSH_CONNECT_TIMEOUT_S = 10
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "CUDA_", "TORCH_", "PYTHON", "MEGATRON_", "WANDB_", "HF_")
FORWARDED_NAMES = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "OMP_NUM_THREADS", "LOG_LEVEL")
SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD")
SECRET_NAMES = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
"""Forwarded variables whose values are secrets: they reach the ranks' environment, never an
argv, a plan (which names them only), a log or a file (see :func:`secret_environment`)."""
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Set per node by the start (the interface that routes to MASTER_ADDR) when not given."""
_HOST_RE = re.compile(r"^[A-Za-z0-9._:@\[\]-]+$")
_TEXTS = {"MEGATRON_LM_DIR": "megatron_lm_dir", "CONTAINER_NAME": "container_name", "SLURM_JOB_ID": "slurm_job_id",
          "STAGES": "stages_text", "GPU_MEMORY_GB": "gpu_memory_gb_text", "MEGATRON_DEVICE_ARCH": "megatron_device_arch_text"}
"""Variables kept as given, by the LaunchEnv field that holds each (None: unset or blank)."""
_FLAGS = {"DRY_RUN": "dry_run", "ALLOW_SLOW_LINKS": "allow_slow_links"}
"""Variables that turn a LaunchEnv field on: set to anything but empty, 0, false or no."""


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """What a start, stop or status command needs to know about the cluster."""

    hosts: tuple[str, ...]
    """Node hosts in node-rank order (ssh names or aliases; ``localhost`` = this machine)."""
    nnodes: int
    """The nodes a start reaches (NNODES, or MAX of NNODES=MIN:MAX)."""
    node_rank: int
    """NODE_RANK: this machine's node rank, for the commands that act on this node only
    (``train``, ``start --this-node``); a start from node 0 plans every node's rank itself."""
    nproc_per_node: int
    master_addr: str
    master_port: int
    master_port_explicit: bool
    """MASTER_PORT was given (else node 0 picks the first free port from 6000 at start)."""
    hosts_explicit: bool
    """HOSTS or HOSTFILE was given (else stop and status take the run's hosts from its resolved plan)."""
    overrides: RunOverrides
    """ZERO_STAGE and ENGINE (None = the data set's)."""
    artifact_root: Path
    """Logs, pid files, metrics, checkpoints, data cache."""
    min_nodes: int | None = None
    """MIN of NNODES=MIN:MAX (torchrun's form): a lost node's run goes on with at least this many
    nodes (None: NNODES gave one number; the data set's training.resilience.min_nodes holds)."""
    checkpoint_root: Path | None = None
    """CHECKPOINT_ROOT: a run's checkpoints go to ``<CHECKPOINT_ROOT>/<run>/checkpoints`` (a parallel file
    system, say) instead of under the artifact root, which links to them."""
    megatron_lm_dir: str | None = None
    """MEGATRON_LM_DIR: the Megatron-LM checkout for ENGINE=megatron-lm."""
    megatron_lm_extra_args: tuple[str, ...] = ()
    """MEGATRON_LM_EXTRA_ARGS (shell words): pretrain_gpt.py flags appended after the rendered ones
    and the data set's training.megatron_lm_extra_args."""
    visible_gpus: int = 0
    """GPUs this machine shows (CUDA_VISIBLE_DEVICES or /dev/nvidia*): the run's device kind."""
    container_name: str | None = None
    """Run every node command through ``docker exec`` into this container."""
    ssh_opts: tuple[str, ...] = ()
    dry_run: bool = False
    forwarded: dict[str, str] = field(default_factory=dict)
    """Variables every node gets, as set where the command was given (secrets aside)."""
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    """Forwarded variables that are secrets (:func:`is_secret`): every node gets them, only in a process's environment or standard input."""
    wandb: WandbSettings | None = None
    """WANDB_PROJECT and friends: one rank logs to Weights & Biases (None: WANDB_PROJECT unset)."""
    use_srun: bool = False
    """Nodes are reached as srun tasks inside a Slurm allocation (LAUNCHER_TRANSPORT=srun, or an
    allocation without HOSTS); else over ssh, and this machine directly (orchestration/cluster/backends.py)."""
    slurm_job_id: str | None = None
    """SLURM_JOB_ID: the allocation the srun transport runs in."""
    slurm_batch: dict[str, str] = field(default_factory=dict)
    """SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT: defaults for ``submit``."""
    slurm_restart_count: int = 0
    """SLURM_RESTART_COUNT: how often this batch job was requeued (unset on its first run)."""
    stages_text: str | None = None
    """STAGES as given (the sweep checks it: a bad STAGES refuses the sweep, not a start)."""
    gpu_memory_gb_text: str | None = None
    """GPU_MEMORY_GB as given (``plan-memory`` checks it)."""
    megatron_device_arch_text: str | None = None
    """MEGATRON_DEVICE_ARCH as given: the compute capability Megatron-LM's argument check assumes
    without a GPU (the Megatron-LM engine checks it)."""
    allow_slow_links: bool = False
    """ALLOW_SLOW_LINKS=1: a start goes on although the preflight named a node with a slow link."""
    link_test_s: float | None = None
    """LINK_TEST_S: how long each node of a multi-node preflight keeps exchanging with its ring
    neighbours (None: the node's default, orchestration/node/linktest.py ``MEASURE_S``)."""
    record_silence_s: float | None = None
    """RECORD_SILENCE_S: how long a node's heartbeat record may stay the same before a start waiting
    on the records (inside a Slurm allocation) takes its supervisor as gone (None: the production
    value, orchestration/runner/record_beats.py ``RECORD_SILENCE_S``, which allows for NFS's cache)."""
    restart_exclude: bool = True
    """RESTART_EXCLUDE (default 1): a restart under NNODES=MIN:MAX leaves out the node the evidence
    names (orchestration/node/exclusion.py); 0: every restart keeps every node."""
    log_level: str = "INFO"
    """LOG_LEVEL (or ``--verbose``: DEBUG): how much the launcher says on standard error."""
    environ: dict[str, str] = field(default_factory=dict, repr=False)
    """The whole environment where the command was given: what commands run on this machine inherit
    (secrets included: never shown)."""
    python: str = sys.executable
    """The interpreter every node runs (nodes share the code path, as DeepSpeed's launcher assumes)."""
    cwd: str = "."
    """The working directory every node runs in."""

    @property
    def zero_stage(self) -> int | None:
        return self.overrides.zero_stage

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def device(self) -> Device:
        return Device.of(self.visible_gpus > 0)


def parse_hosts(text: str, source: str) -> tuple[str, ...]:
    """Hosts from a comma list or a hostfile's text (one per line, ``#`` comments, ``slots=`` ignored)."""
    hosts = []
    for raw in re.split(r"[,\n]", text):
        host = raw.split("#", 1)[0].strip().split()[0] if raw.split("#", 1)[0].strip() else ""
        if not host:
            continue
        if not _HOST_RE.match(host):
            raise UserError(f"{source}: host {host!r} has characters a host name cannot have; fix the entry")
        hosts.append(host)
    if not hosts:
        raise UserError(f"{source} lists no host; give at least one (e.g. HOSTS=node0,node1)")
    seen: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        if host in seen:
            raise UserError(
                f"{source}: host {host!r} is listed twice (node ranks {seen[host]} and {rank}); "
                "list every node once"
            )
        seen[host] = rank
    return tuple(hosts)


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{name}={text!r} must be an integer; e.g. {name}={default}") from None
    if value < minimum:
        raise UserError(f"{name}={value} must be >= {minimum}")
    return value


def is_forwarded(name: str) -> bool:
    return name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES


def is_secret(name: str) -> bool:
    """WANDB_API_KEY, HF_TOKEN, and any name ending in _TOKEN, _KEY, _SECRET or _PASSWORD."""
    return name in SECRET_NAMES or name.endswith(SECRET_SUFFIXES)


def forwarded_environment(env: Mapping[str, str]) -> dict[str, str]:
    """NCCL_*, GLOO_*, CUDA_*, TORCH_*, PYTHON*, MEGATRON_*, WANDB_*, HF_*, PATH, VIRTUAL_ENV,
    CONDA_PREFIX, OMP_NUM_THREADS: what may travel in plain sight (an ssh command line, a plan)."""
    return {k: v for k, v in sorted(env.items()) if is_forwarded(k) and not is_secret(k)}


def secret_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The forwarded variables that are secrets: sent to each node over the transport's standard
    input (ssh, docker exec -i, a local pipe) or inherited (srun, sbatch), never in an argv or a file."""
    return {k: v for k, v in sorted(env.items()) if (is_forwarded(k) or k in SECRET_NAMES) and is_secret(k)}


def read_launch_env(env: Mapping[str, str], visible_gpus: int = 0, slurm_hosts: tuple[str, ...] | None = None,
                    python: str = sys.executable, cwd: str = ".") -> LaunchEnv:
    """Parse and check the launcher variables; every problem is one UserError. ``visible_gpus``
    (see :func:`visible_gpu_count`) is the NPROC_PER_NODE default; ``slurm_hosts`` are the
    allocation's nodes (``scontrol show hostnames $SLURM_JOB_NODELIST``) inside a Slurm allocation."""
    if _text(env, "HOSTS") and _text(env, "HOSTFILE"):
        raise UserError("both HOSTS and HOSTFILE are set; set one of them")
    explicit_hosts = bool(_text(env, "HOSTS") or _text(env, "HOSTFILE"))
    transport = choose_transport(env, explicit_hosts)
    if transport == "srun":
        if not slurm_hosts:
            raise UserError("the allocation lists no node (SLURM_JOB_NODELIST); run inside salloc or sbatch")
        hosts = tuple(slurm_hosts)
    elif _text(env, "HOSTFILE"):
        path = Path(env["HOSTFILE"]).expanduser()
        if not path.is_file():
            raise UserError(f"HOSTFILE={env['HOSTFILE']} does not exist; give a file with one host per line")
        hosts = parse_hosts(path.read_text(), f"HOSTFILE={path}")
    else:
        hosts = parse_hosts(env["HOSTS"], "HOSTS") if _text(env, "HOSTS") else ("localhost",)
    min_nodes, nnodes = _nodes(env, len(hosts))
    if transport == "srun" and nnodes > len(hosts):
        raise UserError(f"NNODES={nnodes} but the Slurm allocation {env.get('SLURM_JOB_ID')} has {len(hosts)} node(s) "
                        f"({', '.join(hosts)}); ask for more nodes (salloc -N {nnodes}) or unset NNODES")
    hosts = hosts[:nnodes] if transport == "srun" else hosts
    if explicit_hosts and nnodes != len(hosts):
        raise UserError(f"NNODES={_text(env, 'NNODES') or nnodes} but {len(hosts)} hosts are listed ({', '.join(hosts)}); "
                        "unset NNODES or list one host per node")
    node_rank = _int(env, "NODE_RANK", 0, 0)
    if node_rank >= nnodes:
        raise UserError(f"NODE_RANK={node_rank} is outside NNODES={nnodes} (node ranks are 0..{nnodes - 1}); fix NODE_RANK or NNODES")
    nproc = _int(env, "NPROC_PER_NODE", visible_gpus or DEFAULT_NPROC_WITHOUT_GPUS, 1)
    port = _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, 1)
    if port > 65535:
        raise UserError(f"MASTER_PORT={port} is not a TCP port; use 1024-65535")
    return LaunchEnv(
        hosts=hosts, hosts_explicit=explicit_hosts, nnodes=nnodes, min_nodes=min_nodes, node_rank=node_rank, nproc_per_node=nproc,
        master_addr=_text(env, "MASTER_ADDR") or hosts[0], master_port=port, master_port_explicit=bool(_text(env, "MASTER_PORT")),
        overrides=read_overrides(env), artifact_root=artifact_root(env), visible_gpus=visible_gpus,
        checkpoint_root=Path(env["CHECKPOINT_ROOT"].strip()).expanduser().absolute() if _text(env, "CHECKPOINT_ROOT") else None,
        megatron_lm_extra_args=_words(env, "MEGATRON_LM_EXTRA_ARGS"), ssh_opts=tuple(shlex.split(env.get("SSH_OPTS", ""))),
        forwarded=forwarded_environment(env), secrets=secret_environment(env), wandb=read_wandb_settings(env),
        use_srun=transport == "srun", slurm_restart_count=_int(env, "SLURM_RESTART_COUNT", 0, 0),
        slurm_batch={key: env[name].strip() for key, name in (("partition", "SBATCH_PARTITION"), ("account", "SBATCH_ACCOUNT"),
                                                               ("time", "SBATCH_TIMELIMIT")) if _text(env, name)},
        log_level=read_log_level(env), restart_exclude=_switch(env, "RESTART_EXCLUDE", True),
        link_test_s=_seconds(env, "LINK_TEST_S", 0.1, 60.0), record_silence_s=_seconds(env, "RECORD_SILENCE_S", 5.0, 3600.0, example=76),
        environ=dict(env), python=python, cwd=cwd,
        **{name: env.get(variable, "").strip() not in ("", "0", "false", "no") for variable, name in _FLAGS.items()},
        **{name: _text(env, variable) for variable, name in _TEXTS.items()},
    )


def _words(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A variable holding shell words (quotes as in a shell)."""
    try:
        return tuple(shlex.split(env.get(name, "")))
    except ValueError as exc:
        raise UserError(f"{name}={env[name]!r} is not valid shell words ({exc}); quote as in a shell, e.g. "
                        f"{name}=\"--attention-backend flash --recompute-activations\"") from None


def _nodes(env: Mapping[str, str], hosts: int) -> tuple[int | None, int]:
    """(MIN, MAX) of NNODES=MIN:MAX, or (None, N) of NNODES=N; N = the hosts by default."""
    text = env.get("NNODES", "").strip()
    if ":" not in text:
        return None, _int(env, "NNODES", hosts, 1)
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise UserError(f"NNODES={text!r} must be a number of nodes or MIN:MAX (torchrun's form), e.g. NNODES=3:4") from None
    if not 1 <= lo <= hi:
        raise UserError(f"NNODES={text!r}: MIN must be at least 1 and at most MAX, e.g. NNODES={max(1, min(lo, hi))}:{max(lo, hi, 1)}")
    return lo, hi


def _seconds(env: Mapping[str, str], name: str, low: float, high: float, example: float = 1.5) -> float | None:
    """A duration in seconds between ``low`` and ``high``; None where unset."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:  # nan fails too
        raise UserError(f"{name}={text!r} must be seconds between {low:g} and {high:g}; e.g. {name}={example:g}")
    return value


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A variable that turns something on (1, true, yes, on) or off (0, false, no, off); ``default`` where unset."""
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise UserError(f"{name}={env[name]!r} must be 0 or 1 (off or on; default {int(default)})")
    return text in ("1", "true", "yes", "on")


def _text(env: Mapping[str, str], name: str) -> str | None:
    return env.get(name, "").strip() or None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def read_log_level(env: Mapping[str, str]) -> str:
    """LOG_LEVEL: DEBUG, INFO (default), WARNING or ERROR (any case)."""
    text = (env.get("LOG_LEVEL", "").strip() or "INFO").upper()
    if text not in LOG_LEVELS:
        raise UserError(f"LOG_LEVEL={env['LOG_LEVEL']!r} is not a level; use one of {', '.join(LOG_LEVELS)} (default INFO)")
    return text


def slurm_nodelist(env: Mapping[str, str]) -> str | None:
    """The allocation's node list, inside a Slurm allocation (SLURM_JOB_ID set)."""
    if not env.get("SLURM_JOB_ID", "").strip():
        return None
    return env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""


def launch_env_from_process(expand_nodelist: Callable[[str], tuple[str, ...]]) -> LaunchEnv:
    """The launcher's one read of its process environment. ``expand_nodelist`` turns a Slurm node
    list into host names (``scontrol show hostnames``, orchestration/cluster/slurm.py)."""
    env = dict(os.environ)
    nodelist = slurm_nodelist(env)
    return read_launch_env(env, visible_gpu_count(env), expand_nodelist(nodelist) if nodelist else None,
                           sys.executable, os.getcwd())


TRANSPORTS = ("ssh", "srun")


def choose_transport(env: Mapping[str, str], explicit_hosts: bool) -> str:
    """``LAUNCHER_TRANSPORT`` (ssh or srun), else srun inside a Slurm allocation without HOSTS,
    else ssh (which is also this machine alone, without HOSTS)."""
    asked = env.get("LAUNCHER_TRANSPORT", "").strip()
    in_allocation = bool(env.get("SLURM_JOB_ID", "").strip())
    if asked and asked not in TRANSPORTS:
        raise UserError(f"LAUNCHER_TRANSPORT={asked!r} is not a transport; use ssh or srun (default: srun inside a "
                        "Slurm allocation without HOSTS, else ssh)")
    if asked == "srun" and not in_allocation:
        raise UserError("LAUNCHER_TRANSPORT=srun needs a Slurm allocation, and SLURM_JOB_ID is not set; run inside "
                        "salloc or sbatch, submit with submit_training.sh, or give HOSTS for ssh")
    if asked == "srun" and explicit_hosts:
        raise UserError("LAUNCHER_TRANSPORT=srun takes the nodes from the allocation; unset HOSTS/HOSTFILE")
    if asked:
        return asked
    return "srun" if in_allocation and not explicit_hosts else "ssh"
