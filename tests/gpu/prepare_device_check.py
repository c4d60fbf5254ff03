"""Prepare the GPU check on the developer machine, before a lent GPU machine starts.

    python3 tests/gpu/prepare_device_check.py [--wheel-dir DIR] [--dry-run]

A lent machine gets a copy of the checkout's working tree: tracked files, untracked files git does
not ignore, and the ignored folders named to go along (``carry``); ``../shared`` beside the
checkout is not there, and it reaches no package registry. Its Python (3.12, torch with CUDA) has
no megatron-core and no pydantic. So: find the megatron-core wheels for Python 3.12 of every
release the check runs (RELEASES: ``--wheel-dir``, ``$WHEEL_DIR``, ``../shared/wheels`` beside the
checkout, ``shared/wheels`` in it), copy them into ``.whl/`` in the checkout, fetch the wheels of
the program's own imports for that Python (DEPENDENCIES, into ``.whl/deps``: ``pip download``
from this machine's registry, once; ``--no-download`` to skip), make git ignore ``.whl/`` through
``.git/info/exclude`` (this clone's own ignore list: a ``.gitignore`` entry would be committed, and
a folder ignored either way travels only when carried), and print the carry list, the machine
kind to ask for (:data:`KIND`) and one command per device call (:data:`CALLS`, each with its rows'
planned seconds), most valuable first. A missing megatron-core wheel is one message and exit 2.
Side effects: ``.whl/`` and the exclude file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

RELEASES = ("0.16.1", "0.19.2")
"""The megatron-core releases the GPU check runs, in order: the project's pin, then the newest."""
WHEEL_GLOB = "megatron_core-{release}-cp312-*.whl"
CARRY = ".whl"
DEPENDENCIES = ("pydantic", "numpy")
"""The program's imports the lent machine's image lacks or may lack (its README: it has PyYAML)."""
PIP_TARGET = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--platform",
              "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64")


@dataclass(frozen=True)
class DeviceCall:
    """One device call: one release's rows, most valuable first, under one wall-time limit."""

    release: str
    rows: str
    """Comma list, in the order they run (gpu_check.py --only)."""
    limit_s: int
    """DEVICE_CHECK_LIMIT_S (the rows' budget, setup included, is 40 s less: device_check.sh)."""
    why: str

    @property
    def command(self) -> str:
        return (f"DEVICE_CHECK_LIMIT_S={self.limit_s} bash tests/gpu/device_check.sh --megatron-core {self.release} "
                f"--only {self.rows}")


CALLS = (
    DeviceCall("0.19.2", "precision,full-z3,full-z2,resume-z3,nan-z2,resume-z2,full-z0-fp8,full-z2-fp8", 300,
               "the sharded path at one rank: the reduce-scatter's dtype, stage 3's per-layer unsharding at full "
               "size, the sharded checkpoint resumed, the NaN check on sharded gradients"),
    DeviceCall("0.16.1", "checkpoint-z0,resume-z1,nan-z2,profile-z0,precision", 300,
               "the pin: the full-size checkpoint saved and loaded, stage 1's resume, then a profiled stage-0 step"),
)
"""The prepared device calls, in order. A lease holds 15 minutes of device time, the machine's start
(minutes) included: call 1, then call 2, or call 1 again if it failed. On 2026-12-04 (one H200, bare
machine) a row took: precision 32-40 s, full-z0 77-86 s on a fresh machine (the compile of the fused
kernels), 34 s after, the other full rows 35-37 s, resume 29-43 s, NaN 18-21 s; installing a wheel
and the dependencies a few seconds (gpu_rows.ROW_TIMINGS). Left out, as they would repeat a run of
the same code: 0.16.1's stage-3 rows (one rank runs stages 2 and 3 alike as no_shard there),
0.19.2's stage 0-1 rows (the switch leaves them as they were measured on 2026-12-04), and the
stage-2 gathers row (the device shim counts the same dispatches on CPU)."""
KIND = "nvidia-h200"
"""The device tool's kind for the full rows: they peaked at 84.78 GiB (91.0 GB) with micro batch 4,
over an H100's 78 GiB; on a GPU under 100 GiB the check runs micro batch 2 (test_gpu_stages.micro_batch_for),
rows that do not compare with the H200's."""
TREE_LIMIT_BYTES = 64 * 2**20
"""What travels to a lent machine at most (its README)."""


@dataclass(frozen=True)
class Preparation:
    """What the command will do (the plan a dry run prints)."""

    wheels: tuple[Path, ...]
    target_dir: Path
    exclude_file: Path
    add_exclude: bool
    """Whether ``/.whl/`` must still be added to the exclude file."""
    download: bool = True
    """Fetch the DEPENDENCIES' wheels into ``target_dir/deps`` (unless there already)."""


def wheel_dirs(repo: Path, given: str | None, env_dir: str | None) -> list[Path]:
    """Where to look, in order."""
    return [Path(d) for d in (given, env_dir) if d] + [repo.parent / "shared" / "wheels", repo / "shared" / "wheels"]


def wheel_release(wheel: Path) -> str:
    """``0.19.2`` of ``megatron_core-0.19.2-cp312-...whl``."""
    return wheel.name.split("-")[1]


