"""Megatron-LM flags -> the fields of :class:`ModelPreset`, :class:`DataParams` and :class:`TrainingParams`.

    python -m orchestration import-megatron-args model.sh data.sh --model-out params/models/m.yaml --data-out params/data/d.yaml

Each flag the files give (merged, :mod:`orchestration.import_args.given_flags`) either maps onto a
field, or is listed (:class:`NotImported`, :mod:`orchestration.import_args.flag_reader`): without
a counterpart, handled by the launcher, or fixed in this project. A field the files do not set
gets Megatron-LM's default, marked in the YAML, so the imported run means what the files meant.
The fields that are one flag each, and their defaults, are the table the renderer going the other
way writes them by (:data:`orchestration.megatron_lm.render.FIELD_FLAGS`). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_ext.run_spec.errors import UserError
from orchestration.import_args.flag_reader import (LAUNCHER, LAUNCHER_FLAGS, NOT_IMPORTED, FlagReader, NotImported,
                                                   list_the_rest)
from orchestration.import_args.given_flags import GivenFlag
from orchestration.megatron_lm.render import FIELD_FLAGS, FSDP_GRAD_DTYPE_FLAGS

DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's split when ``--data-path`` comes without ``--split`` ('969, 30, 1')."""

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


@dataclass(frozen=True, kw_only=True)
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
    """Lines of the files the shell reader ignored on purpose, and the flags of older releases the checkout
    retired (translated or dropped: orchestration/megatron_lm/retired_flags.py)."""
    converted: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Flags read into a field in another form (``--lr-warmup-fraction`` -> lr_warmup_iters)."""


def _field(r: FlagReader, section: str, key: str, *, required: bool = False, default: Any = ..., what: str = "",
           unset: str = "") -> Any:
    """``section.key`` from its flag (:data:`FIELD_FLAGS`): a switch flips Megatron-LM's default; a value is
    read as the field's type, else ``default`` (``...``: the table's, Megatron-LM's; marked with ``what``), else
    None (marked with ``unset``, if given)."""
    flag, kind, fallback = FIELD_FLAGS[section][key]
    if kind is bool:
        return r.switch(flag) != fallback
    if required:
        return r.required(flag, kind, f"{section}.{key}")
    value = r.text(flag, f"{section}.{key}") if kind is str else r.number(flag, kind, f"{section}.{key}")
    default = fallback if default is ... else default
    if value is None and (default is not None or unset):
        r.comments[f"{section}.{key}"] = unset or f"Megatron-LM default{what} (no {flag} in the files)"
    return default if value is None else value


def _model(r: FlagReader) -> dict[str, Any]:
    m: dict[str, Any] = {}
    m["num_layers"] = _field(r, "model", "num_layers", required=True)
    m["hidden_size"] = h = _field(r, "model", "hidden_size", required=True)
    swiglu = _field(r, "model", "swiglu")
    m["ffn_hidden_size"] = _field(r, "model", "ffn_hidden_size", default=int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h,
                                  what=": int(4 x hidden x 2/3 / 64) x 64 with --swiglu" if swiglu else ": 4 x hidden_size")
    m["num_attention_heads"] = _field(r, "model", "num_attention_heads", required=True)
    m["num_query_groups"] = _field(r, "model", "num_query_groups") if r.switch("--group-query-attention") else None
    if m["num_query_groups"] is None:
        r.skip("--num-query-groups", "Megatron-LM ignores it without --group-query-attention (multi-head attention)", section="model")
    m["kv_channels"] = _field(r, "model", "kv_channels")
    m["vocab_size"] = r.number("--padded-vocab-size", int, "model.vocab_size")
    if m["vocab_size"] is None:
        r.comments["model.vocab_size"] = "the tokenizer's, padded (no --padded-vocab-size in the files)"
    for key in ("make_vocab_size_divisible_by", "max_position_embeddings", "position_embedding_type"):
        m[key] = _field(r, "model", key, required=key == "max_position_embeddings")
    if m["position_embedding_type"] not in ("rope", "learned_absolute"):
        raise UserError(f"{r.flags['--position-embedding-type'].where}: --position-embedding-type {m['position_embedding_type']} "
                        "has no counterpart: this project builds rope or learned_absolute positions; change the file")
    for key in ("rotary_base", "rope_scaling", "rope_scaling_factor", "normalization", "norm_epsilon"):
        m[key] = _field(r, "model", key)
    if not m["rope_scaling"] and not r.given("--rope-scaling-factor"):
        r.comments.pop("model.rope_scaling_factor")  # unused without the scaling
    m["swiglu"] = swiglu
    m["gelu_tanh"] = False
    r.comments["model.gelu_tanh"] = "Megatron-LM's megatron-core GPT uses the exact GELU (--openai-gelu: legacy models only)"
    for key in ("qk_layernorm", "add_bias_linear", "add_qkv_bias"):
        m[key] = _field(r, "model", key)
    if m["add_qkv_bias"] and m["add_bias_linear"]:
        r.converted("--add-qkv-bias")  # implied by the linear biases: the renderer leaves it out
        r.comments["model.add_qkv_bias"] = "--add-qkv-bias, implied by the linear biases (no --disable-bias-linear)"
    for key in ("tie_embeddings", "hidden_dropout", "attention_dropout"):
        m[key] = _field(r, "model", key)
    r.skip("--openai-gelu", "Megatron-LM applies it to its legacy models only; its megatron-core GPT uses the exact GELU",
           section="model")
    return m


def _grad_reduce_in_bf16(r: FlagReader) -> bool:
    """``--grad-reduce-in-bf16``, or Megatron-FSDP's two gradient dtypes (core_v0.17.1 and later) both
    ``bf16``: this project accumulates and reduces in one dtype at every stage, fp32 (both ``fp32``, its
    default) or bf16 (``training.grad_reduce_in_bf16``), and renders the pair back at stages 2-3
    (orchestration/megatron_lm/render.py ``gradient_precision_flags``). Another pair (fp16, ``auto``,
    two different dtypes) has no counterpart and is listed."""
    in_bf16 = _field(r, "training", "grad_reduce_in_bf16")
    given = {flag: r.text(flag, "training.grad_reduce_in_bf16") for flag in FSDP_GRAD_DTYPE_FLAGS if r.given(flag)}
    if not given:
        return in_bf16
    dtypes = set(given.values())
    if len(given) == 2 and dtypes in ({"bf16"}, {"fp32"}):
        for flag in given:
            r.converted(flag)
        return in_bf16 or dtypes == {"bf16"}
    for flag in given:
        r.untake(flag)
        r.skip(flag, "no counterpart: this project accumulates and reduces gradients in one dtype at every stage, fp32 "
               "(both flags fp32, the default) or bf16 (both bf16: training.grad_reduce_in_bf16: true)", section="training")
    return in_bf16


def _samples_to_iters(r: FlagReader, flag: str, global_batch: int | None, key: str) -> int | None:
    samples = r.number(flag, int, f"training.{key}")
    if samples is None:
        return None
    if global_batch is None:
        raise UserError(f"{r.flags[flag].where}: {flag} {samples} counts samples; this project counts steps and needs "
                        "--global-batch-size to convert them: add it to a file, or give the iteration flag instead")
    r.converted(flag)
    r.comments[f"training.{key}"] = f"from {flag} {samples} / --global-batch-size {global_batch}"
    return samples // global_batch


def _training(r: FlagReader) -> dict[str, Any]:
    t: dict[str, Any] = {}
    t["seq_length"] = _field(r, "training", "seq_length", required=True)
    t["micro_batch_size"] = _field(r, "training", "micro_batch_size", required=True)
    gbs = t["global_batch_size"] = _field(r, "training", "global_batch_size",
                                          unset="Megatron-LM default: micro x data-parallel (no --global-batch-size)")
    if r.given("--rampup-batch-size") and r.given("--train-samples") and not r.given("--train-iters"):
        raise UserError(f"{r.flags['--train-samples'].where}: --train-samples with --rampup-batch-size cannot become "
                        "train_iters (the ramp-up has no counterpart); give --train-iters instead")
    iters = _field(r, "training", "train_iters")
    if iters is None:
        iters = _samples_to_iters(r, "--train-samples", gbs, "train_iters")
    if iters is None:
        raise UserError("the files give no --train-iters (or --train-samples), which Megatron-LM needs; add one to a file")
    t["train_iters"] = iters
    t["lr"] = _field(r, "training", "lr", required=True)
    t["min_lr"] = _field(r, "training", "min_lr")
    decay = _field(r, "training", "lr_decay_iters")
    if decay is None:
        decay = _samples_to_iters(r, "--lr-decay-samples", gbs, "lr_decay_iters")
    fraction = r.number("--lr-warmup-fraction", float, "training.lr_warmup_iters")
    warmup = _field(r, "training", "lr_warmup_iters", default=None)
    if fraction is not None:
        exact = fraction * (decay or iters)
        warmup = round(exact)
        r.converted("--lr-warmup-fraction")
        r.comments["training.lr_warmup_iters"] = (f"from --lr-warmup-fraction {fraction:g} x lr_decay_iters {decay or iters}"
                                                  + ("" if abs(exact - warmup) < 1e-6 else f" = {exact:g}, rounded"))
    elif warmup is None:
        warmup = _samples_to_iters(r, "--lr-warmup-samples", gbs, "lr_warmup_iters")
    t["lr_warmup_iters"] = warmup if warmup is not None else _field(r, "training", "lr_warmup_iters")
    t["lr_decay_iters"] = decay
    style = r.flags.get("--lr-decay-style")
    if style is not None and style.values and style.values[0].text == "cosine":
        r.switch("--lr-decay-style")
    elif style is not None:
        r.skip("--lr-decay-style", "no counterpart: this project decays with cosine", section="training")
    else:
        r.skipped.append(NotImported(flag="--lr-decay-style", values=("linear",), reason="Megatron-LM's default, which has no counterpart: "
                                     "this project decays with cosine (add --lr-decay-style cosine to mean that)",
                                     where="not in the files", kind=NOT_IMPORTED, section="training"))
    for key in ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        t[key] = _field(r, "training", key)
    t["grad_reduce_in_bf16"] = _grad_reduce_in_bf16(r)
    t["manual_gc"] = _field(r, "training", "manual_gc")
    # fp8: transformer-engine's delayed scaling, as Megatron-LM's default --fp8-recipe (its settings read only with it)
    for key in ("manual_gc_interval", "fp8", "fp8_amax_history_len", "fp8_amax_compute_algo"):
        if (not key.startswith("fp8_") or "fp8" in t) and (value := _field(r, "training", key)) is not None:
            t[key] = value
    t["seed"] = _field(r, "training", "seed")
    t["log_interval"] = _field(r, "training", "log_interval")
    t["eval_interval"] = _field(r, "training", "eval_interval",
                                unset="Megatron-LM default: no validation during training, one at the end") or 0
    t["eval_iters"] = _field(r, "training", "eval_iters")
    t["save_interval"] = _field(r, "training", "save_interval", unset="no --save-interval in the files: no periodic checkpoints") or 0
    # a user's own background saves kept: rendered back with Megatron-LM's worker flags where the stage
    # and the release allow it (orchestration/megatron_lm/render.py async_save_flags)
    t["async_save"] = r.switch("--async-save")
    if t["async_save"]:
        r.converted("--async-save")
    else:
        r.comments["training.async_save"] = "Megatron-LM default: synchronous saves (no --async-save in the files)"
    if r.switch("--verify-integrity"):  # the launcher's default too: rendered where the release and the stage take it
        t["verify_integrity"] = True
        r.converted("--verify-integrity")
    else:
        r.comments["training.verify_integrity"] = ("no --verify-integrity in the files (Megatron-LM's default: no "
                                                   "integrity.json); this project's default writes one at each save, "
                                                   "hashed on rank 0 (false: none)")
    t["zero_stage"] = _zero_stage(r)
    return t


def _zero_stage(r: FlagReader) -> int:
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


def _data(r: FlagReader) -> dict[str, Any]:
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
        # HuggingFaceTokenizer: a tokenizer directory, as Megatron-LM's AutoTokenizer reads it
        tokenizer = {"type": "huggingface" if kind == "HuggingFaceTokenizer" else "sentencepiece", "model_path": model}
        if kind in SENTENCEPIECE_TYPES and kind != "SentencePieceTokenizer":
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
            r.skipped.append(NotImported(flag="--tokenizer-type", values=(kind,), reason=f"{kind} has no counterpart; {fix}",
                                         where="not in the files, implied by --vocab-file and --merge-file", kind=NOT_IMPORTED,
                                         section="data"))
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


def map_flags(flags: Mapping[str, GivenFlag], release: str, sources: Sequence[str], notes: Sequence[str] = (),
              launcher: Sequence[NotImported] = ()) -> ImportedArgs:
    """Map the merged flags onto the params; everything else is listed (``launcher``: torchrun's
    own options, listed already)."""
    r = FlagReader(flags=dict(flags))
    model, training, data = _model(r), _training(r), _data(r)
    list_the_rest(r)
    return ImportedArgs(model=model, data=data, training=training, not_imported=tuple(r.skipped) + tuple(launcher),
                        imported=tuple(r.imported), comments=dict(r.comments),
                        sources=tuple(sources), release=release, notes=tuple(notes), converted=tuple(r.conversions))
