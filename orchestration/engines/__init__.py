"""Which program torchrun runs on every rank: this project's (megatron-core) or Megatron-LM's.

    ENGINE=megatron-lm MEGATRON_LM_DIR=/opt/Megatron-LM python -m orchestration start ...

:func:`plan_program` returns the program part of the torchrun command line and the environment
changes every rank needs (the ZeRO stage's, for both engines). For Megatron-LM it reads the
checkout (version, flags) from source, renders ``pretrain_gpt.py``'s arguments from the same
params and ZeRO table, and refuses a flag or value the checkout lacks. ``prepare=True`` prepares
the data first (the start command does, once); otherwise the render names where the data will be
(dry runs). Reads files; may prepare data.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.spec.errors import UserError
from megatron_ext.spec.params import RunParams
from megatron_ext.spec.run_paths import RunPaths
from megatron_ext.spec.zero import stage_environment


@dataclass(frozen=True)
class ProgramPlan:
    engine: str
    argv: tuple[str, ...]
    """What follows torchrun's own options: ``-m module ...`` or ``script.py ...``."""
    env: dict[str, str | None]
    """Environment changes for every rank (None = unset)."""


def plan_program(params: RunParams, model: str, data: str, paths: RunPaths, megatron_lm_dir: str | None,
                 prepare: bool = False) -> ProgramPlan:
    t = params.training
    if t.engine == "megatron-core":
        return ProgramPlan("megatron-core", (
            "-m", "megatron_ext.pretrain", "--model", model, "--data", data, "--run-name", paths.run,
            "--zero-stage", str(t.zero_stage), "--train-iters", str(t.train_iters),
        ), stage_environment(t.zero_stage))
    from megatron_ext.data.prepare import ensure_prepared, planned_prepared
    from orchestration.engines.megatron_lm_args import check_flags, render_pretrain_gpt
    from orchestration.engines.megatron_lm_checkout import read_checkout

    if not megatron_lm_dir:
        raise UserError("ENGINE=megatron-lm needs MEGATRON_LM_DIR, the Megatron-LM checkout holding pretrain_gpt.py")
    checkout = read_checkout(megatron_lm_dir)
    prepared = (ensure_prepared if prepare else planned_prepared)(params.data, paths.data_cache_dir)
    render = render_pretrain_gpt(params, prepared, paths, checkout.version[:2])
    check_flags(render.args, checkout.flags, checkout.version_text)
    return ProgramPlan("megatron-lm", (str(checkout.root / "pretrain_gpt.py"), *render.args), render.env)
