"""The resolved parameters of a run: written once by the launcher at start, read back typed.

    python -c "from megatron_ext.run_spec.resolved import read_resolved; print(read_resolved('artifacts/logs/demo_params.yaml'))"

``$ARTIFACT_ROOT/logs/<run>_params.yaml`` holds the :class:`RunParams` with every override and
the global batch applied, plus :class:`RunRuntime` (world size, hosts, the program each rank
runs). Both engines get the same file; status and compare read it back with the same checks as
loading params. Side effects: that one file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import RunParams, build_dataclass, params_as_dict, params_from_dict


@dataclass(frozen=True, kw_only=True)
class RunRuntime:
    """What was decided at start, beyond the parameter sets."""

    run: str
    """Run name."""
    run_id: str
    """This start's id (every process of the run carries it)."""
    engine: str
    """megatron-core or megatron-lm."""
    nnodes: int
    """Nodes."""
    nproc_per_node: int
    """Processes (GPUs) per node."""
    hosts: tuple[str, ...]
    """Node hosts in node-rank order."""
    gradient_accumulation_steps: int
    """Micro-batches per rank per optimizer step."""
    program_argv: tuple[str, ...]
    """What torchrun runs on every rank (after its own options)."""
    program_env: dict[str, str | None] = field(default_factory=dict)
    """Environment changes for every rank (None = unset)."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class ResolvedRun:
    params: RunParams
    runtime: RunRuntime


def write_resolved(path: Path, resolved: ResolvedRun) -> None:
    """Write ``path`` atomically (a reader never sees half a file)."""
    raw = params_as_dict(resolved.params)
    raw["runtime"] = {**dataclasses.asdict(resolved.runtime), "world_size": resolved.runtime.world_size}
    raw["runtime"]["hosts"] = list(resolved.runtime.hosts)
    raw["runtime"]["program_argv"] = list(resolved.runtime.program_argv)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    tmp.replace(path)


def read_resolved(path: Path) -> ResolvedRun | None:
    """The run's resolved parameters, or None when the file does not exist."""
    if not path.is_file():
        return None
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict) or "runtime" not in raw:
        raise UserError(f"{path} is not a resolved-parameters file (no runtime section); start the run again")
    runtime = dict(raw.pop("runtime"))
    runtime.pop("world_size", None)
    return ResolvedRun(params_from_dict(raw, str(path)), build_dataclass(RunRuntime, runtime, f"{path}:runtime"))
