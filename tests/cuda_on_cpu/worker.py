"""One rank of the CUDA trainer on the CPU (see shim.py), under torchrun, for tests/test_cuda_trainer_on_cpu.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/cuda_on_cpu/worker.py resume --stage 1 --out DIR
    python -m torch.distributed.run --nproc-per-node 2 tests/cuda_on_cpu/worker.py resume --stage 0,1,2,3 --out DIR

Several stages (``--stage 0,1,2,3``), several modes (``gathers fusion``) and several optimizers
(``--optimizer apex,te``, for ``resume``; the other modes run first, with torch's Adam) run one after
another in one launch: every model is built anew, and the tests pay megatron-core's import once
instead of once per combination (CI time).

Every step trains on the same global batch of 4 micro-batches of 2 sequences, whatever the number
of ranks (rank r takes micro-batches r x a ... r x a + a - 1, a = 4 / ranks), so runs at different
data-parallel sizes see the same data. The first step of every start runs inside the trainer's
``first_iteration()``, as the training loop does.

``resume``: train ``--steps`` steps, saving a checkpoint after ``--save-at``; then a new model and
trainer load it and train on to ``--steps``; with ``--reshard-from DIR``, a new model and trainer
also load that checkpoint (``DIR/checkpoints_z<stage>``: the ``--out`` of a launch at another
data-parallel size), and train on from there
(``--only-reshard``: only that). With 2 ranks it also records what megatron-core leaves to its
caller (stage 1: the load template without the Adam state filled; stages 2-3: the optimizer's
state_dict round trip, the parameters without Adam state before the save), and at stage 1 the
parameter gathers dispatched in the first and second step after the load. ``--optimizer apex|te``:
megatron-core picks a stand-in of that FusedAdam (fused_adam.py). ``nan``: rank 1's loss (so its
gradients) NaN at the second step, each rank that stops writing ``nan_rank<R>.json``;
``gathers``: Megatron-FSDP's parameter all-gathers and gradient-norm computations per step of 1
and of 4 micro-batches, with the adapter's default units and with TransformerLayer as the unit (what
this project once passed at stage 2); ``fusion``: stage 2 with gradient-accumulation fusion on
(a stand-in for apex's extension, which megatron-core's layers only check for), fp32 and bf16
gradient reduction, tied and untied embeddings, against the unfused run. Rank 0 writes
``DIR/<mode>_z<stage>.json`` (``resume_z<stage>_<optimizer>.json`` with apex's or te's).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_on_cpu.shim import cuda_on_cpu  # noqa: E402

VOCAB, SEQ, MICRO = 256, 32, 2
MICRO_BATCHES = 4
"""Micro-batches per optimizer step over all ranks."""

DEVICE = torch.device("cpu")
"""The shim's CPU, or (``--device cuda``, a real GPU) this rank's GPU."""


def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of the global batch of ``step``: the same at any data-parallel size."""
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return tokens.to(DEVICE), torch.arange(SEQ).unsqueeze(0).expand(MICRO, -1).to(DEVICE)


def build(stage: int, units: str = "default", tied: bool = True, **training):
    from megatron_ext.run_spec.params import TrainingParams, load_model
    from megatron_ext.run_spec.zero import ZeroStage
    from megatron_ext.training.cuda_trainer import shard_one_rank_asked, wrap_cuda
    from megatron_ext.training.model import (CPU_KERNELS, build_gpt_model, choose_kernels, installed_megatron_core,
                                             transformer_engine_version)

    torch.manual_seed(1234)  # the same initialisation for every model a process builds:
    if DEVICE.type == "cpu":  # the model-parallel RNG tracker too (the shim's, or megatron-core's own)
        from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu

        install_megatron_on_cpu(1234)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    fusion = training.pop("gradient_accumulation_fusion", False)
    kernels = (dataclasses.replace(CPU_KERNELS, device="cuda", gradient_accumulation_fusion=fusion)
               if DEVICE.type == "cpu" else choose_kernels(True, transformer_engine_version(), stage,
                                                         megatron_core=installed_megatron_core()))
    preset = load_model("gpt_smoke") if tied else dataclasses.replace(load_model("gpt_smoke"), tie_embeddings=False)
    module = build_gpt_model(preset, VOCAB, SEQ, params_dtype=torch.bfloat16, kernels=kernels)
    if DEVICE.type == "cuda":
        module.cuda()
    t = TrainingParams(**{"lr": 3e-3, "clip_grad": 1.0, "weight_decay": 0.01, **training})
    shard_one_rank = shard_one_rank_asked(os.environ)  # as the program reads MEGATRON_EXT_SHARD_ONE_RANK
    if units == "default":
        return wrap_cuda(module, ZeroStage(stage), t, DEVICE, shard_one_rank), t
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter  # what this project once passed at stages 2 and 3
    from megatron.core.transformer.transformer_layer import TransformerLayer

    original = mcore_fsdp_adapter.FullyShardedDataParallel.__init__

    def with_layer_units(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "fsdp_unit_modules": [TransformerLayer]})

    mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = with_layer_units
    try:
        return wrap_cuda(module, ZeroStage(stage), t, DEVICE, shard_one_rank), t
    finally:
        mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = original


