"""The ZeRO table: one mapping, read by the CPU path, megatron-core (CUDA) and Megatron-LM."""

from __future__ import annotations

import pytest

from megatron_ext.training.cuda_trainer import megatron_core_ddp_config, megatron_core_optimizer_config
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import TrainingParams
from megatron_ext.run_spec.zero import STAGES, megatron_lm_flags_for_stage


@pytest.mark.parametrize("stage,dist_opt,fsdp,strategy", [
    (0, False, False, "no_shard"),
    (1, True, False, "no_shard"),
    (2, True, True, "optim_grads"),
    (3, True, True, "optim_grads_params"),
])
def test_megatron_core_configs_follow_facts(stage, dist_opt, fsdp, strategy):
    ddp = megatron_core_ddp_config(stage)
    assert (ddp.use_distributed_optimizer, ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy) == (dist_opt, fsdp, strategy)
    assert ddp.grad_reduce_in_fp32  # Megatron-LM reduces in fp32 under --bf16 unless told otherwise
    opt = megatron_core_optimizer_config(TrainingParams(lr=2e-4, clip_grad=0.5), stage, bf16=True)
    assert opt.use_distributed_optimizer == dist_opt and opt.lr == 2e-4 and opt.clip_grad == 0.5 and opt.bf16


def test_stage_two_is_not_the_obvious_flag_pair():
    # Without --use-megatron-fsdp, Megatron-LM ignores the sharding strategy: that would be ZeRO-1.
    flags = megatron_lm_flags_for_stage(2)
    assert "--use-megatron-fsdp" in flags and flags[flags.index("--data-parallel-sharding-strategy") + 1] == "optim_grads"
    assert flags[flags.index("--ckpt-format") + 1] == "fsdp_dtensor"


def test_version_renames_and_limits():
    assert "--use-custom-fsdp" in megatron_lm_flags_for_stage(3, (0, 13))
    assert "--use-megatron-fsdp" in megatron_lm_flags_for_stage(3, (0, 14))
    assert megatron_lm_flags_for_stage(1, (0, 10)) == ["--use-distributed-optimizer"]
    with pytest.raises(UserError, match="needs Megatron-FSDP"):
        megatron_lm_flags_for_stage(2, (0, 11))


def test_cpu_strategies_and_table_text():
    assert [s.cpu for s in STAGES.values()] == [
        "torch DDP", "torch DDP + ZeroRedundancyOptimizer",
        "FSDP2 fully_shard(reshard_after_forward=False)", "FSDP2 fully_shard(reshard_after_forward=True)",
    ]
