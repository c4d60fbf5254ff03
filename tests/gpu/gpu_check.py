"""The GPU check for a lent machine (one GPU): a preflight of seconds, then what matters most
first, row by row, inside a time budget.

    python3 tests/gpu/prepare_device_check.py   # here, first: the wheels into .whl/, the carry list, the command
    bash tests/gpu/device_check.sh --megatron-core 0.19.2   # there: runs this file for that release
    python3 tests/gpu/gpu_check.py --dry-run     # anywhere: the preflight's findings and the row plan

``--megatron-core VERSION`` is the release under test: the installed megatron-core when it is that
release, else its carried wheel (``.whl/megatron_core-VERSION-cp312-*.whl``), installed into
/tmp/gpu_check_site/VERSION; without the option, the installed one or the newest wheel carried. Every
row's line names the release it ran (one process per release: device_check.sh runs them in turn).

Preflight (before anything slow): python3 3.12 (the carried wheels'), torch with a CUDA device,
megatron-core importable or its wheel in .whl/, the program's own imports (PyYAML, numpy, pydantic:
installed from .whl/deps when missing), free disk, $OUT; every problem is printed at once and the
check exits 2.

Rows (each a process tree in its own session, killed as a group past its limit; each line is
appended to $OUT/gpu_check-<release>.txt as it finishes, so a timeout keeps what was done):

0. The gradient precision at stages 2 and 3 (tests/cuda_on_cpu/worker.py ``precision`` on the
   GPU): fp32 main gradients and fp32 reduction unless bf16 reduction is asked, whatever the
   release (Megatron-FSDP's own dtypes from 0.19).
1. Qwen3-1.7B at full depth (28 layers, sequence 4096, micro batch 4, DP=1) under ZERO_STAGE 0-3,
   BF16: TFLOP/s/GPU, MFU (against the dense peak it names), peak memory, last loss
   (tests/gpu/test_gpu_stages.py); the same in FP8 at stages 0 and 2 where transformer-engine is
   installed.
2. The full-size checkpoint at stage 0 (megatron-core's torch_dist, fully parallel): its size, the
   save and the load timed by the program's own lines.
3. Resume at stages 1 and 3, then 0 and 2 (tests/cuda_on_cpu/worker.py on the GPU, NCCL, one
   rank): PASS when every resumed loss is within RESUME_TOLERANCE of the run never stopped.
4. A NaN loss at the second step, stages 0 and 2: PASS when the run stops, the update was not
   applied and the message names rank 0.
5. Megatron-FSDP's all-gathers and gradient norms per step at stage 2 (1 and 4 micro-batches).

A row starts only if the budget left holds its estimate; ``--only`` runs the named rows (for a
second, shorter run). What only this check shows, next to what the CPU tests show:
docs/training-program.md#what-the-device-shim-cannot-show.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from prepare_device_check import WHEEL_GLOB, find_wheel, wheel_release  # noqa: E402
from test_gpu_stages import (  # noqa: E402
    HEADER, RUNNING, data_yaml, format_row, free_port, kill_group, pretrain_argv, run_in_own_group, run_stage,
)

WORKER = REPO / "tests" / "cuda_on_cpu" / "worker.py"
SITE = Path("/tmp/gpu_check_site")
"""Each release's wheel installs into SITE/<version>, the carried dependencies into SITE/deps."""
DEPS_DIR = ".whl/deps"
"""Wheels of the program's own imports for the GPU machine's Python (prepare_device_check.py)."""
RESUME_TOLERANCE = 1e-3
"""Relative: bf16 kernels on a GPU need not be bitwise deterministic; a wrong optimizer state
shows as a jump of 1e-2 or more from the second resumed step on."""
CHECKPOINT_DISK_GB = 30.0
"""Qwen3-1.7B at stage 0: bf16 weights and fp32 main params and moments, ~24 GB."""
DEFAULT_BUDGET_S = 450.0


# -- preflight ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Facts:
    """What the preflight reads on the machine (gather_facts), checked by preflight_problems."""

    python: tuple[int, int]
    torch: str | None
    cuda_devices: int
    device_name: str | None
    megatron_core: str | None
    wheel: str | None
    transformer_engine: str | None
    free_gb: float
    out_dir: str | None
    pip: bool = True
    """pip imports (it installs the carried wheel)."""
    missing_modules: tuple[str, ...] = ()
    """The program's own imports that are not there (PyYAML, numpy, pydantic)."""
    carried_deps: bool = False
    """Wheels for them are carried (.whl/deps): a missing module is installed from there."""
    release: str | None = None
    """The megatron-core release under test (--megatron-core), or None: whatever is installed or carried."""


