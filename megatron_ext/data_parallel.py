"""Wrap a megatron-core GPTModel for one ZeRO stage, on CPU (torch) or CUDA (megatron-core).

The mapping itself lives in :mod:`megatron_ext.zero`; this module builds it. A
:class:`ParallelTrainer` hides the differences the training loop would otherwise see: gradient
sync only on the last micro-step, clip + optimizer step (returning the global grad norm), and
model-state byte accounting for the memory columns of the metrics.

CPU (gloo, fp32): 0 torch DDP; 1 torch DDP + ZeroRedundancyOptimizer; 2 FSDP2 ``fully_shard``
on every transformer layer and the root with ``reshard_after_forward=False``; 3 the same with
``True``. CUDA (NCCL, bf16): megatron-core DDP, + distributed optimizer, Megatron-FSDP
``optim_grads`` / ``optim_grads_params``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from megatron_ext.params import TrainingParams
from megatron_ext.zero import ZeroStage, strategy_for


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


@dataclass
class ParallelTrainer:
    """A wrapped model plus its optimizer, for one stage and device kind."""

    model: torch.nn.Module
    """Call this for forward passes."""
    module: torch.nn.Module
    """The bare GPTModel (parameters, hooks)."""
    optimizer: object
    stage: ZeroStage
    clip_grad: float
    on_cuda: bool
    fsdp_sharded_bytes: int = 0
    """FSDP2 only: bytes of this rank's parameter shards (padding included)."""
    peak_model_state_bytes: int = field(default=0, init=False)

    # -- gradient accumulation ------------------------------------------------------------
    def sync_context(self, last_micro_step: bool):
        if self.on_cuda:
            return contextlib.nullcontext() if last_micro_step else self.model.no_sync()
        if self.stage >= ZeroStage.GRADIENTS:
            self.model.set_requires_gradient_sync(last_micro_step)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last_micro_step else self.model.no_sync()

    def zero_grad(self) -> None:
        if self.on_cuda:  # megatron-core: gradients live in the DDP/FSDP buffers
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self, lr: float) -> float:
        """Clip, step, and return the global gradient norm (before clipping)."""
        if self.on_cuda:
            self.model.finish_grad_sync()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            _, grad_norm, _ = self.optimizer.step()
            return float(grad_norm or 0.0)
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return float(norm)

    def release_unsharded(self) -> None:
        """Free parameters FSDP2 gathered for a forward with no backward (evaluation)."""
        if self.fsdp_sharded_bytes:
            from torch.distributed.fsdp import FSDPModule

            for m in self.module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    # -- memory ---------------------------------------------------------------------------
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

    def sample_model_state(self) -> int:
        now = self.model_state_bytes()
        self.peak_model_state_bytes = max(self.peak_model_state_bytes, now)
        return now


def _adamw(t: TrainingParams, **extra):
    return dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay, **extra)


def wrap_cpu(module: torch.nn.Module, stage: ZeroStage, t: TrainingParams) -> ParallelTrainer:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if stage >= ZeroStage.GRADIENTS:
        reshard = stage == ZeroStage.PARAMETERS
        for layer in module.decoder.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(module, reshard_after_forward=reshard)
        sharded = _unique_storage_bytes(module.parameters(), set())
        optimizer = torch.optim.AdamW(module.parameters(), **_adamw(t, foreach=False))
        return ParallelTrainer(module, module, optimizer, stage, t.clip_grad, False, sharded)
    model = DistributedDataParallel(module, gradient_as_bucket_view=True, broadcast_buffers=False)
    if stage == ZeroStage.OPTIMIZER:
        optimizer = ZeroRedundancyOptimizer(
            module.parameters(), optimizer_class=torch.optim.AdamW, **_adamw(t, foreach=False)
        )
    else:
        optimizer = torch.optim.AdamW(module.parameters(), **_adamw(t, foreach=False))
    return ParallelTrainer(model, module, optimizer, stage, t.clip_grad, False)


def megatron_core_ddp_config(stage: int):
    """megatron-core DistributedDataParallelConfig for ``stage`` (fp32 gradient reduction)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, **strategy_for(stage).megatron_core_ddp
    )


def megatron_core_optimizer_config(t: TrainingParams, stage: int, bf16: bool):
    """megatron-core OptimizerConfig: AdamW with the schedule's settings and the stage's sharding."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=strategy_for(stage).megatron_core_ddp["use_distributed_optimizer"],
    )


def wrap_cuda(module: torch.nn.Module, stage: ZeroStage, t: TrainingParams) -> ParallelTrainer:
    """megatron-core DDP / distributed optimizer / Megatron-FSDP, bf16 params, fp32 grads."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = module.config
    ddp_config = megatron_core_ddp_config(stage)
    wrapped = Float16Module(config, module) if config.bf16 else module
    if stage >= ZeroStage.GRADIENTS:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            config=config, ddp_config=ddp_config, module=wrapped, fsdp_unit_modules=[TransformerLayer]
        )
    else:
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=wrapped)
    optimizer = get_megatron_optimizer(megatron_core_optimizer_config(t, stage, config.bf16), [model])
    return ParallelTrainer(model, module, optimizer, stage, t.clip_grad, True)


def wrap_for_stage(module: torch.nn.Module, stage: int, t: TrainingParams, on_cuda: bool) -> ParallelTrainer:
    stage = ZeroStage(stage)
    if not dist.is_initialized():
        raise RuntimeError("wrap_for_stage needs an initialized process group")
    return wrap_cuda(module, stage, t) if on_cuda else wrap_cpu(module, stage, t)
