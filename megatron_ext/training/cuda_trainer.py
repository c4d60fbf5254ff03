"""The CUDA trainer: megatron-core DDP, its distributed optimizer and Megatron-FSDP, driven as
Megatron-LM core_v0.16.1 drives them (megatron/training/training.py, checkpointing.py; the line
numbers below are that tag's).

- Stage 0: megatron-core DDP + its mixed-precision optimizer (bf16 params, fp32 main params and
  grads). Stage 1: + ``use_distributed_optimizer``. Stages 2-3: Megatron-FSDP ``optim_grads`` /
  ``optim_grads_params`` + the distributed optimizer. Float16Module wraps the model before the
  data-parallel wrapper (training.py ~L1261); the DDP config is Megatron-LM's (~L1291-1322: fp32
  reduction, ``check_for_nan_in_grad`` on, ``bucket_size = max(4e7, 1e6 x dp)``); Megatron-FSDP
  gets no ``fsdp_unit_modules``, so the adapter's default applies (none for ``optim_grads``,
  TransformerLayer for ``optim_grads_params``: mcore_fsdp_adapter.py ~L93-99).
- Checkpoints (what megatron_ext/training/checkpoint.py writes): stage 0's optimizer state is the
  same on every rank, written once (:meth:`replicated_state`); stage 1's per rank in the
  distributed optimizer's ``dp_reshardable`` layout (its state_dict holds param groups and step
  only, distrib_optimizer.py ~L668: the fp32 main shard and both moments come from
  ``get_parameter_state_dp_reshardable``, ~L942, and go back through ``load_state_dict`` with
  ``param_state``, ~L863-877); stages 2-3 as Megatron-LM's ``fsdp_dtensor`` format
  (checkpointing.py ~L911-934): the model's state dict as it is (the fp32 main weights as
  DTensors), the optimizer's ``sharded_state_dict``, both in one torch.distributed.checkpoint.
- A non-finite gradient stops the run before the update is applied, naming the rank(s)
  (Megatron-LM's ``--check-for-nan-in-loss-and-grad`` default): DDP checks each bucket itself;
  Megatron-FSDP has no such check, so the global norm is checked before the step.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from megatron_ext.run_spec.params import TrainingParams
from megatron_ext.run_spec.zero import ZeroStage, strategy_for
from megatron_ext.training.compat import distributed_optimizer_state_layout, with_fsdp_shards_in_place
from megatron_ext.training.trainers import NonFiniteGradients, Trainer, name_non_finite_ranks

FSDP_DTENSOR_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
                         "chained_optim_avoid_prefix": True}
"""What Megatron-LM's checkpointing passes the optimizer for ``--ckpt-format fsdp_dtensor``
(``_build_sharded_state_dict_metadata``, checkpointing.py ~L401-434)."""


def _host_copy(obj):
    """Tensors copied to the host, compact (a view would otherwise save its whole buffer)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return obj


