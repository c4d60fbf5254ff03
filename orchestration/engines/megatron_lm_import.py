"""Megatron-LM argument files -> this project's model preset and data set YAML.

    python -m orchestration import-megatron-args model.sh data.sh --model-out params/models/m.yaml --data-out params/data/d.yaml

The files are read as bash would source them, in order (:mod:`megatron_lm_shell`); their flags are
split with the flag table of Megatron-LM core_v0.16.1, or of the checkout given with
``--megatron-lm-dir`` / MEGATRON_LM_DIR (:mod:`megatron_lm_flag_table`); a later file's flag
overrides an earlier file's. Each flag then either maps onto a field of :class:`ModelPreset`,
:class:`DataParams` or :class:`TrainingParams`, or is listed (:class:`NotImported`): without a
counterpart, handled by the launcher, or fixed in this project. A field the files do not set gets
Megatron-LM's default (:data:`MODEL_DEFAULTS`, :data:`TRAINING_DEFAULTS`), marked in the YAML, so
the imported run means what the files meant. The renderer going the other way is
:mod:`orchestration.engines.megatron_lm_args`.

Pure apart from :func:`read_arg_files`, which reads the files.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_ext.run_spec.errors import UserError
from orchestration.engines.megatron_lm_flag_table import FlagTable, load_flag_table
from orchestration.engines.megatron_lm_shell import FileArgs, ShellWord, read_files

NOT_IMPORTED, LAUNCHER, FIXED = "not imported", "handled by the launcher", "fixed in this project"

MODEL_DEFAULTS: dict[str, tuple[str, Any]] = {
    "make_vocab_size_divisible_by": ("--make-vocab-size-divisible-by", 128),
    "position_embedding_type": ("--position-embedding-type", "learned_absolute"),
    "rotary_base": ("--rotary-base", 10000),
    "rope_scaling_factor": ("--rope-scaling-factor", 8.0),
    "normalization": ("--normalization", "LayerNorm"),
    "norm_epsilon": ("--norm-epsilon", 1e-5),
    "hidden_dropout": ("--hidden-dropout", 0.1),
    "attention_dropout": ("--attention-dropout", 0.1),
}
"""Megatron-LM core_v0.16.1's argparse defaults for the model fields (field -> flag, default)."""
TRAINING_DEFAULTS: dict[str, tuple[str, Any]] = {
    "min_lr": ("--min-lr", 0.0),
    "lr_warmup_iters": ("--lr-warmup-iters", 0),
    "weight_decay": ("--weight-decay", 0.01),
    "adam_beta1": ("--adam-beta1", 0.9),
    "adam_beta2": ("--adam-beta2", 0.999),
    "adam_eps": ("--adam-eps", 1e-8),
    "clip_grad": ("--clip-grad", 1.0),
    "seed": ("--seed", 1234),
    "log_interval": ("--log-interval", 100),
    "eval_iters": ("--eval-iters", 100),
}
"""The same for the schedule. (``--lr-decay-style`` defaults to linear, which has no counterpart:
listed.)"""
DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's split when ``--data-path`` comes without ``--split`` ('969, 30, 1')."""

TORCHRUN_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
                  "--master-addr", "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend", "--rdzv_endpoint",
                  "--rdzv-endpoint", "--rdzv_id", "--rdzv-id", "--rdzv_conf", "--rdzv-conf", "--standalone",
                  "--max_restarts", "--max-restarts", "--monitor_interval", "--log_dir", "--log-dir", "--redirects",
                  "--tee", "--local_addr", "--local-addr"}
