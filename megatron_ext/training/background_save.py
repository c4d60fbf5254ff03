"""A checkpoint written while training goes on: each rank's part in a thread of its own (or in
megatron-core's checkpoint worker), and the small collective that tells every rank, at the same
step, that every part is on disk (megatron-core's AsyncCallsQueue asks the same with one all-reduce).

torch.distributed.checkpoint's ``async_save`` copies the state to host memory (its stager) and then
writes it from a thread, whose collectives (planning, the coordinator's metadata) run on a gloo
group of their own (:func:`checkpoint_group`): torch's documentation asks for a separate group, and
gloo needs one on CPU as well, where training's collectives run on the default gloo group.
Side effects: the writer thread, the gloo group; collectives (every rank calls
:func:`every_rank_done` at the same steps).
"""

from __future__ import annotations

import errno
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megatron_ext.host.devices import Device


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


class DiskFull(Exception):
    """A save met a full disk on some rank (every rank raises it together)."""


class WriteFailedElsewhere(RuntimeError):
    """Another rank's part of a save failed (that rank raised its own error; its log says which)."""


def in_background(work: Callable[[], None], background: bool) -> Future:
    """``work`` in this process's checkpoint thread, or here and now (a future already done, with
    its result or its exception) when the save is synchronous."""
    if background:
        return _writer_thread().submit(work)
    done: Future = Future()
    try:
        work()
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        done.set_exception(exc)
    else:
        done.set_result(None)
    return done


_WRITER: list[ThreadPoolExecutor] = []


def _writer_thread() -> ThreadPoolExecutor:
    if not _WRITER:
        _WRITER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer"))
    return _WRITER[0]


def every_rank_done(work: Future, blocking: bool) -> bool:
    """Whether every rank's ``work`` has finished (a collective: every rank calls it, one small
    all-reduce, as megatron-core's AsyncCallsQueue checks its writers). A failure on any rank ends
    the save on every rank: :class:`DiskFull` where a disk filled, else the failing rank's own
    exception there and :class:`WriteFailedElsewhere` on the others."""
    if blocking:
        wait([work])
    done = work.done()  # read once: a failure between two reads would report "done, no error"
    error = work.exception() if done else None
    code = 0 if error is None else 1 if disk_full(error) else 2
    t = _tensor([int(not done), code])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    running, worst = (int(v) for v in t.tolist())
    if running:
        return False
    if worst == 2:
        if error is not None and not disk_full(error):
            raise error
        raise WriteFailedElsewhere("another rank's part of the checkpoint failed (its own log says why)")
    if worst == 1:
        raise DiskFull(str(error) if error is not None else "on another rank")
    return True


def _tensor(values: list[int]) -> torch.Tensor:
    on_cuda = dist.get_backend() == "nccl"
    return torch.tensor(values, device=Device.of(on_cuda).value)  # cuda: the current device


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (a collective)."""
    t = _tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def first_rank_says(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a collective)."""
    t = _tensor([int(flag)])
    dist.broadcast(t, 0)
    return bool(t.item())


class Writing(Protocol):
    """A rank's part of a save under way (what a trainer's ``begin_save_state`` returns)."""

    def finished(self, blocking: bool) -> bool:
        """Whether every rank's part is on disk and its writer's own finalization done (a
        collective; raises on every rank when any rank's part failed)."""


@dataclass(frozen=True)
class FutureWriting:
    """A part written by :func:`in_background` (torch.distributed.checkpoint's own writes)."""

    work: Future

    def finished(self, blocking: bool) -> bool:
        return every_rank_done(self.work, blocking)


_GROUP: list = []


def checkpoint_group():
    """The gloo group background writes' collectives run on, made at the first background save
    (a collective: every rank reaches its first save at the same step)."""
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def close() -> None:
    """At the end of a run: the writer thread ends once what it was given is done."""
    while _WRITER:
        _WRITER.pop().shutdown(wait=True)