def _not_padding(param_state):
    """``load_parameter_state_from_dp_reshardable`` keeps only elements whose ``padding`` is False
    (distrib_optimizer.py ~L1790), a key that ``get_parameter_state_dp_reshardable`` does not write
    (its sharded form adds it, ~L1657): add it."""
    for key, per_dtype in param_state.items():
        if isinstance(key, int):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for element in bucket:
                        element.setdefault("padding", False)
    return param_state


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
        checked = None
        if self.stage >= ZeroStage.GRADIENTS:  # Megatron-FSDP checks no gradient for NaN: the norm, before the update
            checked = float(self.optimizer.get_grad_norm())
            if not math.isfinite(checked):
                raise NonFiniteGradients(checked, name_non_finite_ranks(self.last_loss))
        success, grad_norm, _ = self.optimizer.step()
        if checked is not None and self.clip_grad <= 0:
            grad_norm = checked  # the bare distributed optimizer returns 0.0 without clipping (optimizer.py ~L605)
        # ChainedOptimizer.step returns the global norm whether or not it clips (optimizer.py ~L1314).
        return float(grad_norm if grad_norm is not None else float("nan")), not success

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
        state = {"model": self.model_state_dict()}
        if self.stage >= ZeroStage.GRADIENTS:
            from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
                preprocess_state_dict_for_uneven_dtensor,
            )

            # Loading: sharded_state_dict(is_loading=True) first takes a dummy optimizer step to
            # create the moments (distrib_optimizer.py ~L1356); the load that follows overwrites
            # what it moved, as in Megatron-LM's load_checkpoint (~L1675-1710).
            optimizer = self.optimizer.sharded_state_dict(state["model"], is_loading=loading,
                                                          metadata=dict(FSDP_DTENSOR_METADATA))
            state["optimizer"] = self._same_on_every_rank(optimizer)
            # Megatron-LM also splits SwiGLU's fc1 into its two halves (handle_swiglu_in_state_dict,
            # ~L958) so that a checkpoint can change tensor-parallel size; without tensor
            # parallelism (this project's runs) the fused weight reshards as it is.
            preprocess_state_dict_for_uneven_dtensor(state)  # the whole dict, as checkpointing.py ~L972
        return state

    def _same_on_every_rank(self, optimizer_state: dict) -> dict:
        """Megatron-FSDP gives a parameter whose local shard is empty no gradient
        (param_and_grad_buffer.py ~L2669), so Adam keeps no state for it on that rank: the ranks'
        optimizer state dicts would hold different DTensors, in different orders, and
        preprocess_state_dict_for_uneven_dtensor's collective per DTensor would pair unrelated
        tensors or wait forever (uneven_dtensor.py ~L136 warns of it). Every parameter gets its
        moments (empty where its shard is), and the state is ordered by the parameters'."""
        inner = self.optimizer.optimizer
        steps = [st["step"] for st in inner.state.values() if "step" in st]
        params = [p for group in inner.param_groups for p in group["params"]]
        for p in params:
            if not inner.state.get(p) and steps:
                inner.state[p] = {"step": steps[0].clone(), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
        names = [self.optimizer._param_name(p) for p in params]
        by_name = optimizer_state["state"]
        missing = [n for n in names if n not in by_name and steps]
        for p, name in zip(params, names):
            if name in missing:
                by_name[name] = inner.state[p]
        optimizer_state["state"] = {n: by_name[n] for n in names if n in by_name}
        return optimizer_state

    def load_checkpoint_state(self, state: dict) -> None:
        # Megatron-LM's load_model_state_dict: strict, and non-strict only if that raises (the
        # transformer-engine extra state this checkpoint leaves out; checkpointing.py ~L1759-1767).
        # Megatron-FSDP's load post-hook copies the loaded fp32 main weights into the bf16 ones
        # (megatron_fsdp.py ~L1032).
        try:
            self.model.load_state_dict(state["model"], strict=True)
        except RuntimeError:
            self.model.load_state_dict(state["model"], strict=False)
        if self.stage >= ZeroStage.GRADIENTS:
            self.optimizer.load_state_dict(state["optimizer"])  # {"state", "param_to_group_meta"} (~L719-726)

    def replicated_state(self) -> list | None:
        """Stage 0: every rank's optimizer state is the same (moments and fp32 main params of the
        whole model): written once."""
        return [_host_copy(opt.state_dict()) for opt in self.optimizers] if self.stage == ZeroStage.NONE else None

    def load_replicated_state(self, state: list) -> None:
        for opt, saved in zip(self.optimizers, state, strict=True):
            opt.load_state_dict(saved)

    def rank_local_state(self) -> list | None:
        """Stage 1: each rank's distributed-optimizer state (a collective: every rank calls it)."""
        if self.stage != ZeroStage.OPTIMIZER:
            return None
        return [_distributed_optimizer_state(opt) for opt in self.optimizers]

    def load_rank_local_state(self, state: list) -> None:
        for opt, saved in zip(self.optimizers, state, strict=True):
            if saved.get("layout", "dp_reshardable") == "dp_reshardable":
                opt.load_state_dict({**saved["optimizer"], "param_state": _not_padding(saved["param_state"]),
                                     "param_state_sharding_type": "dp_reshardable"})
            else:  # Megatron-LM core_v0.14.0's load_checkpoint for --ckpt-format torch (~L1625-1642)
                opt.load_state_dict(saved["optimizer"])
                with _steps_set_aside(opt):
                    opt.load_parameter_state_from_dp_zero(saved["param_state"])
        _unshare_steps(self.optimizers)

    def memory_values(self) -> list[int]:
        return [torch.cuda.max_memory_allocated()]

    def memory_columns(self, per_rank: list[list[int]]) -> dict:
        return {"cuda_peak_allocated_bytes": max(r[0] for r in per_rank)}


def _distributed_optimizer_state(opt) -> dict:
    """The distributed optimizer's state_dict (param groups, step) with its parameter state: the
    rank's own shard (megatron-core >= 0.15), or, on 0.14, the whole state gathered on
    data-parallel rank 0 (``None`` on the others), as Megatron-LM core_v0.14.0's
    ``save_parameter_state`` keeps it (checkpointing.py ~L467)."""
    layout = distributed_optimizer_state_layout(opt)
    if layout == "dp_reshardable":
        param_state = opt.get_parameter_state_dp_reshardable()
    else:
        gathered = opt.get_parameter_state_dp_zero()
        param_state = gathered if opt.data_parallel_group.rank() == 0 else None
    return {"optimizer": _host_copy(opt.state_dict()), "param_state": _host_copy(param_state), "layout": layout}


@contextlib.contextmanager
def _steps_set_aside(opt):
    """megatron-core 0.14's ``load_parameter_state_from_dp_zero`` copies every entry of a
    parameter's optimizer state from the gathered file, which holds ``param``, ``exp_avg`` and
    ``exp_avg_sq`` only: torch's own Adam (no TE, no apex) also keeps ``step`` there, a KeyError
    (distrib_optimizer.py ~L903-907). ``load_state_dict`` has set the step already: it waits aside."""
    inner = getattr(opt, "optimizer", None)
    states = getattr(inner, "state", {}).values()
    steps = [(state, state.pop("step")) for state in states if "step" in state]
    try:
        yield
    finally:
        for state, step in steps:
            state["step"] = step


def _unshare_steps(optimizers) -> None:
    """The distributed optimizer's load gives every parameter one shared ``step`` tensor when
    torch's own Adam runs it (no TE, no apex: distrib_optimizer.py ~L818-825); torch's Adam adds 1
    to each parameter's step in place, so a shared one would advance once per parameter per step:
    each parameter gets its own."""
    for opt in optimizers:
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()


def megatron_core_ddp_config(stage: int, grad_reduce_in_bf16: bool = False, data_parallel_size: int = 1,
                             premul_sum: bool = True):
    """megatron-core DistributedDataParallelConfig for ``stage``, as Megatron-LM builds it
    (training.py ~L1291-1322): fp32 gradient reduction (unless ``grad_reduce_in_bf16``), the NaN
    check on the gradient buckets (``--check-for-nan-in-loss-and-grad`` is on by default),
    reduction overlapped with backward, buckets of max(4e7, 1e6 x data-parallel size) elements,
    and from stage 1 parameter gathers overlapped with forward. ``premul_sum``: the fused
    divide-and-reduce (an NCCL operation; gloo lacks it)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=not grad_reduce_in_bf16, overlap_grad_reduce=True, overlap_param_gather=stage >= 1,
        check_for_nan_in_grad=True, bucket_size=max(40_000_000, 1_000_000 * data_parallel_size),
        gradient_reduce_div_fusion=premul_sum, **strategy_for(stage).megatron_core_ddp,
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


def wrap_cuda(module: torch.nn.Module, stage: ZeroStage, t: TrainingParams, device: torch.device) -> CudaTrainer:
    """megatron-core DDP / distributed optimizer / Megatron-FSDP around ``module`` (on ``device``)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = module.config
    ddp_config = megatron_core_ddp_config(stage, t.grad_reduce_in_bf16, dist.get_world_size(),
                                          premul_sum=dist.get_backend() == "nccl")
    wrapped = Float16Module(config, module) if config.bf16 else module
    if stage >= ZeroStage.GRADIENTS:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        model = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=wrapped, device=device)
    else:
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=wrapped)
    optimizer = get_megatron_optimizer(megatron_core_optimizer_config(t, stage, config.bf16), [model])
    return CudaTrainer(model, module, optimizer, stage, t.clip_grad)
