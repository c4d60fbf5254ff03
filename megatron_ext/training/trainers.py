"""Data-parallel trainers: a megatron-core GPTModel wrapped for one ZeRO stage, on CPU or CUDA.

The mapping itself lives in :mod:`megatron_ext.run_spec.zero`; this module builds it. Both trainers
have one interface (:class:`Trainer`), so the training loop never asks which device it runs on:
gradient sync only on the last micro-step, clip + optimizer step (returning the global grad
norm), and the memory columns of the metrics.

- :class:`CpuTrainer` (gloo, fp32): 0 torch DDP; 1 torch DDP + ZeroRedundancyOptimizer; 2 FSDP2
  ``fully_shard`` on every transformer layer and the root with ``reshard_after_forward=False``;
  3 the same with ``True``. Memory = model-state bytes this rank holds (parameters, gradients,
  optimizer state), counted from the tensors themselves.
- :class:`CudaTrainer` (NCCL, bf16): megatron-core DDP, + distributed optimizer, Megatron-FSDP
  ``optim_grads`` / ``optim_grads_params``. Memory = peak CUDA allocation.
"""

from __future__ import annotations

import abc
import contextlib
import math
import resource
from typing import Iterable

import torch
import torch.distributed as dist

from megatron_ext.run_spec.params import TrainingParams
from megatron_ext.run_spec.zero import ZeroStage, strategy_for


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
        global gradient norm before clipping (also with clipping off) and whether the step was
        skipped (non-finite gradients)."""

    @abc.abstractmethod
    def model_state_dict(self) -> dict:
        """The model's weights for a checkpoint, in the parameters' dtype whatever the stage."""

    @abc.abstractmethod
    def checkpoint_state(self) -> dict:
        """What torch.distributed.checkpoint saves and loads in place (model, and the optimizer
        where its state is in DCP's terms); also the template a load fills."""

    @abc.abstractmethod
    def load_checkpoint_state(self, state: dict) -> None:
        """Apply a loaded :meth:`checkpoint_state`."""

    def rank_local_state(self) -> dict | None:
        """Optimizer state that only this rank can load (saved as its own file), or None."""
        return None

    def load_rank_local_state(self, state: dict) -> None:
        raise NotImplementedError

    def release_unsharded(self) -> None:
        """Free parameters gathered for a forward with no backward (evaluation)."""

    def synced_parameters(self) -> contextlib.AbstractContextManager:
        """Parameters up to date for a forward outside training or a save (with overlapped
        parameter gathers, the next forward's hooks would otherwise gather them)."""
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
            return norm, True
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        self.optimizer.step()
        return norm, False

    def model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def checkpoint_state(self) -> dict:
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


class CudaTrainer(Trainer):
    """megatron-core DDP / distributed optimizer / Megatron-FSDP on NCCL, bf16 params, fp32 grads
    (bf16 with ``grad_reduce_in_bf16``); gradient reduction overlapped with backward, and (stage 1)
    parameter gathers with the next forward, as Megatron-LM's ``--overlap-grad-reduce
    --overlap-param-gather``."""

    @contextlib.contextmanager
    def synced_parameters(self):
        if self.stage != ZeroStage.OPTIMIZER:
            yield
            return
        self.model.disable_forward_pre_hook()  # gathers every parameter now, as Megatron-LM before eval and save
        try:
            yield
        finally:
            self.model.enable_forward_pre_hook()

    def sync_context(self, last_micro_step: bool):
        return contextlib.nullcontext() if last_micro_step else self.model.no_sync()

    def zero_grad(self) -> None:  # megatron-core: gradients live in the DDP/FSDP buffers
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, lr: float, weight_decay: float) -> tuple[float, bool]:
        self.model.finish_grad_sync()
        for group in self.optimizer.param_groups:  # what Megatron's OptimizerParamScheduler.step sets
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        success, grad_norm, _ = self.optimizer.step()
        if self.clip_grad <= 0:  # megatron-core computes the norm only to clip
            grad_norm = self.optimizer.get_grad_norm()
        return float(grad_norm if grad_norm is not None else float("nan")), not success

    def model_state_dict(self) -> dict:
        """Megatron-FSDP hands uneven DTensor shards: prepared as Megatron-LM's checkpointing does
        before a DCP save (``preprocess_state_dict_for_uneven_dtensor``); bf16 at every stage."""
        state = {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        dtype = self.module.config.params_dtype
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        if self.stage >= ZeroStage.GRADIENTS:
            from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
                preprocess_state_dict_for_uneven_dtensor,
            )

            preprocess_state_dict_for_uneven_dtensor(state)
        return state

    def checkpoint_state(self) -> dict:
        return {"model": self.model_state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"], strict=False)

    def rank_local_state(self) -> dict | None:
        return self.optimizer.state_dict()

    def load_rank_local_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def memory_values(self) -> list[int]:
        return [torch.cuda.max_memory_allocated()]

    def memory_columns(self, per_rank: list[list[int]]) -> dict:
        return {"cuda_peak_allocated_bytes": max(r[0] for r in per_rank)}


def _adamw(t: TrainingParams, **extra):
    return dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay, **extra)


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
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if stage >= ZeroStage.GRADIENTS:
        reshard = stage == ZeroStage.PARAMETERS
        for layer in module.decoder.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(module, reshard_after_forward=reshard)
        sharded = _unique_storage_bytes(module.parameters(), set())
        optimizer = torch.optim.AdamW(param_groups(module), **_adamw(t, foreach=False))
        return CpuTrainer(module, module, optimizer, stage, t.clip_grad, sharded)
    model = DistributedDataParallel(module, gradient_as_bucket_view=True, broadcast_buffers=False)
    if stage == ZeroStage.OPTIMIZER:
        groups = param_groups(module)
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW, **_adamw(t, foreach=False))
        for group in groups[1:]:  # ZeroRedundancyOptimizer takes one group at construction
            optimizer.add_param_group(group)
        optimizer.param_groups[0]["wd_mult"] = groups[0]["wd_mult"]
    else:
        optimizer = torch.optim.AdamW(param_groups(module), **_adamw(t, foreach=False))
    return CpuTrainer(model, module, optimizer, stage, t.clip_grad)


