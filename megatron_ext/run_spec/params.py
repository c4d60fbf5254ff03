"""Typed, frozen parameter sets loaded from ``params/``.

    python -c "from megatron_ext.run_spec.params import load_run_params; print(load_run_params('gpt_smoke', 'smoke'))"

``params/models/<name>.yaml`` holds a model preset, ``params/data/<name>.yaml`` a data set with
its training schedule (``data:`` and ``training:`` sections). Every key maps onto a field of the
dataclasses below; an unknown key, a wrong type or an inconsistent combination raises
:class:`UserError` with the value, the rule and the fix. Loading is pure apart from reading the
YAML files: what the environment changes (ZERO_STAGE, ENGINE, ...) comes in as explicit
:class:`RunOverrides`, built by each program's own environment reader at its edge.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_ext.run_spec.convert import structure_params, unstructure
from megatron_ext.run_spec.errors import UserError
from megatron_ext.host.devices import Device
from megatron_ext.run_spec.engines import ENGINES, MEGATRON_CORE, EngineName
from megatron_ext.run_spec.hf_config import is_hf_model_dir, preset_from_hf_config, read_hf_config
from megatron_ext.run_spec.resilience import ResilienceParams, check_resilience, read_resilience_overrides, with_overrides
from megatron_ext.run_spec.zero import parse_zero_stage

PARAMS_DIR = Path(__file__).resolve().parents[2] / "params"


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A decoder-only transformer, in megatron-core's terms."""

    name: str
    """Preset name (the YAML file's stem)."""
    num_layers: int
    """Transformer layers L."""
    hidden_size: int
    """Model width h (elements)."""
    ffn_hidden_size: int
    """MLP inner width F (elements; per branch for SwiGLU)."""
    num_attention_heads: int
    """Query heads n."""
    num_query_groups: int | None = None
    """KV heads g for grouped-query attention; None = multi-head attention (g = n)."""
    kv_channels: int | None = None
    """Head dim d (elements); None = hidden_size / num_attention_heads."""
    vocab_size: int | None = None
    """Vocabulary before padding (tokens); None = the tokenizer's (smoke models)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary up to a multiple of this (tokens)."""
    max_position_embeddings: int = 2048
    """Longest sequence the positions support (tokens); a longer training.seq_length is refused."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    """Rotary or learned absolute positions."""
    rotary_base: int = 10000
    """RoPE theta (only with rope)."""
    rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (megatron-core's: low/high frequency factors 1 and 4 over
    an original context of 8192 tokens; Megatron-LM's --use-rope-scaling)."""
    rope_scaling_factor: float = 8.0
    """The scaling's factor (only with rope_scaling; Megatron-LM's --rope-scaling-factor)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Norm layer type."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm (dimensionless)."""
    swiglu: bool = False
    """SwiGLU MLP (gated SiLU); False = GELU MLP."""
    gelu_tanh: bool = False
    """GELU MLP with the tanh approximation (GPT-2's ``gelu_new``); False = exact (erf) GELU."""
    qk_layernorm: bool = False
    """Norm on queries and keys per head (Qwen3)."""
    add_bias_linear: bool = True
    """Biases in the linear layers."""
    add_qkv_bias: bool = False
    """Biases in the query/key/value projection only (Qwen2); implied by add_bias_linear."""
    tie_embeddings: bool = True
    """Share input embedding and output projection weights."""
    hidden_dropout: float = 0.0
    """Dropout probability after attention and MLP (0-1)."""
    attention_dropout: float = 0.0
    """Dropout probability on attention scores (0-1)."""
    hf_checkpoint: str | None = None
    """A Hugging Face model directory whose weights start the run (continued pretraining); set when
    MODEL is such a directory (the preset then comes from its config.json)."""

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
    """Tokenizer kind; null = token ids are given (mock data)."""
    model_path: str | None = None
    """sentencepiece ``.model``, or a Hugging Face tokenizer directory (``tokenizer.json`` and its
    ``tokenizer_config.json``, as ``save_pretrained`` writes it; a model directory holds one) or its
    ``tokenizer.json`` (path); None with sentencepiece = train one on the corpus."""
    vocab_size: int = 4096
    """Vocabulary (tokens) of a sentencepiece model trained on the corpus, or of the null tokenizer."""


