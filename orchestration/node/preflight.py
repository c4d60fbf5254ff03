"""Preflight, the node side: every problem this node has, found before anything starts.

    python -m orchestration preflight gpt_smoke smoke demo       # the checks start runs, on their own

:func:`inspect_node` (run by ``node-check`` on every node in parallel): the run is not live there;
the software (Python, torch, megatron-core, transformer-engine, the project's revision), the Python
a Megatron-LM checkout needs (its requires-python, sent by the launcher), whether the program
accepts that megatron-core and whether megatron-core can use that transformer-engine; the data
paths and tokenizer the run reads; the optional modules it imports (wandb with WANDB_PROJECT set);
the artifact root writable and the same one node 0 sees (a token the launcher wrote: the logs,
records and checkpoints go there; the nodes agree over node 0's store, orchestration/node/board.py);
MASTER_ADDR resolves and node 0 answers on MASTER_PORT (a refused connection proves the path; a
timeout means a firewall drops the traffic, e.g. Docker's FORWARD DROP with bridge netfilter);
MASTER_PORT free on node 0 and, with several nodes, MASTER_PORT + 1 (that store), or the first free
pair from 6000 when MASTER_PORT is not set; the network interface that routes to MASTER_ADDR;
NPROC_PER_NODE within the visible GPUs. The launcher side (:mod:`orchestration.runner.preflight`)
puts every node's report in one table and checks that the nodes agree on the software. Side effects: reads
files, sockets, ``ip``, package metadata; writes and removes one probe file.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.fp8 import fp8_problem
from megatron_ext.run_spec.model_size import checkpoint_bytes, checkpoint_bytes_per_parameter
from megatron_ext.run_spec.python_version import python_problem
from megatron_ext.run_spec.wandb_run import wandb_missing_message
from megatron_ext.training.megatron_core_releases import check_megatron_core
from orchestration.node.gpu_health import read_gpu_health
from orchestration.node.processes import port_is_free
from orchestration.node.wire import NodeCheckRequest, NodeReport, coordination_port

DEFAULT_PORT_SEARCH = range(6000, 6100)
CONNECT_TIMEOUT_S = 5.0
SOFTWARE = ("torch", "megatron-core", "transformer-engine", "apex")
"""The distributions whose versions every node reports (and must agree on)."""
MODULE_PROBLEMS = {"wandb": wandb_missing_message}
"""An optional module the run imports -> its refusal where it is missing."""


def node_local_dir() -> Path:
    """Where the ranks' progress files go: tmpfs when the machine has one (no disk, no network)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def writable_problem(directory: Path, node_rank: int) -> str | None:
    """Why ``directory`` (or, where it does not exist yet, its nearest existing parent, which a start
    would create it under) is not writable here; creates nothing that stays."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    probe = existing / f".writable-node{node_rank}-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        return f"the artifact root is not writable here ({exc}); set ARTIFACT_ROOT to a writable shared path"
    return None


def installed_software(project_dir: Path) -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": "%d.%d.%d" % sys.version_info[:3]}
    for dist in SOFTWARE:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    rev = subprocess.run(["git", "-C", str(project_dir), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(project_dir), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    found["project"] = (rev.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")) if rev.returncode == 0 else None
    return found


def route_interface(address: str) -> str | None:
    """The interface this node sends to ``address`` through (``ip route get``); for one of this
    node's own addresses, the interface that holds it (not ``lo``)."""
    try:
        ip = socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
        route = subprocess.run(["ip", "-o", "route", "get", ip], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    words = route.stdout.split()
    dev = words[words.index("dev") + 1] if "dev" in words else None
    if dev == "lo" and not ip.startswith("127."):
        addrs = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
        for line in addrs.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[3].split("/")[0] == ip:
                return parts[1]
    return dev


def resolve_ipv4(address: str) -> str | None:
    """The IPv4 address this node resolves ``address`` to (its /etc/hosts, then DNS), or None."""
    try:
        return socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None


def loopback_master_problem(address: str, resolved: str | None, nnodes: int) -> str | None:
    """Several nodes and MASTER_ADDR resolving to a loopback address here: this node would look for
    the rendezvous on itself and wait in a world of its own (torchrun hangs with no error; its
    issue threads report it: a hostname line ``127.0.1.1 node0`` in /etc/hosts). Pure."""
    if nnodes < 2 or resolved is None or not resolved.startswith("127."):
        return None
    named = "" if address == resolved else f" resolves to {resolved} here, a loopback address:"
    return (f"MASTER_ADDR={address}{named or ' is a loopback address:'} this node would rendezvous with itself and wait "
            f"for the others in a world of its own; " + (
                f"map {address} to node 0's network address in this node's /etc/hosts (a hostname line such as "
                f"'{resolved} {address}' does this), or set MASTER_ADDR to node 0's IP address" if named else
                "set MASTER_ADDR to node 0's network address (a name or IP every node reaches it at)"))


def probe_master(address: str, port: int) -> str | None:
    """None when node 0 answers at ``address:port`` (a refused connection counts: the path works),
    else the problem."""
    try:
        infos = socket.getaddrinfo(address, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"MASTER_ADDR={address} does not resolve here ({exc.strerror}); use an address every node resolves"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            s.connect(infos[0][4])
        except ConnectionRefusedError:
            return None
        except (socket.timeout, TimeoutError):
            return (f"no answer from node 0 at {address}:{port} within {CONNECT_TIMEOUT_S:.0f}s: something drops the "
                    "traffic between the nodes (a firewall; e.g. Docker's FORWARD DROP with bridge netfilter); allow "
                    "TCP between the nodes")
        except OSError as exc:
            return f"cannot reach node 0 at {address}:{port} ({exc.strerror}); check the network between the nodes"
    return None  # something listens already: node 0's own check reports a busy port


def first_free_port(ports=DEFAULT_PORT_SEARCH) -> int | None:
    """The first port free here with the one above it (the run's coordination store: board.py)."""
    return next((p for p in ports if port_is_free(p) and port_is_free(coordination_port(p))), None)


def tokenizer_problem(kind: str, path: str) -> str | None:
    """Why the run's tokenizer does not load here, or None (megatron_ext.data.tokenizers loads it as
    the ranks will; imported here only: node-check is the one node command that needs it)."""
    from megatron_ext.data.tokenizers import check_tokenizer
    from megatron_ext.run_spec.params import TokenizerParams

    try:
        check_tokenizer(TokenizerParams(kind, path))
    except UserError as exc:
        return f"{exc} (on this node)"
    return None


CUDA_PROBE_TIMEOUT_S = 120.0


def _ask_python(code: str, environ: Mapping[str, str]) -> subprocess.CompletedProcess | None:
    """``code`` run by this node's Python in a child with ``environ`` (the ranks'), or None when it
    did not end within CUDA_PROBE_TIMEOUT_S."""
    try:
        return subprocess.run([sys.executable, "-c", code], env=dict(environ), capture_output=True, text=True,
                              timeout=CUDA_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None


def cuda_problem(environ: Mapping[str, str]) -> str | None:
    """Why a rank on this GPU-less node would find no CUDA device: torch asked in a child with the
    node's environment and a rank's LOCAL_RANK (what a CUDA-on-CPU shim keys on), or None when torch sees one."""
    proc = _ask_python("import torch; print('cuda' if torch.cuda.is_available() else 'none')",
                       {**environ, "LOCAL_RANK": "0"})
    if proc is None:
        return f"torch did not answer whether it sees a CUDA device within {CUDA_PROBE_TIMEOUT_S:.0f} s"
    if proc.stdout.strip().endswith("cuda"):
        return None
    return ("ENGINE=megatron-lm needs a CUDA device on every rank (Megatron-LM's initialize_megatron asserts "
            "torch.cuda.is_available()) and this node shows no GPU; run on GPU nodes, or use ENGINE=megatron-core, "
            "which trains on the CPU too")


TE_PROBE = """
import sys
try:
    import transformer_engine.pytorch
except BaseException as exc:
    print(f"{type(exc).__name__}: {exc}".splitlines()[0][:300]); sys.exit(1)
from megatron.core.extensions.transformer_engine import HAVE_TE
print("ok" if HAVE_TE else "megatron-core's HAVE_TE is False"); sys.exit(0 if HAVE_TE else 1)
"""
"""megatron-core's own test (``HAVE_TE``: megatron/core/extensions/transformer_engine.py ~L61-77),
preceded by the import that fails in a broken install, for its error."""


def transformer_engine_problem(version: str, environ: Mapping[str, str]) -> str | None:
    """Why megatron-core could not use the installed transformer-engine ``version`` (its package
    metadata is there): asked in a child with the ranks' environment, or None when it can. A
    pip-installed transformer-engine whose PyTorch extension does not load for this torch imports
    at the top level but not as ``transformer_engine.pytorch``: megatron-core then runs without
    its layers (slower, and Megatron-LM's ``--transformer-impl transformer_engine`` fails)."""
    proc = _ask_python(TE_PROBE, environ)
    if proc is None:
        return f"transformer-engine {version}: importing transformer_engine.pytorch took over {CUDA_PROBE_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return None
    why = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"transformer-engine {version} is installed but megatron-core cannot use it: importing "
            f"transformer_engine.pytorch fails here ({why}); reinstall it for this torch "
            "(pip install --no-build-isolation 'transformer_engine[pytorch]'), or uninstall it "
            "(pip uninstall transformer-engine transformer-engine-torch) to train without it")


def compute_capability() -> tuple[int, int] | None:
    """The first visible GPU's compute capability from nvidia-smi (no CUDA initialisation in this
    process), or None where it does not answer."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    major, _, minor = first.strip().partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() and (minor or "0").isdigit() else None


def size_text(n: float) -> str:
    """Bytes as people read them: 4.2 MB, 24.1 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_problem(checkpoint_dir: Path, parameters: int, keep: int, device: Device, zero_stage: int = 0) -> str | None:
    """Why the run's checkpoints will not fit where they go on this node: ``keep`` of them and the one
    being written, each ``checkpoint_bytes`` (the run's own checkpoints there already count), against
    the free space; or None."""
    one = checkpoint_bytes(parameters, device, zero_stage)
    needed = one * (keep + 1)
    where = nearest_existing(checkpoint_dir)
    held = sum(f.stat().st_size for f in checkpoint_dir.rglob("*") if f.is_file()) if checkpoint_dir.is_dir() else 0
    free = shutil.disk_usage(where).free
    if free + held >= needed:
        return None
    return (f"the run's checkpoints will not fit: {checkpoint_dir} has {size_text(free)} free on this node "
            f"({size_text(held)} held by the run's checkpoints already), and {keep} kept + the one being written need "
            f"{size_text(needed)} ({size_text(one)} each: {parameters:,} parameters x "
            f"{checkpoint_bytes_per_parameter(device, zero_stage)} bytes); keep fewer (training.keep_checkpoints) or put them on a "
            "larger file system (CHECKPOINT_ROOT)")


def module_problem(module: str) -> str | None:
    """Why an optional module the run imports (wandb with WANDB_PROJECT set) is missing here, or None."""
    if importlib.util.find_spec(module) is not None:
        return None
    where, refusal = f"on this node ({sys.executable})", MODULE_PROBLEMS.get(module)
    return refusal(where) if refusal else f"the run imports {module}, which is not installed {where}; pip install {module} on every node"


def megatron_core_problem(version: str | None) -> str | None:
    """Why the program cannot run with the installed megatron-core ``version`` (None: not installed), or None."""
    if version is None:
        return "megatron-core is not installed; run training_scripts/setup_env.sh on this node"
    try:
        check_megatron_core(version)
    except UserError as exc:
        return str(exc)
    return None


def node0_port_problem(report: NodeReport, master_port: int | None, nnodes: int) -> str | None:
    """Node 0: MASTER_PORT free, and MASTER_PORT + 1 (the run's coordination store) with several nodes;
    MASTER_PORT not set: the first free port from 6000 goes to ``report.free_port``."""
    if master_port is None:
        report.free_port = first_free_port()
        return None if report.free_port is not None else \
            f"no free port in {DEFAULT_PORT_SEARCH.start}-{DEFAULT_PORT_SEARCH.stop - 1}; set MASTER_PORT"
    if not port_is_free(master_port):
        return (f"MASTER_PORT={master_port} is in use on node 0 ({report.host}); choose a free port, "
                f"e.g. MASTER_PORT={master_port + 2}, or unset it to pick one")
    if nnodes > 1 and not port_is_free(coordination_port(master_port)):
        return (f"port {coordination_port(master_port)} (MASTER_PORT + 1, where node 0 keeps the run's "
                f"coordination store) is in use on node 0 ({report.host}); choose another MASTER_PORT, "
                f"e.g. MASTER_PORT={master_port + 2}, or unset it to pick one")
    return None


def inspect_node(request: NodeCheckRequest, run_state_dir: Path, visible_gpus: int, project_dir: Path,
                 environ: Mapping[str, str] | None = None) -> NodeReport:
    """Every check of ``request`` on this node (its ``master_port`` None = MASTER_PORT not set:
    node 0 picks one; its tokenizer must load here); ``environ``: the ranks' environment. The checks
    are one list, each a problem or None, in the order the report names them."""
    node_rank, check, master_port, environ = request.target.node_rank, request.check, request.master_port, environ or {}
    report = NodeReport(node_rank=node_rank, host=request.target.host, software=installed_software(project_dir),
                        local_dir=str(node_local_dir()), visible_gpus=visible_gpus, interface=route_interface(check.master_addr),
                        master_address=resolve_ipv4(check.master_addr))
    software, tokenizer, space = report.software, check.tokenizer, check.checkpoints
    te = software.get("transformer-engine")
    health = read_gpu_health() if visible_gpus else None
    report.notes.extend(health.notes if health is not None else ())
    problems = [
        # the ranks' program (a Megatron-LM checkout) would fail at its first import
        python_problem(check.python, sys.version_info[:3], sys.executable) if check.python is not None else None,
        "torch is not installed; run training_scripts/setup_env.sh on this node" if software.get("torch") is None else None,
        megatron_core_problem(software.get("megatron-core")),
        *map(module_problem, check.required_modules),
        *(f"{path} does not exist on this node; every node needs the run's data, tokenizer and model directory "
          "(a shared file system, or a copy at the same path)" for path in check.required_paths
          if not (Path(path).exists() or (Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()))),
        tokenizer_problem(*tokenizer) if tokenizer is not None and Path(tokenizer.path).exists() else None,
        writable_problem(run_state_dir, node_rank),
        f"the artifact root is not the one node 0 sees ({check.shared_token} is missing here): logs, pid files, the "
        "failure file, checkpoints and the data cache (megatron-core builds its index on rank 0 only) must be "
        "shared; set ARTIFACT_ROOT to a path on a file system every node mounts"
        if check.shared_token is not None and not Path(check.shared_token).is_file() else None,
        node0_port_problem(report, master_port, check.nnodes) if node_rank == 0 else
        probe_master(check.master_addr, master_port) if master_port is not None else None,
        loopback_master_problem(check.master_addr, report.master_address, check.nnodes),
        disk_problem(Path(space.directory), space.parameters, space.keep, Device.of(visible_gpus > 0), space.zero_stage)
        if space is not None else None,
        cuda_problem(environ) if check.needs_cuda and not visible_gpus else None,
        transformer_engine_problem(te, environ) if te is not None else None,
        fp8_problem(check.fp8, te, compute_capability() if visible_gpus else None) if check.fp8 else None,
        *(f"{f.gpu}: {f.what}; {f.fix}" for f in (health.findings if health is not None else ())),
        f"NPROC_PER_NODE={check.nproc_per_node} but this node shows {visible_gpus} GPU(s); use at most {visible_gpus} "
        "(or check CUDA_VISIBLE_DEVICES)" if visible_gpus and check.nproc_per_node > visible_gpus else None,
    ]
    report.problems.extend(p for p in problems if p)
    return report
