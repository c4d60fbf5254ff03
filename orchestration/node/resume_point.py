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

The attempt's nodes share node 0's pass (issue 54: a 450 GB checkpoint read by one process at
1 GB/s is 7.5 minutes before every restart): node 0 asks on the board for one checkpoint at a time
(:class:`ShareAsk`); each node reads its share of the files (checksums.py ``written_by``: the
writers' ranks modulo the nodes, so each reads about 1/N of the bytes) and answers what it found
(:class:`ShareCheck`); node 0 reads its own share meanwhile, then judges the checkpoint from
every answer (:func:`merged`). A node that cannot see the checkpoint's records, or that is lost
while node 0 waits, has its share read by node 0. The wait follows the nodes' beats, not a fixed
time: a node reading its share beats and names what it reads.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from megatron_ext.run_spec.checkpoints import MEGATRON_LM_LATEST, latest_iteration
from megatron_ext.run_spec.checksums import (DAMAGED_SUFFIX, INTEGRITY_FILE, CheckpointHealth, Damage, HealthState,
                                             counting, list_checkpoints, moved_aside_note, newest_verified,
                                             none_verifies_fix, recorded_files, share_bytes, verify)
from megatron_ext.host.json_files import write_text_atomic
from megatron_ext.run_spec.errors import UserError
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
    moved_aside: tuple[str, ...] = ()
    """The folders of ``passed_over``, by the names they had: a save of the attempt may write one
    of those names again, which every node waits to see gone first (its view of the share)."""

    def describe(self) -> str:
        if self.refused:
            return self.refused
        where = f"the checkpoint of iteration {self.iteration}" if self.iteration is not None else "no checkpoint of its own"
        return "; ".join((*self.passed_over,
                          f"Megatron-LM loads {where} ({'with' if self.verify else 'without'} --verify-integrity)"))


@dataclass(frozen=True)
class ShareAsk:
    """Node 0 asks the attempt's nodes to read their shares of one checkpoint."""

    iteration: int
    folder: str
    """Its folder's name in the run's checkpoints folder."""
    nodes: tuple[int, ...]
    """The nodes that share the reading, in order: node ``nodes[k]`` reads share (k, len(nodes))."""

    def share(self, node: int) -> tuple[int, int]:
        return self.nodes.index(node), len(self.nodes)


@dataclass(frozen=True)
class ShareCheck:
    """What one node found in its share of a checkpoint."""

    node: int
    damage: tuple[Damage, ...] | None
    """The damaged files of its share; None: this node does not see the checkpoint's records (yet):
    node 0 reads the share itself."""
    read_bytes: int = 0


def check_share(checkpoints_dir: Path, ask: ShareAsk, node: int,
                progress: Callable[[int, int, int], None] | None = None) -> ShareCheck:
    """``node``'s share of the checkpoint ``ask`` names, read on this machine (``progress``: told
    (iteration, bytes read, the share's bytes) as it reads)."""
    path = checkpoints_dir / ask.folder
    entries = recorded_files(path)  # once: each node's records and the manifest, on the share
    if not entries:
        return ShareCheck(node, None)
    total = share_bytes(path, entries, ask.share(node))
    damage = verify(path, ask.share(node), progress=counting(progress, ask.iteration, total) if progress else None,
                    entries=entries)
    return ShareCheck(node, tuple(damage), total)


def merged(iteration: int, path: Path, checks: Sequence[ShareCheck]) -> CheckpointHealth:
    """The checkpoint's health from every share's answer (each share read by someone)."""
    damage = tuple(d for c in sorted(checks, key=lambda c: c.node) for d in c.damage or ())
    return CheckpointHealth(iteration, path, HealthState.DAMAGED if damage else HealthState.VERIFIED, damage)


class PassStopped(UserError):
    """A stop came while a checksum pass before an attempt was reading: it ends at the next chunk,
    not after the rest of a share (minutes at a user's size, past the stop's 40 s grace)."""


@dataclass(kw_only=True)
class PassProgress:
    """How far a checksum pass before an attempt has read (node 0's: :func:`choose`'s ``progress``;
    a node's share: :func:`check_share`'s): each call hands ``tell`` the step under way (the
    supervisor's heartbeat record, which a start waiting on the node follows and names) and, every
    ``say_every_s``, ``say`` (the node's log)."""

    tell: Callable[[str], None]
    say: Callable[[str], None]
    say_every_s: float
    what: str = "verifying the checkpoint of iteration {iteration} before choosing it"
    """The step, with ``{iteration}`` in it."""
    stopped: Callable[[], bool] = lambda: False
    """Whether a stop came: the next call raises :class:`PassStopped`."""
    read: dict[int, int] = field(default_factory=dict, init=False)
    """Bytes read so far, per checkpoint (iteration)."""
    began: float = field(default_factory=time.monotonic, init=False)
    _said: float = field(default=float("-inf"), init=False)

    def __call__(self, iteration: int, done: int, total: int) -> None:
        if self.stopped():
            raise PassStopped("stopped on request")
        doing = f"{self.what.format(iteration=iteration)}: {done / 1e9:.1f} of {total / 1e9:.1f} GB read"
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
           progress: Callable[[int, int, int], None] | None = None,
           check: Callable[[int, Path], CheckpointHealth] | None = None) -> tuple[ResumePoint, tuple[CheckpointHealth, ...]]:
    """The attempt's :class:`ResumePoint` and the damaged checkpoints passed over (moves nothing).
    Each checkpoint it looks at is judged by ``check`` (iteration, folder): the nodes' shared pass;
    by default this process reads every byte, telling ``progress`` (iteration, bytes read, its bytes)."""
    latest = latest_iteration(checkpoints_dir)  # newer folders than the tracker's: a save that did not finish
    chosen, damaged = newest_verified([(it, p) for it, p in list_checkpoints(checkpoints_dir)
                                       if latest is not None and it <= latest], progress, check)
    if chosen is not None:
        notes = tuple(moved_aside_note(h.iteration, h.path, [d.describe() for d in h.damage]) for h in damaged)
        return ResumePoint(chosen.iteration, (chosen.path / INTEGRITY_FILE).is_file(), notes,
                           moved_aside=tuple(h.path.name for h in damaged)), damaged
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
