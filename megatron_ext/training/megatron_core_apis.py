"""Where megatron-core's APIs moved between the tested releases (0.14-0.19), and the one way this
project meets each. Nothing else in the project checks versions; each entry detects the feature
itself rather than comparing version numbers.

- RoPE's move of ``inv_freq`` to ``torch.cuda.current_device()`` (which the CPU path must avoid):
  in ``RotaryEmbedding.forward`` up to 0.15, in ``RotaryEmbedding.get_emb`` from 0.16.
- The distributed optimizer's ``dp_reshardable`` checkpoint layout (Megatron-LM's default for
  ``--ckpt-format torch_dist`` from core_v0.15) arrived in 0.15; on 0.14 Megatron-LM's fully
  parallel save wrote ``fully_sharded_model_space`` (core_v0.14.0 checkpointing.py
  ``_build_sharded_state_dict_metadata``).
- ``dist_checkpointing.save``'s ``content_metadata`` (the sharding type, read back on load) is
  passed only where the release takes it.
- Megatron-FSDP's ``get_mesh_names`` reads torch's DeviceMesh bookkeeping
  (``_mesh_resources.child_to_root_mapping``) unguarded in 0.14; from 0.15 it asks the root mesh
  first. Newer torch (2.13 here) has no such attribute: 0.14's Megatron-FSDP cannot start there.
- Megatron-FSDP swaps the module's parameters between the gathered ones (forward) and the
  optimizer's DTensor shards; its state_dict pre-hook swaps the shards back in. 0.16 registers it on
  every submodule; 0.15 only on the wrapped module, a Float16Module whose ``state_dict`` bypasses
  its own hooks: after a step the state dict held the gathered weights and the optimizer's
  ``sharded_state_dict`` could not name its parameters (AssertionError in ``_param_name``).
"""

from __future__ import annotations

import functools
import inspect

import torch


def rotary_method_that_moves_inv_freq(rotary_cls) -> str:
    """``get_emb`` (megatron-core >= 0.16) or ``forward`` (0.14-0.15)."""
    return "get_emb" if "get_emb" in vars(rotary_cls) else "forward"


def keep_rotary_on_module_device(rotary_cls) -> None:
    """Make RoPE keep ``inv_freq`` where the module lives (the CPU): during the method that would
    move it to ``torch.cuda.current_device()``, that call answers ``"cpu"``. Idempotent."""
    name = rotary_method_that_moves_inv_freq(rotary_cls)
    method = getattr(rotary_cls, name)
    if getattr(method, "_keeps_module_device", False):
        return

    @functools.wraps(method)
    def on_module_device(self, *args, **kwargs):
        real = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = real

    on_module_device._keeps_module_device = True
    setattr(rotary_cls, name, on_module_device)


def distributed_optimizer_sharding_type(optimizer) -> str:
    """``"dp_reshardable"`` (megatron-core >= 0.15) or ``"fully_sharded_model_space"`` (0.14): the
    distributed optimizer's torch_dist layout with Megatron-LM's fully parallel save."""
    return "dp_reshardable" if hasattr(optimizer, "get_parameter_state_dp_reshardable") else "fully_sharded_model_space"


def serializable_content_metadata(save, metadata: dict) -> dict:
    """``{"content_metadata": ...}`` for ``dist_checkpointing.save`` where it takes one (without the
    process group, as Megatron-LM's ``_clean_metadata_for_serialization``), else nothing."""
    if "content_metadata" not in inspect.signature(save).parameters:
        return {}
    return {"content_metadata": {k: v for k, v in metadata.items() if k != "dp_cp_group"}}


def mcore_async_strategy(save) -> dict:
    """``{"async_strategy": "mcore"}`` for ``dist_checkpointing.save`` where it takes one: from
    core_v0.17 its default is ``"nvrx"``, which needs nvidia-resiliency-ext and schedules on that
    package's own queue (serialization.py ~L311 at 0.17.1); Megatron-LM passes ``--async-strategy``
    (checkpointing.py ~L835 at core_v0.19.0), which this project renders as ``mcore``."""
    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}


def megatron_fsdp_incompatibility() -> str | None:
    """Why this megatron-core's Megatron-FSDP cannot run on this torch, or None."""
    from torch.distributed.device_mesh import _mesh_resources

    if hasattr(_mesh_resources, "child_to_root_mapping"):
        return None
    from megatron.core.distributed.fsdp.src.megatron_fsdp import utils

    if "_get_root_mesh" in inspect.getsource(utils.get_mesh_names):
        return None
    import torch

    return (f"this megatron-core's Megatron-FSDP reads torch.distributed.device_mesh._mesh_resources."
            f"child_to_root_mapping, which torch {torch.__version__} no longer has (megatron-core 0.15 and later do not need it)")


def with_fsdp_shards_in_place(model) -> None:
    """What Megatron-FSDP's state_dict pre-hook does (``_replace_param_with_distributed_if_needed``,
    megatron_fsdp.py, idempotent), done before a state dict is taken on every release."""
    model.module._replace_param_with_distributed_if_needed()
