"""Typed, frozen parameter sets loaded from ``params/``.

    python -c "from megatron_ext.params import load_run_params; print(load_run_params('gpt_smoke', 'smoke'))"

``params/models/<name>.yaml`` holds a model preset, ``params/data/<name>.yaml`` a data set with
its training schedule (``data:`` and ``training:`` sections). Every key maps onto a field of the
dataclasses below; an unknown key, a wrong type or an inconsistent combination raises
:class:`ParamsError` with the value, the rule and the fix. Reads YAML files; the one writer is
:func:`write_resolved_params` (the resolved parameters beside a run's logs).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

PARAMS_DIR = Path(__file__).resolve().parent.parent / "params"


ENGINES = ("megatron-core", "megatron-lm")


class ParamsError(ValueError):
    """A user error in parameters: the message names the value, the rule and the fix."""


@dataclass(frozen=True)
class ModelPreset:
    """A decoder-only transformer, in megatron-core's terms."""

    name: str
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    ffn_hidden_size: int
    """MLP inner width F (per branch for SwiGLU)."""
    num_attention_heads: int
    """Query heads n."""
    num_query_groups: int | None = None
    """KV heads g for grouped-query attention; None = multi-head attention (g = n)."""
    kv_channels: int | None = None
    """Head dim d; None = hidden_size / num_attention_heads."""
    vocab_size: int | None = None
    """Vocabulary before padding; None = the tokenizer's (smoke models)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary up to a multiple of this."""
    max_position_embeddings: int = 2048
    """Longest sequence the positions support; training sequences are cut to it."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    rotary_base: int = 10000
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    """SwiGLU MLP (gated SiLU); False = GELU MLP."""
    qk_layernorm: bool = False
    add_bias_linear: bool = True
    tie_embeddings: bool = True
    """Share input embedding and output projection weights."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass(frozen=True)
class TokenizerParams:
    """How text becomes token ids."""

    type: Literal["sentencepiece", "huggingface", "null"] = "sentencepiece"
    model_path: str | None = None
    """sentencepiece ``.model`` or Hugging Face ``tokenizer.json``; None with sentencepiece =
    train one on the corpus."""
    vocab_size: int = 4096
    """Vocabulary of a sentencepiece model trained on the corpus, or of the null tokenizer."""


@dataclass(frozen=True)
class DataParams:
    """Where training tokens come from."""

    source: Literal["embedded", "files", "mock"] = "embedded"
    """embedded: the running Python's standard-library docstrings (nothing downloaded);
    files: ``paths`` (indexed-dataset prefixes, or JSONL/text prepared on first use);
    mock: Megatron's MockGPTDataset (synthetic tokens, null tokenizer)."""
    paths: tuple[str, ...] = ()
    """Inputs for source=files: ``.bin``/``.idx`` prefixes, ``.jsonl`` (``text`` field) or text files."""
    weights: tuple[float, ...] = ()
    """Blend weights, one per path; empty = weighted by size."""
    split: str = "98,2,0"
    """Train/valid/test split of every dataset, as Megatron's ``--split``."""
    tokenizer: TokenizerParams = field(default_factory=TokenizerParams)


@dataclass(frozen=True)
class TrainingParams:
    """The optimisation schedule. Batch sizes count sequences."""

    seq_length: int = 128
    """Tokens per sequence (cut to the model's max_position_embeddings)."""
    micro_batch_size: int = 4
    """Sequences per rank per forward/backward."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all data-parallel ranks."""
    train_iters: int = 20
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int = 2
    lr_decay_iters: int | None = None
    """Steps of cosine decay after warmup end; None = train_iters."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 = off."""
    seed: int = 1234
    log_interval: int = 1
    """Iterations between log lines."""
    eval_interval: int = 0
    """Iterations between validation passes; 0 = only at the end."""
    eval_iters: int = 2
    """Validation batches per pass."""
    save_interval: int = 0
    """Iterations between checkpoints (and one at the end); 0 = no checkpoints."""
    zero_stage: int = 0
    """ZeRO stage 0-3 (overridden by ZERO_STAGE in the environment)."""
    engine: Literal["megatron-core", "megatron-lm"] = "megatron-core"
    """megatron-core: this project's program; megatron-lm: a checkout's pretrain_gpt.py
    (MEGATRON_LM_DIR). Overridden by ENGINE in the environment."""


