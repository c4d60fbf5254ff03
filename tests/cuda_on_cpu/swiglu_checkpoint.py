"""A SwiGLU model's stage 2-3 checkpoints and Megatron-LM's own checkpointing code, both ways: one
rank of the CUDA trainer on the CPU (shim.py), under torchrun, for tests/test_fsdp_dtensor_layout.py.

    MEGATRON_LM_DIR=/path/to/megatron-lm-core_v0.16.1 python -m torch.distributed.run --nproc-per-node 2 \\
        tests/cuda_on_cpu/swiglu_checkpoint.py --stage 2,3 --out DIR
    python -m torch.distributed.run --nproc-per-node 1 tests/cuda_on_cpu/swiglu_checkpoint.py --stage 2,3 \\
        --only-ours --out DIR1

The model is the ``qwen3_smoke`` preset (SwiGLU, RMSNorm, QK-norm, grouped-query attention, tied
embeddings) in bf16 with fp32 main weights, as the CUDA trainer runs it; the data, the steps and the
Adam settings are worker.py's. Megatron-LM's ``megatron/training/checkpointing.py`` is imported
from ``MEGATRON_LM_DIR``, put after the installed packages on ``sys.path`` so that megatron-core
stays the installed one (the checkout's own ``megatron/core`` is the same release); where
megatron-core's wheel ships ``megatron/training`` itself (0.19.2) that one is found first. For
each stage, in one launch:

1. ``A`` trains steps 1-3, is saved by this project (``checkpoint.save``, ``ours_z<stage>/``) and by
   Megatron-LM's save-side code (``mlm_z<stage>/``, :func:`megatron_lm_save`), then trains on to
   step 6 (``uninterrupted``).
2. ``B``, new: this project's load of ``ours`` (``resumed``).
3. ``C``, new: Megatron-LM's load of ``ours`` (:func:`megatron_lm_load`, with the arguments its own
   parser gives for the launcher's flags); its fp32 main weights, Adam moments and steps against
   ``A``'s at the save (``read_by_megatron_lm_equal``), then steps 4-6 (``read_by_megatron_lm``).
4. ``D``, new: this project's load (the trainer's ``load_state``) of ``mlm`` (``from_megatron_lm``).

Rank 0 writes ``DIR/swiglu_z<stage>.json``: the losses, the comparison, the parameters with an
empty shard per rank, and the tensors each checkpoint holds (name -> global shape, from its
metadata). ``--only-ours``: 1-2 only, for one rank, where the trainer runs Megatron-FSDP's
``no_shard`` (cuda_trainer.wrap_cuda), whose parameters megatron-core's split cannot cut by itself
(no ``megatron_fsdp_slice``: Megatron-LM's own save and load raise AttributeError there);
``--reshard-from``: also load that launch's checkpoints (another data-parallel size).

What of Megatron-LM is not run, and why:

- ``save_checkpoint`` and ``load_checkpoint`` as a whole: around the layout they handle the RNG,
  the rerun machine, the scheduler, the tracker file and logging; ``load_checkpoint`` then checks
  the checkpoint's ``args`` against its own (``check_checkpoint_args``, core_v0.16.1
  checkpointing.py ~L1748: AttributeError on None), and this project's checkpoints hold no
  Megatron-LM ``args``, ``checkpoint_version`` or ``iteration`` (it keeps its own in meta.json and
  rank<R>.pt). For the same reason the load is given ``--no-strict-fsdp-dtensor-load`` (Megatron-LM's
  default is strict: ``Missing key in checkpoint state_dict: args``); every tensor it asks for is
  there (the two checkpoints hold the same tensors, and every weight and moment arrives).
- No RNG state (``--no-load-rng``): the model has no dropout.

What this project fills in first, as in its own saves and loads (cuda_checkpoint.py
``fill_missing_adam_state``): Adam state for every parameter, in parameter order, before
Megatron-LM's save of ``A`` and its load into ``C``. Megatron-FSDP gives a parameter whose shard on
a rank is empty no gradient, so Adam gives it no state (here 24 and 9 such parameters on the two
ranks), and Megatron-LM's template leaves it out too (its load's dummy step skips empty shards,
distrib_optimizer.py ~L1137-1152): the ranks' DTensors differ and its collectives do not pair
(NVIDIA/Megatron-LM issue 4910: its save deadlocks; seen here as a chunk-metadata assertion in the
SwiGLU split when the state was filled but left in insertion order).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_on_cpu import worker  # noqa: E402
from cuda_on_cpu.shim import cuda_on_cpu  # noqa: E402

SAVE_AT, STEPS = 3, 6
PRESET = "qwen3_smoke"


def build_swiglu(stage: int):
    """worker.build's CUDA trainer on the CPU, for the SwiGLU preset."""
    from megatron_ext.run_spec.params import TrainingParams, load_model
    from megatron_ext.run_spec.zero import ZeroStage
    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu
    from megatron_ext.training.cuda_trainer import wrap_cuda
    from megatron_ext.training.model import CPU_KERNELS, build_gpt_model

    torch.manual_seed(1234)
    install_megatron_on_cpu(1234)
    kernels = dataclasses.replace(CPU_KERNELS, device="cuda")
    module = build_gpt_model(load_model(PRESET), worker.VOCAB, worker.SEQ, params_dtype=torch.bfloat16, kernels=kernels)
    t = TrainingParams(lr=3e-3, clip_grad=1.0, weight_decay=0.01)
    return wrap_cuda(module, ZeroStage(stage), t, worker.DEVICE), t