_TORCHRUN = "the launcher runs torchrun itself (HOSTS, NNODES, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT)"
_LAUNCHER_REASONS = {
    ("--save", "--load", "--ckpt-format", "--use-dist-ckpt", "--auto-detect-ckpt-format", "--async-save"):
        "checkpoints live under $ARTIFACT_ROOT/<run>/checkpoints (training.save_interval, keep_checkpoints)",
    ("--tensorboard-dir", "--data-cache-path", "--log-throughput"):
        "the launcher sets the run's paths and logging under $ARTIFACT_ROOT/<run>",
    ("--bf16",): "the launcher trains in bf16 on GPUs and fp32 on CPU",
    ("--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--overlap-grad-reduce",
     "--overlap-param-gather"): "the launcher renders the ZeRO stage's flags from training.zero_stage "
                                "(megatron_ext/run_spec/zero.py)",
    ("--exit-signal-handler", "--exit-signal", "--exit-duration-in-mins", "--distributed-backend",
     "--distributed-timeout-minutes"): "the launcher's supervisor stops, saves and times out runs",
    ("--attention-backend", "--transformer-impl", "--use-flash-attn", "--no-masked-softmax-fusion",
     "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
     "--cross-entropy-loss-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
     "--use-cpu-initialization"):
        "the engine picks kernels per device (megatron_ext/training/model.py, KernelChoices)",
    ("--num-workers", "--manual-gc", "--manual-gc-interval"): "the engine sets up data loading and memory itself",
}
LAUNCHER_FLAGS = {flag: reason for flags, reason in _LAUNCHER_REASONS.items() for flag in flags}
_LAUNCHER_PREFIXES = ("--log-", "--tensorboard-", "--wandb-", "--timing-log-")
FIXED_VALUES = {
    "--tensor-model-parallel-size": ("1", "this project trains with data parallelism only (TP = PP = CP = 1)"),
    "--pipeline-model-parallel-size": ("1", "this project trains with data parallelism only (TP = PP = CP = 1)"),
    "--context-parallel-size": ("1", "this project trains with data parallelism only (TP = PP = CP = 1)"),
    "--rotary-percent": ("1.0", "this project rotates the whole head dimension"),
    "--init-method-std": ("0.02", "this project initialises with megatron-core's init_method_std 0.02"),
    "--optimizer": ("adam", "this project's optimizer is Adam with decoupled weight decay (AdamW), as Megatron-LM's adam"),
    "--weight-decay-incr-style": ("constant", "this project's weight decay is constant"),
    "--lr-warmup-init": ("0.0", "this project's warmup starts at 0"),
    "--vocab-extra-ids": ("0", "this project adds no extra vocabulary ids"),
}
"""Flags whose value this project always uses: listed as fixed when the file gives that value, as
not imported otherwise."""
FIXED_SWITCHES = {"--use-mcore-models": "this project builds megatron-core models (Megatron-LM's default too)"}
"""Flags without a value that say what this project always does."""
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


@dataclass(frozen=True)
class GivenFlag:
    flag: str
    values: tuple[ShellWord, ...]
    where: str

    def text(self) -> str:
        return " ".join([self.flag, *(w.text for w in self.values)])


@dataclass(frozen=True)
class NotImported:
    flag: str
    values: tuple[str, ...]
    reason: str
    where: str
    kind: str = NOT_IMPORTED
    """:data:`NOT_IMPORTED` (no counterpart), :data:`LAUNCHER` or :data:`FIXED`."""
    section: str = "other"
    """model / data / training / other: which YAML lists it."""

    def describe(self) -> str:
        return f"{' '.join([self.flag, *self.values])} ({self.where}): {self.reason}"


