"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``, for megatron-core layer specs.

    python -c "from megatron_ext.training.sdpa_attention import SdpaAttention; help(SdpaAttention)"

Used wherever transformer-engine is absent (a GPU image without it, and the CPU path): PyTorch
picks its flash or memory-efficient kernels on Hopper and its fused kernel on CPU; the causal
mask is never materialised (``is_causal=True``), grouped-query attention passes its key/value
heads as they are (``enable_gqa=True``, torch 2.5 and later; older torch repeats them,
:data:`SDPA_TAKES_GQA`). It replaces megatron-core's ``DotProductAttention`` (the local spec's, which
computes the full score matrix and a masked softmax) with the same interface and the same
result (outputs and gradients equal within 1e-5 on CPU, tested). With transformer-engine, its
fused attention is used instead (the TE layer spec).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


SDPA_TAKES_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
"""torch 2.5+: SDPA broadcasts each key/value head over its query heads itself (no copies of K/V
of the query heads' size); before, they are repeated here. Read from the function's own signature
text, so a torch that has it uses it."""


class SdpaAttention(MegatronModule):
    """``DotProductAttention``'s interface: query [sq, b, np, hn], key/value [sk, b, ng, hn] ->
    context [sq, b, np * hn]."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,  # noqa: ARG002 (the interface's signature)
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_unused):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or getattr(config, "softmax_scale", None) or 1.0 / math.sqrt(head_dim)
        self.takes_gqa = SDPA_TAKES_GQA
        """Pass grouped key/value heads with enable_gqa (False: repeat them; tests compare both)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SdpaAttention supports neither packed sequences nor an attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, b, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = {}
        if k.shape[1] != heads:  # grouped-query attention: each KV head serves heads / groups queries
            if self.takes_gqa:
                gqa = {"enable_gqa": True}
            else:
                k = k.repeat_interleave(heads // k.shape[1], dim=1)
                v = v.repeat_interleave(heads // v.shape[1], dim=1)
        mask = None
        causal = mask_type == AttnMaskType.causal
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        dropout = self.dropout_p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                 scale=self.softmax_scale, **gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)
