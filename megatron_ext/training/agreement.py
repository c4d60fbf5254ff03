"""What rank 0 decides for every rank and tells them over the network, never through files.

    torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke

- The data cache (:func:`agree_on_data`): global rank 0 prepares it (megatron_ext/data/prepare.py,
  no lock) and puts its manifest, the one cache folder and files it decided, under a key of
  torchrun's store (the default process group's); the other ranks wait for that key, however long
  the preparation takes, then for the named files to show through the shared file system
  (bounded: megatron_ext/run_spec/shared_fs.py). They compute no cache key of their own.
- The resume point (:func:`agree_on_resume`): rank 0 reads ``latest`` and lists the complete
  checkpoints (megatron_ext/training/checkpoint.py ``choose_resume``) and broadcasts its choice;
  every rank then checks its share of that checkpoint and loads it, so a node whose view of the
  folder is stale resumes the same iteration as the others (or waits for it, bounded).

Side effects: rank 0 prepares data and reads the checkpoints folder; a store key, a broadcast.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from megatron_ext.data.prepare import PreparedData
from megatron_ext.run_spec.shared_fs import SHARED_FS_LAG_S, wait_for_files
from megatron_ext.run_spec.convert import structure
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import DataParams

DATA_KEY = "prepared_data"
"""The store key under which rank 0 announces the prepared data (or why it could not prepare it)."""
WAIT_S = 600.0
"""One wait on the store before a rank says it still waits and waits again: preparing a corpus can
take hours, longer than any collective's timeout, so no rank waits for it inside a collective."""


def agree_on_data(data: DataParams, cache_root: Path, rank: int, workers: int = 2,
                  say: Callable[[str], object] | None = None, store=None,
                  visible_s: float = SHARED_FS_LAG_S, wait_s: float = WAIT_S) -> PreparedData:
    """The prepared data, the same on every rank: rank 0 prepares it (:func:`ensure_prepared`) and
    announces its manifest in ``store`` (default: the process group's); every other rank waits for
    the announcement (``say`` tells that it waits, and again every ``wait_s``) and then up to
    ``visible_s`` for the manifest's files to show on its machine. A preparation that fails on rank
    0 is announced too: the others end with the same UserError instead of waiting."""
    from megatron_ext.data.prepare import ensure_prepared, prepared_files

    store = store if store is not None else dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            prepared = ensure_prepared(data, cache_root, workers)
        except UserError as exc:
            store.set(DATA_KEY, json.dumps({"error": str(exc)}))
            raise
        except BaseException as exc:
            store.set(DATA_KEY, json.dumps({"failed": f"{type(exc).__name__}: {exc}"}))
            raise
        store.set(DATA_KEY, json.dumps({"prepared": prepared.__dict__}))
        return prepared
    started = time.monotonic()
    if say is not None and not store.check([DATA_KEY]):
        say(f"waiting for rank 0 to prepare the data cache under {cache_root}")
    while True:
        try:
            store.wait([DATA_KEY], datetime.timedelta(seconds=wait_s))
            break
        except dist.DistStoreError as exc:  # the wait's timeout; a store that is gone raises otherwise
            if "timeout" not in str(exc).lower():
                raise
        if say is not None:
            say(f"still waiting for rank 0 to prepare the data cache under {cache_root} "
                f"({time.monotonic() - started:,.0f} s)")
    announced = json.loads(store.get(DATA_KEY))
    if "error" in announced:
        raise UserError(announced["error"])  # rank 0 says it
    if "failed" in announced:
        raise RuntimeError(f"rank 0 failed to prepare the data cache under {cache_root}: {announced['failed']}")
    prepared = structure(PreparedData, announced["prepared"])
    wait_for_files(prepared_files(prepared), visible_s, "the data cache rank 0 prepared")
    return prepared


def agree_on_resume(checkpoints_dir: Path, visible_s: float = SHARED_FS_LAG_S):
    """Rank 0's :class:`~megatron_ext.training.checkpoint.ResumeChoice`, on every rank (a
    collective). A UserError on rank 0 (``latest`` names a folder that never shows, and nothing
    older is there) reaches every rank the same way."""
    from megatron_ext.training.checkpoint import choose_resume

    answer: list = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = choose_resume(checkpoints_dir, visible_s)
        except UserError as exc:
            answer[0] = exc
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], UserError):
        raise answer[0]
    return answer[0]
