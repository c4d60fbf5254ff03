"""The README's test command as a new user runs it, N times: each run in a fresh clone with a new venv.

    python benchmarks/suite_runs.py [--runs 3] [--ref HEAD] [--fresh-py312] [--keep-failed]

Each run: ``git clone`` of this repository at ``--ref`` into an empty folder under the system's
temporary directory, ``python3 -m venv`` there (from the interpreter the venv or pyenv is made
from), then the README's test command as ``.ci/run`` gives it (tests/test_docs.py keeps the two
the same), with ``CI=true``, that venv first on ``PATH`` and ``TMPDIR`` inside the run's folder (so
pytest's own folders are the run's, and go with it). The Python 3.12 environment is CI's cache
(``.ci/py312_env.sh``) unless ``--fresh-py312``, which builds it in the clone each time (about 3
minutes more a run, as on a new machine). The system packages are ``.ci/run``'s: install them first.

After each run: what it left (network namespaces, processes whose working folder, command line or
environment names the run's folder, mounts under it); then the folder is removed (kept with
``--keep-failed`` when the run was red). One table at the end: exit code, pytest's summary, the
failed tests, wall time, what was left. Side effects: clones, venvs and runs of the whole suite.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s")
FAILED = re.compile(r"^(FAILED|ERROR) (\S+)")


@dataclass
class SuiteRun:
    number: int
    exit_code: int
    wall_s: float
    summary: str
    failed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    folder: Path | None = None


def readme_test_command(clone: Path) -> str:
    """The test command ``.ci/run`` runs (the README's, verbatim: tests/test_docs.py)."""
    lines = [line.strip() for line in (clone / ".ci" / "run").read_text().splitlines()
             if "pytest" in line and not line.lstrip().startswith("#")]
    if len(lines) != 1:
        raise SystemExit(f"error: .ci/run has {len(lines)} pytest lines, expected 1")
    return lines[0]


def base_python() -> str:
    """The interpreter a new venv is made from: this one's base (a venv's own python makes a venv of a venv)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def netns() -> set[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


def processes_naming(folder: Path) -> list[str]:
    """Live processes whose working folder, command line or environment names ``folder``."""
    needle = str(folder).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if (needle in cmdline or needle in (entry / "environ").read_bytes()
                    or os.readlink(entry / "cwd").startswith(str(folder))):
                state = next((l.split()[1] for l in (entry / "status").read_text().splitlines() if l.startswith("State:")), "?")
                if state != "Z":
                    words = cmdline.replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"pid {entry.name}: {words[:120]}")
        except OSError:
            continue
    return found


def mounts_under(folder: Path) -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(str(folder))]


def summarize(output: str) -> tuple[str, list[str]]:
    lines = output.splitlines()
    summary = next((m.group(1) for line in reversed(lines) if (m := SUMMARY.match(line.strip("= ")))), "no pytest summary")
    return summary, [f"{m.group(1)} {m.group(2)}" for line in lines if (m := FAILED.match(line))]


def one_run(number: int, ref: str, fresh_py312: bool, keep_failed: bool) -> SuiteRun:
    folder = Path(tempfile.mkdtemp(prefix=f"suite-run{number}-"))
    clone, venv, tmp = folder / "clone", folder / "venv", folder / "tmp"
    tmp.mkdir()
    namespaces_before = netns()
    subprocess.run(["git", "clone", "-q", "--no-local", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", ref], check=True)
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(CI="true", TMPDIR=str(tmp), VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    if fresh_py312:
        env["LAUNCHER_CI_CACHE"] = "none"
    command = readme_test_command(clone)
    print(f"run {number}: {folder}: {command}", flush=True)
    started = time.monotonic()
    with open(folder / "output.txt", "w") as out:
        code = subprocess.run(["bash", "-c", command], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - started
    output = (folder / "output.txt").read_text(errors="replace")
    summary, failed = summarize(output)
    left = [f"network namespace {n}" for n in sorted(netns() - namespaces_before)]
    left += processes_naming(folder) + [f"mount {m}" for m in mounts_under(folder)]
    run = SuiteRun(number, code, wall, summary, failed, left)
    print(f"run {number}: exit {code}, {summary}, {wall:.0f} s" + "".join(f"\n  {f}" for f in failed + left), flush=True)
    if code != 0 and keep_failed:
        run.folder = folder
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ref", default="HEAD", help="the commit each clone checks out (committed work only)")
    p.add_argument("--fresh-py312", action="store_true", help="build .venv-py312 in each clone (no CI cache)")
    p.add_argument("--keep-failed", action="store_true", help="keep a red run's folder (its output.txt, its clone)")
    args = p.parse_args(argv)
    ref = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.ref], capture_output=True, text=True, check=True).stdout.strip()
    runs = [one_run(n, ref, args.fresh_py312, args.keep_failed) for n in range(1, args.runs + 1)]
    print(f"\nthe README's test command, {len(runs)} fresh clone(s) of {ref[:12]}:")
    print(f"{'run':>3}  {'exit':>4}  {'wall':>7}  {'left':>4}  summary")
    for r in runs:
        print(f"{r.number:>3}  {r.exit_code:>4}  {r.wall_s:>6.0f}s  {len(r.left):>4}  {r.summary}")
        for line in r.failed + r.left:
            print(f"{'':>25}{line}")
        if r.folder:
            print(f"{'':>25}kept: {r.folder}")
    return 0 if all(r.exit_code == 0 and not r.left for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
