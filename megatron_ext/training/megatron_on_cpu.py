"""The CPU path's three replacements for CUDA-only spots in megatron-core's GPT model.

Used only when training on CPU (``install_megatron_on_cpu()`` is called by the program once, after
megatron's parallel state exists). megatron-core's ``GPTModel`` with the local layer spec,
TP=1 and PP=1 otherwise runs on CPU unchanged:

1. The model-parallel RNG tracker (``megatron.core.tensor_parallel.random``) forks the CUDA RNG
   state around dropout. :class:`CpuRNGStatesTracker` keeps the same named states on the CPU
   generator and is installed as the global tracker.
2. RoPE moves ``inv_freq`` to ``torch.cuda.current_device()`` on its first call (in ``forward``
   up to 0.15, in ``get_emb`` from 0.16: :mod:`megatron_ext.training.megatron_core_apis`); it is kept where the
   module lives instead.
3. The global memory buffer that ``DotProductAttention`` (local spec) uses for its attention
   scores allocates on ``torch.cuda.current_device()``; :class:`CpuMemoryBuffer` allocates on CPU.

(Megatron's default causal mask is also built on CUDA; the program always passes the mask the
GPTDataset creates, as Megatron-LM's own ``pretrain_gpt.py`` does, so that path is never taken.)
Side effects: patches megatron-core module globals, process-wide; idempotent.
"""

from __future__ import annotations

import contextlib
import math

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.tensor_parallel import random as mp_random
from megatron.core.utils import GlobalMemoryBuffer

from megatron_ext.training.megatron_core_apis import keep_rotary_on_module_device


class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
    """Named RNG states on the CPU generator, with the CUDA tracker's interface."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


class CpuMemoryBuffer(GlobalMemoryBuffer):
    """megatron's GlobalMemoryBuffer, allocating on the CPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # noqa: ARG002 (the interface's signature)
        required = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
        return buf[:required].view(*tensor_shape)


def install_megatron_on_cpu(seed: int) -> None:
    """Install the three replacements; call after ``initialize_model_parallel``."""
    tracker = CpuRNGStatesTracker()
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    keep_rotary_on_module_device(rotary_pos_embedding.RotaryEmbedding)
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
