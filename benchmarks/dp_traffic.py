"""Data-parallel traffic per rank per optimizer step, measured, against the memory planner's formula.

    python benchmarks/dp_traffic.py                      # 2 ranks, stages 0-3, 1 and 4 micro-batches, both engines
    python benchmarks/dp_traffic.py --nproc 4 --micro-batches 1,2,8 --reductions fp32 --engines cuda
    .venv-py312/bin/python benchmarks/dp_traffic.py --engines cuda     # another megatron-core release

(about 1.5 minutes on 2 cores; the last figures, dated, are in benchmarks/results.md).

Runs the CUDA trainer's real megatron-core objects (DDP, the distributed optimizer, Megatron-FSDP
``optim_grads`` / ``optim_grads_params``, built by tests/cuda_on_cpu/worker.py's ``build`` and
stepped by its ``train_step``) on the CPU under the device shim (tests/cuda_on_cpu/shim.py), gloo
in place of NCCL, ``--nproc`` ranks of torchrun, and counts what every collective is given. The
counters (worker.py's ``counting_collectives``) sit on torch.distributed.ProcessGroup's methods (``allreduce``, ``reduce_scatter_single``,
``all_gather_single``, their ``_coalesced`` forms, ...), which every torch.distributed function
reaches, however megatron-core names it: its DDP binds ``torch.distributed.all_gather_into_tensor``
and ``reduce_scatter_tensor`` to module globals at import (param_and_grad_buffer.py ~L33-42), so
counters on the torch.distributed module would miss stages 0-1's gathers and reductions.

What is counted, per rank, over one optimizer step of N micro-batches after a warm-up step: the
bytes of each all-reduce's tensor, each reduce-scatter's input and each all-gather's output (the
full buffer, padding included), converted to what a ring sends per rank: (d-1)/d of it for a
reduce-scatter or an all-gather, 2 (d-1)/d for an all-reduce, the figure the planner states
(orchestration/analysis/memory_plan.py ``dp_traffic_bytes``). Collectives of 64 bytes or fewer
(the loss, the gradient norm, the NaN check) are listed apart and left out of the ratio.

Dtypes: the shim runs the GPU's precision on the CPU: bf16 parameters (``build`` passes
``params_dtype=torch.bfloat16``, Float16Module), fp32 gradient buffers and reduction (Megatron's
default) or bf16 ones (``training.grad_reduce_in_bf16``, ``--reductions bf16``), fp32 main
parameters in the optimizer: the same elements and element sizes as on an H100/H200 with NCCL, so
the bytes map one to one; the planner is called with the same parameter count, d, N and dtypes
(``precision="bf16"``). ``--engines cpu``: the CPU path (torch DDP, ZeroRedundancyOptimizer,
FSDP2; fp32 throughout, ``precision="fp32"``), built as the program builds it, without the shim;
torch DDP's reducer calls gloo from C++, so its buckets go through torch's own default all-reduce
hook to be counted. Not what this shows: time, overlap, NCCL's own protocol overheads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron_ext.host.devices import Device  # noqa: E402

SMALL_BYTES = 64
"""Collectives this size or smaller are scalars (loss, norms, checks), not data-parallel traffic."""

RING = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "all_to_all": 1}
"""Times (d-1)/d of the buffer a ring sends per rank."""


# -- in each rank ---------------------------------------------------------------------------------

def cpu_trainer(stage: int):
    """The CPU path's trainer (torch DDP, ZeroRedundancyOptimizer, FSDP2; fp32), as the program builds it."""
    import torch
    from cuda_on_cpu import worker as w

    from megatron_ext.run_spec.params import TrainingParams, load_model
    from megatron_ext.run_spec.zero import ZeroStage
    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu
    from megatron_ext.training.model import build_gpt_model
    from megatron_ext.training.trainers import wrap_cpu

    torch.manual_seed(1234)
    install_megatron_on_cpu(1234)
    module = build_gpt_model(load_model("gpt_smoke"), w.VOCAB, w.SEQ, params_dtype=torch.float32)
    t = TrainingParams(lr=3e-3, clip_grad=1.0, weight_decay=0.01)
    trainer = wrap_cpu(module, ZeroStage(stage), t)
    if isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel):
        # Its reducer calls gloo from C++, past ProcessGroup's Python methods; torch's own default
        # hook (divide, then torch.distributed.all_reduce of each bucket: the same reduction) goes
        # through them.
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        trainer.model.register_comm_hook(None, allreduce_hook)
    return trainer, t


def measure(engine: str, stage: int, micro_batches: list[int], grad_reduce_in_bf16: bool, steps: int) -> dict:
    """One stage: a warm-up step, then ``steps`` counted steps per micro-batch count."""
    from cuda_on_cpu.worker import build, counting_collectives, run_steps, train_step

    trainer, t = build(stage, grad_reduce_in_bf16=grad_reduce_in_bf16) if engine == Device.CUDA else cpu_trainer(stage)
    params = {id(p): p for p in trainer.module.parameters()}  # unique: tied weights count once
    in_layers = {id(p) for p in trainer.module.decoder.layers.parameters()}
    out = {"parameters": sum(p.numel() for p in params.values()),
           "outside_layers": sum(p.numel() for i, p in params.items() if i not in in_layers), "steps": {}}
    run_steps(trainer, t, [1])  # the loop's first step (stage 1: gathers' pre-hook off), not counted
    step = 2
    for n in micro_batches:
        per_step = []
        for _ in range(steps):
            log: list[tuple[str, str, int]] = []
            with counting_collectives(log):
                train_step(trainer, t, step, accumulation=n)
            step += 1
            per_step.append(log)
        out["steps"][str(n)] = per_step
    return out


