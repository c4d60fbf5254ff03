"""CUDA on the CPU for a whole Megatron-LM ``pretrain_gpt.py`` rank (test support, never the product).

What it makes possible: NVIDIA Megatron-LM's own, unmodified ``pretrain_gpt.py`` (core_v0.16.1)
trains on a machine without a GPU, under torchrun, with gloo: DDP, the distributed optimizer and
Megatron-FSDP (ZeRO stages 0-3), its checkpoints and resume (where Megatron-LM itself manages
them without transformer-engine and apex: README.md), its exit-signal handler, its logs and
error lines, so that this project's Megatron-LM launcher
(ENGINE=megatron-lm: the rendered arguments, the log reader, the save signal, the failure reader)
is tested against the real program.

What it cannot show: CUDA kernels and GPU numerics (everything is CPU arithmetic), NCCL
(gloo stands in, PREMUL_SUM as multiply-then-SUM), the overlap of communication with compute
(streams and events are no-ops; asynchronous collectives are waited through their Work
handles), GPU memory (memory statistics read 0), CUDA graphs, transformer-engine, apex, and
torch.compile (TorchDynamo is disabled, and Megatron's jit_fuser, torch.compile, is the no-op
decorator from megatron-core's import: megatron_ext/import_hooks.py). tests/gpu/ is
for those.

Activation: put this folder first on PYTHONPATH (Python imports ``sitecustomize`` at start) and
set ``MEGATRON_LM_CPU_SHIM=1``; it acts only in a process that also has ``LOCAL_RANK`` (a torchrun
worker, and what that worker starts), and only once that process imports torch::

    PYTHONPATH=tests/megatron_lm_shim MEGATRON_LM_CPU_SHIM=1 python -m torch.distributed.run \\
        --nproc-per-node 2 $MEGATRON_LM_DIR/pretrain_gpt.py --distributed-backend gloo \\
        --transformer-impl local --use-cpu-initialization --no-masked-softmax-fusion ... (fp32)

(the README in tests/megatron_lm_shim/ lists the flags). Anywhere else it is inert and hands
over to any other ``sitecustomize`` further down sys.path.

Per rank, once torch is imported: the TorchFunctionMode of tests/cuda_on_cpu/shim.py
(``device='cuda'``/``cuda:N``/an index -> CPU, ``.cuda()`` the identity, ``pin_memory`` dropped,
``Tensor.type()`` says ``torch.cuda.*Tensor``) for the process's main thread; torch.cuda answering
as one H100-like device per local rank (``is_available``, ``device_count`` = LOCAL_WORLD_SIZE,
``current_device`` = LOCAL_RANK, properties and capability 9.0, memory statistics 0, no-op
``set_device``/``synchronize``/``empty_cache``/streams/events/nvtx); the CUDA RNG API on a CPU
``torch.Generator`` of its own, from which dropout draws (so the DataLoader's seed draw on the
CPU generator does not shift dropout, and resume is exact); ``nccl`` process groups made gloo;
``CUDA_HOME`` a stand-in whose ``bin/nvcc -V`` prints a version (``fused_kernels.load()`` reads
it); ``TORCHDYNAMO_DISABLE=1``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE.parent / "cuda_on_cpu" / "shim.py"
IMPORT_HOOKS = HERE.parents[1] / "megatron_ext" / "import_hooks.py"


def wanted() -> bool:
    return os.environ.get("MEGATRON_LM_CPU_SHIM") == "1" and "LOCAL_RANK" in os.environ


def _load(name: str, path: Path):
    """A module by its file, without putting its folder on this process's sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _DeviceProperties:
    def __init__(self, index: int):
        self.name = "CPU standing in for CUDA (tests/megatron_lm_shim)"
        self.major, self.minor = 9, 0
        self.total_memory = 80 * 2**30
        self.multi_processor_count = 132
        self.index = index
        self.uuid = f"cpu-{index}"
        self.L2_cache_size = 50 * 2**20
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.warp_size = 32

    def __repr__(self):
        return f"_DeviceProperties(name={self.name!r}, major=9, minor=0, total_memory={self.total_memory})"


