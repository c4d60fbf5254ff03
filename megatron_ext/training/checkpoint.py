"""Checkpoints that resume exactly: model, optimizer, schedule position, data position, RNG.

Layout (``$ARTIFACT_ROOT/runs/<run>/checkpoints``)::

    iter_0000010/            every rank writes its part (the trainer's save_state):
      .metadata, __0_0.distcp, ...   torch.distributed.checkpoint (CPU; CUDA stages 2-3: fsdp_dtensor)
      + common.pt, metadata.json     megatron-core's torch_dist format (CUDA stages 0-1)
      rank<R>.pt             each rank's RNG states (CPU, CUDA, megatron's model-parallel tracker) and
                             its rank-local optimizer state (CPU stage 1: ZeroRedundancyOptimizer's
                             partition)
      meta.json              iteration, consumed samples, world size, stage, global batch (rank 0, last)
      checksums/rank<R>.json size and CRC-32 of each file rank R wrote, found by name (run_spec/checksums.py)
    latest                   "iter_0000010": written last, atomically (tmp + rename)

Every rank writes into ``.iter_0000010.saving-<token>`` (a name no node looked up before: a shared
file system caches names), which rank 0 renames into place once it is complete. A crash during a
save leaves ``latest`` naming the previous complete checkpoint. The newest
``keep_checkpoints`` are kept. No rank writes or reads the whole state for the others: on CPU
the full AdamW state per parameter (stage 0, each replicated tensor written by one rank:
torch.distributed.checkpoint's de-duplication), FSDP2 DTensor shards (stages 2-3), or each
rank's ZeroRedundancyOptimizer partition (stage 1: only the same data-parallel size can load
it); on CUDA Megatron-LM's own formats (megatron_ext/training/cuda_checkpoint.py: torch_dist with
fully parallel save and load, fsdp_dtensor), which reshard over data-parallel ranks.
:func:`megatron_ext.run_spec.checkpoints.check_resumable` refuses what cannot be resumed exactly,
saying why (the launcher before anything starts, and every rank). At another data-parallel size
every rank takes rank 0's RNG states (they are the same on every rank: one seed; Megatron-LM
saves data-parallel rank 0's alone).

Resume: rank 0 alone reads ``latest`` and lists the folder (:func:`choose_resume`); every rank
takes its choice over the network (training/agreement.py), so a node whose shared file system shows
an older ``latest`` loads the same checkpoint as the others.

Faults (docs/faults.md): a resume verifies the checkpoint against its checksums first, every rank
a share of the writers' files; a damaged one (which file, why) is moved aside as ``iter_N.damaged`` and the
newest that verifies is loaded instead; none is a UserError. A save that meets a full disk
(ENOSPC, EDQUOT) on any rank removes its partial folder, leaves ``latest`` where it was and ends the
run with the free space and the size a checkpoint needs (a restart would meet the same wall).
Side effects: the checkpoint files; collectives (all ranks call save and load).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from megatron_ext.run_spec.checkpoints import LATEST, CheckpointMeta, iteration_dir_name, read_meta
from megatron_ext.run_spec.checksums import (CHECKSUMS_DIR, DAMAGED_SUFFIX, files_written_by, list_checkpoints,
                                             moved_aside_note, none_verifies_fix, record_files, verify_writers)
from megatron_ext.run_spec.errors import FINAL, UserError
from megatron_ext.host.json_files import read_json, write_text_atomic
from megatron_ext.run_spec.shared_fs import SHARED_FS_LAG_S, NotVisibleHere, wait_for_files, wait_until_gone
from megatron_ext.training.background_save import DiskFull, Writing, every_rank_done, in_background


def rng_state() -> dict:
    from megatron.core.tensor_parallel import random as mp_random

    state = {"cpu": torch.get_rng_state(), "tracker": mp_random.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import random as mp_random

    torch.set_rng_state(state["cpu"])
    mp_random.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _complete(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """(iteration, folder) of every checkpoint whose save finished (meta.json written), oldest first."""
    return [(it, p) for it, p in list_checkpoints(checkpoints_dir) if (p / "meta.json").is_file()]


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _end_full_disk(checkpoints_dir: Path, target: Path) -> UserError:
    """Every rank, together, once a save met a full disk on any rank: rank 0 removes the partial
    folder (``latest`` stays on the previous checkpoint); the one error, with the numbers."""
    written = _folder_bytes(target)
    dist.barrier()  # every rank has measured the folder before rank 0 removes it
    if dist.get_rank() == 0:
        shutil.rmtree(target, ignore_errors=True)
    dist.barrier()
    previous = [p for _, p in _complete(checkpoints_dir)]
    need = _folder_bytes(previous[-1]) if previous else 0
    free = shutil.disk_usage(checkpoints_dir).free
    needs = (f"a checkpoint needs {need / 1e9:.2f} GB" if need else
             f"a checkpoint needs more than the {written / 1e9:.2f} GB written before the disk filled")
    kept = f"latest stays at {previous[-1].name}" if previous else "no checkpoint was kept"
    return UserError(f"disk full: {checkpoints_dir.resolve()}, {free / 1e9:.2f} GB free, {needs} ({FINAL}, so the "
                     f"run ends); the partial {target.name} was removed, {kept}; free space, keep fewer checkpoints "
                     f"(training.keep_checkpoints) or put them elsewhere (CHECKPOINT_ROOT)")


@dataclass(kw_only=True)
class PendingSave:
    """One save under way: every rank's part of the state written (in the background or not), then
    each rank's own file and checksums, then rank 0 renames the folder into place and moves
    ``latest``. :meth:`finished` is a collective every rank calls at the same steps."""

    checkpoints_dir: Path
    target: Path
    final: Path
    meta: CheckpointMeta
    keep: int
    token: str
    background: bool
    state: Writing
    own_file: dict
    """This rank's RNG states and rank-local optimizer state, copied when the save began."""
    started: float
    waited_s: float
    """What training waited for: the copy to host memory (the whole save when synchronous)."""
    checksums: Future | None = None
    checksum_s: float = 0.0

    def finished(self, blocking: bool) -> bool:
        """Every rank: move the save on as far as it goes without waiting (``blocking``: to its end).
        True once rank 0 has committed it. A full disk on any rank ends the run with one UserError."""
        started = time.monotonic()
        try:
            if self.checksums is None:
                if not self.state.finished(blocking):
                    return False
                self.checksums = in_background(self._own_file_and_checksums, self.background)
            if not every_rank_done(self.checksums, blocking):
                return False
        except DiskFull:
            raise _end_full_disk(self.checkpoints_dir, self.target) from None
        finally:
            if blocking:
                self.waited_s += time.monotonic() - started
        if dist.get_rank() == 0:
            _commit(self.checkpoints_dir, self.target, self.final, self.meta.iteration, self.token, self.keep)
        return True

    def _own_file_and_checksums(self) -> None:
        rank = dist.get_rank()
        torch.save(self.own_file, self.target / f"rank{rank}.pt")
        if rank == 0:
            (self.target / "meta.json").write_text(self.meta.to_json())
        # What this rank wrote, found by name and read back on its own node while in its page
        # cache: no listing of a folder the other nodes write into (a shared file system shows
        # their names late), no other node's files over the network.
        started = time.monotonic()
        record_files(self.target, files_written_by(self.target, rank), rank)
        self.checksum_s = time.monotonic() - started


