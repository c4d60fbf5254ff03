"""Checkpoints that resume exactly: model, optimizer, schedule position, data position, RNG.

Layout (``$ARTIFACT_ROOT/runs/<run>/checkpoints``)::

    iter_0000010/            torch.distributed.checkpoint: every rank writes its own shards
      .metadata, __0_0.distcp, ...
      rank<R>.pt             each rank's RNG states (CPU, CUDA, megatron's model-parallel tracker) and
                             its rank-local optimizer state (stage 1: ZeroRedundancyOptimizer's partition
                             on CPU, the distributed optimizer's dp_reshardable shard on CUDA)
      replicated.pt          optimizer state every rank holds alike, once (stage 0 on CUDA, rank 0)
      meta.json              iteration, consumed samples, world size, stage, global batch (rank 0, last)
    latest                   "iter_0000010": written last, atomically (tmp + rename)

A crash during a save leaves ``latest`` naming the previous complete checkpoint. The newest
``keep_checkpoints`` are kept. Optimizer state: full AdamW state per parameter (stage 0,
replicated), FSDP2 DTensor shards (stages 2-3: torch.distributed.checkpoint reshards them for
another data-parallel size), or each rank's ZeroRedundancyOptimizer partition (stage 1: only the
same data-parallel size can load it). On CUDA (megatron_ext/training/cuda_trainer.py): stage 0's
optimizer state once, stage 1's shard per rank, stages 2-3 in Megatron-LM's fsdp_dtensor layout
inside the DCP checkpoint (same world size only, for now). :func:`megatron_ext.run_spec.checkpoints.check_resumable` refuses what cannot
be resumed exactly, saying why (the launcher before anything starts, and every rank).
Side effects: the checkpoint files; collectives (all ranks call save and load).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ext.run_spec.checkpoints import LATEST, CheckpointMeta, iteration_dir_name, read_meta

REPLICATED = "replicated.pt"


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


def save(trainer, checkpoints_dir: Path, meta: CheckpointMeta, keep: int) -> Path:
    """Every rank writes its shards; then rank 0 writes meta.json and, last, the ``latest`` marker."""
    import torch.distributed.checkpoint as dcp

    target = checkpoints_dir / iteration_dir_name(meta.iteration)
    rank = dist.get_rank()
    if rank == 0 and target.exists():  # an incomplete earlier attempt at this iteration
        shutil.rmtree(target)
    dist.barrier()
    with trainer.synced_parameters():
        dcp.save(trainer.checkpoint_state(), checkpoint_id=str(target))
    torch.save({"rng": rng_state(), "optimizer": trainer.rank_local_state()}, target / f"rank{rank}.pt")
    replicated = trainer.replicated_state() if rank == 0 else None
    if replicated is not None:
        torch.save(replicated, target / REPLICATED)
    dist.barrier()  # every shard is on disk before the checkpoint is declared complete
    if rank == 0:
        (target / "meta.json").write_text(meta.to_json())
        tmp = checkpoints_dir / f".{LATEST}.tmp"
        tmp.write_text(iteration_dir_name(meta.iteration))
        os.replace(tmp, checkpoints_dir / LATEST)
        _prune(checkpoints_dir, keep)
    dist.barrier()
    return target


def _prune(checkpoints_dir: Path, keep: int) -> None:
    saved = sorted(p for p in checkpoints_dir.glob("iter_*") if (p / "meta.json").is_file())
    for old in saved[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(trainer, checkpoints_dir: Path, iteration: int) -> CheckpointMeta:
    """Load the checkpoint of ``iteration`` into ``trainer`` (all ranks)."""
    import torch.distributed.checkpoint as dcp

    source = checkpoints_dir / iteration_dir_name(iteration)
    meta = read_meta(checkpoints_dir, iteration)
    state = trainer.checkpoint_state(loading=True)
    dcp.load(state, checkpoint_id=str(source))
    trainer.load_checkpoint_state(state)  # the model first, then the optimizer (Megatron-LM's order)
    if (source / REPLICATED).is_file():
        trainer.load_replicated_state(torch.load(source / REPLICATED, weights_only=False))
    if meta.world_size == dist.get_world_size():  # else check_resumable allowed only DCP-held state
        local = torch.load(source / f"rank{dist.get_rank()}.pt", weights_only=False)
        if local["optimizer"] is not None:
            trainer.load_rank_local_state(local["optimizer"])
        set_rng_state(local["rng"])
    return meta
