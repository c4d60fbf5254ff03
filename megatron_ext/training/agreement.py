"""What rank 0 decides for every rank and tells them over the network, never through files.

    torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke

- The resume point (:func:`agree_on_resume`): rank 0 reads ``latest`` and lists the complete
  checkpoints (megatron_ext/training/checkpoint.py ``choose_resume``) and broadcasts its choice;
  every rank then checks its share of that checkpoint and loads it, so a node whose view of the
  folder is stale resumes the same iteration as the others (or waits for it, bounded).

Side effects: rank 0 reads the checkpoints folder; a broadcast.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.shared_fs import SHARED_FS_LAG_S


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