class _DeviceContext:
    def __init__(self, device=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


class _Nvtx:
    @staticmethod
    def range_push(*args, **kwargs):
        return 0

    @staticmethod
    def range_pop(*args, **kwargs):
        return 0

    @staticmethod
    def mark(*args, **kwargs):
        pass

    @staticmethod
    def range(*args, **kwargs):
        return contextlib.nullcontext()


def _cuda_rng_patches(generator, count: int) -> dict:
    """torch.cuda's RNG API, on ``generator`` (every "device" shares it: one device per process)."""

    def manual_seed(seed):
        generator.manual_seed(int(seed))

    def set_rng_state(new_state, device="cuda"):
        generator.set_state(new_state)

    return {
        "get_rng_state": lambda device="cuda": generator.get_state(),
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [generator.get_state()] * count,
        "set_rng_state_all": lambda states: set_rng_state(states[0]),
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": lambda: generator.seed(),
        "seed_all": lambda: generator.seed(),
        "initial_seed": lambda: generator.initial_seed(),
    }


def _gloo(backend):
    """``nccl`` (alone or in a ``cpu:gloo,cuda:nccl`` list) -> ``gloo``."""
    if isinstance(backend, str) and "nccl" in backend.lower():
        return "gloo"
    return backend


def _patch_distributed(torch, cpu_device) -> None:
    dist = torch.distributed
    init_process_group, new_group = dist.init_process_group, dist.new_group

    def init_process_group_on_gloo(*args, **kwargs):
        if args:
            args = (_gloo(args[0]),) + args[1:]
        if "backend" in kwargs:
            kwargs["backend"] = _gloo(kwargs["backend"])
        if kwargs.get("device_id") is not None and cpu_device(kwargs["device_id"]).type == "cpu":
            kwargs["device_id"] = None
        return init_process_group(*args, **kwargs)

    def new_group_on_gloo(*args, **kwargs):
        if len(args) >= 3:
            args = args[:2] + (_gloo(args[2]),) + args[3:]
        if "backend" in kwargs:
            kwargs["backend"] = _gloo(kwargs["backend"])
            if kwargs["backend"] == "gloo":
                kwargs.pop("pg_options", None)
        if kwargs.get("device_id") is not None:
            kwargs["device_id"] = None
        return new_group(*args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group_on_gloo, new_group_on_gloo
    dist.distributed_c10d.init_process_group = init_process_group_on_gloo
    dist.distributed_c10d.new_group = new_group_on_gloo

    # PREMUL_SUM (megatron-core's gradient_reduce_div_fusion) is NCCL's: on gloo, scale the input
    # in place, then SUM, as megatron-core does itself without the fusion.
    def premul_to_sum(collective, inputs_at):
        def wrapped(*args, **kwargs):
            op = kwargs.get("op")
            if op is not None and getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
                inputs = args[inputs_at] if len(args) > inputs_at else kwargs.get(("tensor", "input", "input_list")[inputs_at])
                for t in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
                    t.mul_(op.factor)
                kwargs["op"] = dist.ReduceOp.SUM
            return collective(*args, **kwargs)

        wrapped.__wrapped__ = collective
        return wrapped

    for name, inputs_at in (("all_reduce", 0), ("reduce_scatter_tensor", 1), ("reduce_scatter", 1)):
        setattr(dist, name, premul_to_sum(getattr(dist, name), inputs_at))


def install() -> None:
    """Patch torch for this process and enter the device mode for good (its main thread)."""
    import torch
    import torch.cuda.random
    import torch.utils.cpp_extension

    shim = _load("_megatron_lm_cpu_shim_common", SHIM)
    local_rank = int(os.environ["LOCAL_RANK"])
    count = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1)
    generator = torch.Generator()  # stands for the GPU's: dropout draws from it
    generator.manual_seed(67280421310721)  # torch.cuda's default seed

    zero = lambda *a, **k: 0  # noqa: E731
    cuda = {
        **shim.stream_patches(local_rank),
        "is_available": lambda: True,
        "_lazy_init": lambda: None,
        "_lazy_call": lambda callable, **kwargs: callable(),
        "device_count": lambda: count,
        "set_device": lambda device: None,
        "device": _DeviceContext,
        "set_stream": lambda stream: None,
        "empty_cache": lambda: None,
        "get_device_properties": lambda device=None: _DeviceProperties(local_rank),
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_name": lambda device=None: _DeviceProperties(local_rank).name,
        "memory_allocated": zero, "max_memory_allocated": zero, "memory_reserved": zero,
        "max_memory_reserved": zero, "reset_peak_memory_stats": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
        "mem_get_info": lambda *a, **k: (80 * 2**30, 80 * 2**30),
        "default_generators": (generator,) * count,
        **_cuda_rng_patches(generator, count),
    }
    shim.set_attributes(torch.cuda, cuda)
    shim.set_attributes(torch.cuda.random, {k: v for k, v in cuda.items() if hasattr(torch.cuda.random, k)})
    shim.set_attributes(torch.cuda.nvtx, {"range_push": _Nvtx.range_push, "range_pop": _Nvtx.range_pop,
                                          "mark": _Nvtx.mark, "range": _Nvtx.range})
    # The CUDA build of torch on a machine without a GPU: what asks torch.accelerator (the
    # DataLoader's pin-memory thread, the optimizers' graph-capture check) gets the same answers,
    # and that thread's pin_memory (outside the device mode, which is the main thread's) is dropped.
    import torch.accelerator
    import torch.utils.data._utils.pin_memory as pin

    shim.set_attributes(torch.accelerator, {
        name: value for name, value in {
            "is_available": lambda: True, "device_count": lambda: count,
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "current_device_index": lambda: local_rank, "current_device_idx": lambda: local_rank,
            "set_device_index": lambda device: None, "set_device_idx": lambda device: None,
            "synchronize": lambda device=None: None, "current_stream": lambda device=None: shim.Stream(),
            "set_stream": lambda stream: None,
        }.items() if hasattr(torch.accelerator, name)})
    shim.set_attributes(pin, {"pin_memory": lambda data, device=None: data})
    torch.utils.cpp_extension.CUDA_HOME = str(HERE)  # bin/nvcc -V prints a CUDA version
    _patch_distributed(torch, shim.cpu_device)
    shim.set_attributes(torch.distributed.ProcessGroup, shim.collective_patches())
    shim.CudaOnCpu(cuda_generator=generator).__enter__()  # never left: the process's lifetime


def _chain_other_sitecustomize() -> None:
    """Run the ``sitecustomize`` this file shadows, if any, as Python would have."""
    others = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None and Path(spec.origin).resolve() != Path(__file__).resolve():
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if wanted():
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    hooks = _load("_megatron_ext_import_hooks", IMPORT_HOOKS)
    # Once torch is imported (a process that never imports it, such as ``python3 -m pybind11`` run
    # by the dataset helpers' build, stays untouched); and megatron-core's jit_fuser the no-op
    # decorator from its import: with TorchDynamo disabled the decorated functions run eagerly
    # anyway, and the program's CPU ranks do the same (import_hooks.eager_jit_fuser).
    hooks.after_import("torch", lambda torch: install())
    hooks.eager_jit_fuser()
_chain_other_sitecustomize()