@dataclass(frozen=True)
class ImportedArgs:
    model: dict[str, Any]
    """ModelPreset fields (without name)."""
    data: dict[str, Any]
    """DataParams fields (tokenizer as a dict)."""
    training: dict[str, Any]
    """TrainingParams fields."""
    not_imported: tuple[NotImported, ...]
    imported: tuple[tuple[str, tuple[str, ...]], ...]
    """The flags that map onto a field, as the files give them."""
    comments: dict[str, str]
    """``model.hidden_dropout`` -> why the value is what it is (a default, a conversion)."""
    sources: tuple[str, ...]
    """``path (origin)`` per file."""
    release: str
    notes: tuple[str, ...] = ()
    """Lines of the files the shell reader ignored on purpose."""
    converted: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Flags read into a field in another form (``--lr-warmup-fraction`` -> lr_warmup_iters)."""


# -- flags ----------------------------------------------------------------------------------------


def _is_flag(word: ShellWord) -> bool:
    return word.unresolved is None and word.text.startswith("--")


def split_flags(words: Sequence[ShellWord], table: FlagTable) -> tuple[list[GivenFlag], list[GivenFlag]]:
    """``[--flag, value, ...]`` -> (known flags, unknown flags), values taken by each flag's nargs."""
    known, unknown = [], []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not _is_flag(word):
            last = (known + unknown)[-1] if known or unknown else None
            if word.unresolved:
                raise UserError(f"{word.where}: {word.text} stands where a flag should be and cannot be expanded "
                                f"({word.unresolved}); set it, or give its flags in the file")
            after = f" after {last.text()}, which takes {_wanted(table.flags[last.flag].nargs)}" if last else ""
            raise UserError(f"{word.where}: {word.text!r}{after}: Megatron-LM takes no positional arguments; "
                            "remove it or fix the flag before it")
        name, eq, inline = word.text.partition("=")
        values = [ShellWord(inline, word.where)] if eq else []
        spec = table.flags.get(name)
        nargs = "*" if spec is None else spec.nargs
        limit = {"0": 0, "1": 1, "?": 1}.get(nargs, int(nargs) if nargs.isdigit() else None)
        while i < len(words) and not _is_flag(words[i]) and (limit is None or len(values) < limit):
            values.append(words[i])
            i += 1
        given = GivenFlag(name, tuple(values), word.where)
        if spec is None:
            unknown.append(given)
            continue
        if (nargs == "0" and values) or (nargs in ("1", "+") and not values) or (nargs.isdigit() and len(values) != limit):
            raise UserError(f"{word.where}: {given.text()}: Megatron-LM's {name} takes {_wanted(nargs)}; fix the file")
        for value in values:
            if spec.choices and value.unresolved is None and value.text not in spec.choices:
                raise UserError(f"{value.where}: {name} {value.text} is not one of Megatron-LM's choices "
                                f"({', '.join(spec.choices)}); fix the file")
        known.append(given)
    return known, unknown


def _wanted(nargs: str) -> str:
    return {"0": "no value", "1": "one value", "?": "at most one value", "*": "any number of values",
            "+": "one or more values"}.get(nargs, f"{nargs} values")


def merge_flags(per_file: Sequence[Sequence[GivenFlag]], table: FlagTable) -> dict[str, GivenFlag]:
    """Later files override earlier ones (``--no-x`` cancels ``--x`` and back)."""
    merged: dict[str, GivenFlag] = {}
    for flags in per_file:
        for given in flags:
            name = given.flag
            opposite = "--" + name[5:] if name.startswith("--no-") else "--no-" + name[2:]
            if opposite in table.flags:
                merged.pop(opposite, None)
            merged[name] = given
    return merged


def _unknown_error(unknown: Sequence[GivenFlag], table: FlagTable) -> UserError:
    items = []
    for given in unknown:
        close = difflib.get_close_matches(given.flag, list(table.flags), n=1, cutoff=0.8)
        items.append(f"{given.flag} ({given.where}{'; did you mean ' + close[0] + '?' if close else ''})")
    return UserError(f"Megatron-LM {table.release} defines no {', '.join(items)}; fix the spelling, or give "
                     "--megatron-lm-dir DIR (or MEGATRON_LM_DIR) for the Megatron-LM checkout the files are written for")


# -- mapping --------------------------------------------------------------------------------------


