"""What ``training_scripts/setup_env.sh`` installs: decided from the installed packages' metadata.

    python -m orchestration.setup_env            # prints the pip commands it runs, then runs them
    python -m orchestration.setup_env --dry-run  # prints them only

Never replaces an installed torch, megatron-core or transformer-engine (NGC containers ship
their own builds). A missing torch gets ``torch==2.13.0``; a missing megatron-core gets the
release tested on this Python (0.16.1 on 3.11, the newest that installs there; 0.19.2 on 3.12
and later), without dependencies so that its torch requirement cannot replace a torch build, plus
the small packages it imports. An installed megatron-core that fails to import is left in place:
a missing module it needs is installed, anything else is reported. Reads package metadata, runs
pip.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import subprocess
import sys

TORCH = "torch==2.13.0"
MEGATRON_CORE_FOR_PYTHON = {(3, 11): "0.16.1", (3, 12): "0.19.2"}
"""The megatron-core release tested on each Python (newer Pythons: the newest entry)."""
MEGATRON_CORE_IMPORTS = ("packaging>=24.2", "einops", "pyyaml")
"""What megatron-core imports beyond torch and numpy (its wheel's other requirements are optional here)."""
IMPORTABLE_FIXES = {"packaging": "packaging>=24.2", "einops": "einops", "yaml": "pyyaml", "numpy": "numpy"}


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_error(module: str) -> BaseException | None:
    """The exception importing ``module`` in a fresh interpreter raises, or None."""
    code = (f"import importlib, sys\ntry:\n importlib.import_module({module!r})\n"
            "except Exception as e:\n print(type(e).__name__ + ':' + getattr(e, 'name', '') + ':' + str(e)); sys.exit(1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    kind, name, message = (proc.stdout.strip().split(":", 2) + ["", "", ""])[:3]
    return ModuleNotFoundError(message, name=name) if kind == "ModuleNotFoundError" else ImportError(message or proc.stderr[-300:])


def plan_installs(python: tuple[int, int], have_torch: str | None, have_mcore: str | None,
                  mcore_error: BaseException | None) -> tuple[list[list[str]], list[str]]:
    """(pip argument lists, messages). Pure."""
    commands: list[list[str]] = []
    messages: list[str] = []
    if have_torch is None:
        commands.append(["install", TORCH])
    else:
        messages.append(f"torch {have_torch} is installed: kept")
    if have_mcore is None:
        release = MEGATRON_CORE_FOR_PYTHON.get(python) or MEGATRON_CORE_FOR_PYTHON[max(MEGATRON_CORE_FOR_PYTHON)]
        commands += [["install", "--no-deps", f"megatron-core=={release}"], ["install", *MEGATRON_CORE_IMPORTS]]
    elif mcore_error is None:
        messages.append(f"megatron-core {have_mcore} is installed and imports: kept")
    elif isinstance(mcore_error, ModuleNotFoundError) and mcore_error.name in IMPORTABLE_FIXES:
        messages.append(f"megatron-core {have_mcore} is installed but needs {mcore_error.name}: installing it, "
                        f"keeping megatron-core {have_mcore}")
        commands.append(["install", IMPORTABLE_FIXES[mcore_error.name]])
    else:
        messages.append(f"error: megatron-core {have_mcore} is installed but does not import ({mcore_error}); "
                        "it is left in place: repair that installation, or uninstall it to get the tested release")
    return commands, messages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    have_mcore = installed("megatron-core")
    error = import_error("megatron.core") if have_mcore and installed("torch") else None
    commands, messages = plan_installs(sys.version_info[:2], installed("torch"), have_mcore, error)
    for message in messages:
        print(message, file=sys.stderr if message.startswith("error") else sys.stdout)
    for command in commands:
        full = [sys.executable, "-m", "pip", *command, "-q"]
        print("+", shlex.join(full), flush=True)
        if not args.dry_run:
            subprocess.run(full, check=True)
    return 1 if any(m.startswith("error") for m in messages) else 0


if __name__ == "__main__":
    sys.exit(main())
