"""Model FLOPs per token and MFU (Megatron's >= 0.12 formula, the one Megatron-Bridge reports).

    python -c "from megatron_ext.spec.flops import flops_per_token; help(flops_per_token)"

Per token, forward + backward, causal attention halved:
``6*L*h*(3F or 2F) + 6*L*(h*(q+2k) + q*h) + 6*L*q*s + 6*h*V``. Pure.
"""

from __future__ import annotations

from megatron_ext.spec.params import ModelPreset

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense BF16 peak per device name fragment (SXM), for MFU."""


def flops_per_token(m: ModelPreset, seq_length: int, padded_vocab: int) -> float:
    """Training FLOPs (forward + backward) per token."""
    L, h, F, s, V = m.num_layers, m.hidden_size, m.ffn_hidden_size, seq_length, padded_vocab
    q = m.num_attention_heads * m.head_dim
    k = m.query_groups * m.head_dim
    mlp = 6 * L * h * (3 if m.swiglu else 2) * F
    attn_linear = 6 * L * (h * (q + 2 * k) + q * h)
    attn_core = 6 * L * q * s
    logits = 6 * h * V
    return float(mlp + attn_linear + attn_core + logits)


def tflops_per_gpu(flops_per_iteration: float, iteration_s: float, world_size: int) -> float:
    return flops_per_iteration / (iteration_s * 1e12 * world_size)


def peak_tflops_for(device_name: str) -> float | None:
    for fragment, peak in PEAK_BF16_TFLOPS.items():
        if fragment in device_name:
            return peak
    return None


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron's padding rule (TP=1): round the vocabulary up to a multiple of ``divisible_by``."""
    return -(-vocab_size // divisible_by) * divisible_by
