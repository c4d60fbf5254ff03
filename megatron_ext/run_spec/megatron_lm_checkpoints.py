"""Where a Megatron-LM checkpoint is, which iteration and which format: its folders, no tensors.

    python -c "from megatron_ext.run_spec.megatron_lm_checkpoints import find_megatron_lm_checkpoint as f; print(f('runs/x/checkpoints'))"

Megatron-LM core_v0.16.1's layout (megatron/training/checkpointing.py):

    <save>/latest_checkpointed_iteration.txt   "N", or "release"        (get_checkpoint_tracker_filename L277,
                                                                          read_metadata L291)
    <save>/iter_000000N/  or  <save>/release/                            (get_checkpoint_name L162)
        torch_dist:  metadata.json {"sharded_backend": "torch_dist", ...}, common.pt, .metadata, __R_S.distcp
                     (save_checkpoint L622-656: dist_checkpointing.save of generate_state_dict L877)
        torch:       mp_rank_00/model_optim_rng.pt (one file per tensor-parallel rank; L690-694)

``--load`` and ``--pretrained-checkpoint`` take the ``<save>`` folder and load the iteration its
tracker names (``--ckpt-step`` overrides it). This program's ``training.init_checkpoint`` takes
either the ``<save>`` folder or one iteration folder in it. Pure apart from reading those small
files (the launcher imports this module: no torch).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ext.run_spec.checkpoints import MEGATRON_LM_LATEST, iteration_dir_name
from megatron_ext.run_spec.errors import UserError

RELEASE = "release"
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
DIST_METADATA = "metadata.json"
"""megatron.core.dist_checkpointing's marker (check_is_distributed_checkpoint reads it)."""
LEGACY_FILE = "mp_rank_00/model_optim_rng.pt"
"""The torch format's file of tensor-parallel rank 0 without pipeline parallelism (get_checkpoint_name)."""


@dataclass(frozen=True)
class MegatronLMCheckpoint:
    """One iteration folder of a Megatron-LM ``--save`` folder."""

    save_dir: Path
    """The folder ``--save`` wrote (it holds the tracker file)."""
    directory: Path
    """``iter_000000N`` or ``release``."""
    iteration: int
    """N (0 for a release checkpoint)."""
    format: Literal["torch_dist", "torch"]
    """torch_dist (megatron.core.dist_checkpointing; any parallel layout) or torch (one file per model-parallel rank)."""
    latest: bool
    """The tracker names this folder: what Megatron-LM's ``--pretrained-checkpoint <save_dir>`` loads."""

    def describe(self) -> str:
        return f"{self.directory} ({self.format}, iteration {self.iteration})"


def read_tracker(save_dir: Path) -> tuple[int, bool] | None:
    """(iteration, release) the tracker file names, or None without one (read_metadata L291)."""
    tracker = save_dir / MEGATRON_LM_LATEST
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == RELEASE:
        return 0, True
    if not text.isdigit():
        raise UserError(f"{tracker} holds {text!r}, neither an iteration nor 'release'; it is not a Megatron-LM "
                        "checkpoint tracker (Megatron-LM writes the latest saved iteration there)")
    return int(text), False


def tracked_dir_name(tracked: tuple[int, bool]) -> str:
    """The folder :func:`read_tracker`'s (iteration, release) names: ``release`` or ``iter_000000N``."""
    iteration, release = tracked
    return RELEASE if release else iteration_dir_name(iteration)