def train_step(trainer, t, step: int, accumulation: int | None = None, nan_on: int | None = None) -> float:
    """One optimizer step on this rank's micro-batches of the global batch; ``nan_on``: that
    rank's loss (so its gradients) is NaN. Returns the mean loss over all micro-batches."""
    world, rank = dist.get_world_size(), dist.get_rank()
    accumulation = accumulation or MICRO_BATCHES // world
    trainer.zero_grad()
    total = torch.zeros(1, device=DEVICE)
    for micro in range(accumulation):
        with trainer.sync_context(micro == accumulation - 1):
            tokens, positions = batch(step, rank * accumulation + micro)
            loss = trainer.model(tokens, positions, None, labels=tokens).float().mean()
            if nan_on is not None and nan_on % world == rank:
                loss = loss * float("nan")
            total += loss.detach() / accumulation
            (loss / accumulation).backward()
    trainer.last_loss = total
    trainer.step(t.lr, t.weight_decay)
    mean = total.clone()
    dist.all_reduce(mean)
    return float(mean.cpu()) / world


def run_steps(trainer, t, steps, each=None) -> dict[int, float]:
    """``steps`` in order, the first inside ``first_iteration()`` (the loop's first step of a
    start); ``each(step)``: a context around each step."""
    losses = {}
    for i, step in enumerate(steps):
        with trainer.first_iteration() if i == 0 else contextlib.nullcontext(), \
                each(step) if each else contextlib.nullcontext():
            losses[step] = train_step(trainer, t, step)
    return losses


def main_params(trainer) -> list[torch.Tensor]:
    """What the optimizer updates: its fp32 main parameters (this rank's shards)."""
    return [getattr(p, "_local_tensor", p).detach().clone() for opt in trainer.optimizers
            for group in opt.optimizer.param_groups for p in group["params"]]


@contextlib.contextmanager
def counting(owner, name: str, counts: list[int]):
    """Count the calls of ``owner.name`` inside the block into a new entry of ``counts``."""
    original = getattr(owner, name)
    counts.append(0)

    def counted(*a, **k):
        counts[-1] += 1
        return original(*a, **k)

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