def find_wheel(dirs: list[Path], release: str | None = None) -> Path | None:
    """The wheel of ``release`` (None: the newest release) in the first of ``dirs`` holding one."""
    def newest(wheel: Path) -> tuple:
        return tuple(int(x) if x.isdigit() else 0 for x in wheel_release(wheel).split("."))

    for directory in dirs:
        found = sorted(directory.glob(WHEEL_GLOB.format(release=release or "*")), key=newest) if directory.is_dir() else []
        if found:
            return found[-1]
    return None


def exclude_file(repo: Path) -> Path:
    """This clone's ``info/exclude`` (a worktree's .git may be a file: git says where)."""
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-path", "info/exclude"], capture_output=True,
                         text=True, check=True).stdout.strip()
    path = Path(out)
    return path if path.is_absolute() else repo / path


def plan_preparation(repo: Path, wheels: list[Path], exclude: Path, download: bool = True) -> Preparation:
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    return Preparation(wheels=tuple(wheels), target_dir=repo / CARRY, exclude_file=exclude,
                       add_exclude=f"/{CARRY}/" not in lines, download=download)


def apply(plan: Preparation) -> str | None:
    """Copies, downloads, the exclude entry; a failed download is returned (the check then needs an
    image that has those modules), not raised."""
    plan.target_dir.mkdir(exist_ok=True)
    names = {w.name for w in plan.wheels}
    for old in plan.target_dir.glob("megatron_core-*.whl"):  # the releases asked for, no other
        if old.name not in names:
            old.unlink()
    for wheel in plan.wheels:
        target = plan.target_dir / wheel.name
        if not target.is_file() or target.stat().st_size != wheel.stat().st_size:
            shutil.copyfile(wheel, target)
    if plan.add_exclude:
        plan.exclude_file.parent.mkdir(parents=True, exist_ok=True)
        existing = plan.exclude_file.read_text() if plan.exclude_file.is_file() else ""
        plan.exclude_file.write_text(existing + ("" if existing.endswith("\n") or not existing else "\n") + f"/{CARRY}/\n")
    deps = plan.target_dir / "deps"
    if not plan.download or any(deps.glob("pydantic-*.whl")):
        return None
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PIP_TARGET, "-d", str(deps), *DEPENDENCIES],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip().splitlines()[-1:][0] if (proc.stderr or proc.stdout).strip() else "failed"
    return None


def travelling_bytes(repo: Path) -> int:
    """Tracked and untracked-not-ignored files plus the carried folder."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    files = [repo / os.fsdecode(name) for name in listed if name]
    files += [p for p in (repo / CARRY).rglob("*")]
    return sum(p.stat().st_size for p in files if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel-dir", help="a folder holding the megatron-core cp312 wheels of " + ", ".join(RELEASES))
    p.add_argument("--no-download", action="store_true", help=f"do not fetch {', '.join(DEPENDENCIES)} for Python 3.12")
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2], help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print what it would do, change nothing")
    args = p.parse_args(argv)
    repo = args.repo.resolve()
    dirs = wheel_dirs(repo, args.wheel_dir, os.environ.get("WHEEL_DIR"))
    wheels = {release: find_wheel(dirs, release) for release in RELEASES}
    if missing := [r for r, w in wheels.items() if w is None]:
        print(f"error: no {', '.join(WHEEL_GLOB.format(release=r) for r in missing)} in {', '.join(map(str, dirs))}; give "
              "--wheel-dir (or WHEEL_DIR), or on a machine with a registry: python3 -m pip download --no-deps "
              f"{' '.join(PIP_TARGET)} -d DIR " + " ".join(f"megatron-core=={r}" for r in missing), file=sys.stderr)
        return 2
    plan = plan_preparation(repo, list(wheels.values()), exclude_file(repo), download=not args.no_download)
    print(f"wheels: {', '.join(w.name for w in plan.wheels)} -> {CARRY}/; "
          + (f"{', '.join(DEPENDENCIES)} for Python 3.12 -> {CARRY}/deps; " if plan.download else "")
          + (f"adds /{CARRY}/ to {plan.exclude_file}" if plan.add_exclude else f"/{CARRY}/ already in {plan.exclude_file}"))
    if args.dry_run:
        return 0
    failed = apply(plan)
    if failed:
        print(f"warning: pip download of {', '.join(DEPENDENCIES)} failed ({failed}): the GPU machine's image must have "
              "them", file=sys.stderr)
    size = travelling_bytes(repo)
    print(f"what travels: {size / 2**20:.1f} MiB of the {TREE_LIMIT_BYTES // 2**20} MiB a call may send"
          + ("" if size <= TREE_LIMIT_BYTES else ": too much, ignore or remove large untracked files first"))
    print(f"carry: {json.dumps([CARRY])}")
    print(f"kind: {KIND} (the full rows peak at 84.78 GiB with micro batch 4; under 100 GiB the check runs micro "
          "batch 2)")
    from gpu_check import STOP_MARGIN_S, planned_rows  # the row estimates (it imports this file: here, not above)

    for number, call in enumerate(CALLS, 1):
        _, cut, seconds = planned_rows(call.rows, call.limit_s - STOP_MARGIN_S)
        print(f"command {number} (megatron-core {call.release}: {call.why}; {seconds:.0f} s planned of its "
              f"{call.limit_s} s limit" + (f", then if time is left {', '.join(cut)}" if cut else "") + "): "
              + call.command)
    return 0 if size <= TREE_LIMIT_BYTES else 2


if __name__ == "__main__":
    sys.exit(main())
