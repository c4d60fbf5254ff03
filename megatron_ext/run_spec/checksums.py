"""What a checkpoint should contain, recorded as it is written, and whether it still does.

    bash training_scripts/check_checkpoints.sh demo          # every checkpoint of the run: verified or damaged

Each rank, right after a save, records every file it wrote (size and CRC-32, read back on the node
that wrote them, while the bytes are still in its page cache) in ``checksums/rank<R>.json`` inside
the checkpoint folder: the files it finds by the names its writers give them
(:func:`files_written_by`, :func:`writer_rank`), never by listing a folder the other nodes write
into (a shared file system shows another node's names late); the ``latest`` marker is written
after every rank did (torch.distributed.checkpoint carries no checksum of its own). At a resume
each rank reads the records of its share of the writers by name and checks their files
(:func:`verify_writers`). A checkpoint verifies when every recorded file is there with its size and
CRC-32; a missing file, another size (a truncated copy, a quota hit) or other bytes make it
damaged, naming the file. A checkpoint without records (written before this existed, or by a
Megatron-LM release without ``--verify-integrity``) is "unrecorded": loaded as before, never
called verified. Megatron-LM's own record counts too: a checkpoint saved with ``--verify-integrity``
(core_v0.17.1 and later, torch_dist) holds ``integrity.json``, the SHA-256 of each file
(megatron-core's dist_checkpointing/validation.py ``save_integrity_manifest``, read at
core_v0.19.0), checked here the same way (no sizes recorded: a size check sees only a missing
file). Reads and writes the checkpoint's files only.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from megatron_ext.host.json_files import write_text_atomic

CHECKSUMS_DIR = "checksums"
DAMAGED_SUFFIX = ".damaged"
"""A checkpoint a resume found damaged is kept beside the others as ``iter_N`` + this."""
CHUNK_BYTES = 8 * 2**20
INTEGRITY_FILE = "integrity.json"
"""Megatron-core's manifest in a torch_dist folder: ``{"algorithm": "sha256", "files": {name: hex digest}}``."""
HealthState = StrEnum("HealthState", {"VERIFIED": "verified", "DAMAGED": "damaged", "UNRECORDED": "unrecorded"})


Progress = Callable[[int], None]
"""Told the bytes of each chunk as a check reads it (a long pass over a large checkpoint says how far it is)."""


def _chunks(path: Path, progress: Progress | None = None) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            if progress is not None:
                progress(len(chunk))
            yield chunk


def crc32_of(path: Path, progress: Progress | None = None) -> tuple[int, str]:
    """(bytes, CRC-32 as 8 hex digits) of ``path``, read in chunks."""
    crc, size = 0, 0
    for chunk in _chunks(path, progress):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return size, f"{crc:08x}"


