"""Data-parallel trainers: a megatron-core GPTModel wrapped for one ZeRO stage, on CPU or CUDA.

The mapping itself lives in :mod:`megatron_ext.run_spec.zero`; this module builds it. Both trainers
have one interface (:class:`Trainer`), so the training loop never asks which device it runs on:
gradient sync only on the last micro-step, clip + optimizer step (returning the global grad
norm), and the memory columns of the metrics.

- :class:`CpuTrainer` (gloo, fp32): 0 torch DDP; 1 torch DDP + ZeroRedundancyOptimizer; 2 FSDP2
  ``fully_shard`` on every transformer layer and the root with ``reshard_after_forward=False``;
  3 the same with ``True``. Memory = model-state bytes this rank holds (parameters, gradients,
  optimizer state), counted from the tensors themselves.
- :class:`~megatron_ext.training.cuda_trainer.CudaTrainer` (NCCL, bf16): megatron-core DDP, +
  distributed optimizer, Megatron-FSDP ``optim_grads`` / ``optim_grads_params``. Memory = peak CUDA
  allocation.

Checkpoints: every rank writes and reads its part (:meth:`Trainer.save_state`,
:meth:`Trainer.load_state`): torch.distributed.checkpoint here and at stages 2-3 on CUDA,
megatron-core's torch_dist format at stages 0-1 on CUDA (training/cuda_checkpoint.py).

A non-finite gradient norm stops the run before the update is applied (:class:`NonFiniteGradients`,
naming the ranks whose loss was not finite), at every stage on both devices: Megatron-LM's default
(``--check-for-nan-in-loss-and-grad``). bf16 has no loss scaler, so a NaN is not an overflow to
skip but a divergence or a fault; with MAX_RESTARTS the run resumes from its latest checkpoint, and
the restart breaker stops one that recurs.
"""

from __future__ import annotations

import abc
import contextlib
import math
import resource
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from megatron_ext.run_spec.params import TrainingParams
from megatron_ext.run_spec.zero import ZeroStage
from megatron_ext.training.background_save import FutureWriting, Writing, checkpoint_group, in_background


class NonFiniteGradients(RuntimeError):
    """The global gradient norm was not finite: the update was not applied."""

    def __init__(self, norm: float, ranks: list[int] | None = None, detail: str | None = None):
        where = (f"the loss of rank(s) {', '.join(map(str, ranks))} was not finite" if ranks else
                 "every rank's loss was finite: the gradients overflowed in the backward pass or the reduction")
        super().__init__(detail or (
            f"non-finite gradients (global gradient norm {norm}): {where}; the update was not applied and the run "
            "stops, as Megatron-LM's --check-for-nan-in-loss-and-grad does; a start (or MAX_RESTARTS) resumes from "
            "the latest checkpoint; if it recurs, lower the learning rate or look at the data of this iteration"))
        self.local = detail is not None
        """Raised on one rank only (megatron-core's own bucket check): that rank says it."""


def name_non_finite_ranks(loss: torch.Tensor | None) -> list[int]:
    """The ranks whose ``loss`` is not finite (a collective: every rank calls it)."""
    if loss is None:
        return []
    flag = torch.tensor([0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0], device=loss.device)
    flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, flag)
    return [rank for rank, f in enumerate(flags) if f.item()]


