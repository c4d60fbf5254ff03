"""Hugging Face weights <-> megatron-core GPTModel weights (TP = PP = 1), both ways.

    python -c "from megatron_ext.training.hf_weights import read_hf_state_dict; help(read_hf_state_dict)"

Names and layouts follow transformers' modeling files (Qwen3, Qwen2, Llama, GPT-2) and
megatron-core's layer specs: the local spec (``input_layernorm``, ``pre_mlp_layernorm``) and
transformer-engine's (the norms fused into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``),
which is how Megatron-Bridge maps them too. Three layouts change on the way:

- query/key/value: megatron-core's ``linear_qkv`` holds, per query group, that group's query
  heads, then its key head, then its value head; transformers holds q_proj, k_proj and v_proj
  (GPT-2: one ``c_attn`` with q, k, v side by side);
- SwiGLU: megatron-core's ``linear_fc1`` is [gate; up] (``glu`` chunks it in that order) =
  transformers' gate_proj and up_proj stacked;
- GPT-2's ``Conv1D`` stores weights transposed (in x out).

The vocabulary: Megatron pads it to a multiple of ``make_vocab_size_divisible_by``. On import the
padded rows of the embedding (and of an untied output layer) are zeros; :func:`restrict_logits`
cuts the logits to the real vocabulary before the loss, so the padded rows get no gradient (they
stay zero), the loss is the one over the real vocabulary (the Hugging Face model's, on the same
batch), and export drops them again. RoPE needs no permutation: megatron-core's rotary embedding
rotates halves (``rotary_interleaved=False``), as transformers' ``rotate_half`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import ModelPreset

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
SHARD_BYTES = 5 * 1024**3
"""transformers' default ``max_shard_size`` (5 GB): larger exports are sharded with an index."""


# -- reading and writing safetensors ---------------------------------------------------------------

def read_hf_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors (one file, or shards with their index)."""
    from safetensors.torch import load_file

    d = Path(directory)
    if (d / SAFETENSORS_INDEX).is_file():
        index = json.loads((d / SAFETENSORS_INDEX).read_text())
        files = sorted(set(index["weight_map"].values()))
    elif (d / SAFETENSORS_SINGLE).is_file():
        files = [SAFETENSORS_SINGLE]
    else:
        found = ", ".join(sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))) or "none"
        raise UserError(f"{d} holds no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} (weight files found: {found}); save "
                        "the model with save_pretrained(safe_serialization=True), or set training.init: random")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (d / name).is_file():
            raise UserError(f"{d / SAFETENSORS_INDEX} names {name}, which is missing; copy every shard")
        state.update(load_file(str(d / name)))
    return state


def write_hf_state_dict(state: dict[str, torch.Tensor], directory: Path, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with the index above
    ``shard_bytes`` (as transformers' save_pretrained). Returns the files written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SAFETENSORS_SINGLE), metadata=metadata)
        return [SAFETENSORS_SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(directory / name), metadata=metadata)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, SAFETENSORS_INDEX]


# -- the name and layout maps --------------------------------------------------------------------

def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: ModelPreset) -> torch.Tensor:
    g, per, d = m.query_groups, m.num_attention_heads // m.query_groups, m.head_dim
    q = q.reshape(g, per * d, *q.shape[1:])
    k = k.reshape(g, d, *k.shape[1:])
    v = v.reshape(g, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _qkv_from_megatron(qkv: torch.Tensor, m: ModelPreset) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, per, d = m.query_groups, m.num_attention_heads // m.query_groups, m.head_dim
    grouped = qkv.reshape(g, (per + 2) * d, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _normalise_gpt2(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's keys with ``transformer.`` (OpenAI's release has none), without its causal-mask buffers."""
    return {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in state.items()
            if not (k.endswith((".attn.bias", ".attn.masked_bias")) and v.dim() > 1)}


