"""megatron-core's CUDA-only objects (DDP, the distributed optimizer, Megatron-FSDP) run on the CPU,
for tests of what this project does with them: the real megatron-core code, with every
``device='cuda'`` a tensor factory asks for made the CPU (a TorchFunctionMode), ``.type()``
answering ``torch.cuda.FloatTensor`` for a CPU float tensor (megatron-core's optimizers check it),
and torch.cuda's streams and events standing in for work that is done when it returns.

What this proves: the objects' state handling (state dicts, checkpoints, resume, the NaN checks,
the FSDP configuration and its gathers), with gloo in place of NCCL. What it cannot: CUDA kernels,
the overlap of communication with compute (streams are no-ops), NCCL, GPU numerics and memory;
tests/gpu/ and tests/gpu/device_check.sh are for that.

Two users: :func:`cuda_on_cpu`, a context manager around megatron-core objects built in-process
(tests/cuda_on_cpu/worker.py), and tests/megatron_lm_shim/sitecustomize.py, which installs the
same pieces (:class:`CudaOnCpu`, :class:`Stream`, :class:`Event`, :func:`stream_patches`) for the
whole of a Megatron-LM ``pretrain_gpt.py`` rank, with more of torch.cuda besides.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def cpu_device(device):
    """``'cuda'``, ``'cuda:N'``, ``torch.device('cuda', N)`` or a bare index -> the CPU; others unchanged."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else d


def _is_cuda_device(a) -> bool:
    if isinstance(a, int) and not isinstance(a, bool):  # tensor.to(torch.cuda.current_device())
        return True
    if isinstance(a, (str, torch.device)):
        try:
            return torch.device(a).type == "cuda"
        except RuntimeError:  # a string that is not a device
            return False
    return False


_DROPOUT = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                      torch.dropout, torch.dropout_, torch.bernoulli, torch.Tensor.bernoulli, torch.Tensor.bernoulli_})
"""What draws on the GPU's generator in a CUDA run (dropout, as Megatron's layers call it)."""


class CudaOnCpu(TorchFunctionMode):
    """CUDA device arguments -> the CPU; ``.cuda()``, ``.pin_memory()``, ``.record_stream()`` the
    identity; ``pin_memory=`` dropped; ``Tensor.type()`` says ``torch.cuda.*Tensor``.

    ``cuda_generator``: a CPU generator standing for the GPU's; dropout then draws from it (the
    process's CPU generator is swapped out around the call), so what draws from the CPU generator
    (a DataLoader's seed, CPU initialisation) does not shift dropout, as on a GPU. None: dropout
    draws from the CPU generator."""

    def __init__(self, cuda_generator: torch.Generator | None = None):
        super().__init__()
        self.cuda_generator = cuda_generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # "torch.FloatTensor" -> "torch.cuda.FloatTensor"
            return func(*args).replace("torch.", "torch.cuda.", 1)
        name = getattr(func, "__name__", "")
        if name in ("cuda", "pin_memory") and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "record_stream":
            return None
        if name == "to":
            args = tuple(torch.device("cpu") if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        if self.cuda_generator is not None and func in _DROPOUT:
            return self._on_cuda_generator(func, args, kwargs)
        return func(*args, **kwargs)

    def _on_cuda_generator(self, func, args, kwargs):
        cpu_state = torch.get_rng_state()
        torch.set_rng_state(self.cuda_generator.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            self.cuda_generator.set_state(torch.get_rng_state())
            torch.set_rng_state(cpu_state)


class Event:
    """torch.cuda.Event whose work is done when it is recorded."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class Stream:
    """torch.cuda.Stream on which everything has already run."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def synchronize(self):
        pass

    def is_capturing(self) -> bool:  # torch.accelerator.current_stream()'s: the optimizers' graph-capture check
        return False

    def query(self):
        return True

    def record_event(self, *args):
        return Event()

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def stream_patches(current_device: int = 0) -> dict[str, Any]:
    """torch.cuda attributes for streams, events, the current device and its peak memory."""
    return {"current_device": lambda: current_device, "current_stream": lambda *a, **k: Stream(),
            "default_stream": lambda *a, **k: Stream(), "synchronize": lambda *a, **k: None,
            "Stream": Stream, "Event": Event, "stream": lambda s=None: contextlib.nullcontext(),
            "is_current_stream_capturing": lambda: False, "max_memory_allocated": lambda *a, **k: 0}


_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "all_gather_single",
                "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter",
                "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
                "reduce_scatter_single_coalesced", "broadcast", "alltoall_base")  # not send/recv: P2P could deadlock


def _waited_at_issue(method):
    def collective(self, *args, **kwargs):
        work = method(self, *args, **kwargs)
        if work is not None:
            work.wait()  # CUDA's one stream per communicator, made synchronous (gloo: 2 threads per group)
        done = torch.futures.Future()
        done.set_result([])
        return torch._C._distributed_c10d._create_work_from_future(done)  # complete: its wait() does nothing
    return collective


def collective_patches() -> dict[str, Any]:
    """torch.distributed.ProcessGroup's collectives, each done when it returns, however reached.

    On a GPU megatron-core leaves collectives in flight and relies on stream order (Megatron-FSDP
    dispatches the next step's parameter all-gather at the end of each optimizer step; buckets are
    reused and freed in stream order). With streams no-ops, gloo's own threads could write into a
    bucket freed or a group destroyed meanwhile: a rank died of SIGSEGV inside an all_gather."""
    pg = torch.distributed.ProcessGroup
    return {n: _waited_at_issue(getattr(pg, n)) for n in _COLLECTIVES if hasattr(pg, n)}


def set_attributes(target, values: dict[str, Any]) -> dict[str, Any]:
    """Set ``values`` on ``target``; returns what was there (to put back). A class's own entries are
    taken from its ``__dict__``: ``getattr`` on a class gives a pybind11 method as a plain function,
    which, set back, no longer receives ``self`` (gloo collectives after the block then failed)."""
    own = vars(target) if isinstance(target, type) else {}
    saved = {name: own[name] if name in own else getattr(target, name) for name in values}
    for name, value in values.items():
        setattr(target, name, value)
    return saved


@contextlib.contextmanager
def cuda_on_cpu():
    saved = set_attributes(torch.cuda, stream_patches())
    saved_collectives = set_attributes(torch.distributed.ProcessGroup, collective_patches())
    try:
        with CudaOnCpu():
            yield
    finally:
        set_attributes(torch.distributed.ProcessGroup, saved_collectives)
        set_attributes(torch.cuda, saved)
