"""Model FLOPs per token and MFU (Megatron's >= 0.12 formula, the one Megatron-Bridge reports).

    python -c "from megatron_ext.run_spec.flops import flops_per_token; help(flops_per_token)"

Per token, forward + backward, causal attention halved:
``6*L*h*(3F or 2F) + 6*L*(h*(q+2k) + q*h) + 6*L*q*s + 6*h*V``. MFU is against the dense BF16
peak for every run, FP8 ones too (:func:`describe_mfu_peak`). Pure.
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

def flops_terms(m: ModelPreset, seq_length: int, padded_vocab: int) -> dict[str, float]:
    """Training FLOPs (forward + backward) per token, by part: the linear layers' (``mlp``,
    ``attention_linear``), the core attention's and the logits'."""
    L, h, F, s, V = m.num_layers, m.hidden_size, m.ffn_hidden_size, seq_length, padded_vocab
    q = m.num_attention_heads * m.head_dim
    k = m.query_groups * m.head_dim
    return {"mlp": float(6 * L * h * (3 if m.swiglu else 2) * F), "attention_linear": float(6 * L * (h * (q + 2 * k) + q * h)),
            "attention_core": float(6 * L * q * s), "logits": float(6 * h * V)}


def flops_per_token(m: ModelPreset, seq_length: int, padded_vocab: int) -> float:
    """Training FLOPs (forward + backward) per token."""
    return sum(flops_terms(m, seq_length, padded_vocab).values())


def bf16_share_under_fp8(m: ModelPreset, seq_length: int, padded_vocab: int) -> float:
    """The share of the counted FLOPs that stays in BF16 with ``training.fp8``: transformer-engine
    runs the linear layers' GEMMs in FP8, while the core attention (its fused attention) and the
    output layer's logits (megatron-core's own ColumnParallelLinear) stay in BF16."""
    terms = flops_terms(m, seq_length, padded_vocab)
    return (terms["attention_core"] + terms["logits"]) / sum(terms.values())


def tflops_per_gpu(flops_per_iteration: float, iteration_s: float, world_size: int) -> float:
    return flops_per_iteration / (iteration_s * 1e12 * world_size)


def peak_tflops_for(device_name: str) -> float | None:
    """Dense BF16 peak of ``device_name`` (``torch.cuda.get_device_name()``), or None if unknown."""
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.fullmatch(pattern, device_name.strip()):
            return peak
    return None


def describe_mfu_peak(device_name: str, bf16_share_under_fp8: float | None = None) -> str:
    """What MFU divides by, for the start line: ``MFU against the dense BF16 peak of NVIDIA H200:
    989 TFLOP/s``, or why there is none. Every run's MFU is against the BF16 peak, FP8 runs too
    (``bf16_share_under_fp8``: the share of the FLOPs that stays in BF16 there, which the line
    names), so that MFU compares across runs: an FP8 run's MFU above a BF16 run's is its gain."""
    peak = peak_tflops_for(device_name)
    if peak is None:
        return f"no MFU: no dense BF16 peak is known for {device_name!r} (megatron_ext/run_spec/flops.py)"
    line = f"MFU against the dense BF16 peak of {device_name}: {peak:g} TFLOP/s"
    if bf16_share_under_fp8 is not None:
        line += (f", FP8 runs too (comparable with BF16 runs; {bf16_share_under_fp8:.0%} of the counted FLOPs, core "
                 "attention and logits, stay in BF16, so no FP8 peak is a fair ceiling)")
    return line


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron's padding rule (TP=1): round the vocabulary up to a multiple of ``divisible_by``."""
    return -(-vocab_size // divisible_by) * divisible_by