# megatron-core name -> (transformers name, GPT-2 Conv1D transposed) for the tensors that only move;
# the query/key/value projection and SwiGLU's fc1 also change layout (below).
GLOBAL_NAMES = {
    "gpt2": {"embedding.position_embeddings.weight": "transformer.wpe.weight",
             "decoder.final_layernorm.weight": "transformer.ln_f.weight", "decoder.final_layernorm.bias": "transformer.ln_f.bias"},
    "llama": {"decoder.final_layernorm.weight": "model.norm.weight"},
}
EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}
LAYER_PREFIX = {"gpt2": "transformer.h.", "llama": "model.layers."}
LAYER_NAMES = {
    "gpt2": {"input_layernorm.weight": ("ln_1.weight", False), "input_layernorm.bias": ("ln_1.bias", False),
             "self_attention.linear_proj.weight": ("attn.c_proj.weight", True),
             "self_attention.linear_proj.bias": ("attn.c_proj.bias", False),
             "pre_mlp_layernorm.weight": ("ln_2.weight", False), "pre_mlp_layernorm.bias": ("ln_2.bias", False),
             "mlp.linear_fc1.weight": ("mlp.c_fc.weight", True), "mlp.linear_fc1.bias": ("mlp.c_fc.bias", False),
             "mlp.linear_fc2.weight": ("mlp.c_proj.weight", True), "mlp.linear_fc2.bias": ("mlp.c_proj.bias", False)},
    "llama": {"input_layernorm.weight": ("input_layernorm.weight", False),
              "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", False),
              "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", False),
              "mlp.linear_fc2.weight": ("mlp.down_proj.weight", False),
              "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", False),
              "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", False)},
}
"""qwen2 and qwen3 are llama's names (qwen3 adds the per-head norms, qwen2 the qkv biases)."""


def _family(kind: str) -> str:
    return "gpt2" if kind == "gpt2" else "llama"


def _moved_names(m: ModelPreset, kind: str) -> list[tuple[str, str, bool]]:
    """(megatron-core name, transformers name, transposed) of every tensor that only moves."""
    family = _family(kind)
    pairs = [(mc, hf, False) for mc, hf in GLOBAL_NAMES[family].items()]
    for i in range(m.num_layers):
        for mc, (hf, transposed) in LAYER_NAMES[family].items():
            if "_layernorm." in mc and mc.startswith("self_attention.") and not m.qk_layernorm:
                continue
            pairs.append((f"decoder.layers.{i}.{mc}", f"{LAYER_PREFIX[family]}{i}.{hf}", transposed))
    return pairs


def _qkv_names(kind: str, i: int, what: str) -> list[str]:
    if kind == "gpt2":
        return [f"transformer.h.{i}.attn.c_attn.{what}"]
    return [f"model.layers.{i}.self_attn.{p}_proj.{what}" for p in "qkv"]


def hf_to_megatron(hf: dict[str, torch.Tensor], m: ModelPreset, kind: str, padded_vocab: int) -> dict[str, torch.Tensor]:
    """A transformers state dict -> megatron-core's (local spec names; padded vocabulary rows zero)."""
    take = _Taker(_normalise_gpt2(dict(hf)) if kind == "gpt2" else dict(hf))
    out = {mc: take(name).t() if transposed else take(name) for mc, name, transposed in _moved_names(m, kind)}
    out["embedding.word_embeddings.weight"] = _pad_rows(take(EMBEDDING[_family(kind)]), padded_vocab)
    for i in range(m.num_layers):
        qkv = f"decoder.layers.{i}.self_attention.linear_qkv."
        for what in ("weight", "bias") if (m.add_bias_linear or m.add_qkv_bias) else ("weight",):
            parts = [take(n) for n in _qkv_names(kind, i, what)]
            if kind == "gpt2":
                parts = list((parts[0].t() if what == "weight" else parts[0]).chunk(3, dim=0))
            out[qkv + what] = _qkv_to_megatron(*parts, m)
        if kind != "gpt2":
            mlp = f"model.layers.{i}.mlp."
            out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.cat([take(mlp + "gate_proj.weight"),
                                                                           take(mlp + "up_proj.weight")])
    head = take.optional("lm_head.weight")
    if not m.tie_embeddings:
        if head is None:
            raise UserError("the checkpoint has no lm_head.weight but its config unties the embeddings; "
                            "fix tie_word_embeddings in config.json")
        out["output_layer.weight"] = _pad_rows(head, padded_vocab)
    take.check_all_used(kind)
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], m: ModelPreset, kind: str, vocab: int) -> dict[str, torch.Tensor]:
    """megatron-core's weights in the local spec's names (:func:`local_name`: export_hf reads a
    transformer-engine checkpoint's that way) -> transformers' names and layouts, padded vocabulary
    rows dropped. Tied embeddings: no lm_head.weight (save_pretrained's convention)."""
    get = _Taker(dict(mc))
    out = {name: get(mc_name).t() if transposed else get(mc_name) for mc_name, name, transposed in _moved_names(m, kind)}
    out[EMBEDDING[_family(kind)]] = get("embedding.word_embeddings.weight")[:vocab]
    for i in range(m.num_layers):
        qkv = f"decoder.layers.{i}.self_attention.linear_qkv."
        for what in ("weight", "bias") if (m.add_bias_linear or m.add_qkv_bias) else ("weight",):
            parts = _qkv_from_megatron(get(qkv + what), m)
            names = _qkv_names(kind, i, what)
            if kind == "gpt2":
                joined = torch.cat(parts)
                out[names[0]] = joined.t() if what == "weight" else joined
            else:
                out.update(zip(names, parts))
        if kind != "gpt2":
            gate, up = get(f"decoder.layers.{i}.mlp.linear_fc1.weight").chunk(2, dim=0)
            out[f"model.layers.{i}.mlp.gate_proj.weight"], out[f"model.layers.{i}.mlp.up_proj.weight"] = gate, up
    if not m.tie_embeddings:
        out["lm_head.weight"] = get("output_layer.weight")[:vocab]
    get.check_all_used("megatron-core")
    return {k: v.contiguous() for k, v in out.items()}