def import_megatron_lm():
    """Megatron-LM's checkpointing module, from MEGATRON_LM_DIR after the installed packages (or
    the installed one alone, where megatron-core's wheel ships it)."""
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout and checkout not in sys.path:
        sys.path.append(checkout)
    from megatron.training import checkpointing

    return checkpointing


def megatron_lm_args(stage: int, directory: Path):
    """Megatron-LM's arguments as its own parser gives them for the launcher's flags of ``stage``
    (megatron_ext/run_spec/zero.py) and this model, loading and saving ``directory`` at
    ``SAVE_AT``; the parts of ``parse_args`` / ``validate_args`` its checkpointing reads (rank,
    world size, ``use_dist_ckpt``, no multi-storage client). ``--ckpt-step``: this project's
    checkpoints folder has its own ``latest``, not Megatron-LM's tracker file."""
    from megatron.core.msc_utils import MultiStorageClientFeature
    from megatron.training.arguments import add_megatron_arguments
    from megatron.training.utils import update_use_dist_ckpt

    from megatron_ext.run_spec.zero import megatron_lm_flags_for_stage

    world = dist.get_world_size()
    flags = [*megatron_lm_flags_for_stage(stage), "--swiglu", "--bf16", "--num-layers", "4", "--hidden-size", "128",
             "--ffn-hidden-size", "384", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--kv-channels", "32", "--normalization", "RMSNorm", "--qk-layernorm",
             "--disable-bias-linear", "--position-embedding-type", "rope", "--seq-length", str(worker.SEQ),
             "--max-position-embeddings", "256", "--micro-batch-size", str(worker.MICRO),
             "--global-batch-size", str(worker.MICRO * worker.MICRO_BATCHES), "--lr", "3e-3",
             "--load", str(directory), "--save", str(directory), "--ckpt-step", str(SAVE_AT), "--no-load-rng",
             "--no-strict-fsdp-dtensor-load"]  # see the module docstring
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(flags)
    args.rank, args.world_size, args.data_parallel_size = dist.get_rank(), world, world
    update_use_dist_ckpt(args)
    if not args.enable_msc:
        MultiStorageClientFeature.disable()
    return args


