"""Shared fixtures: an artifact root per session and a real torchrun launcher for training."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO.parent / "shared" / "reference"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without launcher/torchrun variables, plus ``extra``."""
    drop = {"ZERO_STAGE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NNODES", "NODE_RANK", "NPROC_PER_NODE",
            "MASTER_ADDR", "MASTER_PORT", "HOSTS", "HOSTFILE", "CONTAINER_NAME", "DRY_RUN", "LAUNCHER_RUN"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def artifact_root(tmp_path_factory) -> Path:
    """One artifact root for the session, so the embedded corpus is prepared once."""
    return tmp_path_factory.mktemp("artifacts")


def run_torchrun(artifact_root: Path, run: str, nproc: int = 2, model: str = "gpt_smoke", data: str = "smoke",
                 train_iters: int | None = None, timeout: int = 300, **env) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Real torchrun of the training program; returns the process and its metrics records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "megatron_ext.pretrain", "--model", model, "--data", data, "--run-name", run]
    if train_iters:
        cmd += ["--train-iters", str(train_iters)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(ARTIFACT_ROOT=str(artifact_root), **env),
                          capture_output=True, text=True, timeout=timeout)
    metrics_path = artifact_root / "runs" / run / "metrics.jsonl"
    records = [json.loads(l) for l in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    return proc, records
