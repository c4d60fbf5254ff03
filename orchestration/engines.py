"""Which program torchrun runs on every rank: this project's (megatron-core) or Megatron-LM's.

    ENGINE=megatron-lm MEGATRON_LM_DIR=/opt/Megatron-LM python -m orchestration start ...

:func:`plan_program` returns the program part of the torchrun command line and the environment
changes it needs. For Megatron-LM it reads the checkout (version, flags) from source, renders
``pretrain_gpt.py``'s arguments from the same params and ZeRO table, and refuses a flag or value
the checkout lacks. ``prepare=True`` prepares the data first (the start command does, once);
otherwise the render names where the data will be (dry runs). Reads files; may prepare data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from megatron_ext.artifacts import RunPaths
from megatron_ext.params import ParamsError, RunParams


@dataclass(frozen=True)
class ProgramPlan:
    engine: str
    argv: tuple[str, ...]
    """What follows torchrun's own options: ``-m module ...`` or ``script.py ...``."""
    env: dict[str, str | None]
    """Environment changes for every rank (None = unset)."""


def plan_program(params: RunParams, model: str, data: str, paths: RunPaths, env: Mapping[str, str],
                 prepare: bool = False) -> ProgramPlan:
    if params.training.engine == "megatron-core":
        return ProgramPlan("megatron-core", ("-m", "megatron_ext.pretrain", "--model", model, "--data", data,
                                             "--run-name", paths.run), {})
    from megatron_ext.megatron_lm_args import check_flags, render_pretrain_gpt
    from megatron_ext.megatron_lm_checkout import read_checkout
    from megatron_ext.prepare_data import ensure_prepared, planned_prepared

    root = env.get("MEGATRON_LM_DIR", "").strip()
    if not root:
        raise ParamsError("ENGINE=megatron-lm needs MEGATRON_LM_DIR, the Megatron-LM checkout holding pretrain_gpt.py")
    checkout = read_checkout(root)
    prepared = (ensure_prepared if prepare else planned_prepared)(params.data, paths.data_cache_dir)
    render = render_pretrain_gpt(params, prepared, paths, checkout.version[:2])
    check_flags(render.args, checkout.flags, checkout.version_text)
    return ProgramPlan("megatron-lm", (str(checkout.root / "pretrain_gpt.py"), *render.args), render.env)
