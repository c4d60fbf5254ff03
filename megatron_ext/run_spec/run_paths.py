"""The artifact root: one default for every start, stop, status and training process.

    ARTIFACT_ROOT=/shared/runs python -m orchestration status my_run

Layout (``RunPaths``)::

    $ARTIFACT_ROOT/logs/<run>_node<N>.log       every rank's output on node N
    $ARTIFACT_ROOT/logs/<run>_params.yaml       resolved parameters of the run
    $ARTIFACT_ROOT/run_state/<run>_node<N>.pid  what stop needs (JSON)
    $ARTIFACT_ROOT/run_state/<run>_node<N>.{plan.json,exit.json,heartbeat}  the node's supervisor
    $ARTIFACT_ROOT/run_state/<run>_failure.txt  the current attempt's first failure
    $ARTIFACT_ROOT/run_state/<run>_attempts.json the attempts so far and why each ended (node 0's ledger)
    $ARTIFACT_ROOT/run_state/<run>_a<K>.*       attempt K's failure record, set aside when attempt K+1 began
    $ARTIFACT_ROOT/runs/<run>/hangs/<K>/        attempt K's hang: every rank's stack and each node's report
    $ARTIFACT_ROOT/runs/<run>/metrics.jsonl     one record per iteration
    $ARTIFACT_ROOT/runs/<run>/checkpoints/      torch.distributed.checkpoint directories
    $ARTIFACT_ROOT/runs/<run>/wandb/, wandb.json W&B's files (WANDB_PROJECT set), the W&B run id
    $ARTIFACT_ROOT/data_cache/                  prepared corpora and dataset index caches

Path arithmetic, and the root's two checks: :func:`artifact_root` (every reader of ARTIFACT_ROOT:
the launcher's commands, the training program) refuses a root where no directory can be, a file at
it or above it, and only looks; :func:`check_root_writable` (what starts, before anything is
started) makes and removes one empty folder to learn that a start can write there.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from megatron_ext.run_spec.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ARTIFACT_ROOT = REPO_ROOT / "artifacts"
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


ROOT_RULE = "the artifact root must be a directory (every run's logs, run state and checkpoints go under it)"


def artifact_root(env: Mapping[str, str]) -> Path:
    """``$ARTIFACT_ROOT`` from an environment mapping, or ``<repo>/artifacts``: the single default. A
    UserError where no directory can be there (a file, or a path under one). Looks, changes nothing."""
    value = env.get("ARTIFACT_ROOT", "").strip()
    root = Path(value).expanduser().absolute() if value else DEFAULT_ARTIFACT_ROOT
    blocked = _in_the_way(root)
    if blocked is not None:
        path, what = blocked
        where = f"is {what}" if path == root else f"is under {path}, which is {what}"
        raise UserError(f"{_named(root)} {where}; {ROOT_RULE}: {_root_fix(root, 'a directory', f'move {path} away')}")
    return root


def check_root_writable(root: Path) -> None:
    """A UserError where a start could not write under ``root`` on this machine: the root, or where it
    does not exist the nearest folder above it that does, takes no new folder (a read-only or pseudo
    file system such as /proc, no permission). Makes and removes one empty folder there."""
    base = next(p for p in (root, *root.parents) if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=base))
    except OSError as exc:
        where = "is not writable here" if base == root else f"cannot be made: {base} takes no new folder"
        raise UserError(f"{_named(root)} {where} ({exc.strerror}); a start writes every run's logs, run state and "
                        f"checkpoints under it: {_root_fix(root, 'a directory this machine can write', f'make {base} writable')}"
                        ) from None


def _in_the_way(root: Path) -> tuple[Path, str] | None:
    """The first path at or above ``root`` that exists and is no directory, and what it is; None where
    the nearest existing one is a directory."""
    for path in (root, *root.parents):
        try:
            mode = path.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            if path.is_symlink():
                return path, f"a link to {os.readlink(path)}, which does not exist"
            continue
        except OSError as exc:
            return path, f"out of reach ({exc.strerror})"
        if stat.S_ISDIR(mode):
            return None
        return path, "a file" if stat.S_ISREG(mode) else "not a directory"
    return None


def _named(root: Path) -> str:
    return f"ARTIFACT_ROOT={root}" if root != DEFAULT_ARTIFACT_ROOT else f"the artifact root {root} (ARTIFACT_ROOT unset)"


def _root_fix(root: Path, directory: str, otherwise: str) -> str:
    """Set ARTIFACT_ROOT to ``directory``, or unset it (or, where it is unset, do ``otherwise``)."""
    alternative = otherwise if root == DEFAULT_ARTIFACT_ROOT else f"unset it for {DEFAULT_ARTIFACT_ROOT}"
    return f"set ARTIFACT_ROOT to {directory} (e.g. ARTIFACT_ROOT=$HOME/runs), or {alternative}"


def check_run_name(run: str) -> str:
    if not RUN_NAME_RE.match(run or ""):
        raise UserError(
            f"RUN={run!r} is not a valid run name: use letters, digits, '.', '_' and '-' "
            "(at most 128, not starting with '.', '_' or '-'), e.g. qwen3_32gpu_z1"
        )
    return run


@dataclass(frozen=True)
class RunPaths:
    root: Path
    run: str

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def run_state_dir(self) -> Path:
        return self.root / "run_state"

    @property
    def run_dir(self) -> Path:
        return self.root / "runs" / self.run

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        """wandb's files (``wandb.init(dir=run_dir)`` writes here; WANDB_DIR moves them)."""
        return self.run_dir / "wandb"

    @property
    def wandb_state_path(self) -> Path:
        """The W&B run id this run logs to and the last iteration logged (megatron_ext/run_spec/wandb_run.py)."""
        return self.run_dir / "wandb.json"

    @property
    def params_path(self) -> Path:
        return self.logs_dir / f"{self.run}_params.yaml"

    @property
    def data_cache_dir(self) -> Path:
        return self.root / "data_cache"

    def node_log(self, node_rank: int) -> Path:
        return self.logs_dir / f"{self.run}_node{node_rank}.log"

    def node_pid_file(self, node_rank: int) -> Path:
        return self.run_state_dir / f"{self.run}_node{node_rank}.pid"

    def node_plan_file(self, node_rank: int) -> Path:
        """The node's plan, as its supervisor reads it."""
        return self.run_state_dir / f"{self.run}_node{node_rank}.plan.json"

    def node_exit_file(self, node_rank: int) -> Path:
        """How the node's run ended: finished, failed or stopped (JSON, written by its supervisor)."""
        return self.run_state_dir / f"{self.run}_node{node_rank}.exit.json"

    def node_heartbeat_file(self, node_rank: int) -> Path:
        """Touched by the node's supervisor every few seconds while the run lives."""
        return self.run_state_dir / f"{self.run}_node{node_rank}.heartbeat"

    @property
    def failure_file(self) -> Path:
        """The first failure of the current attempt: node, rank, exit code or signal (or the hang and
        its suspects), the node log's last lines."""
        return self.run_state_dir / f"{self.run}_failure.txt"

    @property
    def attempts_file(self) -> Path:
        """The ledger of attempts (node 0's supervisor writes it)."""
        return self.run_state_dir / f"{self.run}_attempts.json"

    def attempt_file(self, attempt: int, what: str) -> Path:
        """Attempt ``attempt``'s file ``what`` (``failure.txt``: its failure record, set aside when the next began)."""
        return self.run_state_dir / f"{self.run}_a{attempt}.{what}"

    def exists(self) -> bool:
        """Whether a start of this run left anything here (its parameters, state or run folder)."""
        return (self.params_path.exists() or self.run_dir.is_dir()
                or any(self.run_state_dir.glob(f"{self.run}_node*"))
                or any(self.run_state_dir.glob(f"{self.run}.*")))  # a batch job's record

    def hangs_dir(self, attempt: int) -> Path:
        """Attempt ``attempt``'s hang: ``node<N>_rank<R>.txt`` stacks and ``node<N>.json`` reports."""
        return self.run_dir / "hangs" / str(attempt)


def runs_under(root: Path) -> list[str]:
    """The runs started under the artifact root ``root`` (by their resolved parameters)."""
    suffix = "_params.yaml"
    return sorted(p.name[: -len(suffix)] for p in (root / "logs").glob(f"*{suffix}"))
