"""The CUDA trainer's model and optimizer state on disk, as Megatron-LM core_v0.16.1's
megatron/training/checkpointing.py writes and reads it for the same megatron-core objects (the
line numbers are that tag's).

    python -m torch.distributed.run --nproc-per-node 2 tests/cuda_on_cpu/worker.py resume --stage 1 --out DIR

- Stages 0-1 (megatron-core DDP with its mixed-precision or distributed optimizer): Megatron-LM's
  default ``--ckpt-format torch_dist``. ``generate_state_dict`` (~L877-952) takes the bare model's
  ``sharded_state_dict`` and the optimizer's, with the metadata of
  ``_build_sharded_state_dict_metadata`` (~L401-434: ``dp_reshardable`` for the distributed
  optimizer); ``dist_checkpointing.save`` writes it through ``FullyParallelSaveStrategyWrapper``
  over the data-parallel group (~L593-639; ``--ckpt-fully-parallel-save`` is on by default): every
  data-parallel rank writes a distinct part of what all ranks hold alike (stage 0's whole
  optimizer state, every weight) and its own shard of the distributed optimizer. Loading
  (``_load_global_dist_base_checkpoint``, ~L1103-1131, with ``--ckpt-fully-parallel-load``: each
  rank reads its part and the ranks exchange the rest) builds the same sharded state dict with
  ``is_loading=True`` and the checkpoint's own content metadata (~L1570-1625), then loads the model
  and the optimizer (~L1759-1800). Both formats reshard over data-parallel ranks: what all hold
  alike is read by any number of ranks, ``dp_reshardable`` keeps each bucket's state as one global
  tensor of its unpadded size that each rank reads its slice of
  (distrib_optimizer.py ~L1539-1687; the buckets must be the same: run_spec/checkpoints.py).
- Stages 2-3 (Megatron-FSDP): ``--ckpt-format fsdp_dtensor`` (~L643-655, ~L911-934): the model's
  state dict (the fp32 main weights as DTensors) and the optimizer's ``fsdp_dtensor`` sharded
  state dict in one torch.distributed.checkpoint, which reshards DTensors by itself, laid out as
  ``preprocess_fsdp_dtensor_state_dict`` lays them out (~L955-975): with a gated linear unit
  (SwiGLU: Qwen3, Llama; Megatron-LM's ``--swiglu``) every ``linear_fc1.weight`` and its Adam
  moments are stored as their two halves, ``linear_fc1.weight_w`` and ``linear_fc1.weight_v``, so
  that Megatron-LM's fsdp_dtensor read, ``_load_base_checkpoint(rank0=False)`` (~L1292-1324), reads
  this project's checkpoints and this project reads Megatron-LM's (tests/test_fsdp_dtensor_layout.py).
  Megatron-LM's ``load_checkpoint`` as a whole is not that: its first, ``rank0=True`` pass returns
  nothing for fsdp_dtensor (~L1294-1295), and it then expects its own ``args`` and iteration
  records, which these checkpoints do not hold; a run that moves between the engines goes through
  the exporters (megatron_ext/export_megatron_lm.py).

What megatron-core leaves to its caller, found running its objects (tests/test_cuda_trainer_on_cpu.py):
Adam's per-parameter state is made only for parameters that have a gradient and, with torch's
Adam (no transformer-engine, no apex), only with a per-parameter ``step`` that the distributed
optimizer's ``state_dict`` asserts on (``assert len(steps) == 1``, ~L642): a fresh optimizer
cannot even build the template a load fills, and under Megatron-FSDP a rank whose shard of a
parameter is empty holds no state for it, so the ranks' checkpoints would hold different
DTensors (:func:`fill_missing_adam_state`).
Side effects: the checkpoint files, collectives over the data-parallel group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.training.background_save import DiskFull, any_rank, disk_full, first_rank_says
from megatron_ext.training.checkpoint import stored_tensors
from megatron_ext.training.megatron_core_apis import (
    distributed_optimizer_sharding_type, mcore_async_strategy, serializable_content_metadata, with_fsdp_shards_in_place,
)

FSDP_DTENSOR_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
                         "chained_optim_avoid_prefix": True}
"""What Megatron-LM's checkpointing passes the optimizer for ``--ckpt-format fsdp_dtensor``
(``_build_sharded_state_dict_metadata``, checkpointing.py ~L401-434)."""


def _dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def torch_dist_metadata(optimizers, saved: dict | None = None) -> dict:
    """``_build_sharded_state_dict_metadata`` for ``--ckpt-format torch_dist`` (~L401-434): the
    distributed optimizer's sharding type (the checkpoint's own when loading one, ~L1572), and the
    data-parallel group."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, "dp_cp_group": _dp_group()}
    distributed = [opt for opt in optimizers if hasattr(opt, "get_parameter_state_dp_zero")]
    if distributed:
        sharding = (saved or {}).get("distrib_optim_sharding_type") or distributed_optimizer_sharding_type(distributed[0])
        metadata["distrib_optim_sharding_type"] = sharding
    return metadata


