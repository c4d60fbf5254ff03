"""What a process decides before megatron-core is imported: megatron-core does work as it is
imported (its package ``__init__`` imports the transformer, the fusions and the timers) that a CPU
rank, a rank that does not log to W&B or a process that runs no model never uses. Each choice here
costs a process's start seconds of CPU when it is not made (measured: docs/training-program.md).

No torch and no megatron-core at the top: this module is imported before them (and loaded by file
by tests/megatron_lm_shim/sitecustomize.py, in Megatron-LM's ranks).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable, Mapping

JIT_MODULE = "megatron.core.jit"


def skip_unused_wandb(env: Mapping[str, str], modules: dict = sys.modules) -> bool:
    """megatron-core imports wandb, when installed, as it is imported (timers.py and the inference
    contexts: ~1 s of a rank's start here); a run that does not log to W&B (no WANDB_PROJECT) blocks
    that import, which megatron-core takes as "not installed": every site catches the ImportError.
    Whether it was blocked."""
    if env.get("WANDB_PROJECT", "").strip() or "wandb" in modules:
        return False
    modules["wandb"] = None  # `import wandb` raises ImportError; importlib.util.find_spec answers None
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after ``name``'s own code, before any importer sees the module
    (the loader is Python's own; this finder wraps its ``exec_module`` for that one call), once."""

    def __init__(self, name: str, then: Callable[[object], None]):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):  # noqa: ARG002 (the interface's signature)
        if name != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # every other finder, as the import would ask them
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        def exec_then(module):
            del loader.exec_module  # the loader's own method again, for whatever else it loads
            loader.exec_module(module)
            self.then(module)

        try:
            loader.exec_module = exec_then
        except AttributeError:  # a loader that takes no attribute: the module loads as it is, unhooked
            pass
        return spec


def after_import(name: str, then: Callable[[object], None]) -> bool:
    """Call ``then(module)`` once module ``name`` has run its own code: now if it is imported
    already, else as it is imported. Whether it ran now."""
    if name in sys.modules:
        then(sys.modules[name])
        return True
    sys.meta_path.insert(0, _AfterImport(name, then))
    return False


def eager_jit_fuser() -> bool:
    """megatron-core's ``jit_fuser`` is ``torch.compile`` (megatron/core/jit.py), applied as a
    decorator to ~40 functions while megatron-core is imported: each call imports TorchDynamo and
    Inductor and builds a compiler wrapper (~3 s of a rank's start on one core). For this project's
    presets the ones a rank can reach are the fused paths (bias+GeLU, bias+SwiGLU,
    bias+dropout+add), off on CPU (training/model.py ``kernel_choices``); the others serve
    activations, norms, gates and MoE routing these presets do not use. Megatron-LM's
    ``--disable-jit-fuser`` calls megatron-core's own ``disable_jit_fuser()``
    (training/global_vars.py), but only after the model's modules were
    imported with ``torch.compile``; calling it right after ``megatron.core.jit`` runs makes every
    importer take the no-op decorator: the same functions, run eagerly. For processes that never
    run them compiled: CPU ranks, the exports, Megatron-LM's argument check (a CUDA rank keeps the
    fuser: it is the point there). Whether it took effect from the import (False: megatron-core was
    imported already; the decorated functions stay compiled)."""
    if JIT_MODULE in sys.modules:
        return False
    after_import(JIT_MODULE, _disable_jit_fuser)
    return True


def runs_no_model_code() -> None:
    """For a process that imports megatron-core but runs no model and logs nowhere (Megatron-LM's
    argument check, the exports): neither the jit fuser's compiles nor wandb at import."""
    eager_jit_fuser()
    skip_unused_wandb({})


def _disable_jit_fuser(jit) -> None:
    """megatron-core's own ``disable_jit_fuser()`` where it has one (0.16.1 and 0.19.2 do); in a
    release without it, what it does: the module's ``jit_fuser`` the identity."""
    if hasattr(jit, "disable_jit_fuser"):
        jit.disable_jit_fuser()
    else:
        jit.jit_fuser = lambda func: func
