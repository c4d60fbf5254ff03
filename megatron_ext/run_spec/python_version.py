"""Whether a Python runs a program that states which Pythons it supports: one rule for every node's preflight and the launcher.

    python -c "from megatron_ext.run_spec.python_version import PythonRequirement as R, python_problem as p; \\
        print(p(R('Megatron-LM 0.19.1', '>=3.12', 'its pyproject.toml'), (3, 11, 7), '/usr/bin/python3'))"

A Megatron-LM checkout states it in its ``pyproject.toml`` (``requires-python``: ``>=3.12`` from
core_v0.19, whose code imports ``typing.override``, new in 3.12); the launcher reads it there
(:func:`orchestration.megatron_lm.checkout.read_requires_python`) and every node compares it with its
own interpreter (``node-check``), so that a start is refused before its ranks fail at their first
import. The specifier is PEP 440's, read by ``packaging`` (megatron-core's own dependency, imported
here only when a requirement is checked). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

NEWEST_MINOR = 20
"""Python 3 minor versions searched for the oldest one a requirement admits (for the fix)."""


@dataclass(frozen=True)
class PythonRequirement:
    program: str
    """Who needs it: ``Megatron-LM 0.19.1 (MEGATRON_LM_DIR=/opt/Megatron-LM)``."""
    specifier: str
    """PEP 440 version specifiers: ``>=3.12``."""
    source: str
    """Where it is stated: ``requires-python in its pyproject.toml``."""


def python_problem(requirement: PythonRequirement, version: Sequence[int], executable: str,
                   where: str = "this node") -> str | None:
    """Why the Python ``version`` (``sys.version_info[:3]``) at ``executable`` cannot run the program
    of ``requirement``, or None when it can. One line: both versions, the rule, the fix."""
    running = ".".join(str(v) for v in version[:3])
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:
        return (f"cannot check that {where} ({executable}, Python {running}) meets {requirement.program}'s Python "
                f"{requirement.specifier}: the packaging module is not installed; run training_scripts/setup_env.sh")
    try:
        wanted = SpecifierSet(requirement.specifier)
    except InvalidSpecifier:
        return (f"{requirement.program} states Python {requirement.specifier!r} ({requirement.source}), which is no "
                "PEP 440 version specifier; fix it there (e.g. >=3.12)")
    if wanted.contains(running, prereleases=True):
        return None
    fitting = next((f"3.{minor}" for minor in range(NEWEST_MINOR + 1) if wanted.contains(f"3.{minor}.0", prereleases=True)),
                   None)
    environment = f"a Python {fitting} environment" if fitting else f"a Python {requirement.specifier} environment"
    minor = ".".join(str(v) for v in version[:2])
    return (f"{requirement.program} needs Python {requirement.specifier} ({requirement.source}), and {where} runs "
            f"{running} ({executable}); run the launcher with {environment} at the same path on every node "
            f"(LAUNCHER_PYTHON=/path/to/python{fitting or '3'} bash training_scripts/setup_env.sh, then start with that "
            f"LAUNCHER_PYTHON), or use a Megatron-LM checkout that supports Python {minor}")
