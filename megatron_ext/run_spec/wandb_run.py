"""Weights & Biases settings from ``WANDB_*``, and where a run's W&B files and identity live.

    WANDB_PROJECT=zero-sweep WANDB_MODE=offline bash training_scripts/start_training.sh gpt_smoke smoke demo

W&B is optional, as TensorBoard is: with ``WANDB_PROJECT`` set, one rank of the run logs the same
scalars as TensorBoard (the last rank, as Megatron-LM does), under the experiment name
``WANDB_NAME`` (default: the run name), its files in ``WANDB_DIR/wandb`` (default: the run
directory, ``runs/<run>/wandb``, as Megatron-LM's ``--wandb-save-dir``).
``WANDB_ENTITY`` and ``WANDB_MODE`` are passed explicitly; everything else wandb reads from its own
variables (``WANDB_API_KEY``, ``WANDB_RUN_GROUP``, ``WANDB_TAGS``, ``WANDB_BASE_URL``, ...), which
reach every rank. A run keeps one W&B run across restarts: its id is kept in
``runs/<run>/wandb.json`` with the last iteration logged (``WANDB_RUN_ID`` overrides the id).
:func:`read_wandb_settings` is pure (the edges call it: orchestration/launch_env.py for the
launcher, megatron_ext/pretrain.py for a rank); :func:`read_wandb_state` /
:func:`write_wandb_state` touch that one file.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from megatron_ext.run_spec.errors import UserError
from megatron_ext.host.json_files import read_json, write_json_atomic
from megatron_ext.run_spec.run_paths import RunPaths

WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")
"""What ``wandb.init(mode=...)`` accepts (``dryrun`` = offline, ``run`` = online)."""
INSTALL_WANDB = "pip install wandb (or pip install -e .[wandb])"


@dataclass(frozen=True, kw_only=True)
class WandbSettings:
    """What the run's W&B logging needs, read once from ``WANDB_*``."""

    project: str
    """WANDB_PROJECT: set = log to W&B."""
    entity: str | None = None
    """WANDB_ENTITY: the team or user (None: the API key's default entity)."""
    name: str | None = None
    """WANDB_NAME: the experiment's display name (None: the run name)."""
    dir: str | None = None
    """WANDB_DIR: wandb writes its files in ``<dir>/wandb`` (None: the run directory)."""
    mode: str | None = None
    """WANDB_MODE: online, offline, disabled, ... (None: wandb's default, online)."""
    run_id: str | None = None
    """WANDB_RUN_ID: the W&B run id (None: one drawn at the run's first start, kept in ``runs/<run>/wandb.json``)."""

    @property
    def enabled(self) -> bool:
        """Whether the ranks import wandb at all (``WANDB_MODE=disabled`` logs nothing)."""
        return self.mode != "disabled"

    def exp_name(self, run: str) -> str:
        return self.name or run

    def save_dir(self, paths: RunPaths) -> Path:
        """``wandb.init(dir=...)`` / ``--wandb-save-dir``: wandb's files go to its ``wandb/`` folder."""
        return Path(self.dir).expanduser().absolute() if self.dir else paths.wandb_dir.parent


def read_wandb_settings(env: Mapping[str, str]) -> WandbSettings | None:
    """None without ``WANDB_PROJECT``; a UserError for a WANDB_MODE wandb does not know."""
    project = env.get("WANDB_PROJECT", "").strip()
    if not project:
        return None
    mode = env.get("WANDB_MODE", "").strip() or None
    if mode is not None and mode not in WANDB_MODES:
        raise UserError(f"WANDB_MODE={mode!r} is not a W&B mode; use one of {', '.join(WANDB_MODES)} "
                        "(offline: write locally, sync later with `wandb sync`), or unset it for online")
    text = lambda name: env.get(name, "").strip() or None  # noqa: E731
    return WandbSettings(project=project, entity=text("WANDB_ENTITY"), name=text("WANDB_NAME"), dir=text("WANDB_DIR"),
                         mode=mode, run_id=text("WANDB_RUN_ID"))


def wandb_missing_message(where: str) -> str:
    """The one refusal when WANDB_PROJECT is set and wandb does not import ``where``."""
    return (f"WANDB_PROJECT is set but wandb is not installed {where}; {INSTALL_WANDB} on every node, "
            "or unset WANDB_PROJECT (WANDB_MODE=disabled also starts without it)")


# -- the run's W&B identity (one file under the run directory) -----------------------------------

@dataclass(frozen=True)
class WandbState:
    """``runs/<run>/wandb.json``: the W&B run this run logs to, and how far it has logged."""

    id: str
    last_step: int = 0
    """The last iteration logged: a resumed attempt skips the iterations up to it (W&B keeps steps
    increasing and cannot purge them, as TensorBoard's purge_step does)."""


def read_wandb_state(paths: RunPaths) -> WandbState | None:
    raw = read_json(paths.wandb_state_path)
    try:
        return WandbState(str(raw["id"]), int(raw.get("last_step", 0)))
    except (ValueError, KeyError, TypeError, AttributeError):  # missing, or not this file's shape
        return None


def write_wandb_state(paths: RunPaths, state: WandbState) -> None:
    write_json_atomic(paths.wandb_state_path, asdict(state))


def wandb_resume_env(settings: WandbSettings, paths: RunPaths) -> dict[str, str]:
    """For Megatron-LM's ranks, whose ``wandb.init`` takes no id: wandb's own WANDB_RUN_ID and
    WANDB_RESUME, so a restart logs to the same W&B run (the launcher records the id at start)."""
    return {"WANDB_RUN_ID": wandb_identity(settings, paths).id, "WANDB_RESUME": "allow"} if settings.enabled else {}


def wandb_identity(settings: WandbSettings, paths: RunPaths) -> WandbState:
    """The W&B run of this run: WANDB_RUN_ID, else the one its first start drew (kept under the run
    directory, so every restart and resume logs to the same W&B run; a new run directory draws a new one)."""
    state = read_wandb_state(paths)
    run_id = settings.run_id or (state.id if state else uuid.uuid4().hex[:16])
    last = state.last_step if state and state.id == run_id else 0
    return WandbState(run_id, last)
