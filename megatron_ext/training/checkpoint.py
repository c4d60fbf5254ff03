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

import errno
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.checkpoints import LATEST, CheckpointMeta, iteration_dir_name, read_meta
from megatron_ext.run_spec.checksums import (CHECKSUMS_DIR, DAMAGED_SUFFIX, files_written_by, list_checkpoints,
                                             moved_aside_note, none_verifies_fix, record_files, verify_writers)
from megatron_ext.run_spec.errors import FINAL, UserError
from megatron_ext.host.json_files import read_json, write_text_atomic
from megatron_ext.run_spec.shared_fs import SHARED_FS_LAG_S, NotVisibleHere, wait_for_files


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


def _point_latest(checkpoints_dir: Path, iteration: int) -> None:
    """The ``latest`` marker names ``iteration``: written to a temporary file, then renamed (atomic)."""
    write_text_atomic(checkpoints_dir / LATEST, iteration_dir_name(iteration))


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (a collective: every rank calls it)."""
    on_cuda = dist.get_backend() == "nccl"
    t = torch.tensor([int(flag)], device=Device.of(on_cuda).value)  # cuda: the current device
    dist.all_reduce(t)
    return bool(t.item())


def disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT, raised here or inside torch.distributed.checkpoint's CheckpointException
    (which carries every failed rank's exception as text)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    failures = getattr(exc, "failures", None)  # CheckpointException: rank -> (exception, traceback)
    if isinstance(failures, dict) and any(isinstance(f, tuple) and f and disk_full(f[0]) for f in failures.values()):
        return True
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _collective_step(what: Callable[[], None], checkpoints_dir: Path, target: Path) -> None:
    """Run this rank's part of a save; if the disk is full on any rank, every rank ends the save
    together: rank 0 removes the partial folder (``latest`` stays on the previous checkpoint) and
    every rank raises one UserError with the numbers."""
    failure = None
    try:
        what()
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if not disk_full(exc):
            raise
        failure = exc
    if not _any_rank(failure is not None):
        return
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
    raise UserError(f"disk full: {checkpoints_dir.resolve()}, {free / 1e9:.2f} GB free, {needs} ({FINAL}, so the "
                    f"run ends); the partial {target.name} was removed, {kept}; free space, keep fewer checkpoints "
                    f"(training.keep_checkpoints) or put them elsewhere (CHECKPOINT_ROOT)")


def save(trainer, checkpoints_dir: Path, meta: CheckpointMeta, keep: int) -> tuple[Path, float]:
    """Every rank writes its part and records the checksums of the files it wrote (rank 0 also
    meta.json); then rank 0 renames the folder into place and writes, last, the ``latest`` marker.
    The folder, and this rank's seconds spent on checksums."""
    final = checkpoints_dir / iteration_dir_name(meta.iteration)
    rank = dist.get_rank()
    # Every rank writes into a folder of a name no node has looked up before, renamed into place by
    # rank 0 once complete: a shared file system caches names (sshfs 20 s, NFS up to 60 s), so a
    # folder removed and made again under the same name (an earlier attempt's incomplete save at
    # this iteration) can stay missing on another node for that long.
    token = [os.urandom(4).hex() if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    target = checkpoints_dir / f".{final.name}.saving-{token[0]}"
    if rank == 0:
        target.mkdir(parents=True)
    dist.barrier()

    def write_state() -> None:
        with trainer.synced_parameters():
            trainer.save_state(target)
        torch.save({"rng": rng_state(), "optimizer": trainer.rank_local_state()}, target / f"rank{rank}.pt")

    _collective_step(write_state, checkpoints_dir, target)
    dist.barrier()  # every shard is on disk before the checkpoint is declared complete

    def write_meta_and_checksums() -> None:
        if rank == 0:
            (target / "meta.json").write_text(meta.to_json())
        # What this rank wrote, found by name and read back on its own node while in its page
        # cache: no listing of a folder the other nodes write into (a shared file system shows
        # their names late), no other node's files over the network.
        record_files(target, files_written_by(target, rank), rank)

    started = time.monotonic()
    _collective_step(write_meta_and_checksums, checkpoints_dir, target)
    checksum_s = time.monotonic() - started
    dist.barrier()
    if rank == 0:
        if final.exists():  # an incomplete earlier attempt at this iteration: aside, then gone
            aside = checkpoints_dir / f".{final.name}.replaced-{token[0]}"
            os.replace(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, final)
        _point_latest(checkpoints_dir, meta.iteration)
        _prune(checkpoints_dir, keep)
    dist.barrier()
    return final, checksum_s


def _prune(checkpoints_dir: Path, keep: int) -> None:
    """The newest ``keep`` complete checkpoints stay; older ones go, and so does what a save that
    crashed left in its own folder (``.iter_N.saving-*``: no save runs beside this one)."""
    saved = [p for _, p in _complete(checkpoints_dir)]
    for old in [*saved[:-keep], *checkpoints_dir.glob(".iter_*.saving-*"), *checkpoints_dir.glob(".iter_*.replaced-*")]:
        shutil.rmtree(old, ignore_errors=True)


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
    a look) and points ``latest`` at the one chosen."""
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


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def read_torch_dist_model_weights(checkpoint: Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint in one process, by the names of ``template``
    (a local-spec model's state dict). megatron-core stores the model's ``sharded_state_dict``:
    every layer's tensor stacked on a leading layer axis under one key
    (``decoder.layers.mlp.linear_fc1.weight`` is (L, F, h)), the norms under transformer-engine's
    names whatever the spec; the files are torch.distributed.checkpoint's, read here without
    megatron-core (``no_dist``). A name the checkpoint lacks is a ValueError naming it."""
    import torch.distributed.checkpoint as dcp

    from megatron_ext.training.hf_weights import local_name

    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    where: dict[str, tuple[str, int | None]] = {}
    for key, meta in stored.items():
        if not hasattr(meta, "size") or key.startswith("optimizer."):
            continue
        if key.startswith("decoder.layers."):
            rest = local_name(f"decoder.layers.0.{key.removeprefix('decoder.layers.')}").removeprefix("decoder.layers.0.")
            for layer in range(meta.size[0]):
                where[f"decoder.layers.{layer}.{rest}"] = (key, layer)
        else:
            where[local_name(key)] = (key, None)
    missing = sorted(set(template) - set(where))
    if missing:
        raise ValueError(f"{checkpoint} holds no {missing[0]} ({len(missing)} model tensors missing)")
    keys = sorted({where[name][0] for name in template})
    state = {key: torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype) for key in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist's note that it loads in one process
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    out = {}
    for name in template:
        key, layer = where[name]
        out[name] = state[key] if layer is None else state[key][layer].clone()
    return out