@dataclass
class _Reader:
    flags: dict[str, GivenFlag]
    used: set[str] = field(default_factory=set)
    skipped: list[NotImported] = field(default_factory=list)
    imported: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    comments: dict[str, str] = field(default_factory=dict)
    conversions: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    def given(self, flag: str) -> bool:
        return flag in self.flags

    def _take(self, flag: str, counterpart: bool = True) -> GivenFlag | None:
        given = self.flags.get(flag)
        if given is not None and flag not in self.used:
            self.used.add(flag)
            if counterpart:
                self.imported.append((flag, tuple(w.text for w in given.values)))
        return given

    def switch(self, flag: str) -> bool:
        return self._take(flag) is not None

    def texts(self, flag: str, needed_for: str) -> list[str] | None:
        given = self._take(flag)
        if given is None:
            return None
        for w in given.values:
            if w.unresolved:
                raise UserError(f"{w.where}: {flag} {w.text}: {w.unresolved}; the value is needed for {needed_for}")
        return [w.text for w in given.values]

    def text(self, flag: str, needed_for: str) -> str | None:
        values = self.texts(flag, needed_for)
        return values[0] if values else None

    def number(self, flag: str, kind: type, needed_for: str) -> Any:
        text = self.text(flag, needed_for)
        if text is None:
            return None
        try:
            return kind(text)
        except ValueError:
            raise UserError(f"{self.flags[flag].where}: {flag} {text!r} is not {'an integer' if kind is int else 'a number'} "
                            f"(Megatron-LM reads it as {kind.__name__}); fix the file") from None

    def required(self, flag: str, kind: type, needed_for: str) -> Any:
        value = self.number(flag, kind, needed_for)
        if value is None:
            raise UserError(f"the files give no {flag}, which Megatron-LM needs (for {needed_for}); add it to a file")
        return value

    def converted(self, flag: str) -> None:
        """``flag`` was read into a field in another form (it does not render back as given)."""
        self.conversions += [(f, v) for f, v in self.imported if f == flag]
        self.imported = [(f, v) for f, v in self.imported if f != flag]

    def untake(self, flag: str) -> None:
        """Undo :meth:`_take` (a flag read first, then found to have no counterpart)."""
        self.used.discard(flag)
        self.imported = [(f, v) for f, v in self.imported if f != flag]

    def default(self, key: str, value: Any, flag: str, what: str = "") -> Any:
        self.comments[key] = f"Megatron-LM default{what} (no {flag} in the files)"
        return value

    def skip(self, flag: str, reason: str, kind: str = NOT_IMPORTED, section: str = "other") -> None:
        if flag in self.used:
            return
        given = self._take(flag, counterpart=False)
        if given is not None:
            self.skipped.append(NotImported(flag, tuple(w.text for w in given.values), reason, given.where, kind, section))


def _model(r: _Reader) -> dict[str, Any]:
    m: dict[str, Any] = {}
    m["num_layers"] = r.required("--num-layers", int, "model.num_layers")
    m["hidden_size"] = h = r.required("--hidden-size", int, "model.hidden_size")
    swiglu = r.switch("--swiglu")
    ffn = r.number("--ffn-hidden-size", int, "model.ffn_hidden_size")
    if ffn is None:
        ffn = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
        r.default("model.ffn_hidden_size", ffn, "--ffn-hidden-size",
                  ": int(4 x hidden x 2/3 / 64) x 64 with --swiglu" if swiglu else ": 4 x hidden_size")
    m["ffn_hidden_size"] = ffn
    m["num_attention_heads"] = r.required("--num-attention-heads", int, "model.num_attention_heads")
    m["num_query_groups"] = None
    if r.switch("--group-query-attention"):
        groups = r.number("--num-query-groups", int, "model.num_query_groups")
        m["num_query_groups"] = groups if groups is not None else r.default("model.num_query_groups", 1, "--num-query-groups")
    else:
        r.skip("--num-query-groups", "Megatron-LM ignores it without --group-query-attention (multi-head attention)", section="model")
    m["kv_channels"] = r.number("--kv-channels", int, "model.kv_channels")
    m["vocab_size"] = r.number("--padded-vocab-size", int, "model.vocab_size")
    if m["vocab_size"] is None:
        r.comments["model.vocab_size"] = "the tokenizer's, padded (no --padded-vocab-size in the files)"
    m["make_vocab_size_divisible_by"] = _or_default(r, "model", "make_vocab_size_divisible_by", int)
    m["max_position_embeddings"] = r.required("--max-position-embeddings", int, "model.max_position_embeddings")
    position = _or_default(r, "model", "position_embedding_type", str)
    if position not in ("rope", "learned_absolute"):
        raise UserError(f"{r.flags['--position-embedding-type'].where}: --position-embedding-type {position} has no "
                        "counterpart: this project builds rope or learned_absolute positions; change the file")
    m["position_embedding_type"] = position
    m["rotary_base"] = _or_default(r, "model", "rotary_base", int)
    m["rope_scaling"] = r.switch("--use-rope-scaling")
    m["rope_scaling_factor"] = _or_default(r, "model", "rope_scaling_factor", float)
    if not m["rope_scaling"] and not r.given("--rope-scaling-factor"):
        r.comments.pop("model.rope_scaling_factor")  # unused without the scaling
    m["normalization"] = _or_default(r, "model", "normalization", str)
    m["norm_epsilon"] = _or_default(r, "model", "norm_epsilon", float)
    m["swiglu"] = swiglu
    m["gelu_tanh"] = False
    r.comments["model.gelu_tanh"] = "Megatron-LM's megatron-core GPT uses the exact GELU (--openai-gelu: legacy models only)"
    m["qk_layernorm"] = r.switch("--qk-layernorm")
    m["add_bias_linear"] = not r.switch("--disable-bias-linear")
    m["add_qkv_bias"] = r.switch("--add-qkv-bias")
    if m["add_qkv_bias"] and m["add_bias_linear"]:
        r.converted("--add-qkv-bias")  # implied by the linear biases: the renderer leaves it out
        r.comments["model.add_qkv_bias"] = "--add-qkv-bias, implied by the linear biases (no --disable-bias-linear)"
    m["tie_embeddings"] = not r.switch("--untie-embeddings-and-output-weights")
    m["hidden_dropout"] = _or_default(r, "model", "hidden_dropout", float)
    m["attention_dropout"] = _or_default(r, "model", "attention_dropout", float)
    r.skip("--openai-gelu", "Megatron-LM applies it to its legacy models only; its megatron-core GPT uses the exact GELU",
           section="model")
    return m


