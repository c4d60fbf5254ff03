"""ZERO_STAGE -> data-parallel strategy: the one table every engine and device reads.

    python -c "from megatron_ext.run_spec.zero import STAGES; print(*STAGES.values(), sep=chr(10))"

ZeRO stages (Rajbhandari et al.) name *what* is sharded over data-parallel ranks; this module
says *how*, per device kind and engine. The obvious mapping is wrong for stage 2: Megatron-LM's
``--data-parallel-sharding-strategy optim_grads`` is read only by Megatron-FSDP, so without
``--use-megatron-fsdp`` it silently stays ZeRO-1 (Megatron-LM 0.16 `validate_args`; see the README). Pure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron_ext.run_spec.errors import UserError


class ZeroStage(enum.IntEnum):
    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


@dataclass(frozen=True)
class MegatronCoreDdp:
    """A stage's keywords for megatron-core's DistributedDataParallelConfig (OptimizerConfig's use_distributed_optimizer too)."""

    use_distributed_optimizer: bool
    megatron_fsdp: str | None = None
    """Megatron-FSDP's data_parallel_sharding_strategy (optim_grads, optim_grads_params); None: megatron-core DDP."""

    def kwargs(self) -> dict[str, bool | str]:
        """The config's keywords: Megatron-FSDP's only with it (megatron-core's defaults otherwise)."""
        fsdp = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": self.megatron_fsdp} if self.megatron_fsdp else {}
        return {"use_distributed_optimizer": self.use_distributed_optimizer, **fsdp}


@dataclass(frozen=True, kw_only=True)
class StageStrategy:
    stage: ZeroStage
    sharded: str
    """What is sharded over data-parallel ranks."""
    cuda: str
    """How it is done on GPUs (megatron-core)."""
    cpu: str
    """How it is done on CPU (torch.distributed, gloo)."""
    megatron_core_ddp: MegatronCoreDdp
    megatron_lm_flags: tuple[str, ...]
    """Megatron-LM pretrain_gpt.py flags (>= 0.14 spelling; see megatron_lm_flags_for_stage)."""


def _megatron_fsdp(stage: ZeroStage, sharded: str, strategy: str, reshard_after_forward: bool) -> StageStrategy:
    """Stages 2-3: Megatron-FSDP's ``strategy`` on GPUs, FSDP2 on CPU."""
    return StageStrategy(
        stage=stage,
        sharded=sharded,
        cuda=f"Megatron-FSDP {strategy} + distributed optimizer",
        cpu=f"FSDP2 fully_shard(reshard_after_forward={reshard_after_forward})",
        megatron_core_ddp=MegatronCoreDdp(use_distributed_optimizer=True, megatron_fsdp=strategy),
        megatron_lm_flags=("--use-megatron-fsdp", "--use-distributed-optimizer", "--data-parallel-sharding-strategy", strategy,
                           "--ckpt-format", "fsdp_dtensor"),
    )


STAGES: dict[ZeroStage, StageStrategy] = {
    ZeroStage.NONE: StageStrategy(
        stage=ZeroStage.NONE,
        sharded="nothing (all-reduce data parallelism)",
        cuda="megatron-core DDP",
        cpu="torch DDP",
        megatron_core_ddp=MegatronCoreDdp(use_distributed_optimizer=False),
        megatron_lm_flags=(),
    ),
    ZeroStage.OPTIMIZER: StageStrategy(
        stage=ZeroStage.OPTIMIZER,
        sharded="optimizer state + fp32 main params",
        cuda="megatron-core DDP + distributed optimizer",
        cpu="torch DDP + ZeroRedundancyOptimizer",
        megatron_core_ddp=MegatronCoreDdp(use_distributed_optimizer=True),
        megatron_lm_flags=("--use-distributed-optimizer",),
    ),
    ZeroStage.GRADIENTS: _megatron_fsdp(ZeroStage.GRADIENTS, "optimizer state + gradients", "optim_grads", False),
    ZeroStage.PARAMETERS: _megatron_fsdp(ZeroStage.PARAMETERS, "optimizer state + gradients + parameters", "optim_grads_params", True),
}


def parse_zero_stage(value: str, source: str = "ZERO_STAGE") -> ZeroStage:
    """Parse a stage from text; anything but 0-3 is one clear error."""
    text = str(value).strip()
    if text not in {"0", "1", "2", "3"}:
        raise UserError(
            f"{source}={value!r} is not a ZeRO stage; use 0 (none), 1 (optimizer state), "
            "2 (+ gradients) or 3 (+ parameters), e.g. ZERO_STAGE=1"
        )
    return ZeroStage(int(text))


def strategy_for(stage: int) -> StageStrategy:
    return STAGES[ZeroStage(stage)]


def megatron_lm_flags_for_stage(stage: int, version: tuple[int, int] = (0, 16)) -> list[str]:
    """Megatron-LM flags for ``stage`` on a checkout of ``version`` (major, minor).

    ``--use-custom-fsdp`` (0.12-0.13) became ``--use-megatron-fsdp`` (0.14+); Megatron-FSDP
    does not exist before 0.12, so stages 2-3 are refused there.
    """
    flags = list(STAGES[ZeroStage(stage)].megatron_lm_flags)
    if stage >= 2:
        if version < (0, 12):
            raise UserError(
                f"ZERO_STAGE={stage} needs Megatron-FSDP, which Megatron-LM {version[0]}.{version[1]} "
                "lacks (added in 0.12); use ZERO_STAGE=1 or a newer checkout"
            )
        if version < (0, 14):
            flags[flags.index("--use-megatron-fsdp")] = "--use-custom-fsdp"
    return flags


def stage_environment(stage: int) -> dict[str, str | None]:
    """Environment every rank needs for ``stage`` (None = unset), for both engines:
    Megatron-FSDP (stages 2-3) needs ``CUDA_DEVICE_MAX_CONNECTIONS`` unset or > 1; the DDP stages
    keep Megatron-LM's usual 1 (required once TP > 1 with the distributed optimizer)."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": None if stage >= ZeroStage.GRADIENTS else "1"}


ALL_STAGES = (0, 1, 2, 3)


def parse_stages(text: str | None, source: str = "STAGES") -> tuple[int, ...]:
    """A list of stages, as the sweep takes it: ``0,1,3`` -> (0, 1, 3), in that order; empty =
    all four; no repeats."""
    if not text or not text.strip():
        return ALL_STAGES
    stages: list[int] = []
    for part in text.replace(" ", "").split(","):
        if part not in ("0", "1", "2", "3"):
            raise UserError(f"{source}={text!r}: {part!r} is not a ZeRO stage; list stages 0-3 separated by commas, "
                            f"e.g. {source}=0,1,2,3")
        stage = int(parse_zero_stage(part))
        if stage in stages:
            raise UserError(f"{source}={text!r} lists stage {stage} twice; list each stage once, e.g. {source}=0,1,2,3")
        stages.append(stage)
    return tuple(stages)
