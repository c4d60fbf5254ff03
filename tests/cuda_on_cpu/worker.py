"""One rank of the CUDA trainer on the CPU (see shim.py), under torchrun, for tests/test_cuda_trainer_on_cpu.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/cuda_on_cpu/worker.py resume --stage 1 --out DIR

``resume``: train ``--steps`` steps from a fixed initialisation and fixed batches, saving a
checkpoint after ``--save-at``; then a new model and trainer load it and train on to ``--steps``
(and the ways this project once did it, at stage 1 and stages 2-3); ``nan``: rank 1's loss (so
its gradients) NaN at the second step, each rank that stops writing ``nan_rank<R>.json``;
``gathers``: Megatron-FSDP's parameter all-gathers per step of 1 and of 4 micro-batches, with the
adapter's default units and with TransformerLayer as the unit (what this project once passed at
stage 2). Rank 0 writes ``DIR/<mode>_z<stage>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_on_cpu.shim import cuda_on_cpu  # noqa: E402

VOCAB, SEQ, MICRO = 256, 32, 2


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return tokens.to(DEVICE), torch.arange(SEQ).unsqueeze(0).expand(MICRO, -1).to(DEVICE)


DEVICE = torch.device("cpu")
"""The shim's CPU, or (``--device cuda``, a real GPU) this rank's GPU."""


def build(stage: int, units: str = "default"):
    from megatron_ext.run_spec.params import TrainingParams, load_model
    from megatron_ext.run_spec.zero import ZeroStage
    from megatron_ext.training.cuda_trainer import wrap_cuda
    from megatron_ext.training.model import CPU_KERNELS, build_gpt_model, choose_kernels, transformer_engine_available

    torch.manual_seed(1234)
    kernels = (dataclasses.replace(CPU_KERNELS, device="cuda") if DEVICE.type == "cpu" else
               choose_kernels(True, transformer_engine_available(), stage))
    module = build_gpt_model(load_model("gpt_smoke"), VOCAB, SEQ, params_dtype=torch.bfloat16, kernels=kernels)
    if DEVICE.type == "cuda":
        module.cuda()
    t = TrainingParams(lr=3e-3, clip_grad=1.0, weight_decay=0.01)
    if units == "default":
        return wrap_cuda(module, ZeroStage(stage), t, DEVICE), t
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter  # what this project once passed at stages 2 and 3
    from megatron.core.transformer.transformer_layer import TransformerLayer

    original = mcore_fsdp_adapter.FullyShardedDataParallel.__init__

    def with_layer_units(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "fsdp_unit_modules": [TransformerLayer]})

    mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = with_layer_units
    try:
        return wrap_cuda(module, ZeroStage(stage), t, DEVICE), t
    finally:
        mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = original


def train_step(trainer, t, step: int, accumulation: int = 2, nan_on: int | None = None) -> float:
    """One optimizer step; ``nan_on``: that rank's loss (so its gradients) is NaN."""
    trainer.zero_grad()
    total = torch.zeros(1, device=DEVICE)
    for micro in range(accumulation):
        with trainer.sync_context(micro == accumulation - 1):
            tokens, positions = batch(step, micro)
            loss = trainer.model(tokens, positions, None, labels=tokens).float().mean()
            if nan_on is not None and nan_on % dist.get_world_size() == dist.get_rank():
                loss = loss * float("nan")
            total += loss.detach() / accumulation
            (loss / accumulation).backward()
    trainer.last_loss = total
    trainer.step(t.lr, t.weight_decay)
    mean = total.clone()
    dist.all_reduce(mean)
    return float(mean.cpu()) / dist.get_world_size()


