"""The GPU check's rows (tests/gpu/gpu_check.py runs them): each starts its processes in a session of
its own (killed as a group past its limit), writes under the folder it is given and returns its line,
a verdict with its threshold where there is one. :func:`all_rows` lists them, most valuable first;
:func:`precision_verdicts` is pure.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from profile_step import one_line  # noqa: E402
from test_gpu_stages import (  # noqa: E402
    ITERS, MICRO_BATCH, data_yaml, format_row, free_port, pretrain_argv, run_in_own_group, run_stage,
)

WORKER = REPO / "tests" / "cuda_on_cpu" / "worker.py"
PROFILER = REPO / "tests" / "gpu" / "profile_step.py"
RESUME_TOLERANCE = 1e-3
"""Relative: bf16 kernels on a GPU need not be bitwise deterministic; a wrong optimizer state
shows as a jump of 1e-2 or more from the second resumed step on."""
NORM_TOLERANCE = 1e-2
"""Relative, the first step's gradient norm at stages 2-3 against stage 0's (the same kernels, another
reduction path); a gradient added twice shows as a factor of 2."""
CHECKPOINT_DISK_GB = 30.0
"""Qwen3-1.7B at stage 0: bf16 weights and fp32 main params and moments, ~24 GB."""
ROW_TIMINGS = {"precision": 40.0, "full": 40.0, "fp8": 45.0, "checkpoint": 100.0, "resume": 45.0, "nan": 25.0,
               "profile": 60.0, "warm_up": 50.0}
"""Seconds per row on an H200, from the rows of 2026-12-04 (prepare_device_check.py quotes them):
precision 32-40 s, a full row 34-37 s once the fused kernels are compiled, resume 29-43 s, NaN 18-21 s.
``warm_up``: what the first full-size run of a machine adds, compiling the fused kernels (full-z0 took
77-86 s there; torch's compile cache then serves every later run, either release): charged to the
first row of a process that starts the program at full size. FP8 (never run: no transformer-engine
there), the checkpoint (two starts, ~24 GB written and read) and the profile (a full row with one
step more, profiled) are estimates."""


@dataclass(frozen=True)
class Row:
    name: str
    estimate_s: float
    """Expected wall time on an H200 once the fused kernels are compiled (:data:`ROW_TIMINGS`)."""
    run: Callable[[Path], str] = field(compare=False, repr=False)
    """Writes under the folder it is given (what it leaves in ``keep/`` goes to $OUT); returns its line
    (its own limit kills its process group)."""
    warm_up_s: float = 0.0
    """Seconds more when it is the first row of the process to start the program at full size."""


def worker(mode: str, stage: int | str, out: Path, limit_s: float) -> tuple[int, str]:
    return run_in_own_group([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                             str(free_port()), str(WORKER), mode, "--stage", str(stage), "--out", str(out),
                             "--device", "cuda"], limit_s, cwd=REPO)


def resume_row(stage: int, out: Path, limit_s: float = 120) -> str:
    code, tail = worker("resume", stage, out, limit_s)
    path = out / f"resume_z{stage}.json"
    if code or not path.exists():
        return f"resume z{stage}: FAIL (exit {code}): {tail[-1200:]}"
    r = json.loads(path.read_text())
    steps = sorted(r["resumed"], key=int)
    diffs = [abs(r["resumed"][s] - r["uninterrupted"][s]) / abs(r["uninterrupted"][s]) for s in steps]
    verdict = "PASS" if max(diffs) <= RESUME_TOLERANCE else "FAIL"
    resumed = ", ".join(f"{r['resumed'][s]:.5f}" for s in steps)
    never = ", ".join(f"{r['uninterrupted'][s]:.5f}" for s in steps)
    return (f"resume z{stage}: {verdict} (threshold {RESUME_TOLERANCE:g} relative): steps {', '.join(steps)} resumed "
            f"{resumed} vs never stopped {never}, max difference {max(diffs):.2e}; files {', '.join(r['files'])}")


def nan_row(stage: int, out: Path, limit_s: float = 90) -> str:
    code, tail = worker("nan", stage, out, limit_s)
    told = out / "nan_rank0.json"
    if not told.exists():
        return f"NaN z{stage}: FAIL (no answer, exit {code}): {tail[-1200:]}"
    r = json.loads(told.read_text())
    named = "Rank 0" in (r["error"] or "") or "rank(s) 0" in (r["error"] or "")
    verdict = "PASS" if code != 0 and r.get("unchanged") and named else "FAIL"
    return (f"NaN z{stage}: {verdict} (threshold: exit != 0, update not applied, rank 0 named): exit {code}, update "
            f"applied: {'no' if r.get('unchanged') else 'YES'}; {(r['error'] or '')[:240]}")


STRATEGIES = {2: "optim_grads", 3: "optim_grads_params"}


def precision_verdicts(results: dict[int, dict], sharded: bool) -> list[str]:
    """Each of stages 2-3 in ``results`` (worker.py ``precision``, stage 0 beside them), fp32 and bf16
    reduction asked: the main gradients and the reduction in that dtype, Megatron-FSDP's policy
    where it has one, its strategy (``sharded``: the stage's own, reduce-scattered; else ``no_shard``,
    all-reduced, beside the loss's fp32), the first step's gradient norm within NORM_TOLERANCE of
    stage 0's. Pure."""
    verdicts = []
    for stage in sorted(s for s in results if s >= 2):
        for asked, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
            got, base = results[stage][asked], results[0][asked]
            strategy = STRATEGIES[stage] if sharded else "no_shard"
            kind = "reduce_scatter" if sharded else "all_reduce"
            reduced = got["collectives"].get(kind, [])
            norm_ratio = got["grad_norm"] / base["grad_norm"] if base["grad_norm"] else float("nan")
            ok = (got["main_grads"] == [dtype] and (reduced == [dtype] if sharded else dtype in reduced)
                  and got["policy"] in (None, {"main_grads_dtype": dtype, "grad_comm_dtype": dtype})
                  and got.get("strategy") == strategy and abs(norm_ratio - 1) <= NORM_TOLERANCE)
            policy = got["policy"]
            verdicts.append(
                f"z{stage} {asked}: {'PASS' if ok else 'FAIL'} ({got.get('strategy')}, main gradients "
                f"{'/'.join(got['main_grads'])}, {kind.replace('_', '-')} in {'/'.join(reduced) or 'nothing'}"
                f"{', policy ' + policy['main_grads_dtype'] + '/' + policy['grad_comm_dtype'] if policy else ''}, "
                f"norm {got['grad_norm']:.4f} vs stage 0's {base['grad_norm']:.4f})")
    return verdicts


def precision_row(out: Path, stages: tuple[int, ...], sharded: bool, limit_s: float = 90) -> str:
    """Stages 0 and ``stages``: the gradient precision asked (fp32, then bf16 reduction) against what
    megatron-core built and did (worker.py ``precision``)."""
    code, tail = worker("precision", ",".join(map(str, (0, *stages))), out, limit_s)
    paths = {stage: out / f"precision_z{stage}.json" for stage in (0, *stages)}
    if code or not all(p.exists() for p in paths.values()):
        return f"precision: FAIL (exit {code}): {tail[-1200:]}"
    results = {stage: json.loads(p.read_text()) for stage, p in paths.items()}
    return (f"precision (threshold: what was asked, fp32 unless bf16 reduction; "
            f"{'reduce-scattered' if sharded else 'no_shard, all-reduced'}; norm within {NORM_TOLERANCE:g} of stage 0's): "
            + "; ".join(precision_verdicts(results, sharded)))


def checkpoint_row(out: Path, micro: int = MICRO_BATCH, limit_s: float = 240) -> str:
    """Stage 0 at full size (the full rows' micro batch: their compiled kernels serve it): 2 iterations
    and a save, then a start that loads it and trains one more."""
    free = shutil.disk_usage(out).free / 1e9
    if free < CHECKPOINT_DISK_GB:
        return f"checkpoint z0: skipped ({free:.0f} GB free, {CHECKPOINT_DISK_GB:.0f} needed)"
    env = {**os.environ, "ARTIFACT_ROOT": str(out)}
    started = time.monotonic()
    code, log = run_in_own_group(pretrain_argv(data_yaml(out, "ckpt_save", iters=2, micro=micro, save_interval=2),
                                               "gpu_ckpt", 0), limit_s, cwd=REPO, env=env)
    saved = next((line for line in log.splitlines() if line.startswith("saved checkpoint")), None)
    if code or saved is None:
        return f"checkpoint z0: FAIL (save run, exit {code}): {log[-1200:]}"
    folder = next((out / "runs" / "gpu_ckpt" / "checkpoints").glob("iter_*"))
    size_gb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9
    left = limit_s - (time.monotonic() - started)
    code, log = run_in_own_group(pretrain_argv(data_yaml(out, "ckpt_load", iters=3, micro=micro), "gpu_ckpt", 0), left,
                                 cwd=REPO, env=env)
    loaded = next((line for line in log.splitlines() if line.startswith("resuming from iteration")), None)
    shutil.rmtree(folder, ignore_errors=True)
    if code or loaded is None:
        return f"checkpoint z0: FAIL (load run, exit {code}): {log[-1200:]}"
    return f"checkpoint z0 ({size_gb:.1f} GB, torch_dist): {saved}; {loaded}"


def profile_row(out: Path, micro: int = MICRO_BATCH, limit_s: float = 180) -> str:
    """Stage 0 at full size, ITERS + 1 iterations, the last under torch.profiler (profile_step.py):
    its table into ``out/keep``; the row of the iterations before it (the medians leave it out)."""
    keep = out / "keep"
    program = (str(PROFILER), "--at", str(ITERS + 1), "--out", str(keep), "--")
    r = run_stage(0, out, micro=micro, iters=ITERS + 1, program=program, skip_last=1, timeout_s=limit_s)
    table = keep / "profile.json"
    if "error" in r or not table.exists():
        return f"profile z0: FAIL: {format_row(r)[-1500:]}"
    return f"profile z0: {one_line(json.loads(table.read_text()))}; the steps before it: {format_row(r).strip()}"


def all_rows(transformer_engine: bool, shards_one_rank: bool = True, micro: int = MICRO_BATCH) -> list[Row]:
    """Every row this release can run, most valuable first. Without ``shards_one_rank`` one rank
    runs stage 3 as ``no_shard``, as stage 2: the stage-3 rows would repeat stage 2's and are left out."""
    t = ROW_TIMINGS
    fsdp = (2, 3) if shards_one_rank else (2,)
    full = [s for s in (3, 2, 0, 1) if s in (0, 1, *fsdp)]

    def full_row(stage: int, fp8: str | None = None) -> Row:
        return Row(f"full-z{stage}" + ("-fp8" if fp8 else ""), t["fp8" if fp8 else "full"],
                   lambda out: format_row(run_stage(stage, out, fp8=fp8, micro=micro)), t["warm_up"])

    rows = [Row("precision", t["precision"], lambda out: precision_row(out, fsdp, shards_one_rank))]
    rows += [full_row(s) for s in full]
    if transformer_engine:
        rows += [full_row(s, "hybrid") for s in (0, 2)]
    rows.append(Row("checkpoint-z0", t["checkpoint"], lambda out: checkpoint_row(out, micro), t["warm_up"]))
    rows += [Row(f"resume-z{s}", t["resume"], lambda out, s=s: resume_row(s, out)) for s in (*fsdp[::-1], 1)]
    rows += [Row(f"nan-z{s}", t["nan"], lambda out, s=s: nan_row(s, out)) for s in (2, 0)]
    rows.append(Row("resume-z0", t["resume"], lambda out: resume_row(0, out)))
    rows.append(Row("profile-z0", t["profile"], lambda out: profile_row(out, micro), t["warm_up"]))
    return rows