def _unique_storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "_local_tensor"):  # DTensor: what this rank holds
            t = t._local_tensor
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class Trainer(abc.ABC):
    """A wrapped model plus its optimizer, for one stage and device kind."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, optimizer, stage: ZeroStage, clip_grad: float):
        self.model = model
        """Call this for forward passes."""
        self.module = module
        """The bare GPTModel (parameters, hooks)."""
        self.optimizer = optimizer
        self.stage = stage
        self.clip_grad = clip_grad

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Gradient reduction only on the last micro-step of an optimizer step."""

    @abc.abstractmethod
    def step(self, lr: float, weight_decay: float) -> tuple[float, bool]:
        """Clip and step with learning rate ``lr`` and weight decay ``weight_decay`` (times each
        parameter group's ``wd_mult``: 0 for biases and norm weights, as Megatron). Returns the
        global gradient norm before clipping (also with clipping off) and whether the optimizer
        skipped the step (only with a loss scaler, which bf16 and fp32 have not). A non-finite
        norm raises :class:`NonFiniteGradients` before the update; the loop sets
        :attr:`last_loss` (this rank's loss of the step) for its message."""

    last_loss: torch.Tensor | None = None

    @property
    def gradients_note(self) -> str | None:
        """The start line's gradient precision; None where it is the parameters' (fp32 on CPU)."""
        return None

    @abc.abstractmethod
    def model_state_dict(self) -> dict:
        """The model's weights for a checkpoint."""

    @abc.abstractmethod
    def checkpoint_state(self, loading: bool = False) -> dict:
        """What torch.distributed.checkpoint saves and loads in place (model, and the optimizer
        where its state is in DCP's terms); with ``loading``, the template a load fills."""

    @abc.abstractmethod
    def load_checkpoint_state(self, state: dict) -> None:
        """Apply a loaded :meth:`checkpoint_state`."""

    def save_state(self, directory: Path) -> None:
        """Write the model and the optimizer state into ``directory``, every rank its part (a
        collective): torch.distributed.checkpoint of :meth:`checkpoint_state` unless the trainer
        says otherwise (megatron-core's torch_dist format on CUDA at stages 0-1)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_to_write(), checkpoint_id=str(directory))

    def begin_save_state(self, directory: Path, background: bool) -> Writing:
        """Start :meth:`save_state` (a collective). ``background``: torch.distributed.checkpoint's
        ``async_save`` copies :meth:`state_to_write` to host memory now and writes it from a thread,
        its collectives on a gloo group of their own (training/background_save.py)."""
        if not background:
            return FutureWriting(in_background(lambda: self.save_state(directory), background=False))
        import torch.distributed.checkpoint as dcp

        return FutureWriting(dcp.async_save(self.state_to_write(), checkpoint_id=str(directory),
                                            process_group=checkpoint_group()))

    def state_to_write(self) -> dict:
        """What :meth:`save_state` writes with torch.distributed.checkpoint."""
        return self.checkpoint_state()

    def load_state(self, directory: Path) -> None:
        """Read what :meth:`save_state` wrote, at this or another data-parallel size where the
        format reshards (a collective): the model first, then the optimizer (Megatron-LM's order)."""
        import torch.distributed.checkpoint as dcp

        state = self.checkpoint_state(loading=True)
        dcp.load(state, checkpoint_id=str(directory))
        self.load_checkpoint_state(state)

    def rank_local_state(self):
        """Optimizer state that only this rank can load (saved as its own file), or None."""
        return None

    def load_rank_local_state(self, state) -> None:
        raise NotImplementedError

    def release_unsharded(self) -> None:
        """Free parameters gathered for a forward with no backward (evaluation)."""

    def synced_parameters(self) -> contextlib.AbstractContextManager:
        """Parameters up to date for a forward outside training or a save (with overlapped
        parameter gathers, the next forward's hooks would otherwise gather them)."""
        return contextlib.nullcontext()

    def first_iteration(self) -> contextlib.AbstractContextManager:
        """Around the first optimizer step of a start (fresh or resumed): Megatron-LM runs it with
        the parameter gathers' forward pre-hook off where they overlap the forward."""
        return contextlib.nullcontext()

    def sample_memory(self) -> None:
        """Note this moment's memory (called at the end of a forward, where sharded stages peak)."""

    @abc.abstractmethod
    def memory_values(self) -> list[int]:
        """This rank's memory figures, in the order :meth:`memory_columns` reads them."""

    @abc.abstractmethod
    def memory_columns(self, per_rank: list[list[int]]) -> dict:
        """Metrics columns from every rank's :meth:`memory_values` (gathered by the loop)."""


class CpuTrainer(Trainer):
    """torch DDP / ZeroRedundancyOptimizer / FSDP2 on gloo, with model-state byte accounting."""

    def __init__(self, model, module, optimizer, stage, clip_grad, fsdp_sharded_bytes: int = 0):
        super().__init__(model, module, optimizer, stage, clip_grad)
        self.fsdp_sharded_bytes = fsdp_sharded_bytes
        """FSDP2 only: bytes of this rank's parameter shards (padding included)."""
        self.peak_model_state_bytes = 0

    def sync_context(self, last_micro_step: bool):
        if self.stage >= ZeroStage.GRADIENTS:
            self.model.set_requires_gradient_sync(last_micro_step)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last_micro_step else self.model.no_sync()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, lr: float, weight_decay: float) -> tuple[float, bool]:
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        if not math.isfinite(norm):  # the same on every rank: the norm is global
            raise NonFiniteGradients(norm, name_non_finite_ranks(self.last_loss))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        self.optimizer.step()
        return norm, False

    def model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def checkpoint_state(self, loading: bool = False) -> dict:  # noqa: ARG002 (the interface's signature)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.stage == ZeroStage.OPTIMIZER:  # ZeroRedundancyOptimizer: a rank-local partition
            return {"model": self.model_state_dict()}
        model, optimizer = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.stage == ZeroStage.OPTIMIZER:
            set_model_state_dict(self.module, state["model"])
        else:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def rank_local_state(self) -> dict | None:
        return self.optimizer.optim.state_dict() if self.stage == ZeroStage.OPTIMIZER else None

    def load_rank_local_state(self, state: dict) -> None:
        self.optimizer.optim.load_state_dict(state)

    def release_unsharded(self) -> None:
        if self.fsdp_sharded_bytes:
            from torch.distributed.fsdp import FSDPModule

            for m in self.module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state this rank holds right now."""
        seen: set[int] = set()
        params = list(self.module.parameters())
        if self.fsdp_sharded_bytes:
            # Sharded parameters are always held; parameters registered as plain tensors are
            # the unsharded copies FSDP gathered for forward/backward.
            total = self.fsdp_sharded_bytes
            total += _unique_storage_bytes((p for p in params if not hasattr(p, "_local_tensor")), seen)
        else:
            total = _unique_storage_bytes(params, seen)
        total += _unique_storage_bytes((p.grad for p in params), seen)
        optim = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: local shard
        for state in optim.state.values():
            total += _unique_storage_bytes(state.values(), seen)
        return total

    def sample_memory(self) -> None:
        self.peak_model_state_bytes = max(self.peak_model_state_bytes, self.model_state_bytes())

    def memory_values(self) -> list[int]:
        now = self.model_state_bytes()
        self.peak_model_state_bytes = max(self.peak_model_state_bytes, now)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return [now, self.peak_model_state_bytes, rss]

    def memory_columns(self, per_rank: list[list[int]]) -> dict:
        now, peak, rss = per_rank[dist.get_rank()]
        return {
            "model_state_bytes": now,
            "model_state_peak_bytes": peak,
            "peak_rss_bytes": rss,
            "model_state_bytes_per_rank": [r[0] for r in per_rank],
            "model_state_peak_bytes_per_rank": [r[1] for r in per_rank],
        }


def _adamw(t: TrainingParams, **extra):
    return dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay, **extra)


def _no_buffer_sync() -> dict:
    """torch DDP without a buffer broadcast at each forward: ``forward_sync_buffers=False`` where
    torch has it (2.13 deprecates ``broadcast_buffers``; it still syncs once at construction, and
    the buffers, rotary frequencies, are the same on every rank anyway), else ``broadcast_buffers``."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    known = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in known else {"broadcast_buffers": False}


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule (megatron-core ``get_standard_config_overrides``): no weight decay on biases
    and one-dimensional parameters (norm weights)."""
    return name.endswith(".bias") or param.dim() == 1


def param_groups(module: torch.nn.Module) -> list[dict]:
    """AdamW parameter groups carrying Megatron's ``wd_mult`` (1: decayed, 0: not)."""
    decay, plain = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (plain if no_weight_decay(name, param) else decay).append(param)
    return [g for g in ({"params": decay, "wd_mult": 1.0}, {"params": plain, "wd_mult": 0.0}) if g["params"]]


def wrap_cpu(module: torch.nn.Module, stage: ZeroStage, t: TrainingParams) -> CpuTrainer:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if stage >= ZeroStage.GRADIENTS:
        reshard = stage == ZeroStage.PARAMETERS
        for layer in module.decoder.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(module, reshard_after_forward=reshard)
        sharded = _unique_storage_bytes(module.parameters(), set())
        optimizer = torch.optim.AdamW(param_groups(module), **_adamw(t, foreach=False))
        return CpuTrainer(module, module, optimizer, stage, t.clip_grad, sharded)
    model = DistributedDataParallel(module, gradient_as_bucket_view=True, **_no_buffer_sync())
    if stage == ZeroStage.OPTIMIZER:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # ~0.4 s of a rank's start: stage 1's only

        groups = param_groups(module)
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW, **_adamw(t, foreach=False))
        for group in groups[1:]:  # ZeroRedundancyOptimizer takes one group at construction
            optimizer.add_param_group(group)
        optimizer.param_groups[0]["wd_mult"] = groups[0]["wd_mult"]
    else:
        optimizer = torch.optim.AdamW(param_groups(module), **_adamw(t, foreach=False))
    return CpuTrainer(model, module, optimizer, stage, t.clip_grad)