def main_params(trainer) -> list[torch.Tensor]:
    """What the optimizer updates: its fp32 main parameters (this rank's shards)."""
    return [getattr(p, "_local_tensor", p).detach().clone() for opt in trainer.optimizers
            for group in opt.optimizer.param_groups for p in group["params"]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["resume", "nan", "gathers"])
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: a real GPU, NCCL, no shim")
    args = p.parse_args()
    global DEVICE
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        DEVICE = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=DEVICE)
    else:
        dist.init_process_group("gloo")
    with cuda_on_cpu() if args.device == "cpu" else contextlib.nullcontext():
        from megatron.core import parallel_state

        from megatron_ext.run_spec.checkpoints import CheckpointMeta, iteration_dir_name
        from megatron_ext.training import checkpoint
        from megatron_ext.training.cpu_compat import install_cpu_compat

        parallel_state.initialize_model_parallel(1, 1)
        install_cpu_compat(1234)
        if args.mode == "gathers":
            result = {units: gathers_per_step(args.stage, units) for units in ("default", "layers")}
        elif args.mode == "nan":
            result = nan_step(args.stage)
            (args.out / f"nan_rank{dist.get_rank()}.json").write_text(json.dumps(result))
            os._exit(1 if result["error"] else 0)  # none goes on to a collective its peers left
        else:
            trainer, t = build(args.stage)
            checkpoints = args.out / f"checkpoints_z{args.stage}"
            meta = CheckpointMeta(iteration=args.save_at, consumed_samples=0, world_size=dist.get_world_size(),
                                  zero_stage=args.stage, global_batch_size=MICRO * 2 * dist.get_world_size(), device="cuda")
            uninterrupted = {}
            for step in range(1, args.steps + 1):
                uninterrupted[step] = train_step(trainer, t, step)
                if step == args.save_at:
                    checkpoint.save(trainer, checkpoints, meta, keep=2)
            result = {"uninterrupted": uninterrupted,
                      "files": sorted(f.name for f in (checkpoints / iteration_dir_name(args.save_at)).iterdir())}
            if args.stage >= 2:  # what this project once did with the optimizer's state at stages 2-3
                probe, t = build(args.stage)
                train_step(probe, t, 1)
                try:
                    probe.optimizer.load_state_dict(probe.optimizer.state_dict())
                    result["state_dict_roundtrip"] = None
                except Exception as exc:
                    result["state_dict_roundtrip"] = f"{type(exc).__name__}: {exc}"
            trainer, t = build(args.stage)  # a new model and optimizer, from the checkpoint on disk
            checkpoint.load(trainer, checkpoints, args.save_at)
            result["resumed"] = {step: train_step(trainer, t, step) for step in range(args.save_at + 1, args.steps + 1)}
            if args.stage == 1:  # what this project once did at stage 1: each optimizer's state_dict() alone
                trainer, t = build(args.stage)
                trainer.load_rank_local_state = lambda saved: [opt.load_state_dict(entry["optimizer"]) for opt, entry
                                                               in zip(trainer.optimizers, saved)]
                checkpoint.load(trainer, checkpoints, args.save_at)
                try:
                    result["state_dict_only"] = {step: train_step(trainer, t, step)
                                                 for step in range(args.save_at + 1, args.steps + 1)}
                except RuntimeError as exc:
                    result["state_dict_only"] = f"{type(exc).__name__}: {exc}"
    if dist.get_rank() == 0:
        (args.out / f"{args.mode}_z{args.stage}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def nan_step(stage: int) -> dict:
    """Rank 1's loss NaN at the second step: who stops, why, and whether the update was applied."""
    trainer, t = build(stage)
    train_step(trainer, t, 1)
    weights = main_params(trainer)
    try:
        train_step(trainer, t, 2, nan_on=1)
        return {"error": None}
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "unchanged": all(torch.equal(a, b) for a, b in
                                                                          zip(weights, main_params(trainer)))}


def gathers_per_step(stage: int, units: str) -> list[int]:
    """Megatron-FSDP's parameter all-gathers in a step of 1 and of 4 micro-batches."""
    trainer, t = build(stage, units)
    train_step(trainer, t, 1)
    counts = []
    for step, accumulation in ((2, 1), (3, 4)):
        counted = {"n": 0}
        original = torch.distributed.all_gather_into_tensor

        def counting(*a, **k):
            counted["n"] += 1
            return original(*a, **k)

        torch.distributed.all_gather_into_tensor = counting
        try:
            train_step(trainer, t, step, accumulation=accumulation)
        finally:
            torch.distributed.all_gather_into_tensor = original
        counts.append(counted["n"])
    return counts


if __name__ == "__main__":
    main()
