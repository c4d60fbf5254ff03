"""Prepare the GPU check on the developer machine, before a lent GPU machine starts.

    python3 tests/gpu/prepare_device_check.py [--wheel-dir DIR] [--dry-run]

A lent machine gets a copy of the checkout's working tree: tracked files, untracked files git does
not ignore, and the ignored folders named to go along (``carry``); ``../shared`` beside the
checkout is not there, and it reaches no package registry. Its Python (3.12, torch with CUDA) has
no megatron-core. So: find the megatron-core 0.16.1 wheel for Python 3.12 (``--wheel-dir``,
``$WHEEL_DIR``, ``../shared/wheels`` beside the checkout, ``shared/wheels`` in it), copy it into
``.whl/`` in the checkout, make git ignore that folder through ``.git/info/exclude`` (this
clone's own ignore list: a ``.gitignore`` entry would be committed, and a folder ignored either
way travels only when carried), and print the carry list and the one command to run there.
Downloads nothing; a missing wheel is one message and exit 2. Side effects: ``.whl/`` and the
exclude file.
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

WHEEL_GLOB = "megatron_core-0.16.1-cp312-*.whl"
CARRY = ".whl"
COMMAND = "bash tests/gpu/device_check.sh"
TREE_LIMIT_BYTES = 64 * 2**20
"""What travels to a lent machine at most (its README)."""


@dataclass(frozen=True)
class Preparation:
    """What the command will do (the plan a dry run prints)."""

    wheel: Path
    target: Path
    exclude_file: Path
    add_exclude: bool
    """Whether ``/.whl/`` must still be added to the exclude file."""


def wheel_dirs(repo: Path, given: str | None, env_dir: str | None) -> list[Path]:
    """Where to look, in order."""
    return [Path(d) for d in (given, env_dir) if d] + [repo.parent / "shared" / "wheels", repo / "shared" / "wheels"]


def find_wheel(dirs: list[Path]) -> Path | None:
    for directory in dirs:
        found = sorted(directory.glob(WHEEL_GLOB)) if directory.is_dir() else []
        if found:
            return found[-1]
    return None


def exclude_file(repo: Path) -> Path:
    """This clone's ``info/exclude`` (a worktree's .git may be a file: git says where)."""
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-path", "info/exclude"], capture_output=True,
                         text=True, check=True).stdout.strip()
    path = Path(out)
    return path if path.is_absolute() else repo / path


def plan_preparation(repo: Path, wheel: Path, exclude: Path) -> Preparation:
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    return Preparation(wheel=wheel, target=repo / CARRY / wheel.name, exclude_file=exclude,
                       add_exclude=f"/{CARRY}/" not in lines)


def apply(plan: Preparation) -> None:
    plan.target.parent.mkdir(exist_ok=True)
    for old in plan.target.parent.glob("megatron_core-*.whl"):  # one version only: two stop the install
        if old.name != plan.target.name:
            old.unlink()
    if not plan.target.is_file() or plan.target.stat().st_size != plan.wheel.stat().st_size:
        shutil.copyfile(plan.wheel, plan.target)
    if plan.add_exclude:
        plan.exclude_file.parent.mkdir(parents=True, exist_ok=True)
        existing = plan.exclude_file.read_text() if plan.exclude_file.is_file() else ""
        plan.exclude_file.write_text(existing + ("" if existing.endswith("\n") or not existing else "\n") + f"/{CARRY}/\n")


def travelling_bytes(repo: Path) -> int:
    """Tracked and untracked-not-ignored files plus the carried folder."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    files = [repo / os.fsdecode(name) for name in listed if name]
    files += [p for p in (repo / CARRY).rglob("*")]
    return sum(p.stat().st_size for p in files if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel-dir", help="a folder holding the megatron-core 0.16.1 cp312 wheel")
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2], help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print what it would do, change nothing")
    args = p.parse_args(argv)
    repo = args.repo.resolve()
    dirs = wheel_dirs(repo, args.wheel_dir, os.environ.get("WHEEL_DIR"))
    wheel = find_wheel(dirs)
    if wheel is None:
        print(f"error: no {WHEEL_GLOB} in {', '.join(map(str, dirs))}; give --wheel-dir (or WHEEL_DIR), or on a machine "
              "with a registry: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
              "--implementation cp --platform manylinux_2_28_x86_64 -d DIR megatron-core==0.16.1", file=sys.stderr)
        return 2
    plan = plan_preparation(repo, wheel, exclude_file(repo))
    print(f"wheel: {wheel} -> {plan.target.relative_to(repo)}; "
          + (f"adds /{CARRY}/ to {plan.exclude_file}" if plan.add_exclude else f"/{CARRY}/ already in {plan.exclude_file}"))
    if args.dry_run:
        return 0
    apply(plan)
    size = travelling_bytes(repo)
    print(f"what travels: {size / 2**20:.1f} MiB of the {TREE_LIMIT_BYTES // 2**20} MiB a call may send"
          + ("" if size <= TREE_LIMIT_BYTES else ": too much, ignore or remove large untracked files first"))
    print(f"carry: {json.dumps([CARRY])}")
    print(f"command: {COMMAND}")
    return 0 if size <= TREE_LIMIT_BYTES else 2


if __name__ == "__main__":
    sys.exit(main())
