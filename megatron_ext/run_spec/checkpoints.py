"""Which checkpoint a run would resume from: the ``latest`` markers of both engines.

    python -c "from megatron_ext.run_spec.checkpoints import latest_iteration; print(latest_iteration('artifacts/runs/demo/checkpoints'))"

This project's program writes ``<checkpoints>/iter_NNNNNNN/`` (one shard per rank plus
``meta.json``) and then, last and atomically, ``<checkpoints>/latest`` naming that directory, so a
crash during a save leaves the previous checkpoint as the latest. Megatron-LM writes
``latest_checkpointed_iteration.txt`` into ``--save``. Pure apart from reading those files. The
launcher reads them here; the training program's ranks do not: rank 0 chooses and tells the others
(megatron_ext/training/checkpoint.py ``choose_resume``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.convert import structure
from megatron_ext.run_spec.errors import UserError

LATEST = "latest"
MEGATRON_LM_LATEST = "latest_checkpointed_iteration.txt"


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """``meta.json`` of a checkpoint: what resuming needs to know before loading it."""

    iteration: int
    consumed_samples: int
    world_size: int
    zero_stage: int
    global_batch_size: int
    device: str
    """cpu or cuda: the checkpoint's layout differs."""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1)


def latest_iteration(checkpoints_dir: Path | str) -> int | None:
    """The iteration the latest complete checkpoint holds (either engine), or None."""
    checkpoints_dir = Path(checkpoints_dir)
    marker = checkpoints_dir / LATEST
    if marker.is_file():
        name = marker.read_text().strip()
        if name.startswith("iter_") and (checkpoints_dir / name / "meta.json").is_file():
            return int(name[len("iter_"):])
    megatron = checkpoints_dir / MEGATRON_LM_LATEST
    if megatron.is_file():
        text = megatron.read_text().strip()
        return int(text) if text.isdigit() else None
    return None


def read_meta(checkpoints_dir: Path, iteration: int) -> CheckpointMeta:
    return structure(CheckpointMeta, json.loads((checkpoints_dir / iteration_dir_name(iteration) / "meta.json").read_text()))


def ddp_bucket_elements(data_parallel_size: int) -> int:
    """megatron-core DDP's gradient bucket size as Megatron-LM sets it: max(4e7, 1e6 x the
    data-parallel size) elements (training.py ~L1316). The distributed optimizer's checkpoint
    layout follows these buckets."""
    return max(40_000_000, 1_000_000 * data_parallel_size)


def reshard_problem(device: str, zero_stage: int, saved_world_size: int, world_size: int) -> str | None:
    """Why a checkpoint saved by ``saved_world_size`` data-parallel ranks cannot be loaded by
    ``world_size`` ranks (the same device and stage), or None when it can. Pure: the one rule
    for a resume at another size, e.g. after a node is lost for good.

    - CPU stages 0, 2, 3: torch.distributed.checkpoint reshards (replicated tensors, FSDP2 DTensors).
    - CPU stage 1: torch's ZeroRedundancyOptimizer keeps a rank-local partition: never.
    - CUDA stage 0: megatron-core's torch_dist format; everything in it is replicated over
      data-parallel ranks: any size.
    - CUDA stage 1: the distributed optimizer's ``dp_reshardable`` layout (megatron-core >= 0.15;
      0.14's ``fully_sharded_model_space`` reshards likewise): each gradient bucket's state is one
      global tensor of the bucket's unpadded size, read in slices by any number of ranks, as long
      as the buckets are the same, i.e. :func:`ddp_bucket_elements` gives the same size at both
      data-parallel sizes (both at most 40 ranks, or any equal pair).
    - CUDA stages 2-3: Megatron-LM's ``fsdp_dtensor`` format: DTensors, resharded by
      torch.distributed.checkpoint at any size."""
    if saved_world_size == world_size:
        return None
    if device == Device.CPU and zero_stage == 1:
        return (f"holds ZeroRedundancyOptimizer partitions of {saved_world_size} ranks, which cannot be resharded to "
                f"{world_size} ranks")
    if device == Device.CUDA and zero_stage == 1:
        saved, now = ddp_bucket_elements(saved_world_size), ddp_bucket_elements(world_size)
        if saved != now:
            return (f"holds the distributed optimizer's state in gradient buckets of {saved:,} elements "
                    f"(max(4e7, 1e6 x {saved_world_size} ranks)), and {world_size} ranks use buckets of {now:,}: "
                    "its dp_reshardable layout reshards only between sizes with the same buckets (both at most 40 "
                    "ranks)")
    return None


def check_resumable(meta: CheckpointMeta, world_size: int, zero_stage: int, global_batch_size: int, device: str,
                    checkpoints_dir: Path) -> str | None:
    """A note when the checkpoint loads at another data-parallel size, None when it loads as saved;
    a UserError when it cannot be resumed exactly (saying why and what to do)."""
    fresh = f"for a fresh start, use another RUN name or remove {checkpoints_dir}"
    if meta.zero_stage != zero_stage:
        raise UserError(f"the checkpoint at iteration {meta.iteration} ({checkpoints_dir}) was saved under ZERO_STAGE={meta.zero_stage}; "
                        f"resume it with ZERO_STAGE={meta.zero_stage} (the optimizer state's layout differs per stage), or {fresh}")
    if meta.global_batch_size != global_batch_size:
        raise UserError(f"the checkpoint at iteration {meta.iteration} was trained with global batch {meta.global_batch_size}, this "
                        f"start would use {global_batch_size} (the data position and schedule would not continue exactly); resume "
                        f"with the same global batch (at another world size, give global_batch_size in the data set), or {fresh}")
    if meta.device != device:
        raise UserError(f"the checkpoint at iteration {meta.iteration} was saved on {meta.device}, this start runs on "
                        f"{device}; resume it on {meta.device}, or {fresh}")
    if meta.world_size == world_size:
        return None
    problem = reshard_problem(device, zero_stage, meta.world_size, world_size)
    if problem:
        raise UserError(f"the checkpoint at iteration {meta.iteration} {problem}; resume with {meta.world_size} ranks, "
                        f"or {fresh}")
    how = "megatron-core's torch_dist format" if device == Device.CUDA and zero_stage < 2 else "torch.distributed.checkpoint"
    return (f"resharding the checkpoint of {meta.world_size} ranks to {world_size} ({how}); "
            f"the data continues at sample {meta.consumed_samples}")