def preflight_problems(f: Facts) -> list[str]:
    """Everything that would stop the check, each with its fix; [] when it can run."""
    problems = []
    if f.torch is None:
        problems.append("torch does not import for python3 here: use the machine's python3 (the one with torch)")
    elif f.cuda_devices == 0:
        problems.append(f"torch {f.torch} sees no CUDA device: this check needs a GPU machine")
    installs = f.megatron_core is None or (f.release is not None and not f.megatron_core.startswith(f.release))
    if installs and f.wheel is None:
        wanted = WHEEL_GLOB.format(release=f.release or "*")
        problems.append(f"megatron-core {f.release or ''} does not import and no {wanted} is in .whl/: on the developer "
                        "machine run python3 tests/gpu/prepare_device_check.py and send .whl along (carry)")
    if installs and f.wheel is not None and f.python != (3, 12):
        problems.append(f"the carried wheel is for Python 3.12, python3 here is {f.python[0]}.{f.python[1]}")
    if (installs and f.wheel is not None or f.missing_modules and f.carried_deps) and not f.pip:
        problems.append("pip does not import for python3 here, and it installs the carried wheels: use a python3 with pip "
                        "(python3 -m ensurepip), or an image with megatron-core installed")
    for module in () if f.carried_deps else f.missing_modules:
        problems.append(f"{module} does not import for python3 here (the training program imports it): carry its "
                        f"wheel in {DEPS_DIR} (prepare_device_check.py), or use an image that has it")
    if f.free_gb < 10:
        problems.append(f"{f.free_gb:.1f} GB free in {tempfile.gettempdir()}: the rows need 10 GB (30 for the checkpoint row)")
    return problems


def _wheel(release: str | None = None) -> Path | None:
    """The carried wheel of ``release``, or (None) the newest carried."""
    return find_wheel([REPO / ".whl", REPO / "shared" / "wheels"], release)


def _version(module: str, *distributions: str) -> str | None:
    """The installed version of ``module`` (from its distribution's metadata: nothing is imported,
    so the preflight takes seconds), or None when it is not there."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except ImportError:
        return None
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def gather_facts(release: str | None = None) -> Facts:
    torch_version = _version("torch", "torch")
    devices, name = 0, None
    if torch_version:
        import torch

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        name = torch.cuda.get_device_name(0) if devices else None
    wheel = _wheel(release)
    return Facts(python=sys.version_info[:2], torch=torch_version, cuda_devices=devices, device_name=name,
                 megatron_core=_version("megatron.core", "megatron-core", "megatron_core"), wheel=str(wheel) if wheel else None,
                 transformer_engine=_version("transformer_engine", "transformer-engine", "transformer_engine"),
                 free_gb=shutil.disk_usage(tempfile.gettempdir()).free / 1e9, out_dir=os.environ.get("OUT"),
                 pip=importlib.util.find_spec("pip") is not None,
                 missing_modules=tuple(m for m in PROGRAM_MODULES if importlib.util.find_spec(m) is None),
                 carried_deps=any((REPO / DEPS_DIR).glob("*.whl")), release=release)


PROGRAM_MODULES = ("yaml", "numpy", "pydantic")
"""What megatron_ext imports besides torch and megatron-core."""


def install_wheels(wheels: list[str], target: Path) -> None:
    """pip-install carried wheels (no index, no dependencies) into ``target``, first on this
    process's path and the rows' PYTHONPATH. A failed install is a SystemExit with pip's last line
    (one message, no traceback)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"error: pip could not install {', '.join(Path(w).name for w in wheels)}: {last[0]}")
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()


def install_wheel(wheel: str) -> str:
    """The carried megatron-core wheel into SITE/<its version>; returns the version that imports."""
    install_wheels([wheel], SITE / wheel_release(Path(wheel)))
    import megatron.core  # noqa: F401  (it imports: the rows' children get the same PYTHONPATH)

    return _version("megatron.core", "megatron-core", "megatron_core") or "?"


# -- rows -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    name: str
    estimate_s: float
    """Expected wall time on an H200 (a row starts only if the budget left holds it)."""
    run: Callable[[Path], str] = field(compare=False, repr=False)
    """Writes under the folder it is given; returns its line (its own limit kills its process group)."""


def plan_rows(rows: list[Row], budget_s: float, only: list[str] | None = None) -> tuple[list[Row], list[Row]]:
    """(the rows expected to run, in order, by their estimates within ``budget_s``; the rows that
    would be cut by the budget). ``only``: just those rows, in that order. While running, each row
    is checked against the time actually left."""
    by_name = {r.name: r for r in rows}
    chosen = [by_name[name] for name in only if name in by_name] if only else list(rows)
    expected, spent = [], 0.0
    for row in chosen:
        if spent + row.estimate_s > budget_s:
            break
        expected.append(row)
        spent += row.estimate_s
    return expected, chosen[len(expected):]


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