@dataclass(frozen=True)
class DataParams:
    """Where training tokens come from."""

    source: Literal["embedded", "files", "mock"] = "embedded"
    """embedded: the running Python's standard-library docstrings (nothing downloaded);
    files: ``paths`` (indexed-dataset prefixes, or JSONL/text prepared on first use);
    mock: Megatron's MockGPTDataset (synthetic tokens, null tokenizer)."""
    paths: tuple[str, ...] = ()
    """Inputs for source=files (paths): ``.bin``/``.idx`` prefixes, ``.jsonl`` (``text`` field) or text files."""
    weights: tuple[float, ...] = ()
    """Blend weights (relative, any scale), one per path; empty = weighted by size."""
    split: str = "98,2,0"
    """Train/valid/test split of every dataset (relative weights), as Megatron's ``--split``."""
    tokenizer: TokenizerParams = field(default_factory=TokenizerParams)
    """The tokenizer."""


@dataclass(frozen=True, kw_only=True)
class TrainingParams:
    """The optimisation schedule. Batch sizes count sequences.

    The batch is given one of two ways (Megatron's rule holds either way: global = micro x
    data-parallel x accumulation): ``global_batch_size`` fixes the global batch (accumulation =
    global / (micro x data-parallel), so it must divide), or ``gradient_accumulation_steps``
    fixes the work per replica (global = micro x data-parallel x accumulation, so it fits any
    world size). Neither = one micro-batch per replica per step.
    """

    seq_length: int = 128
    """Tokens per sequence; at most the model's max_position_embeddings (:func:`check_seq_length`)."""
    micro_batch_size: int = 4
    """Sequences per rank per forward/backward."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all data-parallel ranks; None = from
    gradient_accumulation_steps and the world size (filled in once the world size is known)."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per rank per optimizer step, instead of global_batch_size."""
    train_iters: int = 20
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int = 2
    """Optimizer steps of linear warmup."""
    lr_decay_iters: int | None = None
    """The optimizer step at which the cosine decay reaches ``min_lr``, counted from the start, warmup
    included, as Megatron-LM's ``--lr-decay-iters`` (training/loop.py ``learning_rate``); None = train_iters."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (per step, times lr)."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay (dimensionless)."""
    adam_beta2: float = 0.95
    """AdamW second-moment decay (dimensionless)."""
    adam_eps: float = 1e-8
    """AdamW epsilon (dimensionless)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (L2 norm); 0 = off."""
    grad_reduce_in_bf16: bool = False
    """GPUs: reduce gradients over data-parallel ranks in bf16 instead of fp32 (half the traffic;
    Megatron-LM's --grad-reduce-in-bf16)."""
    fp8: Literal["hybrid", "e4m3"] | None = None
    """GPUs with transformer-engine: matrix multiplications in FP8 through transformer-engine's
    ``fp8_autocast`` (megatron-core's fp8 context, delayed scaling): ``hybrid`` = e4m3 forward, e5m2
    gradients; ``e4m3`` = e4m3 throughout; None = BF16 (Megatron-LM's --fp8-format). Needs
    transformer-engine and compute capability 8.9 or later (run_spec/fp8.py refuses it otherwise).
    MFU stays against the device's dense BF16 peak, as every run's (run_spec/flops.py
    ``describe_mfu_peak``), so that an FP8 run's MFU above a BF16 run's is its gain."""
    fp8_amax_history_len: int = 1
    """Steps of amax history each FP8 scaling factor is computed from (Megatron-LM's
    --fp8-amax-history-len; its default 1; NVIDIA's published recipes use 1024)."""
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """Which amax of the history sets the scale: the latest or the largest (Megatron-LM's
    --fp8-amax-compute-algo; its default most_recent; NVIDIA's recipes use max)."""
    manual_gc: bool = False
    """Turn Python's automatic garbage collector off and collect on every rank at the same steps
    (Megatron-LM's --manual-gc): an automatic collection stalls one rank at a random step and every
    other rank waits for it in the next collective."""
    manual_gc_interval: int = 0
    """With manual_gc: optimizer steps between collections (Megatron-LM's --manual-gc-interval;
    0 = collect only around evaluations, as Megatron-LM's default)."""
    seed: int = 1234
    """Seed of initialisation, dropout and data order."""
    log_interval: int = 1
    """Optimizer steps between log lines (and metrics records)."""
    eval_interval: int = 0
    """Optimizer steps between validation passes; 0 = only at the end."""
    eval_iters: int = 2
    """Global batches per validation pass."""
    save_interval: int = 0
    """Optimizer steps between checkpoints (and one at the end); 0 = no checkpoints. A run whose
    checkpoint exists resumes from the latest one."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (the newest ones); older ones are removed after each save."""
    async_save: bool | Literal["gpu"] = "gpu"
    """Each save written in the background, training waiting only for the state's copy to host
    memory. This program: megatron-core's asynchronous torch_dist save with its persistent worker
    (CUDA stages 0-1; stages 2-3 save synchronously: torch.distributed.checkpoint's stager cannot
    copy Megatron-FSDP's state) or, on CPU, torch.distributed.checkpoint's ``async_save`` in a
    thread; the checksums from the writer, committed (renamed into place, ``latest`` moved) at the
    first step after every rank's part is on disk; the last save of a run and a save on request are
    waited for. ``gpu`` (the default): in the background on GPUs, before training goes on on CPU,
    where the writer takes the ranks' cores (measured slower overall: benchmarks/results.md); true:
    on CPU too. ENGINE=megatron-lm at stages 0-1 on GPU nodes (true or gpu; never on CPU, where its
    background save writes the live tensors): ``--async-save`` with its persistent
    checkpoint worker, ``--async-strategy mcore`` where the release has the flag (torch_dist only,
    Megatron-LM's own limit). false: synchronous saves (docs/faults.md, "Checkpoints and resume")."""

    verify_integrity: bool = True
    """ENGINE=megatron-lm (core_v0.17.1 and later, stages 0-1): ``--verify-integrity``, Megatron-LM's
    ``integrity.json`` (the SHA-256 of every file) written at each save and checked at each load, by
    which node 0 passes a damaged checkpoint over before an attempt and ``check_checkpoints.sh``
    lists it. Its cost: each save's finalize hashes the whole checkpoint on rank 0 while the other
    ranks wait (at about 1 GB/s, 24 GB: ~25 s of training stopped a save, 450 GB: ~8 minutes), and
    each load again. false: no manifest; a checkpoint is then unrecorded, taken for whole by its
    files. This program records its checksums as it writes and ignores this (docs/faults.md, "A
    damaged checkpoint"). An attempt that loads a checkpoint without a manifest runs without the flag
    (Megatron-LM would refuse the load), so its saves, and those resumed from them, carry none."""

    def saves_in_background(self, on_cuda: bool) -> bool:
        """Whether this program writes a save in the background (:attr:`async_save`) on this device."""
        return self.async_save is True or (self.async_save == "gpu" and on_cuda)
    zero_stage: int = 0
    """ZeRO stage 0-3 (ZERO_STAGE in the environment overrides it)."""
    engine: EngineName = MEGATRON_CORE.name
    """megatron-core: this project's program; megatron-lm: a checkout's pretrain_gpt.py
    (MEGATRON_LM_DIR). ENGINE in the environment overrides it."""
    resilience: ResilienceParams = field(default_factory=ResilienceParams)
    """Hang watchdog, restarts and their limits (megatron_ext/run_spec/resilience.py)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """With a Hugging Face model directory as MODEL: start from its weights (pretrained) or from
    megatron-core's random initialisation of the same architecture (random). Other models: random."""
    init_checkpoint: str | None = None
    """A Megatron-LM checkpoint whose model weights start the run (path: the folder Megatron-LM's
    ``--save`` wrote, or one of its ``iter_NNNNNNN`` folders; torch_dist or torch format): iteration 0
    with a fresh optimizer and learning-rate schedule. ENGINE=megatron-lm renders it as Megatron-LM's own
    ``--pretrained-checkpoint``. A run that has checkpoints of its own resumes from those instead."""
    megatron_lm_extra_args: tuple[str, ...] = ()
    """ENGINE=megatron-lm: pretrain_gpt.py flags the launcher does not model, appended to its
    arguments (they win over the rendered ones) and checked by Megatron-LM's own parser with the
    rest; MEGATRON_LM_EXTRA_ARGS (one shell-quoted string) adds more after these."""


