"""The CPU path and the CUDA path of a rank: what training/loop.py does differently on each, chosen
once (:func:`device_path`), so that the loop does not branch on the device (nor on the trainer:
training/trainers.py). megatron-core is imported inside the methods, as in the loop."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.flops import bf16_share_under_fp8, describe_mfu_peak, peak_tflops_for
from megatron_ext.run_spec.params import ModelPreset, TrainingParams
from megatron_ext.run_spec.zero import ZeroStage
from megatron_ext.training.busy_clock import EventBusyClock, SampledBusyClock


class CpuPath:
    """gloo, fp32, megatron-core's CUDA-only spots replaced (training/megatron_on_cpu.py), ``threads``
    intra-op threads where given (loop.cpu_threads), no MFU. ``reads_ahead``: batches pinned, the
    next one read on a thread while this one computes."""

    kind, on_cuda, backend, precision, params_dtype = Device.CPU, False, "gloo", "fp32", torch.float32
    reads_ahead, capability, peak_tflops, busy_clock = False, None, None, SampledBusyClock
    synchronize = staticmethod(torch.cpu.synchronize)

    def __init__(self, threads: int | None):
        self.device = torch.device(self.kind)
        if threads is not None:
            torch.set_num_threads(threads)

    def join(self, timeout: datetime.timedelta, seed: int) -> None:
        """The process group, megatron's TP=1/PP=1 parallel state (the world group is gloo already:
        no second set of gloo groups), its seeds."""
        from megatron.core import parallel_state

        from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu

        dist.init_process_group(self.backend, timeout=timeout)
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        install_megatron_on_cpu(seed)

    def wrap(self, module: torch.nn.Module, t: TrainingParams, **_warm_up):
        """The trainer for the ZeRO stage (training/trainers.py), and what was done before the first step."""
        from megatron_ext.training.trainers import wrap_cpu

        return wrap_cpu(module, ZeroStage(t.zero_stage), t), None

    def mfu_note(self, _m: ModelPreset, _t: TrainingParams, _vocab: int) -> str:
        return "no MFU on CPU"


class CudaPath:
    """One GPU per LOCAL_RANK (set at once), NCCL with gloo groups beside it, bf16, megatron-core's trainers:
    the attributes and methods of :class:`CpuPath`, none of them inherited."""

    kind, on_cuda, backend, precision, params_dtype = Device.CUDA, True, "nccl", "bf16", torch.bfloat16
    reads_ahead, busy_clock, synchronize = True, EventBusyClock, staticmethod(torch.cuda.synchronize)

    def __init__(self, local_rank: int):
        self.device = torch.device(self.kind, local_rank)
        torch.cuda.set_device(local_rank)
        self.capability = torch.cuda.get_device_capability(self.device)
        self.peak_tflops = peak_tflops_for(torch.cuda.get_device_name(self.device))

    def join(self, timeout: datetime.timedelta, seed: int) -> None:
        from megatron.core import parallel_state, tensor_parallel

        dist.init_process_group(self.backend, device_id=self.device, timeout=timeout)
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=True)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def wrap(self, module: torch.nn.Module, t: TrainingParams, *, m: ModelPreset, kernels, vocab: int, shard_one_rank: bool):
        """The trainer, and the fused kernels compiled before the first step (what and how long)."""
        from megatron_ext.training.cuda_trainer import wrap_cuda
        from megatron_ext.training.model import warm_up_fusions

        module.cuda()
        trainer = wrap_cuda(module, ZeroStage(t.zero_stage), t, self.device, shard_one_rank=shard_one_rank)
        started = time.monotonic()  # before the first step's clock: out of step times and MFU
        warmed = warm_up_fusions(m, kernels, t.seq_length, t.micro_batch_size, vocab, self.params_dtype, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)  # the warm-up's logits are no step's peak
        return trainer, (f"fused kernels compiled before the first step in {time.monotonic() - started:.1f} s: "
                         f"{', '.join(warmed)}" if warmed else None)

    def mfu_note(self, m: ModelPreset, t: TrainingParams, vocab: int) -> str:
        share = bf16_share_under_fp8(m, t.seq_length, vocab) if t.fp8 else None
        return describe_mfu_peak(torch.cuda.get_device_name(self.device), share)


def device_path(local_rank: int, threads: int | None) -> CpuPath | CudaPath:
    """CUDA where torch sees a GPU (``local_rank``'s), else the CPU (``threads``)."""
    return CudaPath(local_rank) if torch.cuda.is_available() else CpuPath(threads)
