"""megatron-core's CUDA-only objects (DDP, the distributed optimizer, Megatron-FSDP) run on the CPU,
for tests of what this project does with them: the real megatron-core code, with every
``device='cuda'`` a tensor factory asks for made the CPU (a TorchFunctionMode), ``.type()``
answering ``torch.cuda.FloatTensor`` for a CPU float tensor (megatron-core's optimizers check it),
and torch.cuda's streams and events standing in for work that is done when it returns.

What this proves: the objects' state handling (state dicts, checkpoints, resume, the NaN checks,
the FSDP configuration and its gathers), with gloo in place of NCCL. What it cannot: CUDA kernels,
the overlap of communication with compute (streams are no-ops), NCCL, GPU numerics and memory;
tests/gpu/ and tests/gpu/device_check.sh are for that.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else d


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # "torch.FloatTensor" -> "torch.cuda.FloatTensor"
            return func(*args).replace("torch.", "torch.cuda.", 1)
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "to":
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda" else a
                         for a in args)
        return func(*args, **kwargs)


class _Event:
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


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args):
        return _Event()

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


@contextlib.contextmanager
def cuda_on_cpu():
    patched = {"current_device": lambda: 0, "current_stream": lambda *a, **k: _Stream(), "synchronize": lambda *a, **k: None,
               "Stream": _Stream, "Event": _Event, "stream": lambda s: contextlib.nullcontext(),
               "is_current_stream_capturing": lambda: False, "max_memory_allocated": lambda *a, **k: 0}
    saved = {name: getattr(torch.cuda, name) for name in patched}
    for name, value in patched.items():
        setattr(torch.cuda, name, value)
    try:
        with _CudaOnCpu():
            yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