def _commit(checkpoints_dir: Path, target: Path, final: Path, iteration: int, token: str, keep: int) -> None:
    """Rank 0, once every rank's part and checksums are on disk: the folder into place, then
    ``latest``, then older checkpoints out of the way (renamed now, removed in the background, as
    Megatron-LM removes them in a thread of their own)."""
    if final.exists():  # an incomplete earlier attempt at this iteration: aside, then gone
        aside = checkpoints_dir / f".{final.name}.replaced-{token}"
        os.replace(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(target, final)
    _point_latest(checkpoints_dir, iteration)
    _prune(checkpoints_dir, keep, token)


def _point_latest(checkpoints_dir: Path, iteration: int) -> None:
    """The ``latest`` marker names ``iteration``: written to a temporary file, then renamed (atomic)."""
    write_text_atomic(checkpoints_dir / LATEST, iteration_dir_name(iteration))


def begin_save(trainer, checkpoints_dir: Path, meta: CheckpointMeta, keep: int, background: bool) -> PendingSave:
    """Every rank: start a save of iteration ``meta.iteration``. Training waits only for the state's
    copy to host memory when ``background`` (torch.distributed.checkpoint's stager, megatron-core's
    preload to its checkpoint worker); the rest is :meth:`PendingSave.finished`'s."""
    final = checkpoints_dir / iteration_dir_name(meta.iteration)
    rank = dist.get_rank()
    # Every rank writes into a folder of a name no node has looked up before, renamed into place by
    # rank 0 once complete: a shared file system caches names (sshfs 20 s, NFS up to 60 s), so a
    # folder removed and made again under the same name (an earlier attempt's incomplete save at
    # this iteration) can stay missing on another node for that long.
    started = time.monotonic()
    token = [os.urandom(4).hex() if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    target = checkpoints_dir / f".{final.name}.saving-{token[0]}"
    if rank == 0:
        target.mkdir(parents=True)
    dist.barrier()
    with trainer.synced_parameters():
        state = trainer.begin_save_state(target, background)
    own_file = copy.deepcopy({"rng": rng_state(), "optimizer": trainer.rank_local_state()})  # not the live objects
    return PendingSave(checkpoints_dir=checkpoints_dir, target=target, final=final, meta=meta, keep=keep,
                       token=token[0], background=background, state=state, own_file=own_file, started=started,
                       waited_s=time.monotonic() - started)


def save(trainer, checkpoints_dir: Path, meta: CheckpointMeta, keep: int, background: bool = False) -> PendingSave:
    """Every rank: a whole save, returned once rank 0 has committed it (``background``: the state
    still written by the background writers, and waited for)."""
    pending = begin_save(trainer, checkpoints_dir, meta, keep, background)
    pending.finished(blocking=True)
    dist.barrier()
    return pending


def _prune(checkpoints_dir: Path, keep: int, token: str) -> None:
    """The newest ``keep`` complete checkpoints stay; older ones are renamed aside at once (O(1): a
    later listing no longer sees them) and removed in a thread, with what a save that crashed left
    in its own folder (``.iter_N.saving-*``: no other save runs beside this one) and what an earlier
    removal left (``.iter_N.pruning-*``)."""
    saved = [p for _, p in _complete(checkpoints_dir)]
    for old in saved[:-keep]:
        os.replace(old, checkpoints_dir / f".{old.name}.pruning-{token}")
    leftovers = [*checkpoints_dir.glob(".iter_*.saving-*"), *checkpoints_dir.glob(".iter_*.replaced-*"),
                 *checkpoints_dir.glob(".iter_*.pruning-*")]
    removal = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in leftovers],
                               name="checkpoint-prune", daemon=True)
    removal.start()
    _REMOVALS.append(removal)


