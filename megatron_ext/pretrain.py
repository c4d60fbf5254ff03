"""The program torchrun runs on every rank: a megatron-core GPT pretrain with a ZeRO switch.

    torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke --run-name demo
    ZERO_STAGE=3 torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke

The edge of the program: reads the rank's environment once (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE as torchrun sets them; ZERO_STAGE and ENGINE when no ``--zero-stage`` is given;
ARTIFACT_ROOT; MEGATRON_EXT_ALLOW_UNTESTED; MEGATRON_EXT_SHARD_ONE_RANK; the supervisor's
LAUNCHER_PROGRESS_DIR and LAUNCHER_ATTEMPT; WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME, WANDB_DIR,
WANDB_MODE, WANDB_RUN_ID: the last rank logs to W&B), checks parameters, batch geometry, megatron-core and the data paths before
any process group exists, and hands over to :class:`megatron_ext.training.loop.Pretrain`. With
CUDA: NCCL, one GPU per LOCAL_RANK, bf16, transformer-engine layers when they import. Without:
gloo, fp32, megatron-core's local layers (see training/megatron_on_cpu.py). A user error is one message
from rank 0 and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Mapping

from megatron_ext.import_hooks import eager_jit_fuser, skip_unused_wandb
from megatron_ext.host.devices import visible_gpu_count
from megatron_ext.run_spec.errors import EXIT_NODE_FAILED, EXIT_OK, EXIT_USER_ERROR, UserError
from megatron_ext.run_spec.params import BatchGeometry, RunParams, load_run_params, read_overrides, with_batch_geometry
from megatron_ext.run_spec.resilience import ATTEMPT_ENV, PROGRESS_DIR_ENV
from megatron_ext.run_spec.run_paths import RunPaths, artifact_root, check_root_writable, check_run_name
from megatron_ext.run_spec.wandb_run import WandbSettings, read_wandb_settings, wandb_missing_message
from megatron_ext.run_spec.zero import parse_zero_stage

RANK_0_SPEAKS_S = 3.0
"""How long the other ranks wait before exiting on a user error, so rank 0's message is printed
before torchrun tears the group down."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model preset under params/models (or a YAML path)")
    p.add_argument("--data", required=True, help="data set under params/data (or a YAML path)")
    p.add_argument("--run-name", dest="run", help="run name (default MODEL_DATA)")
    p.add_argument("--zero-stage", help="ZeRO stage 0-3 (default $ZERO_STAGE, else the data set's)")
    p.add_argument("--train-iters", type=int, help="override training.train_iters")
    p.add_argument("--global-batch-size", type=int, help="override training.global_batch_size (the launcher's: a run "
                   "that continues on fewer nodes keeps its global batch)")
    return p.parse_args(argv)


def read_rank_env(env: Mapping[str, str]) -> dict:
    """torchrun's variables, the supervisor's (LAUNCHER_PROGRESS_DIR: where this rank reports
    its progress; LAUNCHER_ATTEMPT: which attempt of the run this is) and OMP_NUM_THREADS: the fields of
    :class:`megatron_ext.training.loop.RankEnv`, read without importing torch."""
    try:
        world = int(env.get("WORLD_SIZE", 1))
        progress = env.get(PROGRESS_DIR_ENV, "").strip()
        return dict(rank=int(env.get("RANK", 0)), local_rank=int(env.get("LOCAL_RANK", 0)), world_size=world,
                    local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)), node=int(env.get("GROUP_RANK", 0)),
                    progress_dir=Path(progress) if progress else None, attempt=int(env.get(ATTEMPT_ENV, "1") or 1),
                    omp_num_threads=env.get("OMP_NUM_THREADS"))
    except ValueError as exc:
        raise UserError(f"RANK/LOCAL_RANK/WORLD_SIZE/GROUP_RANK/{ATTEMPT_ENV} must be integers ({exc}); run under torchrun") from None