def precision_row(out: Path, limit_s: float = 90) -> str:
    """Stages 2 and 3: the gradient precision asked (fp32, then bf16 reduction) against what
    megatron-core built and did (worker.py ``precision``)."""
    code, tail = worker("precision", "2,3", out, limit_s)
    verdicts = []
    for stage in (2, 3):
        path = out / f"precision_z{stage}.json"
        if not path.exists():
            return f"precision z2-z3: FAIL (exit {code}): {tail[-1200:]}"
        r = json.loads(path.read_text())
        for asked, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
            got = r[asked]
            # Sharded, the gradients are reduce-scattered; at DP=1 (no_shard) all-reduced, beside the loss's fp32.
            reduced = got["collectives"].get("reduce_scatter") or got["collectives"].get("all_reduce", [])
            ok = got["main_grads"] == [dtype] and dtype in reduced and got["policy"] in (
                None, {"main_grads_dtype": dtype, "grad_comm_dtype": dtype})
            verdicts.append(
                f"z{stage} {asked}: {'PASS' if ok else 'FAIL'} (main gradients {'/'.join(got['main_grads'])}, "
                f"reduced in {'/'.join(reduced) or 'nothing'}"
                f"{', policy ' + got['policy']['main_grads_dtype'] + '/' + got['policy']['grad_comm_dtype'] if got['policy'] else ''})")
    return "precision (threshold: what was asked, fp32 unless bf16 reduction): " + "; ".join(verdicts)


def gathers_row(out: Path, limit_s: float = 90) -> str:
    code, tail = worker("gathers", 2, out, limit_s)
    path = out / "gathers_z2.json"
    if code or not path.exists():
        return f"gathers z2: FAIL (exit {code}): {tail[-1200:]}"
    r = json.loads(path.read_text())
    return (f"gathers z2 per step (1 / 4 micro-batches): default units {r['default']['gathers']}, TransformerLayer units "
            f"{r['layers']['gathers']}; gradient norms {r['default']['norms']} (one rank runs no_shard: the gathers "
            "are what it dispatches there; PASS when the norms are [1, 1])")


def checkpoint_row(out: Path, limit_s: float = 240) -> str:
    """Stage 0 at full size: 2 iterations and a save, then a start that loads it and trains one more."""
    free = shutil.disk_usage(out).free / 1e9
    if free < CHECKPOINT_DISK_GB:
        return f"checkpoint z0: skipped ({free:.0f} GB free, {CHECKPOINT_DISK_GB:.0f} needed)"
    env = {**os.environ, "ARTIFACT_ROOT": str(out)}
    started = time.monotonic()
    code, log = run_in_own_group(pretrain_argv(data_yaml(out, "ckpt_save", iters=2, micro=1, save_interval=2),
                                               "gpu_ckpt", 0), limit_s, cwd=REPO, env=env)
    saved = next((line for line in log.splitlines() if line.startswith("saved checkpoint")), None)
    if code or saved is None:
        return f"checkpoint z0: FAIL (save run, exit {code}): {log[-1200:]}"
    folder = next((out / "runs" / "gpu_ckpt" / "checkpoints").glob("iter_*"))
    size_gb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9
    left = limit_s - (time.monotonic() - started)
    code, log = run_in_own_group(pretrain_argv(data_yaml(out, "ckpt_load", iters=3, micro=1), "gpu_ckpt", 0), left,
                                 cwd=REPO, env=env)
    loaded = next((line for line in log.splitlines() if line.startswith("resuming from iteration")), None)
    shutil.rmtree(folder, ignore_errors=True)
    if code or loaded is None:
        return f"checkpoint z0: FAIL (load run, exit {code}): {log[-1200:]}"
    return f"checkpoint z0 ({size_gb:.1f} GB, torch_dist): {saved}; {loaded}"


def all_rows(transformer_engine: bool) -> list[Row]:
    rows = [Row("precision-z2-z3", 30, precision_row)]
    rows += [Row(f"full-z{s}", 70 if s == 0 else 40, lambda out, s=s: format_row(run_stage(s, out))) for s in range(4)]
    if transformer_engine:
        rows += [Row(f"full-z{s}-fp8", 45, lambda out, s=s: format_row(run_stage(s, out, fp8="hybrid"))) for s in (0, 2)]
    rows.append(Row("checkpoint-z0", 110, checkpoint_row))
    rows += [Row(f"resume-z{s}", 35, lambda out, s=s: resume_row(s, out)) for s in (1, 3)]
    rows += [Row(f"nan-z{s}", 25, lambda out, s=s: nan_row(s, out)) for s in (0, 2)]
    rows += [Row(f"resume-z{s}", 35, lambda out, s=s: resume_row(s, out)) for s in (0, 2)]
    rows.append(Row("gathers-z2", 30, gathers_row))
    return rows