_REMOVALS: list[threading.Thread] = []


def wait_for_removals() -> None:
    """At the end of a run: older checkpoints' removal done (a process ended during it leaves a
    ``.iter_N.pruning-*`` folder, which the next save's prune removes)."""
    while _REMOVALS:
        _REMOVALS.pop().join()


@dataclass(frozen=True)
class ResumeCandidate:
    """A complete checkpoint rank 0 saw, as every rank needs it to check its share."""

    iteration: int
    saved_world_size: int
    """The ranks that wrote it: one checksum record each."""
    recorded: bool
    """It has checksum records (a checkpoint written before they existed has none: loaded as it is)."""


@dataclass(frozen=True)
class ResumeChoice:
    """Rank 0's answer to "where does this start resume": the complete checkpoints at or before the
    one ``latest`` names, newest first (empty: a fresh start), and what rank 0 has to say of them."""

    candidates: tuple[ResumeCandidate, ...] = ()
    notes: tuple[str, ...] = ()


def choose_resume(checkpoints_dir: Path, visible_s: float = SHARED_FS_LAG_S) -> ResumeChoice:
    """Rank 0 alone: read ``latest`` and list the complete checkpoints (every other rank takes this
    choice over the network: megatron_ext/training/agreement.py). The folder ``latest`` names is
    waited for up to ``visible_s`` (the marker is written after the folder, but a shared file system
    can show the two apart); if it never shows, the older complete ones are the candidates, and
    with none a UserError."""
    marker = checkpoints_dir / LATEST
    name = marker.read_text().strip() if marker.is_file() else ""
    if not (name.startswith("iter_") and name.removeprefix("iter_").isdigit()):
        return ResumeChoice()
    latest, notes = int(name.removeprefix("iter_")), []
    try:
        wait_for_files([checkpoints_dir / name / "meta.json"], visible_s, f"the checkpoint {checkpoints_dir / LATEST} names")
    except NotVisibleHere as exc:
        notes.append(f"{exc}; resuming from an older checkpoint instead")
    complete = {it: p for it, p in _complete(checkpoints_dir) if it <= latest}
    if not notes:
        complete[latest] = checkpoints_dir / name  # whatever the listing shows yet
    if not complete:
        raise UserError(f"{notes[0].removesuffix('; resuming from an older checkpoint instead')}, and no older complete "
                        f"checkpoint is there to resume from; for a fresh start, use another RUN name or remove "
                        f"{checkpoints_dir}")
    candidates = tuple(ResumeCandidate(it, int((read_json(p / "meta.json") or {}).get("world_size", 1)),
                                       (p / CHECKSUMS_DIR).is_dir())
                       for it, p in sorted(complete.items(), reverse=True))
    return ResumeChoice(candidates, tuple(notes))


