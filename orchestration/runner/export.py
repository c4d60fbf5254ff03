"""Export a run's checkpoint as a Hugging Face model directory: the child process that does it.

    bash training_scripts/export_hf.sh demo /models/demo_hf --iteration 2000
    DRY_RUN=1 bash training_scripts/export_hf.sh demo /models/demo_hf     # prints the command

The launcher imports no torch: megatron_ext/export_hf.py does the work in a child process with
the launcher's interpreter. Side effects: that child process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from megatron_ext.run_spec.engines import MEGATRON_LM
from orchestration.launch_env import LaunchEnv


EXPORTERS = {"hf": "megatron_ext.export_hf", MEGATRON_LM.name: "megatron_ext.export_megatron_lm"}


def export_argv(launch: LaunchEnv, run: str, out: Path, iteration: int | None, force: bool, to: str = "hf") -> list[str]:
    """The exporter's command line (what the dry run prints); ``to``: hf or megatron-lm. Pure."""
    return [launch.python, "-m", EXPORTERS[to], "--artifact-root", str(launch.artifact_root), "--run", run,
            "--out", str(out.expanduser().resolve()),
            *(["--iteration", str(iteration)] if iteration is not None else []), *(["--force"] if force else [])]


def run_export(launch: LaunchEnv, argv: list[str]) -> int:
    """Run the exporter in the foreground; its exit code."""
    return subprocess.run(argv, cwd=launch.cwd, stdin=subprocess.DEVNULL).returncode
