"""The checkpoint a Megatron-LM attempt starts from: node 0's choice before each attempt.

This project's ranks verify the checkpoint they resume from themselves, and pass over a damaged
one (megatron_ext/training/checkpoint.py ``newest_verified``). Megatron-LM's load takes the
iteration its tracker file names, and with ``--verify-integrity`` dies on a damaged one
(megatron-core 0.19's ``verify_integrity_manifest`` raises CheckpointingException on rank 0's
finding: no fallback), so a restart would meet the same checkpoint again. So before each attempt
node 0's supervisor takes the newest checkpoint at or before the tracker's that verifies
(its ``integrity.json``: megatron_ext/run_spec/checksums.py), moves the damaged ones newer than it
aside (``iter_N.damaged``), points the tracker at it, and puts the choice on the run's board;
every node then passes ``--ckpt-step N`` (Megatron-LM's own override of the tracker,
checkpointing.py ``_load_base_checkpoint`` at core_v0.16.1 and core_v0.19.0), never the tracker
another node may read late. ``--verify-integrity`` goes with an attempt when what it loads has a
manifest to check (the run's checkpoint, or training.init_checkpoint's on a fresh start) or it
loads nothing: Megatron-LM refuses a checkpoint saved without one (a run begun on an older
release, a foreign init checkpoint).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from megatron_ext.run_spec.checkpoints import MEGATRON_LM_LATEST, latest_iteration
from megatron_ext.run_spec.checksums import (DAMAGED_SUFFIX, INTEGRITY_FILE, CheckpointHealth, list_checkpoints,
                                             moved_aside_note, newest_verified, none_verifies_fix)
from megatron_ext.host.json_files import write_text_atomic
from megatron_ext.run_spec.megatron_lm_checkpoints import find_megatron_lm_checkpoint


@dataclass(frozen=True)
class ResumePoint:
    """What an attempt loads, as node 0 chose it."""

    iteration: int | None
    """The run's checkpoint it loads (``--ckpt-step``); None: none (a fresh start, or the init checkpoint)."""
    verify: bool
    """Whether Megatron-LM checks ``integrity.json`` at the load (and writes one at each save)."""
    passed_over: tuple[str, ...] = ()
    """The damaged checkpoints newer than it, each described (moved aside)."""
    refused: str = ""
    """Set when no checkpoint of the run verifies: why, and what to do (the run ends)."""

    def describe(self) -> str:
        if self.refused:
            return self.refused
        where = f"the checkpoint of iteration {self.iteration}" if self.iteration is not None else "no checkpoint of its own"
        return "; ".join((*self.passed_over,
                          f"Megatron-LM loads {where} ({'with' if self.verify else 'without'} --verify-integrity)"))


@dataclass(kw_only=True)
class PassProgress:
    """How far node 0's checksum pass before an attempt has read (:func:`choose`'s ``progress``):
    each call hands ``tell`` the step under way (the supervisor's heartbeat record, which a start
    waiting on the node follows and names) and, every ``say_every_s``, ``say`` (the node's log)."""

    tell: Callable[[str], None]
    say: Callable[[str], None]
    say_every_s: float
    read: dict[int, int] = field(default_factory=dict, init=False)
    """Bytes read so far, per checkpoint (iteration)."""
    began: float = field(default_factory=time.monotonic, init=False)
    _said: float = field(default=float("-inf"), init=False)

    def __call__(self, iteration: int, done: int, total: int) -> None:
        doing = f"verifying the checkpoint of iteration {iteration} before choosing it: {done / 1e9:.1f} of {total / 1e9:.1f} GB read"
        self.tell(doing)
        self.read[iteration] = done
        now = time.monotonic()
        if now - self._said >= self.say_every_s:
            self._said = now
            self.say(doing)

    def summary(self) -> str | None:
        """What the pass read, and how long it took (None: it read nothing)."""
        if not self.read:
            return None
        return (f"read {sum(self.read.values()) / 1e9:.1f} GB of {len(self.read)} checkpoint(s) through in "
                f"{time.monotonic() - self.began:.0f} s")


def choose(checkpoints_dir: Path, init_checkpoint: str = "",
           progress: Callable[[int, int, int], None] | None = None) -> tuple[ResumePoint, tuple[CheckpointHealth, ...]]:
    """The attempt's :class:`ResumePoint` and the damaged checkpoints passed over (reads every
    byte of each checkpoint it looks at, telling ``progress`` (iteration, bytes read, its bytes);
    moves nothing)."""
    latest = latest_iteration(checkpoints_dir)  # newer folders than the tracker's: a save that did not finish
    chosen, damaged = newest_verified([(it, p) for it, p in list_checkpoints(checkpoints_dir)
                                       if latest is not None and it <= latest], progress)
    if chosen is not None:
        notes = tuple(moved_aside_note(h.iteration, h.path, [d.describe() for d in h.damage]) for h in damaged)
        return ResumePoint(chosen.iteration, (chosen.path / INTEGRITY_FILE).is_file(), notes), damaged
    if damaged:
        what = "; ".join(h.describe() for h in damaged[:3])
        return ResumePoint(None, False, refused=f"no checkpoint of this run verifies ({what}): "
                                                f"{none_verifies_fix(checkpoints_dir)}"), ()
    init = find_megatron_lm_checkpoint(init_checkpoint).directory if init_checkpoint else None
    return ResumePoint(None, init is None or (init / INTEGRITY_FILE).is_file()), ()


def take(point: ResumePoint, damaged: tuple[CheckpointHealth, ...], checkpoints_dir: Path) -> None:
    """Node 0: the damaged checkpoints moved aside and the tracker pointed at the chosen one
    (written aside, then renamed), so that status and the next start see the run as it resumes."""
    for h in damaged:
        os.replace(h.path, h.path.with_name(h.path.name + DAMAGED_SUFFIX))
    if damaged and point.iteration is not None:
        write_text_atomic(checkpoints_dir / MEGATRON_LM_LATEST, str(point.iteration))
