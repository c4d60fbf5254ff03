"""Where megatron-core's APIs moved between the tested releases (0.14-0.19), and the one way this
project meets each. Nothing else in the project checks versions; each entry detects the feature
itself rather than comparing version numbers.

- RoPE's move of ``inv_freq`` to ``torch.cuda.current_device()`` (which the CPU path must avoid):
  in ``RotaryEmbedding.forward`` up to 0.15, in ``RotaryEmbedding.get_emb`` from 0.16.
"""

from __future__ import annotations

import functools

import torch


def rotary_method_that_moves_inv_freq(rotary_cls) -> str:
    """``get_emb`` (megatron-core >= 0.16) or ``forward`` (0.14-0.15)."""
    return "get_emb" if "get_emb" in vars(rotary_cls) else "forward"


def keep_rotary_on_module_device(rotary_cls) -> None:
    """Make RoPE keep ``inv_freq`` where the module lives (the CPU): during the method that would
    move it to ``torch.cuda.current_device()``, that call answers ``"cpu"``. Idempotent."""
    name = rotary_method_that_moves_inv_freq(rotary_cls)
    method = getattr(rotary_cls, name)
    if getattr(method, "_keeps_module_device", False):
        return

    @functools.wraps(method)
    def on_module_device(self, *args, **kwargs):
        real = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = real

    on_module_device._keeps_module_device = True
    setattr(rotary_cls, name, on_module_device)