@dataclass(frozen=True)
class RunParams:
    """One training run: a model preset plus a data set with its schedule."""

    model: ModelPreset
    data: DataParams
    training: TrainingParams
    data_set: str


# ---------------------------------------------------------------------------------------------
# Loading


def _names_in(kind: str, params_dir: Path) -> list[str]:
    return sorted(p.stem for p in (params_dir / kind).glob("*.yaml"))


def list_models(params_dir: Path = PARAMS_DIR) -> list[str]:
    return _names_in("models", params_dir)


def list_data_sets(params_dir: Path = PARAMS_DIR) -> list[str]:
    return _names_in("data", params_dir)


def _read_yaml(kind: str, name: str, params_dir: Path) -> dict[str, Any]:
    """``name`` is a set under ``params_dir/kind`` or a path to a ``.yaml`` file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else params_dir / kind / f"{name}.yaml"
    if not path.is_file():
        choices = ", ".join(_names_in(kind, params_dir))
        what = "model" if kind == "models" else "data set"
        raise ParamsError(
            f"unknown {what} {name!r}: no {path}; choose one of: {choices} "
            f"(or add {kind}/{name}.yaml under {params_dir})"
        )
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping at top level, got {type(raw).__name__}")
    return raw


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check/convert one YAML value against a dataclass field annotation."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is Literal:
        if value not in args:
            raise ParamsError(f"{where}={value!r} is not one of {list(args)}; use one of them")
        return value
    if origin is tuple:
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"{where}={value!r} must be a list")
        return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        return build_dataclass(annotation, value or {}, where)
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "1e-3" as a string
        except ValueError:
            pass
    if annotation in (int, float, str, bool):
        if isinstance(value, bool) != (annotation is bool) or not isinstance(value, annotation):
            raise ParamsError(
                f"{where}={value!r} must be {annotation.__name__}, got {type(value).__name__}"
            )
    return value


def build_dataclass(cls: type, raw: dict[str, Any], where: str) -> Any:
    """Build a frozen dataclass from a mapping; unknown keys and wrong types are ParamsErrors."""
    if not isinstance(raw, dict):
        raise ParamsError(f"{where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ParamsError(
            f"unknown key {unknown[0]!r} in {where}; known keys: {', '.join(sorted(known))} "
            "(fix the spelling or remove it)"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ParamsError(f"{where}: {exc}") from None


def load_model(name: str, params_dir: Path = PARAMS_DIR) -> ModelPreset:
    raw = _read_yaml("models", name, params_dir)
    return build_dataclass(ModelPreset, {"name": Path(name).stem, **raw}, _where("models", name))


def _where(kind: str, name: str) -> str:
    return name if name.endswith((".yaml", ".yml")) else f"{kind}/{name}.yaml"


def load_data_set(name: str, params_dir: Path = PARAMS_DIR) -> tuple[DataParams, TrainingParams]:
    raw = _read_yaml("data", name, params_dir)
    where = _where("data", name)
    unknown = sorted(set(raw) - {"data", "training"})
    if unknown:
        raise ParamsError(
            f"unknown key {unknown[0]!r} in {where}; known keys: data, training "
            "(fix the spelling or remove it)"
        )
    data = build_dataclass(DataParams, raw.get("data") or {}, f"{where}:data")
    training = build_dataclass(TrainingParams, raw.get("training") or {}, f"{where}:training")
    return data, training


def load_run_params(
    model: str,
    data_set: str,
    env: typing.Mapping[str, str] | None = None,
    params_dir: Path = PARAMS_DIR,
) -> RunParams:
    """Load and validate model + data set; ZERO_STAGE from ``env`` overrides the params."""
    from megatron_ext.zero import parse_zero_stage

    preset = load_model(model, params_dir)
    data, training = load_data_set(data_set, params_dir)
    env = os.environ if env is None else env
    if env.get("ZERO_STAGE", "").strip():
        stage = parse_zero_stage(env["ZERO_STAGE"], source="ZERO_STAGE")
    else:
        stage = parse_zero_stage(str(training.zero_stage), source=f"{_where('data', data_set)}:training.zero_stage")
    seq = min(training.seq_length, preset.max_position_embeddings)
    engine = env.get("ENGINE", "").strip() or training.engine
    if engine not in ENGINES:
        raise ParamsError(f"ENGINE={engine!r} is not an engine; use one of {', '.join(ENGINES)} (default megatron-core)")
    training = dataclasses.replace(training, zero_stage=int(stage), seq_length=seq, engine=engine)
    params = RunParams(model=preset, data=data, training=training, data_set=data_set)
    validate_run_params(params)
    return params


def validate_run_params(p: RunParams) -> None:
    """Cross-field checks that need no process group (data-parallel size is checked later)."""
    m, d, t = p.model, p.data, p.training
    if m.hidden_size % m.num_attention_heads and m.kv_channels is None:
        raise ParamsError(
            f"hidden_size={m.hidden_size} is not divisible by num_attention_heads="
            f"{m.num_attention_heads}; set kv_channels or change one of them"
        )
    if m.num_attention_heads % m.query_groups:
        raise ParamsError(
            f"num_attention_heads={m.num_attention_heads} is not divisible by num_query_groups="
            f"{m.query_groups}; choose a divisor"
        )
    if d.source == "files" and not d.paths:
        raise ParamsError(f"{_where('data', p.data_set)}: source=files needs data.paths; list one or more")
    if d.weights and len(d.weights) != len(d.paths):
        raise ParamsError(
            f"data.weights has {len(d.weights)} entries for {len(d.paths)} paths; give one weight "
            "per path or none"
        )
    if d.source == "mock" and d.tokenizer.type != "null":
        raise ParamsError("data.source=mock needs data.tokenizer.type=null (synthetic token ids)")
    if d.tokenizer.type == "huggingface" and not d.tokenizer.model_path:
        raise ParamsError("data.tokenizer.type=huggingface needs model_path (a tokenizer.json)")
    for key in ("micro_batch_size", "global_batch_size", "train_iters", "seq_length", "log_interval"):
        if getattr(t, key) <= 0:
            raise ParamsError(f"training.{key}={getattr(t, key)} must be > 0")
    if t.global_batch_size % t.micro_batch_size:
        raise ParamsError(
            f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size="
            f"{t.micro_batch_size}; change one of them"
        )


def check_batch_geometry(t: TrainingParams, data_parallel_size: int) -> int:
    """Return gradient-accumulation steps, or raise naming all three factors."""
    per_step = t.micro_batch_size * data_parallel_size
    if t.global_batch_size % per_step:
        suggestion = per_step * max(1, round(t.global_batch_size / per_step))
        raise ParamsError(
            f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size"
            f"({t.micro_batch_size}) x data_parallel_size({data_parallel_size}) = {per_step}; "
            f"change one of them (e.g. global_batch_size={suggestion})"
        )
    return t.global_batch_size // per_step


def params_as_dict(p: RunParams) -> dict[str, Any]:
    return dataclasses.asdict(p)


def write_resolved_params(path: Path, p: RunParams, runtime: dict[str, Any]) -> None:
    """The run's resolved parameters plus what was decided at run time, as YAML."""
    resolved = params_as_dict(p)
    resolved["runtime"] = runtime
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
