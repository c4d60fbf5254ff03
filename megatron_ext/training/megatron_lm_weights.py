"""Megatron-LM checkpoints <-> this program's megatron-core GPTModel: the model weights, both ways.

    python -c "from megatron_ext.training.megatron_lm_weights import load_megatron_lm_weights; help(load_megatron_lm_weights)"

Both programs build the same megatron-core ``GPTModel`` (TP = PP = 1), so the checkpoint's keys
are the model's own ``sharded_state_dict()`` keys, which megatron-core makes independent of the
layer spec: the local spec's ``input_layernorm`` is stored as transformer-engine's
``self_attention.linear_qkv.layer_norm_weight`` and every layer's tensors are stacked on a leading
layer axis (``decoder.layers.mlp.linear_fc1.weight`` is (L, F, h)). Reading and writing therefore
go through megatron-core's own ``dist_checkpointing`` with that sharded state dict, as Megatron-LM
core_v0.16.1 does (megatron/training/checkpointing.py):

- read (torch_dist): ``generate_state_dict`` L877-905 builds ``{"model": model.sharded_state_dict(metadata)}``
  with the metadata of ``_build_sharded_state_dict_metadata`` L401-434, ``_load_global_dist_base_checkpoint``
  L1103-1131 loads it with ``dist_checkpointing.load``, ``load_model_state_dict`` L1759-1781 puts
  ``state_dict["model"]`` into the model. Only the tensors are requested (no optimizer, no RNG, no
  ``_extra_state`` objects: what ``--finetune`` loads, L1579-1581 and L1841); each keeps the dtype it
  was saved in (bf16 from GPU runs, fp32 from CPU runs) until ``load_state_dict`` copies it into the
  model's parameters, as Megatron-LM's own load does.
- read (torch format): ``mp_rank_00/model_optim_rng.pt``, whose ``model`` is
  ``state_dict_for_save_checkpoint()`` (L911), names mapped between the local and the
  transformer-engine spec (:func:`megatron_ext.training.hf_weights.local_name`).
- write: what ``load_checkpoint`` needs to start from the weights with ``--pretrained-checkpoint``
  (L1494-1502 sets ``finetune``: iteration 0, no optimizer, scheduler or RNG state read, L1579,
  L1731, L1785, L1841): the tracker file, ``common.pt`` with ``args`` (tensor/pipeline-parallel
  sizes read at L1542-1545), ``checkpoint_version`` 3.0 and ``iteration`` (L892-895), and the
  model's sharded tensors (its ``_extra_state`` objects included, as save_checkpoint L622-656 writes them).

Side effects: reading and writing checkpoint folders; ``dist_checkpointing`` runs collectives on
the default process group (one process in the export command, every rank in a training start).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import warnings
from pathlib import Path

import torch

from megatron_ext.run_spec.checksums import write_integrity_manifest
from megatron_ext.run_spec.checkpoints import MEGATRON_LM_LATEST, iteration_dir_name
from megatron_ext.run_spec.errors import UserError
from megatron_ext.host.json_files import write_text_atomic
from megatron_ext.run_spec.megatron_lm_checkpoints import LEGACY_FILE, MegatronLMCheckpoint
from megatron_ext.training.hf_weights import local_name, to_model_names

CHECKPOINT_VERSION = 3.0
"""generate_state_dict's ``checkpoint_version`` (checkpointing.py L893); older ones need a QKV reorder."""


def sharded_metadata() -> dict:
    """The metadata Megatron-LM passes to ``model.sharded_state_dict`` without the distributed
    optimizer (``_build_sharded_state_dict_metadata``, L401-434), the CUDA trainer's torch_dist one."""
    from megatron_ext.training.cuda_checkpoint import torch_dist_metadata

    return torch_dist_metadata([])


def _sharded_tensors(module: torch.nn.Module) -> dict[str, object]:
    """The model's ShardedTensors (and ShardedTensorFactories: SwiGLU's fc1 is stored as its gate and
    up halves) by state-dict name; the ``_extra_state`` ShardedObjects left out."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {name: sh for name, sh in module.sharded_state_dict(metadata=sharded_metadata()).items()
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}


def _stored_pieces(sh) -> list:
    """The ShardedTensors one entry is stored as (a factory builds several)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return list(nested_values(sh.build())) if isinstance(sh, ShardedTensorFactory) else [sh]