@dataclass(frozen=True)
class RunParams:
    """One training run: a model preset plus a data set with its schedule."""

    model: ModelPreset
    """The model preset."""
    data: DataParams
    """The data set."""
    training: TrainingParams
    """The schedule (with overrides applied)."""
    data_set: str
    """The data set's name (or YAML path), for messages."""

    @property
    def hf_weights(self) -> str | None:
        """The Hugging Face directory whose weights start the run (MODEL a Hugging Face directory and
        training.init: pretrained), else None."""
        return self.model.hf_checkpoint if self.training.init == "pretrained" else None


COLLECTIVE_TIMEOUT_S = {Device.CPU: 300, Device.CUDA: 600}
"""How long a collective waits for a peer before the job fails (gloo on CPU, NCCL on GPUs): a lost
peer ends the run in minutes, not in torch's default half hour; long enough for rank 0 to build
a data set's index while the others wait. The launcher's supervisor stops a run whose node fails
much sooner (see orchestration/node/supervisor.py)."""


@dataclass(frozen=True)
class RunOverrides:
    """What the environment or the command line changes in a data set's schedule; each program
    builds it at its edge (the launcher from its environment, a rank from its arguments)."""

    zero_stage: int | None = None
    """ZERO_STAGE; None = the data set's."""
    engine: str | None = None
    """ENGINE; None = the data set's."""
    train_iters: int | None = None
    """--train-iters; None = the data set's."""
    global_batch_size: int | None = None
    """--global-batch-size (the launcher's resolved one, which a run that loses a node keeps);
    None = the data set's."""
    resilience: dict[str, Any] = field(default_factory=dict)
    """MAX_RESTARTS, HANG_*: changes to training.resilience."""


