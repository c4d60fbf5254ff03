"""Megatron-LM's dataset helpers (``megatron/core/datasets/helpers_cpp``), built for the ranks' Python
before a start.

    python -m orchestration.megatron_lm.dataset_helpers /opt/Megatron-LM [PYTHON]   # builds, says what it did

Megatron-LM's rank 0 builds them as it starts (``compile_helpers``: ``make -C megatron/core/datasets``),
with the checkout's own Makefile, which takes the library's suffix from ``python3-config
--extension-suffix`` and the headers from ``python3 -m pybind11 --includes``: whichever python3 and
python3-config come first on PATH. A virtual environment of another Python has no python3-config,
so on Python 3.12 with core_v0.19.0 the build made a cpython-311 library, and every rank died with
``ModuleNotFoundError: megatron.core.datasets.helpers_cpp``. The launcher runs the same Makefile
first, on node 0 where rank 0 would, with those two values taken from the ranks' own Python (make's
command-line variables override the Makefile's): the library the ranks import is there before they
start, and a failed build is one line before anything starts. (Rank 0's own make may still build a
library for the other suffix beside it: unused.) Side effects: the build, in the checkout.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.run_spec.errors import UserError

DATASETS_DIR = Path("megatron") / "core" / "datasets"
LIBRARY = "helpers_cpp"
BUILD_TIMEOUT_S = 600.0
PROBE = ("import sysconfig, subprocess, sys; print(sysconfig.get_config_var('EXT_SUFFIX')); "
         "print(subprocess.run([sys.executable, '-m', 'pybind11', '--includes'], capture_output=True, text=True, "
         "check=True).stdout.strip())")
"""The ranks' Python's extension suffix and pybind11's include flags (what the Makefile asks python3 and
python3-config for)."""


@dataclass(frozen=True)
class HelpersBuild:
    """What the Makefile is given for one Python."""

    directory: Path
    ext_suffix: str
    """``.cpython-312-x86_64-linux-gnu.so``"""
    includes: str
    """``-I/usr/include/python3.12 -I.../pybind11/include``"""

    @property
    def library(self) -> Path:
        return self.directory / f"{LIBRARY}{self.ext_suffix}"

    def argv(self) -> list[str]:
        return ["make", "-C", str(self.directory), f"LIBEXT={self.ext_suffix}", f"CPPFLAGS={self.includes}"]


def plan_build(checkout: Path, python: str) -> HelpersBuild:
    """Ask ``python`` (the ranks') what the Makefile needs; a UserError naming the fix when it cannot
    answer (no pybind11 there)."""
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"the ranks' Python {python} did not answer ({exc}); check PATH / the launcher's Python") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or len(lines) != 2:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"Megatron-LM builds its dataset helpers with pybind11, which the ranks' Python {python} cannot "
                        f"run ({why}); install it there: {python} -m pip install pybind11")
    return HelpersBuild(checkout / DATASETS_DIR, lines[0], lines[1])


def ensure_built(checkout: Path, python: str) -> str:
    """Build the helpers for ``python`` with the checkout's Makefile (make rebuilds only what is
    missing or older than its source); its note, or a UserError with make's last line."""
    build = plan_build(checkout, python)
    if not (build.directory / "Makefile").is_file():
        return f"no {build.directory / 'Makefile'}: this checkout builds no dataset helpers"
    started = time.monotonic()
    try:
        proc = subprocess.run(build.argv(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"building Megatron-LM's dataset helpers failed ({exc}); install make and a C++ compiler "
                        "(apt-get install build-essential), or build them yourself for the ranks' Python") from None
    if proc.returncode != 0 or not build.library.is_file():
        why = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
        raise UserError(f"building Megatron-LM's dataset helpers for {python} failed: {' '.join(build.argv())}: {why}; "
                        "install a C++ compiler and the Python headers (python3-dev), or fix the checkout")
    return (f"Megatron-LM's dataset helpers for the ranks' Python: {build.library.name} "
            # make echoes the compile command when it builds (no file times compared here)
            + (f"built in {time.monotonic() - started:.1f} s" if f"-o {build.library.name}" in proc.stdout
               else "already built"))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    try:
        print(ensure_built(Path(args[0]), args[1] if len(args) > 1 else sys.executable))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
