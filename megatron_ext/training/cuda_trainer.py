"""The CUDA trainer: megatron-core DDP, its distributed optimizer and Megatron-FSDP, driven as
Megatron-LM core_v0.16.1 drives them (megatron/training/training.py, checkpointing.py,
megatron/core/optimizer/optimizer.py; the line numbers below are that tag's).

- Stage 0: megatron-core DDP + its mixed-precision optimizer (bf16 params, fp32 main params and
  grads; on megatron-core 0.19+ Megatron-FSDP's gradient dtypes set too, :data:`FSDP_GRAD_DTYPE_FIELDS`,
  as Megatron-LM core_v0.19.0's training.py ~L1999-2001 passes them). Stage 1: + ``use_distributed_optimizer``.
  Stages 2-3: Megatron-FSDP ``optim_grads`` /
  ``optim_grads_params`` + the distributed optimizer. Float16Module wraps the model before the
  data-parallel wrapper (training.py ~L1261); the DDP config is Megatron-LM's (~L1291-1322: fp32
  reduction, ``check_for_nan_in_grad`` on, ``bucket_size = max(4e7, 1e6 x dp)``); Megatron-FSDP
  gets no ``fsdp_unit_modules``, so the adapter's default applies (none for ``optim_grads``,
  TransformerLayer for ``optim_grads_params``: mcore_fsdp_adapter.py ~L93-99). One rank runs
  stages 2-3 as ``no_shard`` unless ``MEGATRON_EXT_SHARD_ONE_RANK=1`` (:func:`one_rank_strategy`).
- The step: stages 0-1 call the optimizer's ``step()`` (the chained optimizer computes the global
  norm once and clips by it, optimizer.py ~L1308-1340); stages 2-3 take its parts themselves
  (``prepare_grads``, ``get_grad_norm``, ``clip_grad_by_total_norm_fp32``,
  ``step_with_ready_grads``, as ``MixedPrecisionOptimizer.step``, ~L593-623) so that the one norm
  also serves the NaN check: Megatron-FSDP checks no gradient bucket itself.
- The first iteration of every start runs stage 1 with the forward pre-hook off (training.py
  ~L2654-2663, on again after the step ~L2812-2827; ``should_disable_forward_pre_hook`` ~L3496): a
  bad load or initialisation on one rank does not spread to all in the first all-gather.
- Checkpoints: megatron_ext/training/cuda_checkpoint.py (torch_dist with fully parallel save and
  load at stages 0-1, fsdp_dtensor at stages 2-3).
- A non-finite gradient stops the run before the update is applied, naming the rank(s)
  (Megatron-LM's ``--check-for-nan-in-loss-and-grad`` default): DDP checks each bucket itself;
  under Megatron-FSDP the global norm is checked before the update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from megatron_ext.run_spec.checkpoints import ddp_bucket_elements
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import TrainingParams
from megatron_ext.run_spec.zero import ZeroStage, strategy_for
from megatron_ext.training import cuda_checkpoint
from megatron_ext.training.background_save import Writing
from megatron_ext.training.megatron_core_apis import with_fsdp_shards_in_place
from megatron_ext.training.trainers import NonFiniteGradients, Trainer, name_non_finite_ranks


class CudaTrainer(Trainer):
    """megatron-core DDP / distributed optimizer / Megatron-FSDP, bf16 params, fp32 grads
    (bf16 with ``grad_reduce_in_bf16``); gradient reduction overlapped with backward, and (stage 1)
    parameter gathers with the next forward, as Megatron-LM's ``--overlap-grad-reduce
    --overlap-param-gather``."""

    @property
    def optimizers(self) -> list:
        """The distributed or mixed-precision optimizers: a ChainedOptimizer's parts (what
        get_megatron_optimizer returns without FSDP), or the bare DistributedOptimizer (with it)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    @property
    def gradients_note(self) -> str:
        note = describe_gradients(self.model.ddp_config, self.stage)
        if self.stage >= ZeroStage.GRADIENTS:  # one rank: no_shard, unless asked (one_rank_strategy)
            note += f"; strategy {self.model.ddp_config.data_parallel_sharding_strategy}"
        return note

    @property
    def _gathers_overlapped(self) -> bool:
        """Megatron-LM's ``should_disable_forward_pre_hook``: the distributed optimizer with
        overlapped parameter gathers and no Megatron-FSDP (training.py ~L3496)."""
        return self.stage == ZeroStage.OPTIMIZER

    @contextlib.contextmanager
    def synced_parameters(self):
        if not self._gathers_overlapped:
            yield
            return
        self.model.disable_forward_pre_hook()  # gathers every parameter now, as Megatron-LM before eval and save
        try:
            yield
        finally:
            self.model.enable_forward_pre_hook()

    @contextlib.contextmanager
    def first_iteration(self):
        if not self._gathers_overlapped:
            yield
            return
        self.model.disable_forward_pre_hook(param_sync=False)  # training.py ~L2657-2663
        yield  # an exception ends the run: the hook stays off
        self.model.enable_forward_pre_hook()  # after the step, ~L2825

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
        if self.stage >= ZeroStage.GRADIENTS:
            return self._step_with_one_norm()
        success, grad_norm, _ = self.optimizer.step()
        # ChainedOptimizer.step returns the global norm whether or not it clips (optimizer.py ~L1314).
        return float(grad_norm if grad_norm is not None else float("nan")), not success

    def _step_with_one_norm(self) -> tuple[float, bool]:
        """``MixedPrecisionOptimizer.step`` (optimizer.py ~L593-623) in its parts, the norm taken
        once: it is checked (Megatron-FSDP checks no bucket), clips (clip_grad_by_total_norm_fp32
        with the total norm, as ChainedOptimizer.step ~L1318-1332) and is returned (the bare
        distributed optimizer's step returns 0.0 without clipping, ~L605)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        if opt.prepare_grads():  # a loss scaler's overflow (fp16 only): the step is skipped
            return float("nan"), True
        grad_norm = float(opt.get_grad_norm())
        if not math.isfinite(grad_norm):
            raise NonFiniteGradients(grad_norm, name_non_finite_ranks(self.last_loss))
        params = opt.get_parameters()
        if self.clip_grad > 0 and params:
            decoupled = getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
            clip_grad_by_total_norm_fp32(params, max_norm=self.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=decoupled)
        return grad_norm, not opt.step_with_ready_grads()

    # -- checkpoints ------------------------------------------------------------------------------

    def model_state_dict(self) -> dict:
        """The weights as Megatron-LM saves them (``state_dict_for_save_checkpoint``, ~L911): the
        bf16 weights of the DDP stages; Megatron-FSDP's fp32 main weights as DTensors, uncast (they
        are shared with the optimizer: param_and_grad_buffer.py ~L2514)."""
        if self.stage >= ZeroStage.GRADIENTS:
            with_fsdp_shards_in_place(self.model)
        return {k: v for k, v in self.model.state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")}  # handle_fp8_extra_state_case

    def checkpoint_state(self, loading: bool = False) -> dict:
        """Stages 2-3: the fsdp_dtensor state as it is laid out on disk (cuda_checkpoint.fsdp_dtensor_state)."""
        return cuda_checkpoint.fsdp_dtensor_state(self, loading)[1]

    def load_checkpoint_state(self, state: dict) -> None:
        # Megatron-LM's load_model_state_dict: strict, and non-strict only if that raises (the
        # transformer-engine extra state this checkpoint leaves out; checkpointing.py ~L1759-1767).
        # Megatron-FSDP's load post-hook copies the loaded fp32 main weights into the bf16 ones
        # (megatron_fsdp.py ~L1032).
        try:
            self.model.load_state_dict(state["model"], strict=True)
        except RuntimeError:
            self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])  # {"state", "param_to_group_meta"} (~L719-726)

    def save_state(self, directory: Path) -> None:
        if self.stage >= ZeroStage.GRADIENTS:
            cuda_checkpoint.save_fsdp_dtensor(self, directory)
        else:
            cuda_checkpoint.save_torch_dist(self, directory)

    def begin_save_state(self, directory: Path, background: bool) -> Writing:
        """Stages 0-1 in the background: megatron-core's own asynchronous torch_dist save, as
        Megatron-LM's ``--async-save``. Stages 2-3 are written before training goes on, as
        Megatron-LM writes fsdp_dtensor (its ``--async-save`` is torch_dist's alone):
        torch.distributed.checkpoint's stager cannot copy Megatron-FSDP's state ("Attempted to call
        copy_() on an invalid python storage", found through the device shim on 0.16.1)."""
        if background and self.stage < ZeroStage.GRADIENTS:
            return cuda_checkpoint.begin_torch_dist_save(self, directory)
        return super().begin_save_state(directory, background=False)

    def load_state(self, directory: Path) -> None:
        if self.stage >= ZeroStage.GRADIENTS:
            cuda_checkpoint.load_fsdp_dtensor(self, directory)
        else:
            cuda_checkpoint.load_torch_dist(self, directory)

    def memory_values(self) -> list[int]:
        return [torch.cuda.max_memory_allocated()]

    def memory_columns(self, per_rank: list[list[int]]) -> dict:
        return {"cuda_peak_allocated_bytes": max(r[0] for r in per_rank)}


def megatron_core_ddp_config(stage: int, grad_reduce_in_bf16: bool = False, data_parallel_size: int = 1,
                             premul_sum: bool = True):
    """megatron-core DistributedDataParallelConfig for ``stage``, as Megatron-LM builds it
    (training.py ~L1291-1322): fp32 gradient reduction (unless ``grad_reduce_in_bf16``), the NaN
    check on the gradient buckets (``--check-for-nan-in-loss-and-grad`` is on by default),
    reduction overlapped with backward, buckets of max(4e7, 1e6 x data-parallel size) elements,
    and from stage 1 parameter gathers overlapped with forward. ``premul_sum``: the fused
    divide-and-reduce (an NCCL operation; gloo lacks it). Megatron-FSDP's own gradient dtypes
    where the release has them: :func:`megatron_fsdp_grad_dtypes`."""
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=not grad_reduce_in_bf16, overlap_grad_reduce=True, overlap_param_gather=stage >= 1,
        check_for_nan_in_grad=True, bucket_size=ddp_bucket_elements(data_parallel_size),
        gradient_reduce_div_fusion=premul_sum, **strategy_for(stage).megatron_core_ddp.kwargs(),
        **megatron_fsdp_grad_dtypes(fields, grad_reduce_in_bf16),
    )


FSDP_GRAD_DTYPE_FIELDS = ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype")
"""Megatron-FSDP's gradient precision from megatron-core 0.19 on: its MixedPrecisionPolicy is built
from these two fields (mcore_fsdp_adapter.py ~L134-138 at core_v0.19.0), both defaulting to the
compute dtype (None: bf16 gradients accumulated and reduce-scattered in bf16,
distributed_data_parallel_config.py ~L192-198), and ``grad_reduce_in_fp32`` no longer reaches it
(0.16.1-0.18.2 read that flag: param_and_grad_buffer.py ~L2022-2030 at 0.16.1). Megatron-LM 0.19
passes its ``--megatron-fsdp-main-grads-dtype`` / ``--megatron-fsdp-grad-comm-dtype`` (default
``auto``; training.py ~L1999-2001)."""


def megatron_fsdp_grad_dtypes(config_fields: set[str], grad_reduce_in_bf16: bool) -> dict:
    """fp32 main gradients and fp32 gradient communication for Megatron-FSDP (bf16 with
    ``grad_reduce_in_bf16``), on the releases whose DDP config has the fields
    (:data:`FSDP_GRAD_DTYPE_FIELDS`); {} on older ones, where ``grad_reduce_in_fp32`` decides. Pure."""
    dtype = torch.bfloat16 if grad_reduce_in_bf16 else torch.float32
    return {name: dtype for name in FSDP_GRAD_DTYPE_FIELDS if name in config_fields}


def describe_gradients(ddp_config, stage: int) -> str:
    """The start line's gradient precision, read from the config megatron-core was given."""
    if stage >= ZeroStage.GRADIENTS and all(hasattr(ddp_config, f) for f in FSDP_GRAD_DTYPE_FIELDS):
        main, comm = (str(getattr(ddp_config, f)).removeprefix("torch.") for f in FSDP_GRAD_DTYPE_FIELDS)
        return (f"gradients: {main} main gradients, reduce-scattered in {comm} (Megatron-FSDP's "
                "megatron_fsdp_main_grads_dtype / megatron_fsdp_grad_comm_dtype)")
    where = "Megatron-FSDP" if stage >= ZeroStage.GRADIENTS else "megatron-core DDP"
    return (f"gradients: {'fp32' if ddp_config.grad_reduce_in_fp32 else 'bf16'} main gradients and reduction "
            f"({where}'s grad_reduce_in_fp32={ddp_config.grad_reduce_in_fp32})")


def megatron_core_optimizer_config(t: TrainingParams, stage: int, bf16: bool):
    """megatron-core OptimizerConfig: AdamW with the schedule's settings and the stage's sharding."""
    from megatron.core.optimizer import OptimizerConfig

    same_named = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")  # TrainingParams' names too
    return OptimizerConfig(optimizer="adam", bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                           use_distributed_optimizer=strategy_for(stage).megatron_core_ddp.use_distributed_optimizer,
                           **{name: getattr(t, name) for name in same_named})


def distributed_optimizer_layout(module: torch.nn.Module, ddp_config) -> dict:
    """``full_param_layout`` for megatron-core's DDP with the distributed optimizer (stage 1), computed
    before the wrap as Megatron-LM's ``wrap_model_chunks_with_ddp`` does (training.py L1630-1693 at
    core_v0.19.0): ``DistributedOptimizer.compute_full_param_layout`` over the chunk's parameters
    that take a gradient, the bucket size, and the intra-instance data-parallel group's size. DDP
    computes the same itself when given none, with a warning on rank 0 ("full_param_layout not
    provided", distributed_data_parallel.py ~L131-149 at 0.19.2). {} where DDP has no such
    argument (megatron-core 0.16-0.18) or there is no distributed optimizer (stage 0)."""
    import inspect

    from megatron.core.distributed import DistributedDataParallel

    if not ddp_config.use_distributed_optimizer or "full_param_layout" not in inspect.signature(
            DistributedDataParallel.__init__).parameters:
        return {}
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_size

    groups = ProcessGroupCollection.use_mpu_process_groups()
    dense, expert = getattr(groups, "intra_dp_cp", None), getattr(groups, "intra_expt_dp", None)
    dense = dense if dense is not None else groups.dp_cp
    expert = expert if expert is not None else getattr(groups, "expt_dp", None)
    layout = DistributedOptimizer.compute_full_param_layout(
        [p for p in module.parameters() if p.requires_grad], ddp_config.bucket_size, get_pg_size(dense), ddp_config,
        expert_data_parallel_world_size=get_pg_size(expert))
    return {"full_param_layout": layout}


SHARD_ONE_RANK_ENV = "MEGATRON_EXT_SHARD_ONE_RANK"
"""``1``: at one data-parallel rank, stages 2-3 keep Megatron-FSDP's own strategy (``optim_grads``,
``optim_grads_params``: the reduce-scatter, per-layer unsharding at stage 3, the sharded buffers in
the checkpoint) instead of ``no_shard``. The GPU check sets it where the release allows it
(tests/gpu/gpu_check.py: one GPU runs the sharded path); refused on :data:`ONE_RANK_DOUBLE_ADD`."""

ONE_RANK_DOUBLE_ADD = frozenset({(0, 16)})
"""The megatron-core releases (major, minor) whose Megatron-FSDP, sharding at one rank, adds every
reduced gradient bucket into itself: 0.16.0-0.16.1 reduce-scatter whenever the strategy is not
``no_shard`` and then add the result to the local buffer (``local_grad += reduced_grad``,
param_and_grad_buffer.py ~L3225-3257 at core_v0.16.1), which at one rank is the bucket just
reduced, so the gradients double at every micro-batch (seen through the device shim: norm 12.2
against stage 0's 6.1 with one micro-batch, 34.3 against 4.2 with four). 0.14-0.15 all-reduce in
place where the buffer is not distributed (one rank: ~L2898 at core_v0.15.3); 0.17 on add only into
a distributed buffer (~L3665-3682 at core_v0.17.0, ~L4104-4121 at core_v0.19.0)."""


def shard_one_rank_asked(env: Mapping[str, str]) -> bool:
    """Whether :data:`SHARD_ONE_RANK_ENV` asks for the stage's own strategy at one rank. Pure."""
    return env.get(SHARD_ONE_RANK_ENV, "").strip() not in ("", "0")


def one_rank_strategy(stage: int, world_size: int, release: tuple[int, int], shard_one_rank: bool) -> str | None:
    """The Megatron-FSDP sharding strategy put in place of the stage's, or None (the stage's own).
    One rank has nothing to shard: stages 2-3 run ``no_shard`` there (it reduces in place, the same
    memory), unless ``shard_one_rank`` asks for the real strategy, a UserError on the releases of
    :data:`ONE_RANK_DOUBLE_ADD`. Pure."""
    if stage < ZeroStage.GRADIENTS or world_size > 1:
        return None
    if not shard_one_rank:
        return "no_shard"
    if release in ONE_RANK_DOUBLE_ADD:
        raise UserError(f"{SHARD_ONE_RANK_ENV}=1 at ZeRO stage {stage} on one rank: megatron-core "
                        f"{release[0]}.{release[1]}'s Megatron-FSDP adds each reduced gradient into itself at one "
                        "rank (the gradients would double every micro-batch); unset it (one rank then runs "
                        "no_shard), or use megatron-core 0.17 or later")
    return None


def wrap_cuda(module: torch.nn.Module, stage: ZeroStage, t: TrainingParams, device: torch.device,
              shard_one_rank: bool = False) -> CudaTrainer:
    """megatron-core DDP / distributed optimizer / Megatron-FSDP around ``module`` (on ``device``).
    ``shard_one_rank``: :func:`one_rank_strategy`'s switch (the program reads
    :data:`SHARD_ONE_RANK_ENV` at its edge, megatron_ext/pretrain.py)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.training.model import installed_megatron_core

    config = module.config
    ddp_config = megatron_core_ddp_config(stage, t.grad_reduce_in_bf16, dist.get_world_size(),
                                          premul_sum=dist.get_backend() == "nccl")
    if strategy := one_rank_strategy(stage, dist.get_world_size(), installed_megatron_core(), shard_one_rank):
        ddp_config.data_parallel_sharding_strategy = strategy
    wrapped = Float16Module(config, module) if config.bf16 else module
    if stage >= ZeroStage.GRADIENTS:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        model = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=wrapped, device=device)
    else:
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=wrapped,
                                        **distributed_optimizer_layout(wrapped, ddp_config))
    optimizer = get_megatron_optimizer(megatron_core_optimizer_config(t, stage, config.bf16), [model])
    return CudaTrainer(model, module, optimizer, stage, t.clip_grad)