def worker(args) -> None:
    """One rank: ``args.engine``'s stages. The CUDA trainer runs under the device shim, the CPU path
    without it (as the program's CPU ranks); one engine per launch, since the shim, once left,
    does not give ProcessGroup's methods back as they were."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from cuda_on_cpu.shim import cuda_on_cpu

    from megatron_ext.import_hooks import eager_jit_fuser

    eager_jit_fuser()  # as worker.py and the program's CPU ranks
    dist.init_process_group("gloo")
    result: dict = {"world_size": dist.get_world_size()}
    with cuda_on_cpu() if args.engine == Device.CUDA else contextlib.nullcontext():
        from megatron.core import package_info, parallel_state

        from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu

        parallel_state.initialize_model_parallel(1, 1)
        install_megatron_on_cpu(1234)
        result["megatron_core"] = package_info.__version__
        for reduction in args.reductions if args.engine == Device.CUDA else ["fp32"]:
            for stage in args.stages:
                result[f"{args.engine}_{reduction}_z{stage}"] = measure(args.engine, stage, args.micro_batches,
                                                                        reduction == "bf16", args.steps)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher ---------------------------------------------------------------------------------

def summarize(log: list[list], d: int) -> dict:
    """Passed bytes per kind and dtype, ring bytes per rank, and the small collectives apart."""
    passed: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)
    ring, small = 0, 0
    for kind, dtype, size in log:
        if size <= SMALL_BYTES:
            small += 1
            continue
        passed[f"{kind} {dtype}"] += size
        calls[f"{kind} {dtype}"] += 1
        ring += RING[kind] * size * (d - 1) // d
    return {"passed": dict(passed), "calls": dict(calls), "ring": ring, "small": small}


def table(result: dict) -> str:
    sys.path.insert(0, str(REPO))
    from orchestration.analysis.memory_plan import dp_traffic_bytes

    d = result["world_size"]
    header = ["engine", "reduction", "stage", "micro-batches", "collectives (calls: bytes passed)",
              "measured ring bytes/rank/step", "planner", "measured/planner", "small"]
    rows, counts = [], set()
    for key, r in result.items():
        if not key.startswith(("cuda_", "cpu_")):
            continue
        engine, reduction, stage = key.split("_")
        stage = int(stage.removeprefix("z"))
        psi, outside = r["parameters"], r["outside_layers"]
        counts.add((engine, psi, outside))
        for n, logs in r["steps"].items():
            sums = [summarize(log, d) for log in logs]
            s = sums[-1]
            same = all(x["ring"] == s["ring"] for x in sums)
            grad, param = (4, 4) if engine == Device.CPU else (2 if reduction == "bf16" else 4, 2)
            planned = dp_traffic_bytes(stage, psi, d, grad, param, micro_batches=int(n), outside_layers=outside,
                                       precision="fp32" if engine == Device.CPU else "bf16")
            what = "; ".join(f"{k} x{s['calls'][k]}: {v:,}" for k, v in sorted(s["passed"].items()))
            rows.append([engine, reduction, str(stage), n, what, f"{s['ring']:,}" + ("" if same else " (steps differ)"),
                         f"{planned:,}", f"{s['ring'] / planned:.4f}", str(s["small"])])
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i in (0, 1, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths))).rstrip()
             for x in [header, *rows]]
    sizes = "; ".join(f"{e}: {p:,} parameters, {o:,} outside the transformer layers" for e, p, o in sorted(counts))
    return "\n".join([
        f"gpt_smoke (vocabulary 256, sequence 32, micro batch 2), {d} ranks on gloo, megatron-core "
        f"{result['megatron_core']}; {sizes}",
        "cuda = the CUDA trainer under the device shim (bf16 parameters, gradients reduced in the named dtype); "
        "cpu = the CPU path (fp32)",
        "bytes passed: each all-reduce's tensor, reduce-scatter's input, all-gather's output, broadcast's tensor; "
        "ring bytes = (d-1)/d of them (x2 for an all-reduce); small = collectives of <= 64 bytes (loss, norms), "
        "not counted; planner = orchestration/analysis/memory_plan.py dp_traffic_bytes",
        "", *lines])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                   help="micro-batches per rank per optimizer step, comma-separated")
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3])
    p.add_argument("--reductions", type=lambda s: s.split(","), default=["fp32", "bf16"],
                   help="gradient reduction dtypes: fp32 (default), bf16 (training.grad_reduce_in_bf16)")
    p.add_argument("--engines", type=lambda s: [Device(e) for e in s.split(",")], default=list(Device)[::-1],
                   help="cuda: the CUDA trainer under the device shim; cpu: the CPU path (torch DDP, ZeRO, FSDP2)")
    p.add_argument("--steps", type=int, default=2, help="counted steps per micro-batch count (they must agree)")
    p.add_argument("--json", help="also write the raw counts here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import free_port

    env = {k: v for k, v in os.environ.items() if k != "CONTAINER_NAME"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="dp_traffic_") as tmp:
        for engine in args.engines:
            out = Path(tmp) / f"{engine}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), __file__, "--worker", "--engine", engine,
                   "--out", str(out), "--micro-batches", ",".join(map(str, args.micro_batches)),
                   "--stages", ",".join(map(str, args.stages)), "--reductions", ",".join(args.reductions),
                   "--steps", str(args.steps)]
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]
                sys.exit(f"error: the {engine} ranks failed (exit {proc.returncode}): "
                         + ("\n".join(errors[-5:]) or proc.stderr[-3000:]))
            result.update(json.loads(out.read_text()))
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    print(table(result))


if __name__ == "__main__":
    main()