def newest_verified(checkpoints_dir: Path, choice: ResumeChoice, visible_s: float = SHARED_FS_LAG_S) -> tuple[int, list[str]]:
    """The newest of rank 0's ``choice`` whose files verify, and a note per damaged one passed over
    (a collective: every rank calls it with the same choice and checks its share of the writers'
    files, :func:`verify_writers`, after waiting up to ``visible_s`` for the folder to show on its
    machine). A checkpoint without checksums (written before they existed) is taken as it is. None
    that verifies is a UserError. Rank 0 moves each damaged one aside (``iter_N.damaged``, kept for
    a look) and points ``latest`` at the one chosen; every rank then waits, up to ``visible_s``,
    until its machine no longer shows the old names (a later save writes them again)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    damaged: list[tuple[int, Path, list[str]]] = []
    for candidate in choice.candidates:
        iteration = candidate.iteration
        path = checkpoints_dir / iteration_dir_name(iteration)
        wait_for_files([path / "meta.json"], visible_s, f"the checkpoint of iteration {iteration}, which rank 0 chose to resume")
        mine = verify_writers(path, rank, world, candidate.saved_world_size) if candidate.recorded else []
        everyone: list = [None] * world
        dist.all_gather_object(everyone, [d.describe() for d in mine])
        found = [what for part in everyone for what in part]
        if found:
            damaged.append((iteration, path, found))
            continue
        notes = [moved_aside_note(it, p, found) for it, p, found in damaged]
        if damaged and rank == 0:
            for _, p, _ in damaged:
                os.replace(p, p.with_name(p.name + DAMAGED_SUFFIX))
            _point_latest(checkpoints_dir, iteration)
        dist.barrier()
        if damaged:  # a save of a passed-over iteration writes its folder's name again: each machine's view
            waited, showing = wait_until_gone([p for _, p, _ in damaged], visible_s)  # without the old entries
            if showing:
                print(f"warning: rank {rank}'s machine still shows {', '.join(p.name for p in showing)} {waited:.0f} s "
                      "after rank 0 moved it aside (its client caches names): a save under that name may fail there",
                      flush=True)
        return iteration, notes
    what = "; ".join(f"iteration {it}: {'; '.join(found[:2])}" for it, _, found in damaged)
    raise UserError(f"no checkpoint of this run verifies ({FINAL}): {what}; {none_verifies_fix(checkpoints_dir)}")


def load(trainer, checkpoints_dir: Path, iteration: int) -> CheckpointMeta:
    """Load the checkpoint of ``iteration`` into ``trainer`` (all ranks), at the data-parallel size
    it was saved at or another one that check_resumable allowed."""
    source = checkpoints_dir / iteration_dir_name(iteration)
    meta = read_meta(checkpoints_dir, iteration)
    trainer.load_state(source)
    same_size = meta.world_size == dist.get_world_size()
    local = torch.load(source / f"rank{dist.get_rank() if same_size else 0}.pt", weights_only=False)
    if same_size and local["optimizer"] is not None:  # else check_resumable allowed none
        trainer.load_rank_local_state(local["optimizer"])
    set_rng_state(local["rng"])
    return meta


def is_torch_dist(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is megatron-core's torch_dist format (CUDA stages 0-1): its
    ``metadata.json`` names the backend."""
    marker = checkpoint / "metadata.json"
    return marker.is_file() and json.loads(marker.read_text()).get("sharded_backend") == "torch_dist"