# -- the run --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-core", metavar="VERSION", help="the release under test: installed, or its carried wheel "
                   "(default: the installed one, else the newest carried)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall time for the rows (default %(default)s)")
    p.add_argument("--only", help="comma list of row names to run (see --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="print the preflight's findings and the row plan, run nothing")
    args = p.parse_args(argv)
    started = time.monotonic()
    facts = gather_facts(args.megatron_core)
    problems = preflight_problems(facts)
    only = args.only.split(",") if args.only else None
    expected, cut = plan_rows(all_rows(facts.transformer_engine is not None), args.budget_s, only)
    rows = expected + cut
    if only and (unknown := set(only) - {r.name for r in all_rows(True)}):
        problems.append(f"--only names unknown rows {sorted(unknown)}; see --dry-run")
    print(f"preflight: python {facts.python[0]}.{facts.python[1]}, torch {facts.torch}, {facts.cuda_devices} CUDA "
          f"device(s) {facts.device_name or ''}, megatron-core {facts.megatron_core or 'not importable'}"
          f"{f' (wheel {Path(facts.wheel).name})' if facts.wheel and not facts.megatron_core else ''}, "
          f"transformer-engine {facts.transformer_engine or 'none (no FP8 rows)'}, {facts.free_gb:.0f} GB free, "
          f"OUT={facts.out_dir or '(unset: /tmp)'}", flush=True)
    total = sum(r.estimate_s for r in expected)
    print(f"plan: {len(expected)} rows expected in {total:.0f} s of the {args.budget_s:.0f} s budget: "
          + ", ".join(f"{r.name} ~{r.estimate_s:.0f} s" for r in expected)
          + (f"; then, if time is left: {', '.join(r.name for r in cut)}" if cut else ""), flush=True)
    if problems:
        for problem in problems:
            print(f"device check: missing: {problem}", file=sys.stderr, flush=True)
        return 2
    if args.dry_run:
        return 0
    if facts.missing_modules:
        install_wheels(sorted(str(w) for w in (REPO / DEPS_DIR).glob("*.whl")), SITE / "deps")
        print(f"installed {', '.join(facts.missing_modules)} from {DEPS_DIR}", flush=True)
    release = facts.megatron_core
    if release is None or (args.megatron_core and not release.startswith(args.megatron_core)):
        release = install_wheel(facts.wheel)
        print(f"installed megatron-core {release} from {Path(facts.wheel).name} ({time.monotonic() - started:.0f} s)",
              flush=True)
    out_dir = Path(facts.out_dir or "/tmp")
    report = out_dir / f"gpu_check-{release}.txt"
    report.write_text("")

    def say(line: str) -> None:
        print(line, flush=True)
        with report.open("a") as f:
            f.write(line + "\n")

    def stopped(*_):  # device_check.sh's timeout: the running row's group goes too
        for proc in list(RUNNING):
            kill_group(proc)
        say("stopped (SIGTERM): the rows above are what was done")
        sys.exit(124)

    signal.signal(signal.SIGTERM, stopped)
    say(f"{facts.device_name}; megatron-core {release}; torch {facts.torch}; python {facts.python[0]}.{facts.python[1]}; "
        f"transformer-engine {facts.transformer_engine or 'none'}")
    if facts.transformer_engine is None:
        say("FP8 rows: skipped: transformer-engine is not installed here")
    say(HEADER)
    skipped = []
    with tempfile.TemporaryDirectory() as d:
        for row in rows:
            budget_left = args.budget_s - (time.monotonic() - started)
            if budget_left < row.estimate_s:  # a smaller row after it may still fit
                skipped.append(row.name)
                continue
            row_dir = Path(d) / row.name
            row_dir.mkdir()
            t0 = time.monotonic()
            try:
                line = row.run(row_dir)
            except Exception as exc:  # a row's own failure is its line; the next row runs
                line = f"{row.name}: FAIL ({type(exc).__name__}: {exc})"
            say(f"{line}  [{row.name} {time.monotonic() - t0:.0f} s, megatron-core {release}]")
    if skipped:
        say(f"budget: {len(skipped)} row(s) not run, their estimates past the {args.budget_s:.0f} s budget: "
            f"{', '.join(skipped)}")
    say(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