def _or_default(r: _Reader, section: str, key: str, kind: type) -> Any:
    flag, default = (MODEL_DEFAULTS if section == "model" else TRAINING_DEFAULTS)[key]
    value = r.number(flag, kind, f"{section}.{key}") if kind is not str else r.text(flag, f"{section}.{key}")
    return r.default(f"{section}.{key}", default, flag) if value is None else value


def _samples_to_iters(r: _Reader, flag: str, global_batch: int | None, key: str) -> int | None:
    samples = r.number(flag, int, f"training.{key}")
    if samples is None:
        return None
    if global_batch is None:
        raise UserError(f"{r.flags[flag].where}: {flag} {samples} counts samples; this project counts steps and needs "
                        "--global-batch-size to convert them: add it to a file, or give the iteration flag instead")
    r.converted(flag)
    r.comments[f"training.{key}"] = f"from {flag} {samples} / --global-batch-size {global_batch}"
    return samples // global_batch


def _training(r: _Reader) -> dict[str, Any]:
    t: dict[str, Any] = {}
    t["seq_length"] = r.required("--seq-length", int, "training.seq_length")
    t["micro_batch_size"] = r.required("--micro-batch-size", int, "training.micro_batch_size")
    gbs = t["global_batch_size"] = r.number("--global-batch-size", int, "training.global_batch_size")
    if gbs is None:
        r.comments["training.global_batch_size"] = "Megatron-LM default: micro x data-parallel (no --global-batch-size)"
    if r.given("--rampup-batch-size") and r.given("--train-samples") and not r.given("--train-iters"):
        raise UserError(f"{r.flags['--train-samples'].where}: --train-samples with --rampup-batch-size cannot become "
                        "train_iters (the ramp-up has no counterpart); give --train-iters instead")
    iters = r.number("--train-iters", int, "training.train_iters")
    if iters is None:
        iters = _samples_to_iters(r, "--train-samples", gbs, "train_iters")
    if iters is None:
        raise UserError("the files give no --train-iters (or --train-samples), which Megatron-LM needs; add one to a file")
    t["train_iters"] = iters
    t["lr"] = r.required("--lr", float, "training.lr")
    t["min_lr"] = _or_default(r, "training", "min_lr", float)
    decay = r.number("--lr-decay-iters", int, "training.lr_decay_iters")
    if decay is None:
        decay = _samples_to_iters(r, "--lr-decay-samples", gbs, "lr_decay_iters")
    fraction = r.number("--lr-warmup-fraction", float, "training.lr_warmup_iters")
    warmup = r.number("--lr-warmup-iters", int, "training.lr_warmup_iters")
    if fraction is not None:
        exact = fraction * (decay or iters)
        warmup = round(exact)
        r.converted("--lr-warmup-fraction")
        r.comments["training.lr_warmup_iters"] = (f"from --lr-warmup-fraction {fraction:g} x lr_decay_iters {decay or iters}"
                                                  + ("" if abs(exact - warmup) < 1e-6 else f" = {exact:g}, rounded"))
    elif warmup is None:
        warmup = _samples_to_iters(r, "--lr-warmup-samples", gbs, "lr_warmup_iters")
    t["lr_warmup_iters"] = warmup if warmup is not None else r.default("training.lr_warmup_iters", 0, "--lr-warmup-iters")
    t["lr_decay_iters"] = decay
    style = r.flags.get("--lr-decay-style")
    if style is not None and style.values and style.values[0].text == "cosine":
        r.switch("--lr-decay-style")
    elif style is not None:
        r.skip("--lr-decay-style", "no counterpart: this project decays with cosine", section="training")
    else:
        r.skipped.append(NotImported("--lr-decay-style", ("linear",), "Megatron-LM's default, which has no counterpart: "
                                     "this project decays with cosine (add --lr-decay-style cosine to mean that)",
                                     "not in the files", NOT_IMPORTED, "training"))
    for key in ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        t[key] = _or_default(r, "training", key, float)
    t["grad_reduce_in_bf16"] = r.switch("--grad-reduce-in-bf16")
    t["seed"] = _or_default(r, "training", "seed", int)
    t["log_interval"] = _or_default(r, "training", "log_interval", int)
    interval = r.number("--eval-interval", int, "training.eval_interval")
    t["eval_interval"] = interval if interval is not None else 0
    if interval is None:
        r.comments["training.eval_interval"] = "Megatron-LM default: no validation during training, one at the end"
    t["eval_iters"] = _or_default(r, "training", "eval_iters", int)
    save = r.number("--save-interval", int, "training.save_interval")
    t["save_interval"] = save if save is not None else 0
    if save is None:
        r.comments["training.save_interval"] = "no --save-interval in the files: no periodic checkpoints"
    t["zero_stage"] = _zero_stage(r)
    return t


