"""Hugging Face ``config.json`` <-> model preset: what MODEL means when it is a model directory.

    python -c "from megatron_ext.run_spec.hf_config import read_hf_preset; print(read_hf_preset('/models/Qwen3-1.7B'))"

Four architectures map onto megatron-core's GPTModel exactly (transformers' modeling files,
checked by hand): ``qwen3`` (RMSNorm, SwiGLU, grouped-query attention with a per-head RMSNorm on
queries and keys, RoPE, no biases), ``qwen2`` (the same without the per-head norms, with
query/key/value biases), ``llama`` (no biases, optional Llama 3.1 RoPE scaling) and ``gpt2``
(LayerNorm, biases everywhere, learned absolute positions, the tanh GELU). Anything a config
asks for that the model cannot do (sliding windows, another RoPE scaling, MLP biases in Llama,
...) is one :class:`UserError` naming the key, the value and what would work. Pure: JSON in,
dicts out; transformers and torch are not imported here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_ext.run_spec.errors import UserError

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "gpt2": "GPT2LMHeadModel"}
"""model_type -> the transformers class a config names (``architectures``)."""

LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""megatron-core's Llama 3.1 RoPE scaling has these fixed (rotary_pos_embedding.py ``_apply_scaling``);
only the factor is a parameter."""

GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
"""GPT-2's activation_function -> gelu_tanh (False = exact erf GELU)."""


def is_hf_model_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    f = Path(directory) / "config.json"
    try:
        raw = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{f} is not a readable JSON config ({exc}); give a Hugging Face model directory") from None
    if not isinstance(raw, dict):
        raise UserError(f"{f} holds no JSON object; give a Hugging Face model directory")
    return raw


def _need(config: dict, key: str, where: str) -> Any:
    if config.get(key) is None:
        raise UserError(f"{where}: {key} is missing; a {config.get('model_type')} config.json names it")
    return config[key]


def _refuse(where: str, key: str, value: Any, rule: str) -> UserError:
    return UserError(f"{where}: {key}={value!r} {rule}")


def _rope(config: dict, where: str) -> dict[str, Any]:
    """rotary_base and the Llama 3.1 scaling, from ``rope_theta``/``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"} or None)
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    out: dict[str, Any] = {"rotary_base": int(theta) if float(theta).is_integer() else theta}
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return out
    if kind != "llama3":
        raise _refuse(where, "rope_scaling.rope_type", kind, "is not supported: megatron-core has Llama 3.1's "
                      "scaling (llama3) only; use a model without it or with rope_type llama3")
    for key, value in LLAMA3_ROPE.items():
        if float(scaling.get(key, value)) != value:
            raise _refuse(where, f"rope_scaling.{key}", scaling.get(key), f"is not supported: megatron-core fixes it at {value}")
    return {**out, "rope_scaling": True, "rope_scaling_factor": float(scaling.get("factor", 8.0))}


def preset_from_hf_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelPreset fields for a transformers config (without ``name``); a UserError for what
    megatron-core's GPTModel cannot be."""
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise _refuse(where, "model_type", kind, f"is not one this launcher imports; use one of {', '.join(ARCHITECTURES)}")
    if kind == "gpt2":
        return _gpt2(config, where)
    if config.get("use_sliding_window"):
        raise _refuse(where, "use_sliding_window", True, "is not supported (megatron-core's GPT attends to the whole "
                      "sequence); set it false")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(where, "hidden_act", act, "is not supported: these models use SwiGLU (silu)")
    heads = _need(config, "num_attention_heads", where)
    hidden = _need(config, "hidden_size", where)
    preset = dict(
        num_layers=_need(config, "num_hidden_layers", where),
        hidden_size=hidden,
        ffn_hidden_size=_need(config, "intermediate_size", where),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or hidden // heads,
        vocab_size=_need(config, "vocab_size", where),
        max_position_embeddings=_need(config, "max_position_embeddings", where),
        position_embedding_type="rope",
        normalization="RMSNorm",
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        qk_layernorm=kind == "qwen3",
        add_bias_linear=False,
        add_qkv_bias=kind == "qwen2" or bool(config.get("attention_bias")),
        tie_embeddings=bool(config.get("tie_word_embeddings", kind != "llama")),
        hidden_dropout=0.0,
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        **_rope(config, where),
    )
    if kind == "llama" and config.get("mlp_bias"):
        raise _refuse(where, "mlp_bias", True, "is not supported (megatron-core has biases in every linear layer or "
                      "in query/key/value only)")
    if kind in ("llama", "qwen3") and config.get("attention_bias"):
        # transformers' Llama and Qwen3 put the bias on o_proj too; megatron-core's add_qkv_bias does not.
        raise _refuse(where, "attention_bias", True, "is not supported for this model type (the output projection's "
                      "bias has no megatron-core counterpart without every linear layer's)")
    return preset