def megatron_lm_save(trainer, args) -> Path:
    """Megatron-LM core_v0.16.1's fsdp_dtensor save of ``trainer`` (``save_checkpoint``: ~L504,
    ~L577-590, ~L643-655): its unwrapped model, its metadata, its state dict, its preprocessing, a
    DCP save into ``iter_<SAVE_AT>``."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.utils import unwrap_model

    mlm = import_megatron_lm()
    model = unwrap_model([trainer.model])
    metadata = mlm._build_sharded_state_dict_metadata(args)
    state_dict = mlm.generate_state_dict(args, model, trainer.optimizer, None, None, iteration=SAVE_AT,
                                         optim_sd_kwargs=dict(metadata=metadata))
    name = mlm.get_checkpoint_name(args.save, SAVE_AT, return_base_dir=True)
    if dist.get_rank() == 0:
        mlm.ensure_directory_exists(name, check_parent=False)
    dist.barrier()
    state_dict = mlm.preprocess_fsdp_dtensor_state_dict(args, state_dict, model[0])
    dcp.save(state_dict=state_dict, storage_writer=dcp.FileSystemWriter(name))
    dist.barrier()
    return Path(name)


def megatron_lm_load(trainer, args) -> None:
    """Megatron-LM core_v0.16.1's ``load_checkpoint`` for fsdp_dtensor, up to the model and the
    optimizer: the template (its unwrapped model, ``generate_state_dict`` with ``is_loading``, the
    model under ``_model``: ~L1504, ~L1675-1710), its ``_load_base_checkpoint`` (the same
    preprocessing, its DCP load, the raw dicts put back: ~L1292-1325), then the model's and the
    optimizer's ``load_state_dict`` (~L1759-1767, ~L1794). Its ``load_checkpoint`` as a whole then
    checks the checkpoint's ``args`` against its own (``check_checkpoint_args``, ~L1748), which this
    project's checkpoints do not hold (see the module docstring)."""
    from megatron.core.utils import unwrap_model

    mlm = import_megatron_lm()
    model = unwrap_model([trainer.model])
    metadata = mlm._build_sharded_state_dict_metadata(args)
    template = mlm.generate_state_dict(args, model=model, optimizer=trainer.optimizer, opt_param_scheduler=None,
                                       rng_state=None, optim_sd_kwargs=dict(metadata=metadata, is_loading=True),
                                       rerun_state={}, iteration=1)
    template["_model"] = model
    state_dict, _, _, kind = mlm._load_base_checkpoint(args.load, args, rank0=False, sharded_state_dict=template)
    assert kind == mlm.CheckpointType.FSDP_DTENSOR, kind
    trainer.model.load_state_dict(state_dict["model"], strict=True)
    trainer.optimizer.load_state_dict(state_dict["optimizer"])


def weights_and_moments(trainer) -> list[torch.Tensor]:
    """This rank's part of every fp32 main weight and of its Adam state (``exp_avg``,
    ``exp_avg_sq``, ``step``), in the optimizer's parameter order."""
    inner = trainer.optimizer.optimizer
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            out.append(getattr(p, "_local_tensor", p).detach().clone())
            for key in ("exp_avg", "exp_avg_sq", "step"):
                value = inner.state[p][key]
                out.append(getattr(value, "_local_tensor", value).detach().clone())
    return out


def empty_shards(trainer) -> int:
    """Parameters whose local shard on this rank is empty (no gradient, so no Adam state)."""
    return sum(1 for group in trainer.optimizer.optimizer.param_groups for p in group["params"]
               if getattr(p, "_local_tensor", p).numel() == 0)