def _zero_stage(r: _Reader) -> int:
    reason = LAUNCHER_FLAGS["--use-distributed-optimizer"]
    distributed = r.given("--use-distributed-optimizer")
    fsdp = r.given("--use-megatron-fsdp")
    strategy_flag = r.flags.get("--data-parallel-sharding-strategy")
    strategy = strategy_flag.values[0].text if strategy_flag and strategy_flag.values else "no_shard"
    if fsdp:
        stage = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[strategy]
        source = f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}"
    else:
        stage = 1 if distributed else 0
        source = "--use-distributed-optimizer" if distributed else ""
        if strategy_flag is not None:
            r.skip("--data-parallel-sharding-strategy", "Megatron-LM reads it only with --use-megatron-fsdp "
                   "(megatron_ext/run_spec/zero.py)", LAUNCHER, "training")
    for flag in ("--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy"):
        r.skip(flag, f"imported as training.zero_stage {stage}; {reason}", LAUNCHER, "training")
    if source:
        r.comments["training.zero_stage"] = f"from {source}"
    return stage


def _data(r: _Reader) -> dict[str, Any]:
    d: dict[str, Any] = {}
    kind = r.text("--tokenizer-type", "data.tokenizer.type")
    if kind is None and r.given("--vocab-file") and r.given("--merge-file"):
        kind = "GPT2BPETokenizer"
        r.comments["data.tokenizer"] = "no --tokenizer-type in the files; --vocab-file and --merge-file mean GPT2BPETokenizer"
    if kind is None:
        raise UserError("the files give no --tokenizer-type, which Megatron-LM needs; add one to a file "
                        "(HuggingFaceTokenizer, SentencePieceTokenizer, NullTokenizer, ...)")
    tokenizer: dict[str, Any] = {}
    if kind == "NullTokenizer":
        tokenizer = {"type": "null", "vocab_size": r.required("--vocab-size", int, "data.tokenizer.vocab_size")}
    elif kind == "HuggingFaceTokenizer" or kind in SENTENCEPIECE_TYPES:
        model = r.text("--tokenizer-model", "data.tokenizer.model_path")
        if model is None:
            raise UserError(f"{r.flags['--tokenizer-type'].where}: --tokenizer-type {kind} needs --tokenizer-model; add it to a file")
        if kind == "HuggingFaceTokenizer":  # a tokenizer directory, as Megatron-LM's AutoTokenizer reads it
            tokenizer = {"type": "huggingface", "model_path": model}
        else:
            tokenizer = {"type": "sentencepiece", "model_path": model}
            if kind != "SentencePieceTokenizer":
                r.comments["data.tokenizer.type"] = (f"from {kind} (same ids and end-of-document as this project's "
                                                     "sentencepiece; ENGINE=megatron-lm renders SentencePieceTokenizer)")
                r.converted("--tokenizer-type")  # renders back as SentencePieceTokenizer
    else:
        fix = ("convert --vocab-file/--merge-file to a Hugging Face tokenizer.json (transformers: "
               "GPT2TokenizerFast(vocab_file=..., merges_file=...).save_pretrained(DIR)) and set "
               "data.tokenizer.model_path to DIR/tokenizer.json") if kind == "GPT2BPETokenizer" else \
            "use HuggingFaceTokenizer, SentencePieceTokenizer or NullTokenizer"
        r.untake("--tokenizer-type")
        r.skip("--tokenizer-type", f"{kind} has no counterpart; {fix}", section="data")
        if "--tokenizer-type" not in r.flags:
            r.skipped.append(NotImported("--tokenizer-type", (kind,), f"{kind} has no counterpart; {fix}",
                                         "not in the files, implied by --vocab-file and --merge-file", NOT_IMPORTED, "data"))
        for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
            r.skip(flag, f"{kind}'s files (see --tokenizer-type)", section="data")
        tokenizer = {"type": "huggingface", "model_path": "TODO-tokenizer.json"}
        r.comments["data.tokenizer.model_path"] = f"{kind} has no counterpart: {fix}"
    for flag in ("--vocab-size", "--vocab-file", "--merge-file", "--tokenizer-model"):
        r.skip(flag, f"Megatron-LM's {kind} does not read it", section="data")
    mock = r.switch("--mock-data")
    if mock:
        if tokenizer["type"] != "null":
            raise UserError(f"{r.flags['--mock-data'].where}: --mock-data with {kind}: this project's mock data uses the "
                            "null tokenizer; add --tokenizer-type NullTokenizer --vocab-size N to a later file")
        d["source"] = "mock"
        r.skip("--data-path", "Megatron-LM ignores it with --mock-data", section="data")
        r.skip("--split", "Megatron-LM ignores it with --mock-data", section="data")
    else:
        values = r.texts("--data-path", "data.paths")
        if not values:
            raise UserError("the files give no --data-path (nor --mock-data); this project reads data from --data-path "
                            "prefixes (--train-data-path, --data-args-path and the like have no counterpart): add one")
        d["source"] = "files"
        d["paths"], d["weights"] = _blend(values, r.flags["--data-path"].where)
        split = r.text("--split", "data.split")
        d["split"] = split if split is not None else DEFAULT_SPLIT
        if split is None:
            r.comments["data.split"] = "Megatron-LM default with --data-path (no --split in the files)"
    d["tokenizer"] = tokenizer
    return d


