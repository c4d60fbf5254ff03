"""Weights & Biases logging of one rank: the scalars TensorBoard gets, once per iteration.

    WANDB_PROJECT=demo WANDB_MODE=offline torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke

:func:`open_wandb` starts (or resumes) the run's W&B run (see megatron_ext/run_spec/wandb_run.py:
one id per run, kept under the run directory, ``resume="allow"``); :class:`WandbWriter` logs
with ``step=iteration`` and skips the iterations already logged (a resumed attempt repeats those
after its checkpoint; W&B cannot purge them as TensorBoard's purge_step does). Only the rank
that logs opens it (the last rank, as Megatron-LM). Side effects: wandb (its files under the run
directory or WANDB_DIR, its service process, the network when online) and the run's
``wandb.json``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.wandb_run import WandbSettings, WandbState, wandb_identity, write_wandb_state


class WandbRefused(UserError):
    """wandb.init refused (no API key online, a bad entity, ...): said by the rank that logs."""

    local = True


class WandbWriter:
    def __init__(self, run: Any, paths: RunPaths, state: WandbState):
        self.run, self.paths, self.state = run, paths, state

    def write(self, iteration: int, scalars: Mapping[str, float]) -> None:
        """One iteration's scalars, unless W&B has them already (from an earlier attempt)."""
        if iteration <= self.state.last_step or not scalars:
            return
        self.run.log(dict(scalars), step=iteration)
        self.state = WandbState(self.state.id, iteration)
        write_wandb_state(self.paths, self.state)

    def close(self) -> None:
        self.run.finish()


def wandb_rank(world_size: int) -> int:
    """The rank that logs to W&B: the last, as Megatron-LM's ``_set_wandb_writer`` does
    (megatron/training/global_vars.py, core_v0.16.1: ``args.rank == (args.world_size - 1)``, the rank
    that holds the loss under pipeline parallelism); rank 0 writes the metrics file and TensorBoard."""
    return world_size - 1


def open_wandb_on(settings: WandbSettings, paths: RunPaths, params: Any, rank: int, world_size: int,
                  accumulation_steps: int) -> WandbWriter | None:
    """On the logging rank, the run's W&B run with the resolved parameters and the run's shape as its
    configuration; None on every other rank."""
    if rank != wandb_rank(world_size):
        return None
    config = json.loads(json.dumps(dataclasses.asdict(params), default=str))
    config.update(run=paths.run, world_size=world_size, logging_rank=rank, accumulation_steps=accumulation_steps)
    return open_wandb(settings, paths, config)


def open_wandb(settings: WandbSettings, paths: RunPaths, config: Mapping[str, Any]) -> WandbWriter | None:
    """The run's W&B run (None with WANDB_MODE=disabled); ``config`` is what the W&B run shows as its
    configuration (the resolved parameters, world size, the logging rank)."""
    if not settings.enabled:
        return None
    import wandb

    state = wandb_identity(settings, paths)
    directory = settings.save_dir(paths)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        run = wandb.init(project=settings.project, entity=settings.entity, name=settings.exp_name(paths.run),
                         dir=str(directory), id=state.id, resume="allow", mode=settings.mode, config=dict(config),
                         settings=wandb.Settings(console="off"))  # our own stdout stays as it is (the node log)
    except wandb.errors.Error as exc:
        raise WandbRefused(f"wandb.init for project {settings.project!r} failed: {str(exc).strip().rstrip('.')}; set WANDB_API_KEY (or run "
                           "`wandb login` on every node), check WANDB_ENTITY, or use WANDB_MODE=offline and "
                           "`wandb sync` later") from None
    write_wandb_state(paths, state)  # the id, before the first step: a restart resumes this W&B run
    return WandbWriter(run, paths, state)
