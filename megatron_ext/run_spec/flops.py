"""Model FLOPs per token and MFU (Megatron's >= 0.12 formula, the one Megatron-Bridge reports).

    python -c "from megatron_ext.run_spec.flops import flops_per_token; help(flops_per_token)"

Per token, forward + backward, causal attention halved:
``6*L*h*(3F or 2F) + 6*L*(h*(q+2k) + q*h) + 6*L*q*s + 6*h*V``. Pure.
"""

from __future__ import annotations

import re

from megatron_ext.run_spec.params import ModelPreset

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    # (torch.cuda.get_device_name() pattern, dense BF16 TFLOP/s from NVIDIA's datasheets)
    (r"NVIDIA H100 80GB HBM3", 989.0),          # H100 SXM
    (r"NVIDIA H100 PCIe", 756.0),
    (r"NVIDIA H100 NVL", 835.0),
    (r"NVIDIA H800", 989.0),                    # H800 SXM
    (r"NVIDIA H200", 989.0),                    # H200 SXM (141 GB)
    (r"NVIDIA H200 NVL", 835.0),
    (r"NVIDIA GH200 (480|144)GB", 989.0),
    (r"NVIDIA A100-SXM4-(40|80)GB", 312.0),
    (r"NVIDIA A100 80GB PCIe|NVIDIA A100-PCIE-40GB", 312.0),
    (r"NVIDIA B200", 2250.0),
)
"""Device names matched exactly (the whole name): an unknown device gets no MFU rather than a wrong one."""

PEAK_FP8_TFLOPS: dict[str, float] = {
    # the same patterns, dense FP8 TFLOP/s from NVIDIA's datasheets (twice the BF16 peak); none before Hopper
    r"NVIDIA H100 80GB HBM3": 1979.0, r"NVIDIA H100 PCIe": 1513.0, r"NVIDIA H100 NVL": 1671.0,
    r"NVIDIA H800": 1979.0, r"NVIDIA H200": 1979.0, r"NVIDIA H200 NVL": 1671.0, r"NVIDIA GH200 (480|144)GB": 1979.0,
    r"NVIDIA B200": 4500.0,
}
"""Used for MFU when ``training.fp8`` is set: FP8 runs its matrix multiplications at this peak."""


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


def peak_tflops_for(device_name: str, fp8: bool = False) -> float | None:
    """Dense BF16 (or, with ``fp8``, FP8) peak of ``device_name`` (``torch.cuda.get_device_name()``),
    or None if unknown."""
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.fullmatch(pattern, device_name.strip()):
            return PEAK_FP8_TFLOPS.get(pattern) if fp8 else peak
    return None


def describe_mfu_peak(device_name: str, fp8: bool = False) -> str:
    """What MFU divides by, for the start line: ``MFU against the dense BF16 peak of NVIDIA H200:
    989 TFLOP/s``, or why there is none."""
    kind = "FP8" if fp8 else "BF16"
    peak = peak_tflops_for(device_name, fp8)
    if peak is None:
        return f"no MFU: no dense {kind} peak is known for {device_name!r} (megatron_ext/run_spec/flops.py)"
    return f"MFU against the dense {kind} peak of {device_name}: {peak:g} TFLOP/s"


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron's padding rule (TP=1): round the vocabulary up to a multiple of ``divisible_by``."""
    return -(-vocab_size // divisible_by) * divisible_by
