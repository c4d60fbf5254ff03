"""The embedded default corpus: docstrings of the running Python's standard library.

    python -c "from megatron_ext.data.corpus import embedded_documents; d=embedded_documents(); print(len(d), sum(map(len, d)))"

About half a megabyte of English and code, the same on every node that runs the same Python;
nothing is downloaded or committed. Reads source files; no other side effects.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from pathlib import Path

EMBEDDED_CORPUS_BYTES = 512 * 1024
"""Stop collecting once the documents reach this many characters."""
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    docs = (ast.get_docstring(n) for n in nodes)
    return [d.strip() for d in docs if d and len(d.strip()) >= 40]


def _stdlib_sources(stdlib: Path) -> list[Path]:
    """Every ``.py`` file of the standard library, sorted; never descends into site-packages
    (whose contents change under a running pip) or tests."""
    found = []
    for dirpath, dirnames, filenames in os.walk(stdlib, onerror=lambda _err: None):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith((".", "~"))]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found)


def embedded_documents(max_chars: int = EMBEDDED_CORPUS_BYTES) -> list[str]:
    """Standard-library docstrings in a fixed order (sorted paths), up to ``max_chars``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents: list[str] = []
    total = 0
    for path in _stdlib_sources(stdlib):
        for doc in _docstrings(path):
            documents.append(doc)
            total += len(doc)
            if total >= max_chars:
                return documents
    return documents