def stored_tensors(checkpoint: Path) -> dict[str, list[int]]:
    """The tensors a torch.distributed.checkpoint holds: name -> global shape."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {k: list(v.size) for k, v in stored.items() if hasattr(v, "size")}


def both_ways(stage: int, out: Path, megatron_lm: bool = True, reshard_from: Path | None = None) -> dict:
    """Steps 1-4 of the module docstring (1-2 without ``megatron_lm``); with ``reshard_from``, a
    new trainer also loads ``reshard_from/ours_z<stage>`` (another data-parallel size) and trains
    steps 4-6 (``resharded``)."""
    from megatron_ext.run_spec.checkpoints import CheckpointMeta, iteration_dir_name
    from megatron_ext.training import checkpoint
    import torch.distributed.checkpoint as dcp

    from megatron_ext.training.cuda_checkpoint import fill_missing_adam_state, fsdp_dtensor_state

    ours, theirs = out / f"ours_z{stage}", out / f"mlm_z{stage}"
    after = range(SAVE_AT + 1, STEPS + 1)
    result: dict = {}

    a, t = build_swiglu(stage)
    result["empty_shards"] = worker.every_rank(empty_shards(a))
    result["uninterrupted"] = worker.run_steps(a, t, range(1, SAVE_AT + 1))
    meta = CheckpointMeta(iteration=SAVE_AT, consumed_samples=0, world_size=dist.get_world_size(), zero_stage=stage,
                          global_batch_size=worker.MICRO * worker.MICRO_BATCHES, device="cuda")
    checkpoint.save(a, ours, meta, keep=2)  # fills A's missing Adam state (fill_missing_adam_state)
    saved = weights_and_moments(a)
    fused = out / f"fused_z{stage}"  # the layout this project wrote before Megatron-LM's: fc1 whole
    dcp.save(fsdp_dtensor_state(a, loading=False, split_swiglu=False)[1], checkpoint_id=str(fused))
    if megatron_lm:
        result["megatron_lm_checkpointing"] = import_megatron_lm().__file__
        written = megatron_lm_save(a, megatron_lm_args(stage, theirs))
    result["uninterrupted"].update({s: worker.train_step(a, t, s) for s in after})

    b, t = build_swiglu(stage)
    checkpoint.load(b, ours, SAVE_AT)
    result["resumed"] = worker.run_steps(b, t, after)
    e, t = build_swiglu(stage)
    e.load_state(fused)
    result["from_fused"] = worker.run_steps(e, t, after)

    if megatron_lm:
        c, t = build_swiglu(stage)
        fill_missing_adam_state(c.optimizer.optimizer)  # see the module docstring
        megatron_lm_load(c, megatron_lm_args(stage, ours))
        loaded = weights_and_moments(c)
        result["read_by_megatron_lm_equal"] = worker.every_rank(
            len(loaded) == len(saved) and all(torch.equal(x, y) for x, y in zip(saved, loaded)))
        result["read_by_megatron_lm"] = worker.run_steps(c, t, after)

        d, t = build_swiglu(stage)
        d.load_state(written)
        result["from_megatron_lm"] = worker.run_steps(d, t, after)
        if dist.get_rank() == 0:
            result["megatron_lm_tensors"] = stored_tensors(written)

    if reshard_from:
        r, t = build_swiglu(stage)
        checkpoint.load(r, reshard_from / f"ours_z{stage}", SAVE_AT)
        result["resharded"] = worker.run_steps(r, t, after)
    if dist.get_rank() == 0:
        result["ours_tensors"] = stored_tensors(ours / iteration_dir_name(SAVE_AT))
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=worker.stages, required=True, help="2, 3, or both: 2,3")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only-ours", action="store_true",
                   help="this project's save and load only (one rank: see the module docstring)")
    p.add_argument("--reshard-from", type=Path, help="the --out of a launch at another data-parallel size")
    args = p.parse_args()
    from megatron_ext.import_hooks import eager_jit_fuser

    eager_jit_fuser()
    dist.init_process_group("gloo")
    with cuda_on_cpu():
        from megatron.core import parallel_state

        from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu

        parallel_state.initialize_model_parallel(1, 1)
        install_megatron_on_cpu(1234)
        for stage in args.stage:
            result = both_ways(stage, args.out, not args.only_ours, args.reshard_from)
            if dist.get_rank() == 0:
                (args.out / f"swiglu_z{stage}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