@dataclass(frozen=True)
class BatchGeometry:
    """The batch of one optimizer step, once the data-parallel size is known."""

    micro_batch_size: int
    """Sequences per rank per forward/backward."""
    data_parallel_size: int
    """Data-parallel ranks (= world size: TP = PP = 1)."""
    accumulation_steps: int
    """Micro-batches per rank per optimizer step."""

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.data_parallel_size * self.accumulation_steps

    def describe(self) -> str:
        return (f"micro {self.micro_batch_size} x dp {self.data_parallel_size} x accumulation "
                f"{self.accumulation_steps} = global {self.global_batch_size}")


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
        if name.endswith((".yaml", ".yml")):  # a path: say so, and what else would do
            raise UserError(f"{what} file {name} does not exist; give an existing .yaml file, or one of the {what}s "
                            f"under {params_dir / kind}: {choices}")
        raise UserError(f"unknown {what} {name!r}: no {path}; choose one of: {choices} (or add {kind}/{name}.yaml under {params_dir})")
    raw = _parse_yaml(path) or {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping at top level, got {type(raw).__name__}")
    return raw


def _parse_yaml(path: Path) -> Any:
    """The YAML in ``path``; a syntax error names the file, line and column (1-based)."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{where}: not valid YAML ({problem}); fix the file at that line") from None


def build_dataclass(cls: type, raw: dict[str, Any], where: str) -> Any:
    """A parameters dataclass from a user's mapping (megatron_ext/run_spec/convert.py): unknown keys
    and wrong types are UserErrors naming ``where``."""
    return structure_params(cls, raw, where)


def load_model(name: str, params_dir: Path = PARAMS_DIR) -> ModelPreset:
    """A preset under ``params_dir/models``, a ``.yaml`` path, or a Hugging Face model directory."""
    if is_hf_model_dir(name):
        directory = Path(name).expanduser().resolve()
        fields = preset_from_hf_config(read_hf_config(directory), f"{directory}/config.json")
        return build_dataclass(ModelPreset, {"name": directory.name, **fields, "hf_checkpoint": str(directory)},
                               f"{directory}/config.json")
    if Path(name).is_dir():
        raise UserError(f"model {name} is a directory without config.json; give a Hugging Face model directory "
                        "(config.json and its safetensors) or a preset name")
    raw = _read_yaml("models", name, params_dir)
    return build_dataclass(ModelPreset, {"name": Path(name).stem, **raw}, _where("models", name))


def _where(kind: str, name: str) -> str:
    return name if name.endswith((".yaml", ".yml")) else f"{kind}/{name}.yaml"


def load_data_set(name: str, params_dir: Path = PARAMS_DIR) -> tuple[DataParams, TrainingParams]:
    raw = _read_yaml("data", name, params_dir)
    where = _where("data", name)
    unknown = sorted(set(raw) - {"data", "training"})
    if unknown:
        raise UserError(f"unknown key {unknown[0]!r} in {where}; known keys: data, training (fix the spelling or remove it)")
    data = build_dataclass(DataParams, raw.get("data") or {}, f"{where}:data")
    training = build_dataclass(TrainingParams, raw.get("training") or {}, f"{where}:training")
    return data, training


def read_overrides(env: typing.Mapping[str, str]) -> RunOverrides:
    """ZERO_STAGE, ENGINE, MAX_RESTARTS and HANG_* from an environment mapping (each program's edge
    calls this once)."""
    stage = env.get("ZERO_STAGE", "").strip()
    engine = env.get("ENGINE", "").strip()
    return RunOverrides(
        zero_stage=int(parse_zero_stage(stage, source="ZERO_STAGE")) if stage else None,
        engine=check_engine(engine, "ENGINE") if engine else None,
        resilience=read_resilience_overrides(env),
    )


def check_engine(engine: str, source: str) -> str:
    if engine not in ENGINES:
        raise UserError(f"{source}={engine!r} is not an engine; use one of {', '.join(ENGINES)} (default {MEGATRON_CORE.name})")
    return engine


def load_run_params(model: str, data_set: str, overrides: RunOverrides = RunOverrides(), params_dir: Path = PARAMS_DIR) -> RunParams:
    """Load and validate model + data set, with ``overrides`` applied. Pure apart from reading
    the YAML files: nothing here reads the environment."""
    preset = load_model(model, params_dir)
    data, training = load_data_set(data_set, params_dir)
    where = _where("data", data_set)
    stage = overrides.zero_stage
    if stage is None:
        stage = parse_zero_stage(str(training.zero_stage), source=f"{where}:training.zero_stage")
    engine = overrides.engine or check_engine(training.engine, f"{where}:training.engine")
    training = dataclasses.replace(
        training, zero_stage=int(stage), engine=engine, train_iters=overrides.train_iters or training.train_iters,
        resilience=with_overrides(training.resilience, overrides.resilience),
    )
    if overrides.global_batch_size:
        training = dataclasses.replace(training, global_batch_size=overrides.global_batch_size,
                                       gradient_accumulation_steps=None)
    if data.tokenizer.type == "huggingface" and not data.tokenizer.model_path and preset.hf_checkpoint:
        # The model directory's own tokenizer (a Hugging Face model directory holds one).
        data = dataclasses.replace(data, tokenizer=dataclasses.replace(data.tokenizer, model_path=preset.hf_checkpoint))
    params = RunParams(model=preset, data=data, training=training, data_set=data_set)
    validate_run_params(params)
    return params


def validate_run_params(p: RunParams) -> None:
    """Cross-field checks that need no process group (data-parallel size is checked later)."""
    m, d, t = p.model, p.data, p.training
    if m.hidden_size % m.num_attention_heads and m.kv_channels is None:
        raise UserError(f"hidden_size={m.hidden_size} is not divisible by num_attention_heads={m.num_attention_heads}; "
                        "set kv_channels or change one of them")
    if m.num_attention_heads % m.query_groups:
        raise UserError(f"num_attention_heads={m.num_attention_heads} is not divisible by num_query_groups={m.query_groups}; "
                        "choose a divisor")
    if m.swiglu and m.gelu_tanh:
        raise UserError(f"model {m.name}: swiglu and gelu_tanh are both set; an MLP has one activation, keep one")
    if m.rope_scaling and m.position_embedding_type != "rope":
        raise UserError(f"model {m.name}: rope_scaling needs position_embedding_type=rope")
    if d.source == "files" and not d.paths:
        raise UserError(f"{_where('data', p.data_set)}: source=files needs data.paths; list one or more")
    if d.weights and len(d.weights) != len(d.paths):
        raise UserError(f"data.weights has {len(d.weights)} entries for {len(d.paths)} paths; give one weight per path or none")
    if t.init_checkpoint and p.hf_weights:
        raise UserError(f"training.init_checkpoint={t.init_checkpoint} and the Hugging Face weights of {m.hf_checkpoint} "
                        "both start the run; keep one (training.init: random keeps only init_checkpoint)")
    if d.source == "mock" and d.tokenizer.type != "null":
        raise UserError("data.source=mock needs data.tokenizer.type=null (synthetic token ids)")
    if d.tokenizer.type == "huggingface" and not d.tokenizer.model_path:
        raise UserError("data.tokenizer.type=huggingface needs model_path (a Hugging Face tokenizer directory or its "
                        "tokenizer.json), or a Hugging Face model directory as MODEL (its tokenizer)")
    for key in ("micro_batch_size", "global_batch_size", "gradient_accumulation_steps", "train_iters", "seq_length",
                "log_interval", "keep_checkpoints"):
        value = getattr(t, key)
        if value is not None and value <= 0:
            raise UserError(f"training.{key}={value} must be > 0")
    check_seq_length(t.seq_length, m, f"{_where('data', p.data_set)}:training.seq_length")
    if t.global_batch_size is not None and t.gradient_accumulation_steps is not None:
        raise UserError(f"training sets both global_batch_size={t.global_batch_size} and gradient_accumulation_steps="
                        f"{t.gradient_accumulation_steps}; give one of them (global = micro x data-parallel x accumulation)")
    if t.fp8_amax_history_len <= 0:
        raise UserError(f"training.fp8_amax_history_len={t.fp8_amax_history_len} must be > 0 (steps of amax history; "
                        "1 is Megatron-LM's default, 1024 NVIDIA's recipes')")
    if t.manual_gc_interval < 0:
        raise UserError(f"training.manual_gc_interval={t.manual_gc_interval} must be >= 0 (optimizer steps between "
                        "collections; 0 = only around evaluations)")
    check_resilience(t.resilience, f"{_where('data', p.data_set)}:training.resilience")
    if t.global_batch_size is not None and t.global_batch_size % t.micro_batch_size:
        raise UserError(f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size={t.micro_batch_size}; "
                        "change one of them")


def check_seq_length(seq_length: int, m: ModelPreset, source: str) -> None:
    """A UserError naming both and the fix where ``m`` has fewer positions than ``seq_length`` (never cut
    to fit). Megatron-LM asserts the same for either position type (``max_position_embeddings >=
    seq_length``); learned positions are weights of that many rows, rotary ones a preset may extend."""
    if seq_length <= m.max_position_embeddings:
        return
    more = ("raise max_position_embeddings in a preset of your own (rotary positions are computed, not learned)"
            if m.position_embedding_type == "rope" else
            "use a model with at least that many positions (learned_absolute positions are weights: they do not extend)")
    raise UserError(f"{source}={seq_length} is longer than model {m.name}'s max_position_embeddings="
                    f"{m.max_position_embeddings}: a sequence cannot have more tokens than the model has positions; "
                    f"set it to at most {m.max_position_embeddings}, or {more}")


def batch_geometry(t: TrainingParams, data_parallel_size: int) -> BatchGeometry:
    """The step's batch at ``data_parallel_size``, or a UserError naming all three factors."""
    if t.global_batch_size is None:
        return BatchGeometry(t.micro_batch_size, data_parallel_size, t.gradient_accumulation_steps or 1)
    per_step = t.micro_batch_size * data_parallel_size
    if t.global_batch_size % per_step:
        suggestion = per_step * max(1, round(t.global_batch_size / per_step))
        raise UserError(
            f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size"
            f"({t.micro_batch_size}) x data_parallel_size({data_parallel_size}) = {per_step}; "
            f"change one of them (e.g. global_batch_size={suggestion}), or give "
            "gradient_accumulation_steps instead of global_batch_size"
        )
    return BatchGeometry(t.micro_batch_size, data_parallel_size, t.global_batch_size // per_step)


def with_batch_geometry(p: RunParams, data_parallel_size: int) -> tuple[RunParams, BatchGeometry]:
    """``p`` with the global batch filled in for ``data_parallel_size``, and the geometry."""
    geometry = batch_geometry(p.training, data_parallel_size)
    training = dataclasses.replace(p.training, global_batch_size=geometry.global_batch_size,
                                   gradient_accumulation_steps=None)
    return dataclasses.replace(p, training=training), geometry


def params_as_dict(p: RunParams) -> dict[str, Any]:
    return unstructure(p)


def params_from_dict(raw: dict[str, Any], where: str) -> RunParams:
    """The inverse of :func:`params_as_dict`, with the same checks as loading."""
    return build_dataclass(RunParams, raw, where)
