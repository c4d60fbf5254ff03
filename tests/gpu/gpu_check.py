"""The GPU check for a lent machine (one GPU): a preflight of seconds, then what matters most
first, row by row, inside a time budget.

    python3 tests/gpu/prepare_device_check.py   # here, first: the wheels into .whl/, the carry list, the kind, the commands
    bash tests/gpu/device_check.sh --megatron-core 0.19.2 --only ROW,...   # there: runs this file for that release
    python3 tests/gpu/gpu_check.py --dry-run     # anywhere: the preflight's findings and the row plan

``--megatron-core VERSION`` is the release under test: the installed megatron-core when it is that
release, else its carried wheel (``.whl/megatron_core-VERSION-cp312-*.whl``), installed into
/tmp/gpu_check_site/VERSION; without the option, the installed one or the newest wheel carried. Every
row's line names the release it ran (one process per release and device call: prepare_device_check.py
prints one command per call, each fitting about 300 s).

Preflight (before anything slow): python3 3.12 (the carried wheels'), torch with a CUDA device,
megatron-core importable or its wheel in .whl/, the program's own imports (PyYAML, numpy, pydantic:
installed from .whl/deps when missing), free disk, $OUT; every problem is printed at once and the
check exits 2. Then, once megatron-core imports, the program itself answers two questions (one child
process, :data:`PROGRAM_ANSWERS`): which transformer-engine megatron-core would use
(``transformer_engine_version``, megatron-core's own HAVE_TE: the FP8 rows follow it, not a bare
find_spec), and whether the release may shard at one rank (``cuda_trainer.ONE_RANK_DOUBLE_ADD``):
where it may, MEGATRON_EXT_SHARD_ONE_RANK=1 is set for every row, so stages 2-3 run Megatron-FSDP's
own strategies (the reduce-scatter, stage 3's per-layer unsharding, sharded buffers in the
checkpoint); where not (0.16), one rank runs them as ``no_shard`` and the stage-3 rows, which would
repeat stage 2's, are left out.

Rows (each a process tree in its own session, killed as a group past its limit; each line is
appended to $OUT/gpu_check-<release>.txt as it finishes, so a timeout keeps what was done; what a row
keeps, its profile table, goes beside it):

- ``precision``: the gradient precision at stages 2 and 3 (tests/cuda_on_cpu/worker.py on the GPU):
  fp32 main gradients and fp32 reduction unless bf16 reduction is asked, whatever the release
  (Megatron-FSDP's own dtypes from 0.19), reduce-scattered where one rank shards, and the first
  step's gradient norm equal to stage 0's (no gradient added twice).
- ``full-zS`` (``-fp8``): Qwen3-1.7B at full depth (28 layers, sequence 4096, micro batch 4, or 2 on a
  GPU under 100 GiB, DP=1) under ZERO_STAGE S, BF16 or FP8 where megatron-core uses a
  transformer-engine: TFLOP/s/GPU, MFU, peak memory, last loss, the strategy (tests/gpu/test_gpu_stages.py).
- ``checkpoint-z0``: the full-size checkpoint at stage 0 (torch_dist, fully parallel): its size, the
  save and the load timed by the program's own lines.
- ``resume-zS``: resume after step 3 (worker.py on the GPU, NCCL, one rank): PASS when every resumed
  loss is within RESUME_TOLERANCE of the run never stopped.
- ``nan-zS``: a NaN loss at the second step: PASS when the run stops, the update was not applied and
  the message names rank 0.
- ``profile-z0``: stage 0 at full size with its last step under torch.profiler (tests/gpu/profile_step.py):
  the step's time by kernel group (GEMM, attention, elementwise, optimizer, communication) into
  $OUT/profile-z0-<release>.md, and the row of the steps before it.

A row starts only if the budget left (preflight and installs counted) holds its estimate
(:data:`ROW_TIMINGS`); ``--only`` runs the named rows in that order. What only this check shows, next
to what the CPU tests show: docs/training-program.md#what-the-device-shim-cannot-show.
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from gpu_rows import Row, all_rows  # noqa: E402
from prepare_device_check import WHEEL_GLOB, find_wheel, wheel_release  # noqa: E402
from test_gpu_stages import RUNNING, format_header, kill_group, micro_batch_for  # noqa: E402

SITE = Path("/tmp/gpu_check_site")
"""Each release's wheel installs into SITE/<version>, the carried dependencies into SITE/deps."""
DEPS_DIR = ".whl/deps"
"""Wheels of the program's own imports for the GPU machine's Python (prepare_device_check.py)."""
STOP_MARGIN_S = 40.0
"""device_check.sh passes ``--budget-s`` its limit less this: the last row's overrun and the stop."""
DEFAULT_BUDGET_S = 300.0 - STOP_MARGIN_S
"""device_check.sh's default limit (300 s) less STOP_MARGIN_S."""
SETUP_S = 20.0
"""Before the first row: the preflight (torch's import, the device), the wheels' installs (a few
seconds), the program's answers (one child importing megatron-core). Counted in the budget."""


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
    """Found by its distribution (seconds, nothing imported); the FP8 rows follow the program's own
    answer once megatron-core imports (:func:`ask_program`)."""
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
    device_memory_gib: float | None = None
    """The GPU's memory: the full rows' micro batch (test_gpu_stages.micro_batch_for)."""


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
    devices, name, memory = 0, None, None
    if torch_version:
        import torch

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        name = torch.cuda.get_device_name(0) if devices else None
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if devices else None
    wheel = _wheel(release)
    return Facts(python=sys.version_info[:2], torch=torch_version, cuda_devices=devices, device_name=name,
                 device_memory_gib=memory,
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


PROGRAM_ANSWERS = """import json
from megatron_ext.training.cuda_trainer import ONE_RANK_DOUBLE_ADD, SHARD_ONE_RANK_ENV
from megatron_ext.training.model import installed_megatron_core, transformer_engine_version
print(json.dumps({"transformer_engine": transformer_engine_version(), "switch": SHARD_ONE_RANK_ENV,
                  "shards_one_rank": installed_megatron_core() not in ONE_RANK_DOUBLE_ADD}))
"""
"""The program's own answers, asked in a child (its imports stay out of this process)."""


@dataclass(frozen=True)
class ProgramAnswers:
    transformer_engine: str | None
    """``megatron_ext.training.model.transformer_engine_version()``: the transformer-engine megatron-core
    would use (its own HAVE_TE), or None: the FP8 rows run where the program would run FP8."""
    shards_one_rank: bool
    """The release may keep Megatron-FSDP's own strategy at one rank (not ``cuda_trainer.ONE_RANK_DOUBLE_ADD``)."""
    switch: str
    """The variable that asks for it (``cuda_trainer.SHARD_ONE_RANK_ENV``)."""


def ask_program() -> ProgramAnswers:
    """:data:`PROGRAM_ANSWERS` under this Python and PYTHONPATH (the installs'); a failure is one
    SystemExit with the child's last line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", PROGRAM_ANSWERS], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=180)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"error: the training program's modules do not import here: {last[0]}")
    return ProgramAnswers(**json.loads(proc.stdout.strip().splitlines()[-1]))


# -- the plan -------------------------------------------------------------------------------------

def plan_rows(rows: list[Row], budget_s: float, only: list[str] | None = None,
              setup_s: float = SETUP_S) -> tuple[list[Row], list[Row]]:
    """(the rows expected to run, in order, by their estimates within ``budget_s`` after ``setup_s``;
    the rows that would be cut by the budget). ``only``: just those rows, in that order (names not
    among ``rows`` left out). While running, each row is checked against the time actually left."""
    by_name = {r.name: r for r in rows}
    chosen = [by_name[name] for name in only if name in by_name] if only else list(rows)
    spent, fitting = setup_s, 0
    for cost in row_costs(chosen):
        if spent + cost > budget_s:
            break
        spent += cost
        fitting += 1
    return chosen[:fitting], chosen[fitting:]


def row_cost(row: Row, warm: bool) -> float:
    """Its estimate, with the fused kernels' compile unless an earlier row of the process paid it."""
    return row.estimate_s + (0.0 if warm else row.warm_up_s)


def row_costs(rows: list[Row]) -> list[float]:
    """Each row's expected seconds when run in that order (the first full-size start pays the compile)."""
    costs, warm = [], False
    for row in rows:
        costs.append(row_cost(row, warm))
        warm = warm or row.warm_up_s > 0
    return costs


def planned_s(rows: list[Row], setup_s: float = SETUP_S) -> float:
    """The expected wall time of ``rows`` in that order, the setup included."""
    return setup_s + sum(row_costs(rows))


def planned_rows(only: str, budget_s: float) -> tuple[list[str], list[str], float]:
    """A prepared call's plan (prepare_device_check.py): the rows expected, those left to the time
    left, the seconds expected; no transformer-engine (the lent image has none)."""
    expected, cut = plan_rows(all_rows(False), budget_s, only.split(","))
    return [r.name for r in expected], [r.name for r in cut], planned_s(expected)


# -- the run --------------------------------------------------------------------------------------

def describe_plan(expected: list[Row], cut: list[Row], budget_s: float) -> str:
    rows = ", ".join(f"{r.name} ~{cost:.0f} s" for r, cost in zip(expected, row_costs(expected)))
    return (f"plan: {len(expected)} rows expected in {planned_s(expected):.0f} s of the {budget_s:.0f} s budget "
            f"(setup {SETUP_S:.0f} s, {rows})" + (f"; then, if time is left: {', '.join(r.name for r in cut)}" if cut else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-core", metavar="VERSION", help="the release under test: installed, or its carried wheel "
                   "(default: the installed one, else the newest carried)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="wall time for everything, setup included (default %(default)s)")
    p.add_argument("--only", help="comma list of row names to run (see --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="print the preflight's findings and the row plan, run nothing")
    args = p.parse_args(argv)
    started = time.monotonic()
    facts = gather_facts(args.megatron_core)
    problems = preflight_problems(facts)
    only = args.only.split(",") if args.only else None
    micro = micro_batch_for(facts.device_memory_gib)
    if only and (unknown := set(only) - {r.name for r in all_rows(True)}):
        problems.append(f"--only names unknown rows {sorted(unknown)}; see --dry-run")
    print(f"preflight: python {facts.python[0]}.{facts.python[1]}, torch {facts.torch}, {facts.cuda_devices} CUDA "
          f"device(s) {facts.device_name or ''}"
          f"{f' ({facts.device_memory_gib:.1f} GiB: micro batch {micro})' if facts.device_memory_gib else ''}, "
          f"megatron-core {facts.megatron_core or 'not importable'}"
          f"{f' (wheel {Path(facts.wheel).name})' if facts.wheel and not facts.megatron_core else ''}, "
          f"transformer-engine {facts.transformer_engine + ' found' if facts.transformer_engine else 'none'} (FP8 rows "
          "only where megatron-core uses it), "
          f"{facts.free_gb:.0f} GB free, OUT={facts.out_dir or '(unset: /tmp)'}", flush=True)
    print(describe_plan(*plan_rows(all_rows(facts.transformer_engine is not None, True, micro), args.budget_s, only),
                        args.budget_s) + " (before the program's answers, which may leave out FP8 and stage-3 rows)",
          flush=True)
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
    answers = ask_program()
    if answers.shards_one_rank:
        os.environ[answers.switch] = "1"  # every row's program and worker: stages 2-3 keep their own strategy
    rows = all_rows(answers.transformer_engine is not None, answers.shards_one_rank, micro)
    names = {r.name for r in rows}
    expected, cut = plan_rows(rows, args.budget_s, only)
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
        f"transformer-engine {answers.transformer_engine or 'none'} (megatron-core's own check); micro batch {micro}"
        f"{f' ({facts.device_memory_gib:.1f} GiB)' if facts.device_memory_gib else ''}")
    say(f"stages 2-3 at one rank: Megatron-FSDP's own strategies ({answers.switch}=1)" if answers.shards_one_rank else
        f"stages 2-3 at one rank: no_shard (megatron-core {release} adds a one-rank gradient twice when sharding: "
        "cuda_trainer.ONE_RANK_DOUBLE_ADD); stage 3's rows would repeat stage 2's and are left out")
    if answers.transformer_engine is None:
        say("FP8 rows: skipped: megatron-core uses no transformer-engine here")
    if dropped := [n for n in only or () if n not in names]:
        say(f"not run on this release: {', '.join(dropped)}")
    say(describe_plan(expected, cut, args.budget_s))
    say(format_header(micro))
    skipped, warm = [], False
    with tempfile.TemporaryDirectory() as d:
        for row in expected + cut:
            budget_left = args.budget_s - (time.monotonic() - started)
            if budget_left < row_cost(row, warm):  # a smaller row after it may still fit
                skipped.append(row.name)
                continue
            row_dir = Path(d) / row.name
            row_dir.mkdir()
            t0 = time.monotonic()
            try:
                line = row.run(row_dir)
            except Exception as exc:  # a row's own failure is its line; the next row runs
                line = f"{row.name}: FAIL ({type(exc).__name__}: {exc})"
            warm = warm or row.warm_up_s > 0
            kept = [shutil.copyfile(f, out_dir / f"{row.name}-{release}{f.suffix}")
                    for f in sorted((row_dir / "keep").glob("*")) if f.is_file()]
            say(f"{line}  [{row.name} {time.monotonic() - t0:.0f} s, megatron-core {release}"
                + (f"; kept {', '.join(Path(k).name for k in kept)}" if kept else "") + "]")
    if skipped:
        say(f"budget: {len(skipped)} row(s) not run, their estimates past the {args.budget_s:.0f} s budget: "
            f"{', '.join(skipped)}")
    say(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