def every_rank(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def resume(args, stage: int, suffix: str = "") -> dict:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from megatron_ext.run_spec.checkpoints import CheckpointMeta, iteration_dir_name
    from megatron_ext.training import checkpoint, cuda_checkpoint

    world = dist.get_world_size()
    result: dict = {}
    checkpoints = args.out / f"checkpoints_z{stage}{suffix}"
    after = range(args.save_at + 1, args.steps + 1)
    if not args.only_reshard:
        trainer, t = build(stage)
        meta = CheckpointMeta(iteration=args.save_at, consumed_samples=0, world_size=world, zero_stage=stage,
                              global_batch_size=MICRO * MICRO_BATCHES, device="cuda")
        result["uninterrupted"] = run_steps(trainer, t, range(1, args.save_at + 1))
        if stage >= 2:  # Megatron-FSDP: parameters whose local shard got no gradient, so no Adam state
            inner = trainer.optimizer.optimizer
            result["without_state"] = every_rank(sum(1 for g in inner.param_groups for p in g["params"]
                                                     if not inner.state.get(p)))
        # Stage 0 in the background (megatron-core's asynchronous torch_dist save; stage 2 asks for
        # it and is written synchronously, as the trainer writes stages 2-3), 1 and 3 synchronously.
        if not cuda_checkpoint.ASYNC_CALLS:  # megatron-core's forking caller: it keeps this shim, which its
            # persistent worker (spawned, setting a CUDA device first) has not
            cuda_checkpoint.ASYNC_CALLS.append(AsyncCallsQueue(persistent=False))
        checkpoint.save(trainer, checkpoints, meta, keep=2, background=stage % 2 == 0)
        result["uninterrupted"].update({s: train_step(trainer, t, s) for s in after})
        result["files"] = sorted(f.name for f in (checkpoints / iteration_dir_name(args.save_at)).iterdir())
        if world > 1:
            result.update(probes(stage))
        trainer, t = build(stage)  # a new model and optimizer, from the checkpoint on disk
        checkpoint.load(trainer, checkpoints, args.save_at)
        gathers: list[int] = []
        result["resumed"] = run_steps(trainer, t, after,
                                      lambda step: counting(_ParamAndGradBucketGroup, "start_param_sync", gathers))
        result["gathers_after_load"] = gathers[:2]
    if args.reshard_from:
        trainer, t = build(stage)
        checkpoint.load(trainer, args.reshard_from / f"checkpoints_z{stage}{suffix}", args.save_at)
        result["resharded"] = run_steps(trainer, t, after)
    return result


def probes(stage: int) -> dict:
    """What megatron-core leaves to its caller, shown on a new model and optimizer."""
    from megatron_ext.training import cuda_checkpoint

    probe, t = build(stage)
    if stage == 1:  # megatron-core's own template for a torch_dist load, as Megatron-LM builds it
        metadata = cuda_checkpoint.torch_dist_metadata(probe.optimizers)
        try:
            probe.optimizer.sharded_state_dict({"model": probe.module.sharded_state_dict(metadata=metadata)},
                                               is_loading=True, metadata=metadata)
            return {"unfilled_template": None}
        except Exception as exc:
            return {"unfilled_template": f"{type(exc).__name__}: {exc}"}
    if stage >= 2:  # what this project once did with the optimizer's state at stages 2-3
        train_step(probe, t, 1)
        try:
            probe.optimizer.load_state_dict(probe.optimizer.state_dict())
            return {"state_dict_roundtrip": None}
        except Exception as exc:
            return {"state_dict_roundtrip": f"{type(exc).__name__}: {exc}"}
    return {}


def nan_step(stage: int) -> dict:
    """Rank 1's loss NaN at the second step: who stops, why, and whether the update was applied."""
    trainer, t = build(stage)
    run_steps(trainer, t, [1])
    weights = main_params(trainer)
    try:
        train_step(trainer, t, 2, nan_on=1)
        return {"error": None}
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "unchanged": all(torch.equal(a, b) for a, b in
                                                                          zip(weights, main_params(trainer)))}


