"""The device kind a run computes on, and how many GPUs a machine shows (without initialising CUDA).

    python -c "from megatron_ext.host.devices import visible_gpu_count; import os; print(visible_gpu_count(os.environ))"

Both programs ask: the launcher for the NPROC_PER_NODE default, a node's preflight for
NPROC_PER_NODE against its GPUs. Reads ``/dev`` (fast: no CUDA initialisation on the launch path).
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Mapping


class Device(StrEnum):
    """Where a run's ranks compute: the one place its two names are spelled."""

    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def of(cls, on_cuda: bool) -> Device:
        return cls.CUDA if on_cuda else cls.CPU


def visible_gpu_count(env: Mapping[str, str], dev_dir: Path = Path("/dev")) -> int:
    """GPUs this node would use: CUDA_VISIBLE_DEVICES, else the NVIDIA device files."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in dev_dir.glob("nvidia*") if p.name[len("nvidia"):].isdigit()])