def _shape(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _with_dtype(sh, dtype: torch.dtype):
    """``sh`` over a new CPU tensor of ``dtype`` (the checkpoint's): the template may be on the meta
    device or of another dtype."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = torch.empty(tuple(sh.data.shape), dtype=dtype)
    return dataclasses.replace(sh, data=data, **({"dtype": dtype} if isinstance(sh, ShardedTensor) else {}))


def _check_against(stored: dict, wanted: dict[str, object], checkpoint: MegatronLMCheckpoint, model_name: str) -> None:
    """Every tensor the model needs is there with the model's global shape, or one UserError."""
    pieces = [piece for sh in wanted.values() for piece in _stored_pieces(sh)]
    missing = sorted({piece.key for piece in pieces} - set(stored))
    if missing:
        raise UserError(f"{checkpoint.describe()} holds no {missing[0]} ({len(missing)} of the model's tensors missing): "
                        f"it is not a checkpoint of model {model_name} (a different architecture: "
                        "qk_layernorm, biases, untied embeddings or position embeddings differ)")
    for sh in pieces:
        have = tuple(stored[sh.key].global_shape)
        if have != tuple(sh.global_shape):
            hint = ("the number of layers differs" if sh.key.startswith("decoder.layers.") and have[1:] == tuple(sh.global_shape)[1:]
                    else "the vocabulary differs (padded rows included: use the tokenizer and make_vocab_size_divisible_by "
                         "the checkpoint was trained with)" if "word_embeddings" in sh.key or sh.key.startswith("output_layer")
                    else "the model's sizes differ")
            raise UserError(f"{checkpoint.describe()}: {sh.key} is {_shape(have)} there and {_shape(sh.global_shape)} in model "
                            f"{model_name}: {hint}")


def read_megatron_lm_weights(checkpoint: MegatronLMCheckpoint, module: torch.nn.Module,
                             model_name: str = "the run's") -> dict[str, torch.Tensor]:
    """The model tensors of ``checkpoint`` by the names of ``module.state_dict()`` (``module``: a
    megatron-core GPTModel of either layer spec, possibly on the meta device), in the dtype they
    were saved in. A missing tensor or a shape unlike the model's is a UserError."""
    if checkpoint.format == "torch":
        return _read_legacy(checkpoint, module, model_name)
    from megatron.core import dist_checkpointing

    wanted = _sharded_tensors(module)
    stored = dist_checkpointing.load_tensors_metadata(str(checkpoint.directory))
    _check_against(stored, wanted, checkpoint, model_name)
    request = {name: _with_dtype(sh, stored[sh.key].dtype) for name, sh in wanted.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = dist_checkpointing.load(request, str(checkpoint.directory))
    return {name: loaded[name] for name in request}  # without common.pt's entries, which load returns too


def _read_legacy(checkpoint: MegatronLMCheckpoint, module: torch.nn.Module, model_name: str) -> dict[str, torch.Tensor]:
    """The torch format: one pickled file (Megatron-LM's _load_base_checkpoint L1243-1263 unpickles it too)."""
    state = torch.load(checkpoint.directory / LEGACY_FILE, map_location="cpu", weights_only=False)
    version = state.get("checkpoint_version", 0)
    if version < CHECKPOINT_VERSION:
        raise UserError(f"{checkpoint.describe()} has checkpoint_version {version}; versions before {CHECKPOINT_VERSION} "
                        "store query/key/value in another order: load and save it once with Megatron-LM")
    if "model" not in state:
        raise UserError(f"{checkpoint.describe()} holds no 'model' (a pipeline-parallel checkpoint holds model0, model1, ...); "
                        "only pipeline-parallel size 1 is read in the torch format")
    tensors = {local_name(k): v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    own = {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    tensors = to_model_names(tensors, set(own))
    for name, want in own.items():
        if name.endswith("_extra_state"):
            continue
        if name not in tensors:
            raise UserError(f"{checkpoint.describe()} holds no {name}: it is not a checkpoint of model {model_name}")
        if tuple(tensors[name].shape) != tuple(want.shape):
            raise UserError(f"{checkpoint.describe()}: {name} is {_shape(tensors[name].shape)} there and "
                            f"{_shape(want.shape)} in model {model_name}")
    return {name: tensors[name] for name in own if name in tensors}


def stored_vocab_rows(checkpoint: MegatronLMCheckpoint) -> int | None:
    """Rows of the checkpoint's word embedding (its padded vocabulary), or None without one."""
    key = "embedding.word_embeddings.weight"
    if checkpoint.format == "torch":
        tensor = torch.load(checkpoint.directory / LEGACY_FILE, map_location="cpu", weights_only=False)["model"].get(key)
        return None if tensor is None else tensor.shape[0]
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(checkpoint.directory))
    return stored[key].global_shape[0] if key in stored else None


def load_megatron_lm_weights(module: torch.nn.Module, checkpoint: MegatronLMCheckpoint, model_name: str) -> None:
    """``checkpoint``'s weights into ``module`` (before any wrapper; every rank reads them, as every
    Megatron-LM rank does), cast to the module's dtype by ``load_state_dict``."""
    weights = read_megatron_lm_weights(checkpoint, module, model_name)
    missing, unexpected = module.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:  # _check_against already named what a checkpoint lacks; this is a bug guard
        raise UserError(f"{checkpoint.describe()}: weights missing for {missing[:3]} / not in the model {unexpected[:3]}")


def _torch_dist_writer():
    """megatron-core's torch_dist save strategy, writing synchronously through torch's own
    ``FileSystemWriter``: the same translation (megatron ShardedTensors to torch ShardedTensors, one
    key per global tensor) and planner (``MCoreSavePlanner``), hence the same files Megatron-LM reads.
    megatron-core 0.16.1's own writer (``FileSystemWriterAsync.preload_tensors``) calls
    ``torch.cuda.synchronize()``, which a torch without CUDA refuses, and writes from spawned processes."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint import FileSystemWriter, save

    class SynchronousTorchDistSave(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            save(mcore_torch.mcore_to_pyt_state_dict(flat, False), storage_writer=FileSystemWriter(str(checkpoint_dir)),
                 planner=mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return SynchronousTorchDistSave("torch_dist", 1)


def load_init_checkpoint(module: torch.nn.Module, path: str, model_name: str, announce: bool) -> MegatronLMCheckpoint:
    """``training.init_checkpoint``: find the checkpoint ``path`` names and load its weights into
    ``module`` (every rank); ``announce`` prints what was loaded."""
    from megatron_ext.run_spec.megatron_lm_checkpoints import find_megatron_lm_checkpoint

    checkpoint = find_megatron_lm_checkpoint(path)
    load_megatron_lm_weights(module, checkpoint, model_name)
    if announce:
        print(f"initialised from the Megatron-LM checkpoint {checkpoint.describe()}: iteration 0, a fresh optimizer "
              "and learning-rate schedule", flush=True)
    return checkpoint


def checkpoint_args(module: torch.nn.Module) -> argparse.Namespace:
    """``common.pt``'s ``args``: what Megatron-LM's load reads from it (parallel sizes, L1542-1545), and
    the model's sizes under Megatron-LM's argument names for whoever reads the folder."""
    config = module.config
    return argparse.Namespace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers=config.num_layers,
        hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels, padded_vocab_size=module.vocab_size,
        untie_embeddings_and_output_weights=not module.share_embeddings_and_output_weights,
        ckpt_format="torch_dist", params_dtype=module.embedding.word_embeddings.weight.dtype,
    )


def write_megatron_lm_checkpoint(module: torch.nn.Module, save_dir: Path, iteration: int) -> Path:
    """``module``'s weights as the Megatron-LM ``--save`` folder ``save_dir`` (torch_dist, its
    ``iter_NNNNNNN`` and tracker file), in the dtype of its parameters. A folder there is replaced.
    Returns the iteration folder. Every rank of the default group calls it (one process: the export)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_ext.training.megatron_core_apis import serializable_content_metadata

    target = save_dir / iteration_dir_name(iteration)
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    metadata = sharded_metadata()
    state = {"model": module.sharded_state_dict(metadata=metadata), "args": checkpoint_args(module),
             "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "num_floating_point_operations_so_far": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist_checkpointing.save(state, str(target), _torch_dist_writer(),
                                **serializable_content_metadata(dist_checkpointing.save, metadata))
    if first:  # Megatron-LM's --verify-integrity manifest (0.17.1+ loads check it), then the tracker last
        write_integrity_manifest(target)  # (Megatron-LM writes the tracker after the save, checkpointing.py L703-723)
        write_text_atomic(save_dir / MEGATRON_LM_LATEST, str(iteration))
    if dist.is_initialized():
        dist.barrier()
    return target