def _blend(values: list[str], where: str) -> tuple[list[str], list[float]]:
    """``--data-path`` values: one prefix, prefixes, or weight-prefix pairs (Megatron's get_blend_from_list)."""
    if len(values) == 1:
        return values, []
    try:
        float(values[0])
    except ValueError:
        return values, []
    if len(values) % 2:
        raise UserError(f"{where}: --data-path {' '.join(values)}: weights and prefixes must come in pairs; fix the file")
    try:
        weights = [float(v) for v in values[0::2]]
    except ValueError as exc:
        raise UserError(f"{where}: --data-path {' '.join(values)}: {exc}; give weight-prefix pairs") from None
    return values[1::2], weights


def _rest(r: _Reader) -> None:
    """Every flag not yet taken: launcher business, a fixed value, or no counterpart."""
    for flag, given in list(r.flags.items()):
        if flag in r.used:
            continue
        values = tuple(w.text for w in given.values)
        if flag in TORCHRUN_FLAGS:
            r.skip(flag, _TORCHRUN, LAUNCHER)
        elif flag in LAUNCHER_FLAGS or flag.startswith(_LAUNCHER_PREFIXES):
            default = ("the launcher logs to W&B from WANDB_PROJECT, WANDB_NAME, WANDB_ENTITY, WANDB_DIR"
                       if flag.startswith("--wandb-") else "the launcher writes its own logs and metrics under $ARTIFACT_ROOT/<run>")
            r.skip(flag, LAUNCHER_FLAGS.get(flag, default), LAUNCHER)
        elif flag in FIXED_SWITCHES:
            r.skip(flag, FIXED_SWITCHES[flag], FIXED)
        elif flag in FIXED_VALUES:
            fixed, reason = FIXED_VALUES[flag]
            same = len(values) == 1 and _same_number(values[0], fixed)
            r.skip(flag, reason if same else f"no counterpart: {reason}", FIXED if same else NOT_IMPORTED,
                   "model" if flag in ("--rotary-percent", "--init-method-std", "--vocab-extra-ids") else "other")
        elif flag == "--fp16":
            r.skip(flag, "no counterpart: this project trains in bf16 on GPUs (no fp16 loss scaling)")
        elif flag == "--rampup-batch-size":
            r.skip(flag, "no counterpart: this project keeps the global batch fixed", section="training")
        else:
            r.skip(flag, "no counterpart in ModelPreset, DataParams or TrainingParams")


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def import_flags(files: Sequence[FileArgs], table: FlagTable) -> ImportedArgs:
    """Map the files' flags (later files override) onto the params; everything else is listed."""
    per_file, unknown, launcher = [], [], []
    for f in files:
        known, strange = split_flags(f.args, table)
        per_file.append(known)
        unknown += [g for g in strange if g.flag not in TORCHRUN_FLAGS]
        launcher += [g for g in strange if g.flag in TORCHRUN_FLAGS]
        words = list(f.launcher_args)
        while words:  # torchrun's own options, loosely: a -flag and the words after it
            head, words = words[0], words[1:]
            values = []
            while words and not words[0].text.startswith("-"):
                values.append(words.pop(0).text)
            launcher.append(GivenFlag(head.text, tuple(ShellWord(v, head.where) for v in values), head.where))
    if unknown:
        raise _unknown_error(unknown, table)
    r = _Reader(merge_flags(per_file, table))
    model, training, data = _model(r), _training(r), _data(r)
    _rest(r)
    skipped = [NotImported(g.flag, tuple(w.text for w in g.values), _TORCHRUN, g.where, LAUNCHER) for g in launcher]
    return ImportedArgs(model, data, training, tuple(r.skipped + skipped), tuple(r.imported), dict(r.comments),
                        tuple(f"{f.path} ({f.origin})" for f in files), table.release,
                        tuple(n for f in files for n in f.notes), tuple(r.conversions))


def read_arg_files(paths: Sequence[str]) -> list[tuple[str, str]]:
    """``(path, text)`` of each file (the one function here that touches the file system)."""
    out = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"{path} does not exist; give Megatron-LM argument files (shell files or a command line)")
        out.append((path, p.read_text(errors="replace")))
    return out


def import_files(files: Sequence[tuple[str, str]], table: FlagTable, variables: Mapping[str, str] | None = None) -> ImportedArgs:
    """:func:`import_flags` of ``(path, text)`` pairs read as shell, in order."""
    return import_flags(read_files(files, variables), table)


def import_arg_files(paths: Sequence[str], variables: Sequence[str] = (), megatron_lm_dir: str | None = None) -> ImportedArgs:
    """Read the files and the flag table (the checkout's, or the shipped one), and import
    (:mod:`megatron_lm_import_yaml` writes the result)."""
    return import_files(read_arg_files(paths), load_flag_table(megatron_lm_dir), parse_variables(variables))


def parse_variables(items: Sequence[str]) -> dict[str, str]:
    """``--var NAME=VALUE`` items."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise UserError(f"--var {item!r} is not NAME=VALUE; e.g. --var DATA_PATH=/data/corpus_text_document or --var 5=...")
        out[name] = value
    return out
