"""How many parameters a preset has: megatron-core's GPTModel counted from its shapes, exactly,
without building it (no torch).

    python -c "from megatron_ext.run_spec.model_size import count_model_parameters; \\
        from megatron_ext.run_spec.params import load_model; print(count_model_parameters(load_model('qwen3_1p7b')))"

The memory planner, the checkpoint-size estimate and the tests read it; the training program's
:func:`megatron_ext.training.model.count_parameters` counts the built model and returns the same
:class:`ParameterCount` (the tests hold the two equal for every preset). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.flops import padded_vocab_size
from megatron_ext.run_spec.params import ModelPreset, RunParams


@dataclass(frozen=True)
class ParameterCount:
    total: int
    embedding: int
    """Input (and, untied, output) embedding rows; learned positions count as non-embedding."""
    padded_vocab: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_model_parameters(preset: ModelPreset, vocab_size: int | None = None) -> ParameterCount:
    """Exact parameter count of megatron-core's GPTModel for ``preset`` (TP = PP = 1), from its
    shapes: ``vocab_size`` (unpadded; default the preset's) is padded as Megatron pads it."""
    vocab = vocab_size or preset.vocab_size
    if vocab is None:
        raise UserError(f"model {preset.name} takes its vocabulary from the tokenizer; give DATA or --vocab-size")
    V = padded_vocab_size(vocab, preset.make_vocab_size_divisible_by)
    h, F = preset.hidden_size, preset.ffn_hidden_size
    q, k = preset.num_attention_heads * preset.head_dim, preset.query_groups * preset.head_dim
    bias = preset.add_bias_linear
    norm = (2 if preset.normalization == "LayerNorm" else 1)  # weight (+ bias) per element
    fc1_out = 2 * F if preset.swiglu else F
    layer = (
        2 * norm * h                                   # input and pre-MLP norms
        + h * (q + 2 * k) + (q + 2 * k) * (bias or preset.add_qkv_bias)  # linear_qkv
        + q * h + h * bias                              # linear_proj
        + (2 * norm * preset.head_dim if preset.qk_layernorm else 0)  # q_layernorm, k_layernorm (per head dim)
        + h * fc1_out + fc1_out * bias                  # linear_fc1
        + F * h + h * bias                              # linear_fc2
    )
    embedding = V * h * (1 if preset.tie_embeddings else 2)
    positions = preset.max_position_embeddings * h if preset.position_embedding_type == "learned_absolute" else 0
    total = embedding + positions + preset.num_layers * layer + norm * h
    return ParameterCount(total=total, embedding=embedding, padded_vocab=V)


def checkpoint_bytes_per_parameter(device: Device, zero_stage: int = 0) -> int:
    """What a checkpoint holds per parameter, every rank's shards together: fp32 weights and AdamW's
    two fp32 moments on the CPU (4 + 8); on GPUs at stages 0-1 (torch_dist) bf16 weights, fp32 main
    weights and the moments (2 + 4 + 8), as both engines save them; at stages 2-3 (fsdp_dtensor)
    Megatron-FSDP's state dict holds the fp32 main weights in place of the bf16 ones, and the
    moments (4 + 8). RNG states, the schedule and the metadata are a rounding error. Pure."""
    return 14 if Device(device) is Device.CUDA and zero_stage < 2 else 12


def checkpoint_bytes(parameters: int, device: Device, zero_stage: int = 0) -> int:
    """The size of one checkpoint of a model with ``parameters`` on ``device`` (cpu or cuda) at
    ``zero_stage`` (:func:`checkpoint_bytes_per_parameter`)."""
    return parameters * checkpoint_bytes_per_parameter(device, zero_stage)


def parameters_to_save(params: RunParams) -> int | None:
    """The model's parameter count when the run keeps checkpoints (its vocabulary known), else None."""
    if not params.training.save_interval:
        return None
    vocab = params.model.vocab_size or params.data.tokenizer.vocab_size
    try:
        return count_model_parameters(params.model, vocab).total
    except UserError:
        return None