def stored_tensors(checkpoint: Path) -> dict:
    """The tensors a torch.distributed.checkpoint folder holds: key -> its metadata (``size``, ``properties.dtype``)."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: meta for key, meta in stored.items() if hasattr(meta, "size")}


def load_stored_tensors(checkpoint: Path, stored: dict, where: dict[str, tuple[str | None, ...]],
                        names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The whole tensors (by checkpoint key) that ``where`` (model name -> its keys in ``stored``) gives
    ``names``, read in one process without megatron-core (``no_dist``); a name without them (or with a
    key None) is a ValueError naming it. The skeleton of both readers of a checkpoint's model weights."""
    import torch.distributed.checkpoint as dcp

    missing = sorted(name for name in names if None in where.get(name, (None,)))
    if missing:
        raise ValueError(f"{checkpoint} holds no {missing[0]} ({len(missing)} model tensors missing)")
    keys = dict.fromkeys(key for name in names for key in where[name])  # a layer-stacked key once
    state = {key: torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype) for key in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist's note that it loads in one process
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state


def read_torch_dist_model_weights(checkpoint: Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint in one process, by the names of ``template``
    (a local-spec model's state dict). megatron-core stores the model's ``sharded_state_dict``:
    every layer's tensor stacked on a leading layer axis under one key
    (``decoder.layers.mlp.linear_fc1.weight`` is (L, F, h)), the norms under transformer-engine's
    names whatever the spec; the files are torch.distributed.checkpoint's (:func:`load_stored_tensors`)."""
    from megatron_ext.training.hf_weights import local_name

    stored = stored_tensors(checkpoint)
    where: dict[str, tuple[str, int | None]] = {}
    for key, meta in stored.items():
        if key.startswith("optimizer."):
            continue
        if key.startswith("decoder.layers."):
            rest = local_name(f"decoder.layers.0.{key.removeprefix('decoder.layers.')}").removeprefix("decoder.layers.0.")
            for layer in range(meta.size[0]):
                where[f"decoder.layers.{layer}.{rest}"] = (key, layer)
        else:
            where[local_name(key)] = (key, None)
    state = load_stored_tensors(checkpoint, stored, {name: (key,) for name, (key, _) in where.items()}, template)
    out = {}
    for name in template:
        key, layer = where[name]
        out[name] = state[key] if layer is None else state[key][layer].clone()
    return out