def check_device_connections(stage: int, env: Mapping[str, str]) -> None:
    """Megatron-FSDP (stages 2-3) needs CUDA_DEVICE_MAX_CONNECTIONS unset or above 1: Megatron-LM
    asserts it (arguments.py ~L686); the launcher unsets it, a plain torchrun may not have."""
    if stage >= 2 and env.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1" and visible_gpu_count(env):
        raise UserError(f"CUDA_DEVICE_MAX_CONNECTIONS=1 with ZERO_STAGE={stage}: Megatron-FSDP needs it unset or above 1 "
                        "(Megatron-LM: 'FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one'); unset it, "
                        "as the start scripts do, or use ZERO_STAGE=0 or 1")


def check_megatron_fsdp(stage: int, env: Mapping[str, str]) -> None:
    """Stages 2-3 on GPUs run Megatron-FSDP: refuse before the model is built if this
    megatron-core's cannot run on this torch (training/megatron_core_apis.py)."""
    if stage < 2 or not visible_gpu_count(env):
        return
    from megatron_ext.training.megatron_core_apis import megatron_fsdp_incompatibility

    reason = megatron_fsdp_incompatibility()
    if reason:
        raise UserError(f"ZERO_STAGE={stage} runs Megatron-FSDP on GPUs, but {reason}; use megatron-core 0.15 or "
                        "later, the torch that megatron-core release shipped with, or ZERO_STAGE=0 or 1")


@dataclasses.dataclass(frozen=True)
class CheckedInputs:
    """What :func:`check_inputs` read and checked: the fields of
    :class:`megatron_ext.training.loop.RunInputs`, with the rank's as plain values."""

    params: RunParams
    geometry: BatchGeometry
    ranks: dict
    paths: RunPaths
    wandb: WandbSettings | None


def check_inputs(args, env: Mapping[str, str]) -> CheckedInputs:
    """Every check of the rank's input that needs neither torch nor megatron-core (the run name, the
    parameter files, the batch geometry, the environment's numbers, the data paths, W&B): a bad
    input ends the rank here, before its ~5 s of imports, as it ends the launcher before it starts."""
    from megatron_ext.data.prepare import check_data_paths

    run = check_run_name(args.run or f"{args.model}_{os.path.splitext(os.path.basename(args.data))[0]}")
    overrides = read_overrides(env)
    if args.zero_stage is not None:
        overrides = dataclasses.replace(overrides, zero_stage=int(parse_zero_stage(args.zero_stage, "--zero-stage")))
    overrides = dataclasses.replace(overrides, train_iters=args.train_iters, global_batch_size=args.global_batch_size)
    ranks = read_rank_env(env)
    params, geometry = with_batch_geometry(load_run_params(args.model, args.data, overrides), ranks["world_size"])
    check_device_connections(params.training.zero_stage, env)
    paths = RunPaths(artifact_root(env), run)
    check_root_writable(paths.root)
    check_data_paths(params.data)  # missing data paths fail here, on every rank (rank 0 alone prepares)
    wandb = read_wandb_settings(env)
    if wandb and wandb.enabled and importlib.util.find_spec("wandb") is None:  # the launcher's preflight says so first
        raise UserError(wandb_missing_message(f"for {sys.executable}"))
    return CheckedInputs(params, geometry, ranks, paths, wandb)


def resolve(args, env: Mapping[str, str], checked: CheckedInputs | None = None):
    """Everything checked before a process group exists (the environment is read here only):
    :func:`check_inputs` (unless ``checked`` is its answer), then megatron-core's release and
    Megatron-FSDP's prerequisites."""
    from megatron_ext.training.loop import RankEnv, RunInputs
    from megatron_ext.training.megatron_core_releases import ALLOW_UNTESTED_ENV, check_megatron_core

    checked = checked or check_inputs(args, env)
    ranks = RankEnv(**checked.ranks)
    _, warning = check_megatron_core(allow_untested=env.get(ALLOW_UNTESTED_ENV, "").strip() not in ("", "0"))
    if warning and ranks.rank == 0:
        print(warning, file=sys.stderr, flush=True)
    check_megatron_fsdp(checked.params.training.zero_stage, env)
    from megatron_ext.training.cuda_trainer import shard_one_rank_asked

    return RunInputs(params=checked.params, geometry=checked.geometry, ranks=ranks, paths=checked.paths,
                     wandb=checked.wandb, shard_one_rank=shard_one_rank_asked(env))