def _gpt2(config: dict[str, Any], where: str) -> dict[str, Any]:
    act = config.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise _refuse(where, "activation_function", act, f"is not supported; use one of {', '.join(GPT2_ACTIVATIONS)}")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if config.get(key, ok) != ok:
            raise _refuse(where, key, config.get(key), f"is not supported (megatron-core scales attention by "
                          f"1/sqrt(head dim)); it must be {ok}")
    hidden = _need(config, "n_embd", where)
    return dict(
        num_layers=_need(config, "n_layer", where),
        hidden_size=hidden,
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        num_attention_heads=_need(config, "n_head", where),
        vocab_size=_need(config, "vocab_size", where),
        max_position_embeddings=_need(config, "n_positions", where),
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
        swiglu=False,
        gelu_tanh=GPT2_ACTIVATIONS[act],
        add_bias_linear=True,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        hidden_dropout=float(config.get("resid_pdrop", 0.1)),
        attention_dropout=float(config.get("attn_pdrop", 0.1)),
    )


def hf_model_type(preset) -> str:
    """The transformers architecture a preset is, or a UserError saying why it is none."""
    m = preset
    if m.position_embedding_type == "learned_absolute":
        if (m.normalization, m.swiglu, m.add_bias_linear, m.query_groups) == ("LayerNorm", False, True, m.num_attention_heads) \
                and m.head_dim * m.num_attention_heads == m.hidden_size and not m.qk_layernorm:
            return "gpt2"
    elif (m.normalization, m.swiglu, m.add_bias_linear) == ("RMSNorm", True, False):
        if m.qk_layernorm and not m.add_qkv_bias:
            return "qwen3"
        if m.add_qkv_bias and not m.qk_layernorm:
            return "qwen2"
        if not m.add_qkv_bias and not m.qk_layernorm:
            return "llama"
    raise UserError(
        f"model {m.name} is none of {', '.join(ARCHITECTURES)} (position {m.position_embedding_type}, norm "
        f"{m.normalization}, swiglu {m.swiglu}, biases {m.add_bias_linear}, qkv bias {m.add_qkv_bias}, qk norm "
        f"{m.qk_layernorm}); transformers has no class for it, so it cannot be exported"
    )


def hf_config_from_preset(preset, vocab_size: int, dtype: str, eos_token_id: int | None,
                          bos_token_id: int | None) -> dict[str, Any]:
    """The transformers config.json of ``preset`` (``vocab_size``: the real, unpadded vocabulary)."""
    m, kind = preset, hf_model_type(preset)
    common = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": vocab_size,
              "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype, "eos_token_id": eos_token_id,
              "bos_token_id": bos_token_id, "use_cache": True}
    if kind == "gpt2":
        return {**common, "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
                "n_inner": m.ffn_hidden_size, "n_positions": m.max_position_embeddings,
                "n_ctx": m.max_position_embeddings, "layer_norm_epsilon": m.norm_epsilon,
                "activation_function": "gelu_new" if m.gelu_tanh else "gelu", "resid_pdrop": m.hidden_dropout,
                "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout, "scale_attn_weights": True}
    config = {**common, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
              "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
              "num_key_value_heads": m.query_groups, "head_dim": m.head_dim,
              "max_position_embeddings": m.max_position_embeddings, "rms_norm_eps": m.norm_epsilon,
              "hidden_act": "silu", "rope_theta": float(m.rotary_base), "attention_dropout": m.attention_dropout,
              "rope_scaling": ({"rope_type": "llama3", "factor": m.rope_scaling_factor, **LLAMA3_ROPE}
                               if m.rope_scaling else None)}
    if kind == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if kind in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    return config