def gathers_per_step(stage: int, units: str) -> dict:
    """Megatron-FSDP's parameter all-gathers and global gradient-norm computations in a step of 1
    and of 4 micro-batches."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    trainer, t = build(stage, units)
    run_steps(trainer, t, [1])
    gathers, norms = [], []
    for step, accumulation in ((2, 1), (3, 4)):
        with counting(torch.distributed, "all_gather_into_tensor", gathers), \
                counting(mcore_optimizer, "get_grad_norm_fp32", norms):
            train_step(trainer, t, step, accumulation=accumulation)
    return {"gathers": gathers, "norms": norms}


def fusion(stage: int) -> dict:
    """Gradient-accumulation fusion under Megatron-FSDP: megatron-core's layers check for apex's
    extension at construction (a stand-in module here: Megatron-FSDP's path never calls it) and
    write the weight gradient with torch.matmul(out=main_grad)."""
    from megatron.core.tensor_parallel import layers

    sys.modules.setdefault("fused_weight_gradient_mlp_cuda", types.ModuleType("fused_weight_gradient_mlp_cuda"))
    layers._grad_accum_fusion_available = True
    # The fused backward allocates its dummy weight gradient on torch.cuda.current_device() inside
    # autograd's backward, where the shim's TorchFunctionMode does not reach: there it names the CPU.
    current_device = torch.cuda.current_device
    result = {}
    for name, fused, bf16, tied in (("unfused_bf16", False, True, True), ("fused_bf16", True, True, True),
                                    ("fused_fp32", True, False, True), ("unfused_bf16_untied", False, True, False),
                                    ("fused_bf16_untied", True, True, False)):
        trainer, t = build(stage, tied=tied, gradient_accumulation_fusion=fused, grad_reduce_in_bf16=bf16)
        torch.cuda.current_device = lambda: "cpu"
        try:
            result[name] = run_steps(trainer, t, [1, 2, 3])
        except RuntimeError as exc:
            result[name] = f"{type(exc).__name__}: {exc}"
        finally:
            torch.cuda.current_device = current_device
    return result


KINDS = {  # torch.distributed.ProcessGroup method -> (kind, how to read the full buffer's tensors from its arguments)
    "allreduce": ("all_reduce", lambda a: a[0]),
    "allreduce_coalesced": ("all_reduce", lambda a: a[0]),
    "reduce_scatter": ("reduce_scatter", lambda a: [t for ts in a[1] for t in ts]),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: [a[1]]),
    "reduce_scatter_single": ("reduce_scatter", lambda a: [a[1]]),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: a[1]),
    "reduce_scatter_single_coalesced": ("reduce_scatter", lambda a: a[1]),
    "allgather": ("all_gather", lambda a: [t for ts in a[0] for t in ts]),
    "_allgather_base": ("all_gather", lambda a: [a[0]]),
    "all_gather_single": ("all_gather", lambda a: [a[0]]),
    "allgather_into_tensor_coalesced": ("all_gather", lambda a: a[0]),
    "all_gather_single_coalesced": ("all_gather", lambda a: a[0]),
    "allgather_coalesced": ("all_gather", lambda a: [t for ts in a[0] for t in ts]),
    "broadcast": ("broadcast", lambda a: a[0]),
    "alltoall_base": ("all_to_all", lambda a: [a[1]]),
}

@contextlib.contextmanager
def counting_collectives(log: list[tuple[str, str, int]], single_rank_groups: bool = False):
    """Append (kind, dtype, bytes of the full buffer) to ``log`` for every collective in the block
    on a group of more than one rank (megatron-core's cross entropy all-reduces over the
    tensor-parallel group, one rank here: no traffic), or of any size with ``single_rank_groups``
    (one rank's reductions still show their dtype). On torch.distributed.ProcessGroup's methods,
    which every torch.distributed function reaches however megatron-core names it (its DDP binds
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to module globals at import,
    param_and_grad_buffer.py ~L33-42: counters on the module's functions miss those); used by
    ``precision`` and benchmarks/dp_traffic.py."""
    pg = dist.ProcessGroup
    saved = {name: vars(pg)[name] for name in KINDS if name in vars(pg)}  # descriptors: a pybind method read with
    # getattr is a bare builtin, which drops ``self`` once set back on the class

    def counted(name, descriptor):
        kind, buffers = KINDS[name]

        def collective(self, *args, **kwargs):
            method = descriptor.__get__(self, type(self))
            if self.size() == 1 and not single_rank_groups:
                return method(*args, **kwargs)
            tensors = [t for t in buffers(args) if t is not None]
            size = sum(t.numel() * t.element_size() for t in tensors)
            log.append((kind, str(tensors[0].dtype).removeprefix("torch.") if tensors else "-", size))
            return method(*args, **kwargs)
        return collective

    for name, descriptor in saved.items():
        setattr(pg, name, counted(name, descriptor))
    try:
        yield
    finally:
        for name, descriptor in saved.items():
            setattr(pg, name, descriptor)


def precision(stage: int) -> dict:
    """What gradient precision megatron-core was told and what it did, with fp32 reduction (the
    default) and with ``grad_reduce_in_bf16``: Megatron-FSDP's mixed-precision policy where the
    release has one, the dtype of the main gradients after a step's backward (each parameter's
    ``main_grad`` under DDP, Megatron-FSDP's gradient buffers), and the
    dtypes the gradient collectives were given (the loss's own all-reduce aside: fp32), the first
    step's gradient norm and Megatron-FSDP's sharding strategy (one rank: ``no_shard`` unless
    MEGATRON_EXT_SHARD_ONE_RANK=1, cuda_trainer.one_rank_strategy)."""
    result = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        trainer, t = build(stage, grad_reduce_in_bf16=bf16)
        policy = getattr(trainer.model, "mp_policy", None)
        log: list[tuple[str, str, int]] = []
        main_grads: set[str] = set()
        norms: list[float] = []
        original_step = trainer.step

        def step_after_reading(lr, wd):  # after the last backward and the reduction it started
            trainer.model.finish_grad_sync()
            buffer = getattr(trainer.model.module, "param_and_grad_buffer", None)  # Megatron-FSDP's
            grads = ([g.main_grad_buffer for g in buffer.parameter_groups] if buffer is not None else
                     [getattr(p, "main_grad", None) for p in trainer.module.parameters()])
            main_grads.update(str(g.dtype).removeprefix("torch.") for g in grads if g is not None)
            norm, skipped = original_step(lr, wd)
            norms.append(norm)
            return norm, skipped

        trainer.step = step_after_reading
        with counting_collectives(log, single_rank_groups=True):
            run_steps(trainer, t, [1])
        result[name] = {
            "policy": {f: str(getattr(policy, f)).removeprefix("torch.") for f in ("main_grads_dtype", "grad_comm_dtype")}
            if policy is not None else None,
            "note": trainer.gradients_note,
            "main_grads": sorted(main_grads),
            "grad_norm": norms[0],
            "strategy": getattr(trainer.model.ddp_config, "data_parallel_sharding_strategy", None),
            "collectives": {kind: sorted({dtype for k, dtype, _ in log if k == kind}) for kind in {k for k, _, _ in log}},
        }
    from megatron.core import package_info

    result["megatron_core"] = package_info.__version__
    return result


def stages(text: str) -> list[int]:
    return [int(s) for s in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("modes", nargs="+", choices=["resume", "nan", "gathers", "fusion", "precision"],
                   metavar="mode", help="resume, nan, gathers, fusion, precision; several run in order (nan alone: its ranks exit)")
    p.add_argument("--stage", type=stages, required=True, help="a ZeRO stage, or several: 0,1,2,3")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int, default=3)
    p.add_argument("--reshard-from", type=Path, help="the --out of a launch at another data-parallel size")
    p.add_argument("--only-reshard", action="store_true")
    p.add_argument("--optimizer", type=lambda t: t.split(","), default=["torch"],
                   help="resume's optimizer: torch, apex, te, or several: apex,te (the other modes: torch's)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: a real GPU, NCCL, no shim")
    args = p.parse_args()
    if "nan" in args.modes and (len(args.modes) > 1 or len(args.stage) > 1):
        p.error("nan runs alone, at one stage: its ranks exit")
    if "torch" in args.optimizer[1:]:
        p.error("--optimizer: torch comes first (a FusedAdam stand-in, once in use, stays for the launch)")
    global DEVICE
    if args.device == "cpu":  # as the program's CPU ranks (import_hooks.py): a decorated function, if called, runs eagerly
        from megatron_ext.import_hooks import eager_jit_fuser

        eager_jit_fuser()
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        DEVICE = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=DEVICE)
    else:
        dist.init_process_group("gloo")
    with cuda_on_cpu() if args.device == "cpu" else contextlib.nullcontext():
        from megatron.core import parallel_state

        from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu

        parallel_state.initialize_model_parallel(1, 1)
        if args.device == "cpu":  # on a GPU megatron-core's own memory buffer and CUDA RNG tracker (build() seeds it)
            install_megatron_on_cpu(1234)
        # --optimizer is resume's: the other modes run first, with torch's Adam (a FusedAdam
        # stand-in, once in use, stays for the launch).
        for mode in sorted(args.modes, key=lambda m: m == "resume"):
            for optimizer in args.optimizer if mode == "resume" else ["torch"]:
                suffix = "" if optimizer == "torch" else f"_{optimizer}"
                if optimizer != "torch":
                    from cuda_on_cpu import fused_adam

                    fused_adam.use(optimizer)
                for stage in args.stage:
                    if mode == "gathers":
                        result = {units: gathers_per_step(stage, units) for units in ("default", "layers")}
                    elif mode == "fusion":
                        result = fusion(stage)
                    elif mode == "precision":
                        result = precision(stage)
                    elif mode == "nan":
                        result = nan_step(stage)
                        answer = args.out / f"nan_rank{dist.get_rank()}.json"
                        answer.with_suffix(".tmp").write_text(json.dumps(result))
                        answer.with_suffix(".tmp").rename(answer)
                        # Megatron-FSDP: every rank stops; each waits for the others' answers (torchrun stops the
                        # rest at the first exit: on a loaded machine once before rank 0 had written its own).
                        deadline = time.monotonic() + (60 if stage >= 2 else 0)
                        while len(list(args.out.glob("nan_rank*.json"))) < dist.get_world_size() and time.monotonic() < deadline:
                            time.sleep(0.1)
                        os._exit(1 if result["error"] else 0)  # none goes on to a collective its peers left
                    else:
                        result = resume(args, stage, suffix)
                    if dist.get_rank() == 0:
                        (args.out / f"{mode}_z{stage}{suffix}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