def refuse(exc: Exception, env: Mapping[str, str], exit_code: int = EXIT_USER_ERROR) -> int:
    """An error that ends every rank: one message (rank 0's, or the rank's own when it alone found it),
    then ``exit_code`` (a user error: 2)."""
    if getattr(exc, "local", False):  # found by this rank alone (e.g. the W&B rank's wandb.init)
        print(f"error: rank {env.get('RANK', '0')}: {exc}", file=sys.stderr, flush=True)
    elif env.get("RANK", "0") == "0":
        print(f"error: {exc}", file=sys.stderr, flush=True)
    else:  # torchrun ends every rank at the first exit: give rank 0 the time to say why
        time.sleep(RANK_0_SPEAKS_S)
    return exit_code


QUIET_WARNINGS: tuple[tuple[str, str, str], ...] = (
    (r"megatron\.core", "(Transformer Engine and )?Apex (are|is) not installed",
     "megatron-core's fallbacks; the start line says what the nodes have"),
    (r"megatron\.core\.inference\.contexts", "The following imports from `dynamic_context.py` will be removed",
     "megatron-core's import of its own modules, at every import since 0.13"),
    (r"megatron\.core\.transformer\.transformer_config", "full scope is deprecated",
     "megatron-core's own default of cuda_graph_scope / cuda_graph_modules, left as it is"),
    (r"torch\.jit\._script", r"`torch\.jit\.\w+` is deprecated",
     "megatron-core's fused kernels, scripted with torch.jit (at its import, and on GPUs at the first step)"),
)
"""(module, message, why) of the warnings a run shows at every start that ask nothing of a user of
this program (regular expressions at the start of the module's name and of the message, as
``warnings.filterwarnings`` takes them), each seen in gpt_smoke runs at stages 0 and 3 on
megatron-core 0.16.1 and 0.19.2 (2026-12-04). What else megatron-core deprecates is shown: its
``tp_group is None ... mandatory soon`` names a call that a later release will refuse."""


def configure_warnings(rank: str) -> None:
    """Rank 0 shows each warning once (megatron-core's deprecations among them: they say what its
    next release changes, and this program admits several), less :data:`QUIET_WARNINGS`; the other
    ranks show none (the same lines again, once per rank). Megatron-core's loggers say errors only."""
    if rank != "0":
        warnings.simplefilter("ignore")
    else:
        warnings.simplefilter("once")
        for module, message, _ in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message, module=module)
    for name in ("megatron", "megatron.core", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    configure_warnings(os.environ.get("RANK", "0"))
    args = parse_args(argv)
    env = os.environ
    try:
        checked = check_inputs(args, env)  # before torch: a bad input costs no imports
    except UserError as exc:
        return refuse(exc, env)
    skip_unused_wandb(env)  # before megatron-core is imported
    import torch

    if not torch.cuda.is_available():
        eager_jit_fuser()  # device_paths.device_path's decision, before megatron-core is imported
    from megatron_ext.training.trainers import NonFiniteGradients

    try:
        inputs = resolve(args, env, checked)
        from megatron_ext.training.loop import Pretrain

        Pretrain(inputs).run()  # data preparation can still find a user error
    except UserError as exc:
        return refuse(exc, env)
    except NonFiniteGradients as exc:  # a fault of the run, not of its input: one line, exit 1
        return refuse(exc, env, EXIT_NODE_FAILED)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