def torch_dist_state(trainer, metadata: dict, loading: bool) -> dict:
    """``generate_state_dict`` (~L877-952): the bare model's sharded state dict (Megatron-LM
    unwraps DDP and Float16Module, ~L533) and the optimizer's, built on it."""
    if loading:  # the distributed optimizer with torch's Adam: its state_dict needs a state per parameter
        for opt in trainer.optimizers:
            if hasattr(opt, "get_parameter_state_dp_zero"):
                fill_missing_adam_state(opt.optimizer)
    state = {"model": trainer.module.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = trainer.optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    return state


def save_torch_dist(trainer, directory: Path, background: bool = False):
    """Every rank: Megatron-LM's torch_dist save with the fully parallel strategy (~L593-639);
    ``background``: the request :func:`begin_torch_dist_save` hands to the checkpoint worker."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    metadata = torch_dist_metadata(trainer.optimizers)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), _dp_group())
    in_worker = dict(async_sharded_save=True, **mcore_async_strategy(dist_checkpointing.save)) if background else {}
    return dist_checkpointing.save(torch_dist_state(trainer, metadata, loading=False), str(directory), strategy,
                                   **in_worker, **serializable_content_metadata(dist_checkpointing.save, metadata))


def begin_torch_dist_save(trainer, directory: Path) -> QueuedWriting:
    """Every rank: Megatron-LM's torch_dist save with ``--async-save --use-persistent-ckpt-worker``
    (checkpointing.py ~L573-641: ``dist_checkpointing.save(..., async_sharded_save=True)``, then a
    barrier; ~L791-792 ``schedule_async_save``; training/async_utils.py: one ``AsyncCallsQueue(persistent=True)``
    per process). The state is copied to host memory before this returns (the request's preload);
    the files are written by megatron-core's checkpoint worker process."""
    request = save_torch_dist(trainer, directory, background=True)
    torch.distributed.barrier()
    queue = async_calls_queue()
    queue.schedule_async_request(request)
    return QueuedWriting(queue)


ASYNC_CALLS: list = []
"""The process's one megatron-core AsyncCallsQueue, made at the first background save (the device
shim on CPU puts megatron-core's forking caller here first: the persistent worker is spawned
without the shim and sets a CUDA device, ``async_utils.py`` ``async_loop``)."""


def async_calls_queue():
    """The process's megatron-core AsyncCallsQueue with its persistent worker (Megatron-LM's
    ``init_persistent_async_worker``)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if not ASYNC_CALLS:
        ASYNC_CALLS.append(AsyncCallsQueue(persistent=True))
    return ASYNC_CALLS[0]


def close_async_calls_queue(abort: bool = False) -> None:
    """At the end of a run: what is still queued finalized, the worker ended (Megatron-LM's
    ``maybe_finalize_async_save(blocking=True, terminate=True)``, training.py ~L3012). ``abort``
    (a rank that raised): the worker killed, what it was writing left unfinished (Megatron-LM's
    ``reset_persistent_async_worker``: on core_v0.16.1 the worker is not a daemon, and Python's exit
    would wait for it forever)."""
    while ASYNC_CALLS:
        ASYNC_CALLS.pop().close(abort=abort)


def _worker_alive(queue) -> bool:
    """Whether the queue's persistent worker process (if it has one yet) is alive: 0.16's
    ``persistent_caller.process``, 0.17+'s ``_persistent_process``."""
    caller = getattr(queue, "persistent_caller", None)
    process = getattr(caller, "process", None) or getattr(caller, "_persistent_process", None)
    return process is None or process.is_alive()


@dataclass(frozen=True)
class QueuedWriting:
    """A torch_dist save in megatron-core's checkpoint worker."""

    queue: object

    def finished(self, blocking: bool) -> bool:
        """megatron-core's own check and finalization (training.py ~L2694
        ``maybe_finalize_async_save(blocking=False)`` at every step): an all-reduce of its writers'
        states, then its finalize functions (the coordinator's metadata), polled until done when
        ``blocking``. A worker that died on any rank (its write never reports: megatron-core would
        wait for it forever) ends the save on every rank; a failed write raises on every rank, a full
        disk as :class:`DiskFull` on every rank (rank 0's verdict: megatron-core gives the failures
        to the coordinator alone)."""
        while True:
            if any_rank(not _worker_alive(self.queue)):
                raise RuntimeError("megatron-core's checkpoint worker process died during a background save "
                                   "(its log or the kernel's, e.g. the out-of-memory killer, says why)")
            try:
                if self.queue.maybe_finalize_async_calls(False, no_dist=False):
                    return True
            except BaseException as exc:  # megatron-core's CheckpointException is a BaseException
                if first_rank_says(disk_full(exc)):
                    raise DiskFull(str(exc)) from exc
                raise
            if not blocking:
                return False
            time.sleep(0.1)


def load_torch_dist(trainer, directory: Path) -> None:
    """Every rank: Megatron-LM's torch_dist load with the fully parallel strategy (~L1103-1131),
    then the model (strict, non-strict if that raises: ``load_model_state_dict``, ~L1759-1767) and
    the optimizer (~L1794), as the trainer's ``load_checkpoint_state`` takes them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    saved = dist_checkpointing.load_content_metadata(checkpoint_dir=str(directory))
    metadata = torch_dist_metadata(trainer.optimizers, saved)
    template = torch_dist_state(trainer, metadata, loading=True)
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(directory)), _dp_group())
    state = dist_checkpointing.load(template, str(directory), strategy)
    trainer.load_checkpoint_state(state)
    restore_adam_steps(trainer.optimizers, state["optimizer"])


def fsdp_dtensor_state(trainer, loading: bool, split_swiglu: bool = True) -> tuple[dict, dict]:
    """Megatron-LM's fsdp_dtensor state (~L911-934, ~L955-975): (the raw state, the state laid out
    for the checkpoint). Raw: the model's state dict as it is and the optimizer's
    ``sharded_state_dict``, the same DTensors in the same order on every rank; laid out by
    :func:`preprocess_fsdp_dtensor_state` (SwiGLU's fc1 in halves unless ``split_swiglu`` is off,
    uneven DTensors). Loading: ``sharded_state_dict(is_loading=True)`` first takes a dummy optimizer
    step to create the moments (distrib_optimizer.py ~L1356); the load that follows overwrites what
    it moved, as in Megatron-LM's load_checkpoint (~L1675-1710)."""
    with_fsdp_shards_in_place(trainer.model)
    raw = {"model": trainer.model_state_dict()}
    optimizer = trainer.optimizer.sharded_state_dict(raw["model"], is_loading=loading,
                                                     metadata=dict(FSDP_DTENSOR_METADATA))
    inner = trainer.optimizer.optimizer
    fill_missing_adam_state(inner)
    params = [p for group in inner.param_groups for p in group["params"]]
    # The optimizer's entries refer to inner.state's own dicts: rebuilt from it, in parameter order.
    optimizer["state"] = {trainer.optimizer._param_name(p): inner.state[p] for p in params}
    raw["optimizer"] = optimizer
    return raw, preprocess_fsdp_dtensor_state(trainer.model, raw, split_swiglu)


def save_fsdp_dtensor(trainer, directory: Path) -> None:
    """Every rank: Megatron-LM's fsdp_dtensor save (~L643-655): torch.distributed.checkpoint of the
    laid-out state."""
    import torch.distributed.checkpoint as dcp

    dcp.save(fsdp_dtensor_state(trainer, loading=False)[1], checkpoint_id=str(directory))


def saved_with_fused_fc1(directory: Path) -> bool:
    """Whether a stage 2-3 checkpoint holds SwiGLU's fc1 whole (as this project wrote it before
    taking Megatron-LM's layout), read from its torch.distributed.checkpoint metadata."""
    return any(key.endswith(".mlp.linear_fc1.weight") for key in stored_tensors(directory))


def load_fsdp_dtensor(trainer, directory: Path) -> None:
    """Every rank: Megatron-LM's fsdp_dtensor load (``_load_base_checkpoint`` ~L1292-1324): the
    template laid out as the checkpoint is (Megatron-LM's halves, or a fused fc1 of this project's
    older checkpoints: :func:`saved_with_fused_fc1`), loaded in place; the halves are views of the
    local shards of the fc1 weight and its moments, so the load fills the raw state's tensors. Then,
    as Megatron-LM puts the raw dicts back for ``load_state_dict`` (~L1320-1324), the model and the
    optimizer take the raw state (the trainer's ``load_checkpoint_state``)."""
    import torch.distributed.checkpoint as dcp

    raw, state = fsdp_dtensor_state(trainer, loading=True, split_swiglu=not saved_with_fused_fc1(directory))
    dcp.load(state, checkpoint_id=str(directory))
    trainer.load_checkpoint_state(raw)


def preprocess_fsdp_dtensor_state(model, raw: dict, split_swiglu: bool = True) -> dict:
    """Megatron-LM core_v0.16.1's ``preprocess_fsdp_dtensor_state_dict`` (checkpointing.py
    ~L955-975; core_v0.19.0 ~L1380-1397 is the same), calling megatron-core's own functions:
    ``handle_fp8_extra_state_case`` (transformer-engine's ``_extra_state`` out of the model dict),
    then, where the model has a gated linear unit (its ``--swiglu`` is ``gated_linear_unit``),
    ``handle_swiglu_in_state_dict`` (megatron/core/transformer/fsdp_dtensor_checkpoint.py): every
    ``linear_fc1.weight`` of the model and its ``exp_avg`` / ``exp_avg_sq`` in two DTensors,
    ``..._w`` (the first half of its rows) and ``..._v``, each a view of this rank's part of the
    shard. It is given what Megatron-LM gives it: ``unwrap_model`` of the wrapped model
    (save_checkpoint ~L504, load_checkpoint ~L1504), which stops at MegatronFSDP (only DDP, both
    FSDPs and Float16Module are unwrapped), so that ``get_parameter(f"module.{key}")`` of a model
    key (``module.decoder...``: MegatronFSDP's child, the Float16Module) and of an optimizer name
    less its first ``module.`` (``module.module.module.decoder...``: the adapter's
    ``named_parameters``) both find the parameter. Then ``preprocess_state_dict_for_uneven_dtensor``
    (the whole dict). No MoE here: Megatron-LM's ``handle_experts_in_state_dict`` (``--num-experts``)
    does not apply. ``raw`` is left as it is (its dicts are copied; the tensors are shared)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_fp8_extra_state_case, handle_swiglu_in_state_dict
    from megatron.core.utils import unwrap_model

    state = dict(raw)
    state["model"] = dict(raw["model"])
    handle_fp8_extra_state_case(state["model"])
    unwrapped = unwrap_model(model)
    if unwrapped.config.gated_linear_unit and split_swiglu:
        _give_unsharded_parameters_their_slice(unwrapped)
        state["model"], state["optimizer"] = handle_swiglu_in_state_dict(unwrapped, state["model"], state.get("optimizer"))
        if state["optimizer"] is None:
            del state["optimizer"]
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def _give_unsharded_parameters_their_slice(module) -> None:
    """``handle_swiglu_in_state_dict`` cuts each half out of this rank's part of the flat
    parameter, ``megatron_fsdp_slice``, which Megatron-FSDP sets only where it keeps a model-weight
    buffer (param_and_grad_buffer.py ~L2603-2608 at 0.16.1); ``no_shard``, this project's
    Megatron-FSDP on one rank (cuda_trainer.wrap_cuda), keeps none, and the split raised
    AttributeError at the first save. There the rank holds the whole parameter (a replicated
    DTensor): its part is ``slice(0, numel)``, what the buffer would give for an unsharded one."""
    for p in module.parameters():
        local = getattr(p, "_local_tensor", None)
        if not hasattr(p, "megatron_fsdp_slice") and local is not None and local.numel() == p.numel():
            p.megatron_fsdp_slice = slice(0, p.numel())


def _local_numel(p: torch.Tensor) -> int:
    return getattr(p, "_local_tensor", p).numel()


def fill_missing_adam_state(inner) -> int:
    """Give every parameter of the Adam ``inner`` optimizer its state, as megatron-core may pick it
    (transformer-engine's or apex's FusedAdam: ``step`` in the param group, ``exp_avg`` and
    ``exp_avg_sq`` per parameter, made at its first gradient; torch's Adam/AdamW: the same plus a
    per-parameter ``step`` tensor). Keyed on missing state, whatever the optimizer: a parameter
    with no state, or whose local shard is empty (Megatron-FSDP gives such a shard no gradient, so
    its state never steps), gets the layout of the others' (zeros shaped like it, in their dtypes;
    the common ``step`` where the optimizer keeps one per parameter; ``exp_avg`` and
    ``exp_avg_sq`` when no parameter has state yet, plus a zero ``step`` for torch's Adam).
    Under Megatron-FSDP every rank's shard of the flat buffer holds elements of some parameter, so
    the step comes from a parameter that stepped. The state is left in parameter order, the same on
    every rank: megatron-core's ``sharded_param_state_fsdp_dtensor`` lists it in the order of
    ``state`` (distrib_optimizer.py ~L1363 at 0.16.1), where a parameter filled late would come
    last on some ranks only, and Megatron-LM's save and load pair the ranks' SwiGLU halves and
    uneven DTensors by that order (mismatched collectives, seen as a chunk-metadata assertion).
    Returns how many parameters were filled."""
    params = [p for group in inner.param_groups for p in group["params"]]
    stepped = [inner.state[p] for p in params if inner.state.get(p) and _local_numel(p)]
    template = stepped[0] if stepped else next((inner.state[p] for p in params if inner.state.get(p)), None)
    if template is None:
        template = {"exp_avg": None, "exp_avg_sq": None}
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            template["step"] = torch.tensor(0.0)
    filled = 0
    for p in params:
        if inner.state.get(p) and _local_numel(p):
            continue
        entry = {}
        for key, value in template.items():
            if key == "step" or (isinstance(value, torch.Tensor) and value.dim() == 0):
                entry[key] = value.detach().clone()
            else:
                entry[key] = torch.zeros_like(p, dtype=value.dtype if isinstance(value, torch.Tensor) else None)
        inner.state[p] = entry
        filled += 1
    if [id(p) for p in inner.state] != [id(p) for p in params]:
        ordered = [(p, inner.state[p]) for p in params]
        inner.state.clear()
        inner.state.update(ordered)
    return filled


def _saved_steps(tree) -> set:
    """The ``step`` values of every param group in a loaded optimizer state (nested dicts)."""
    if not isinstance(tree, dict):
        return set()
    found = {g["step"] for g in tree.get("param_groups", []) if isinstance(g, dict) and "step" in g}
    for value in tree.values():
        found |= _saved_steps(value)
    return found


def restore_adam_steps(optimizers, loaded: dict) -> None:
    """torch's Adam (no TE, no apex) keeps a ``step`` per parameter; the distributed optimizer saves
    it in its param groups and its ``load_state_dict`` puts it back (distrib_optimizer.py
    ~L817-825), but the ``dp_reshardable`` parameter state loaded after it copies each state's
    entries from the load template, ``step`` included (``_set_main_param_and_optimizer_states``,
    ~L911-940): the template's step, not the checkpoint's (seen: 0 after a load of step 3, the loss
    off from the second step on). Every parameter gets the saved step, as a tensor of its own
    (a shared one would advance once per parameter per step)."""
    steps = _saved_steps(loaded)
    if len(steps) != 1:
        return
    step = float(next(iter(steps)))
    for opt in optimizers:
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