def sha256_of(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(path, progress):
        digest.update(chunk)
    return digest.hexdigest()


_WRITTEN_BY = re.compile(r"__(\d+)_\d+\.distcp|rank(\d+)\.pt")


def writer_rank(name: str) -> int:
    """The rank that wrote ``name`` (a path inside a checkpoint): torch.distributed.checkpoint's
    data files ``__R_I.distcp`` (megatron-core's torch_dist too: R is the writer's rank), this
    project's ``rankR.pt``; rank 0 wrote everything else (``.metadata``, ``metadata.json``,
    ``common.pt``, ``meta.json``). Pure."""
    match = _WRITTEN_BY.fullmatch(Path(name).name)
    return int(match.group(1) or match.group(2)) if match else 0


RANK_0_FILES = (".metadata", "metadata.json", "common.pt", "meta.json")
"""What rank 0 alone writes into a checkpoint: torch.distributed.checkpoint's ``.metadata`` (its
coordinator), megatron-core's ``metadata.json`` and ``common.pt`` (torch_dist format), this
project's ``meta.json``."""


def files_written_by(checkpoint: Path, rank: int) -> list[Path]:
    """The files ``rank`` wrote into ``checkpoint``, found by their names on this rank's own machine
    (which shows its own writes at once), not by listing the folder: ``rank<R>.pt``; the data files
    ``__<R>_0.distcp``, ``__<R>_1.distcp``, ... that torch.distributed.checkpoint's
    FileSystemWriter (a file per writer thread) and megatron-core's FileSystemWriterAsync (a file
    per non-empty bucket) number from 0 without a gap; on rank 0, :data:`RANK_0_FILES` present."""
    names = [f"rank{rank}.pt", *(RANK_0_FILES if rank == 0 else ())]
    count = 0
    while (checkpoint / f"__{rank}_{count}.distcp").is_file():
        names.append(f"__{rank}_{count}.distcp")
        count += 1
    return [checkpoint / name for name in names if (checkpoint / name).is_file()]


def written_by(names: Iterable[str], rank: int, world: int) -> list[str]:
    """The ``names`` that ``rank`` of ``world`` wrote (or, at another world size, its share of the
    writers: rank ``writer_rank % world``), so that a rank reads back, at a save and at a resume,
    the files its own node wrote rather than other nodes' over the shared file system. Pure."""
    return [name for name in names if writer_rank(name) % world == rank]


def record_path(checkpoint: Path, writer: int | str) -> Path:
    """Where the checksums of what ``writer`` (a rank, or a name) wrote are recorded."""
    return checkpoint / CHECKSUMS_DIR / (f"rank{writer}.json" if isinstance(writer, int) else f"{writer}.json")


def record_files(checkpoint: Path, files: Iterable[Path], writer: int | str) -> Path:
    """Record ``files`` (inside ``checkpoint``) as ``writer`` wrote them: ``checksums/rank<R>.json``."""
    entries = {}
    for path in sorted(files):
        size, crc = crc32_of(path)
        entries[str(path.relative_to(checkpoint))] = {"bytes": size, "crc32": crc}
    out = record_path(checkpoint, writer)
    write_text_atomic(out, json.dumps({"algorithm": "crc32", "files": entries}, indent=0, sort_keys=True))
    return out


def write_integrity_manifest(checkpoint: Path) -> Path:
    """Megatron-core's ``integrity.json`` for the files at the top of ``checkpoint`` (as its
    ``save_integrity_manifest`` writes it), so that Megatron-LM's ``--verify-integrity`` loads a
    checkpoint this project wrote (the Megatron-LM export)."""
    files = {p.name: sha256_of(p) for p in sorted(checkpoint.iterdir()) if p.is_file() and p.name != INTEGRITY_FILE}
    out = checkpoint / INTEGRITY_FILE
    write_text_atomic(out, json.dumps({"algorithm": "sha256", "files": files}, indent=2))
    return out


def manifest_files(checkpoint: Path) -> dict[str, dict]:
    """The files Megatron-LM's ``integrity.json`` lists: name -> {sha256} (empty without one)."""
    path = checkpoint / INTEGRITY_FILE
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("algorithm", "sha256") != "sha256":
            raise ValueError(manifest["algorithm"])
        return {name: {"sha256": digest} for name, digest in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {INTEGRITY_FILE: {"crc32": "unreadable record"}}


def recorded_files(checkpoint: Path) -> dict[str, dict]:
    """Every file the checkpoint's writers recorded: relative path -> {bytes, crc32}, or {sha256}
    from Megatron-LM's manifest."""
    entries: dict[str, dict] = manifest_files(checkpoint)
    for record in sorted((checkpoint / CHECKSUMS_DIR).glob("*.json")):
        try:
            entries.update(json.loads(record.read_text())["files"])
        except (OSError, ValueError, KeyError, TypeError):
            entries[f"{CHECKSUMS_DIR}/{record.name}"] = {"bytes": -1, "crc32": "unreadable record"}
    return entries


@dataclass(frozen=True)
class Damage:
    """One file that is not as it was written."""

    file: str
    why: str
    """missing, truncated (N of M bytes), other bytes (CRC-32 ...), unreadable record."""

    def describe(self) -> str:
        return f"{self.file}: {self.why}"


def check_file(checkpoint: Path, name: str, entry: dict, sizes_only: bool = False,
               progress: Progress | None = None) -> Damage | None:
    path = checkpoint / name
    if entry.get("crc32") == "unreadable record":
        return Damage(name, "its checksum record does not read")
    if not path.is_file():
        return Damage(name, "missing")
    size = path.stat().st_size
    if "bytes" in entry and size != entry["bytes"]:
        return Damage(name, f"{size:,} bytes where {entry['bytes']:,} were written"
                            + (" (truncated)" if size < entry["bytes"] else ""))
    if sizes_only:
        return None
    if "sha256" in entry:
        digest = sha256_of(path, progress)
        return None if digest == entry["sha256"] else \
            Damage(name, f"other bytes (SHA-256 {digest[:16]}..., written {entry['sha256'][:16]}...)")
    crc = crc32_of(path, progress)[1]
    return None if crc == entry["crc32"] else Damage(name, f"other bytes (CRC-32 {crc}, written {entry['crc32']})")


def verify(checkpoint: Path, share: tuple[int, int] = (0, 1), sizes_only: bool = False,
           progress: Progress | None = None, entries: dict[str, dict] | None = None) -> list[Damage] | None:
    """Damage in the checkpoint's recorded files (``share`` = (k, n): the files rank k of n wrote,
    :func:`written_by`, so that n ranks verify a checkpoint together, each reading its own node's
    files once); None when nothing was recorded. ``entries``: :func:`recorded_files`, already read."""
    entries = recorded_files(checkpoint) if entries is None else entries
    if not entries:
        return None
    names = written_by(sorted(entries), *share)
    return [d for d in (check_file(checkpoint, name, entries[name], sizes_only, progress) for name in names) if d is not None]


def verify_writers(checkpoint: Path, rank: int, world: int, saved_world: int) -> list[Damage]:
    """Damage in the files that this rank's share of the checkpoint's ``saved_world`` writers wrote
    (writer ``w`` where ``w % world == rank``: its own at the same size, read once by one rank),
    each writer's record read by its name, ``checksums/rank<w>.json``, not found by listing the
    folder; a record missing or unreadable is damage too. For a checkpoint that has records."""
    damage: list[Damage] = []
    for writer in range(rank, saved_world, world):
        record = record_path(checkpoint, writer)
        try:
            entries = json.loads(record.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            damage.append(Damage(str(record.relative_to(checkpoint)), "its checksum record is missing or does not read"))
            continue
        damage += [d for name, entry in sorted(entries.items()) if (d := check_file(checkpoint, name, entry)) is not None]
    return damage


@dataclass(frozen=True)
class CheckpointHealth:
    iteration: int
    path: Path
    state: HealthState
    """Verified, damaged, or unrecorded (no checksums: written before they existed); its value is what a check prints."""
    damage: tuple[Damage, ...] = ()

    def describe(self) -> str:
        what = "; ".join(d.describe() for d in self.damage[:3]) + (" ..." if len(self.damage) > 3 else "")
        return f"iteration {self.iteration}: {self.state}" + (f" ({what})" if what else "")


def health(checkpoint: Path, iteration: int, sizes_only: bool = False, progress: Progress | None = None) -> CheckpointHealth:
    damage = verify(checkpoint, sizes_only=sizes_only, progress=progress)
    if damage is None:
        return CheckpointHealth(iteration, checkpoint, HealthState.UNRECORDED)
    return CheckpointHealth(iteration, checkpoint, HealthState.DAMAGED if damage else HealthState.VERIFIED, tuple(damage))


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Every checkpoint folder of a run (``iter_NNNNNNN``, either engine's), oldest first."""
    out = []
    for path in checkpoints_dir.glob("iter_*") if checkpoints_dir.is_dir() else ():
        digits = path.name.removeprefix("iter_")
        if path.is_dir() and digits.isdigit():
            out.append((int(digits), path))
    return sorted(out)


def checkpoint_bytes_on_disk(checkpoint: Path) -> int:
    """The bytes of the files in a checkpoint folder (its size as a check reads it)."""
    return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def share_bytes(checkpoint: Path, entries: dict[str, dict], share: tuple[int, int] = (0, 1)) -> int:
    """The bytes of the files of ``entries`` (:func:`recorded_files`) in ``share`` (k, n) of
    ``checkpoint``: what :func:`verify` reads."""
    return sum((checkpoint / name).stat().st_size for name in written_by(sorted(entries), *share)
               if (checkpoint / name).is_file())


def counting(progress: Callable[[int, int, int], None], iteration: int, total: int) -> Progress:
    """A chunk's bytes added up, handed on as (iteration, bytes read so far, ``total``)."""
    done = 0

    def told(n: int) -> None:
        nonlocal done
        done += n
        progress(iteration, done, total)
    return told


def newest_verified(checkpoints: Sequence[tuple[int, Path]],
                    progress: Callable[[int, int, int], None] | None = None,
                    check: Callable[[int, Path], CheckpointHealth] | None = None
                    ) -> tuple[CheckpointHealth | None, tuple[CheckpointHealth, ...]]:
    """The newest checkpoint that verifies (or has no records), of (iteration, folder) pairs, and
    the damaged ones newer than it (every one when none verifies). Each is judged by ``check``
    (iteration, folder), by default :func:`health` in this process, which reads every byte (node 0's
    supervisor hands in a check that the attempt's nodes share: orchestration/node/resume_point.py;
    a run's ranks share the reading too: megatron_ext/training/checkpoint.py). ``progress``: the
    default check's, told (iteration, bytes read, its folder's bytes) as it reads."""
    damaged: list[CheckpointHealth] = []
    for iteration, path in sorted(checkpoints, reverse=True):
        if check is not None:
            h = check(iteration, path)
        else:
            told = counting(progress, iteration, checkpoint_bytes_on_disk(path)) if progress is not None else None
            h = health(path, iteration, progress=told)
        if h.state != HealthState.DAMAGED:
            return h, tuple(damaged)
        damaged.append(h)
    return None, tuple(damaged)


def moved_aside_note(iteration: int, folder: Path, found: Sequence[str]) -> str:
    """What a resume says of a damaged checkpoint it passed over (either engine's)."""
    return (f"the checkpoint of iteration {iteration} is damaged ({'; '.join(found[:3])}{' ...' if len(found) > 3 else ''}"
            f"): moved aside as {folder.name}{DAMAGED_SUFFIX}")


def none_verifies_fix(checkpoints_dir: Path) -> str:
    """What to do when no checkpoint of a run verifies (either engine's)."""
    return (f"copy good checkpoints back into {checkpoints_dir}, or start a new RUN "
            "(bash training_scripts/check_checkpoints.sh RUN lists them)")