TE_FUSED_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_"}
"""transformer-engine's layer spec fuses the two norms into the next linear layer (TELayerNormColumnParallelLinear)."""


def local_name(name: str) -> str:
    """A transformer-engine spec's parameter name as the local spec names it."""
    for norm, fused in TE_FUSED_NORMS.items():
        if f".{fused}" in name:
            name = name.replace(f".{fused}", f".{norm}.")
    return name


def to_model_names(state: dict[str, torch.Tensor], model_keys: set[str]) -> dict[str, torch.Tensor]:
    """Local-spec names -> the names of the model at hand (transformer-engine's where it uses them)."""
    if not any(".layer_norm_weight" in k for k in model_keys):
        return state
    out = {}
    for k, v in state.items():
        for norm, fused in TE_FUSED_NORMS.items():
            if f".{norm}." in k:
                k = k.replace(f".{norm}.", f".{fused}")
        out[k] = v
    return out


class _Taker:
    """Takes tensors by name; a missing one, or one left over, is a UserError."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.used = state, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise UserError(f"the weights have no {name}; the checkpoint does not match its config.json "
                            "(or the run's model)")
        self.used.add(name)
        return self.state[name]

    def optional(self, name: str) -> torch.Tensor | None:
        return self(name) if name in self.state else None

    def check_all_used(self, what: str) -> None:
        left = sorted(set(self.state) - self.used)
        if left:
            raise UserError(f"{len(left)} {what} weight(s) have no counterpart, e.g. {left[0]}; the checkpoint does "
                            "not match its config.json")


# -- into a model, and the loss over the real vocabulary ----------------------------------------------

def load_hf_weights(module: torch.nn.Module, m: ModelPreset, kind: str, padded_vocab: int) -> None:
    """The model directory's weights into ``module`` (a megatron-core GPTModel before any wrapper:
    every rank reads them, as every Megatron-LM rank reads its checkpoint)."""
    hf = read_hf_state_dict(m.hf_checkpoint)
    own = module.state_dict()
    state = to_model_names(hf_to_megatron(hf, m, kind, padded_vocab), set(own))
    for name, tensor in state.items():
        if name in own and tuple(own[name].shape) != tuple(tensor.shape):
            raise UserError(f"{m.hf_checkpoint}: {name} has shape {tuple(tensor.shape)} where the model built from "
                            f"config.json has {tuple(own[name].shape)}; the weights do not match config.json")
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise UserError(f"{m.hf_checkpoint}: weights missing for {missing[:3]} / not in the model {unexpected[:3]}; "
                        "the weights do not match config.json")


def restrict_logits(module: torch.nn.Module, vocab: int, padded_vocab: int) -> Callable[[], None] | None:
    """Cut the output layer's logits to the real vocabulary (see the module docstring); returns the
    hook's remover, or None when there is no padding."""
    if padded_vocab == vocab:
        return None

    def cut(_module, _inputs, output):
        logits, bias = output
        return logits[..., :vocab].contiguous(), bias

    return module.output_layer.register_forward_hook(cut).remove