def megatron_core_ddp_config(stage: int, grad_reduce_in_bf16: bool = False):
    """megatron-core DistributedDataParallelConfig for ``stage``: fp32 gradient reduction (unless
    ``grad_reduce_in_bf16``), reduction overlapped with backward, and from stage 1 parameter
    gathers overlapped with forward (the distributed optimizer's, or Megatron-FSDP's)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=not grad_reduce_in_bf16, overlap_grad_reduce=True, overlap_param_gather=stage >= 1,
        **strategy_for(stage).megatron_core_ddp,
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


def wrap_cuda(module: torch.nn.Module, stage: ZeroStage, t: TrainingParams) -> CudaTrainer:
    """megatron-core DDP / distributed optimizer / Megatron-FSDP, bf16 params, fp32 grads."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = module.config
    ddp_config = megatron_core_ddp_config(stage, t.grad_reduce_in_bf16)
    wrapped = Float16Module(config, module) if config.bf16 else module
    if stage >= ZeroStage.GRADIENTS:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            config=config, ddp_config=ddp_config, module=wrapped, fsdp_unit_modules=[TransformerLayer]
        )
    else:
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=wrapped)
    optimizer = get_megatron_optimizer(megatron_core_optimizer_config(t, stage, config.bf16), [model])
    return CudaTrainer(model, module, optimizer, stage, t.clip_grad)


def build_trainer(module: torch.nn.Module, stage: int, t: TrainingParams, on_cuda: bool) -> Trainer:
    stage = ZeroStage(stage)
    if not dist.is_initialized():
        raise RuntimeError("build_trainer needs an initialized process group")
    return wrap_cuda(module, stage, t) if on_cuda else wrap_cpu(module, stage, t)