def checkpoint_format(directory: Path) -> Literal["torch_dist", "torch"]:
    """The format of one iteration folder (checkpointing.py _get_checkpoint_format L1134), or a UserError."""
    marker = directory / DIST_METADATA
    if marker.is_file():
        try:
            backend = json.loads(marker.read_text()).get("sharded_backend")
        except (ValueError, AttributeError):
            backend = None
        if backend == "torch_dist":
            return "torch_dist"
        raise UserError(f"{marker} names sharded backend {backend!r}; only torch_dist checkpoints (Megatron-LM's "
                        "default --ckpt-format) and the torch format are read")
    if (directory / LEGACY_FILE).is_file():
        if any(p.name != "mp_rank_00" for p in directory.glob("mp_rank_*")):
            raise UserError(f"{directory} is a torch-format checkpoint with several model-parallel ranks "
                            f"({', '.join(sorted(p.name for p in directory.glob('mp_rank_*')))}); only tensor- and "
                            "pipeline-parallel size 1 is read in that format: save it with --ckpt-format torch_dist "
                            "(which any parallel layout reads)")
        return "torch"
    if (directory / ".metadata").is_file():
        raise UserError(f"{directory} is a torch.distributed.checkpoint folder without {DIST_METADATA}: Megatron-FSDP's "
                        "fsdp_dtensor format (ZeRO stages 2-3), or this program's own checkpoint; Megatron-LM's "
                        "fsdp_dtensor checkpoints are not read: convert it with Megatron-LM's --ckpt-convert-format "
                        "torch_dist, or give this program's checkpoint to export_hf")
    found = ", ".join(sorted(p.name for p in directory.iterdir())[:8]) if directory.is_dir() else ""
    raise UserError(f"{directory} is not a Megatron-LM checkpoint: no {DIST_METADATA} (torch_dist) and no {LEGACY_FILE} "
                    f"(torch format); it holds {found or 'nothing'}")


def find_megatron_lm_checkpoint(path: str | Path, what: str = "training.init_checkpoint") -> MegatronLMCheckpoint:
    """``path`` is a Megatron-LM ``--save`` folder (its tracker picks the iteration) or one of its
    ``iter_000000N``/``release`` folders. Anything else is a UserError naming ``what`` and the path."""
    given = Path(path).expanduser()
    if not given.is_dir():
        raise UserError(f"{what}={path} does not exist or is not a folder; give a Megatron-LM --save folder (with "
                        f"{MEGATRON_LM_LATEST}) or one of its iter_NNNNNNN folders")
    given = given.resolve()
    own = ITERATION_DIR.match(given.name)
    if own or given.name == RELEASE:
        save_dir, directory = given.parent, given
        iteration = int(own.group(1)) if own else 0
        tracked = read_tracker(save_dir)
        latest = tracked is not None and tracked == (iteration, not own)
    else:
        tracked = read_tracker(given)
        if tracked is None:
            inside = sorted(p.name for p in given.glob("iter_*"))
            raise UserError(f"{what}={path} is not a Megatron-LM checkpoint: no {MEGATRON_LM_LATEST}"
                            + (f" (it holds {', '.join(inside[-3:])}: give one of those folders)" if inside else
                               " and no iter_NNNNNNN folder; give the folder Megatron-LM's --save wrote"))
        save_dir, iteration = given, tracked[0]
        directory = given / tracked_dir_name(tracked)
        latest = True
        if not directory.is_dir():
            raise UserError(f"{what}={path}: {MEGATRON_LM_LATEST} names {directory.name}, which is missing; the save "
                            "did not finish or the folder was copied in part")
    try:
        fmt = checkpoint_format(directory)
    except UserError as exc:
        raise UserError(f"{what}: {exc}") from None
    return MegatronLMCheckpoint(save_dir=save_dir, directory=directory, iteration=iteration, format=fmt, latest=latest)


def pretrained_checkpoint_dir(path: str) -> str:
    """The folder Megatron-LM's ``--pretrained-checkpoint`` takes for ``training.init_checkpoint``:
    the ``--save`` folder itself, or the one holding a given ``iter_NNNNNNN``/``release`` folder. Pure."""
    given = Path(path).expanduser()
    return str(given.parent if ITERATION_DIR.match(given.name) or given.name == RELEASE else given)


def check_loadable_by_megatron_lm(checkpoint: MegatronLMCheckpoint, what: str = "training.init_checkpoint") -> None:
    """Megatron-LM's ``--pretrained-checkpoint`` loads the iteration the tracker names, no other
    (checkpointing.py load_checkpoint L1494-1502, then _load_base_checkpoint L1194-1224)."""
    if not checkpoint.latest:
        tracked = read_tracker(checkpoint.save_dir)
        names = (f"names {tracked_dir_name(tracked)}" if tracked else "is missing")
        raise UserError(f"{what}={checkpoint.directory}: ENGINE=megatron-lm starts from the iteration "
                        f"{checkpoint.save_dir / MEGATRON_LM_LATEST} names (--pretrained-checkpoint {checkpoint.save_dir}), "
                        f"and it {names}; give that folder, or copy {checkpoint.directory.name} into a folder of its own "
                        f"with a {MEGATRON_LM_LATEST} holding {checkpoint.iteration}")
