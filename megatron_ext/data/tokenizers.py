"""Tokenizers with the interface megatron-core's datasets read (``vocab_size``, ``eod``).

    python -c "from megatron_ext.data.tokenizers import train_sentencepiece; help(train_sentencepiece)"

- sentencepiece: a ``.model`` file, or one trained on the corpus (:func:`train_sentencepiece`,
  BPE, one thread, so every node that trains it gets the same model);
- huggingface: a tokenizer directory (or its ``tokenizer.json``) through the optional ``tokenizers``
  package, as Megatron-LM's default tokenizer system reads it;
- null: token ids are given (mock data); vocabulary ``vocab_size + 1`` with end-of-document last,
  as Megatron-LM's NullTokenizer.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import TokenizerParams

if TYPE_CHECKING:
    import numpy as np


def _arrays(id_lists: Iterable[list[int]], dtype: str) -> list[np.ndarray]:
    """Token id lists as arrays. numpy is imported here, not with the module: a start checks its
    tokenizer with this module and otherwise loads no numpy (see orchestration/runner/start_plan.py)."""
    import numpy as np

    return [np.asarray(ids, dtype=dtype) for ids in id_lists]


def _identifiers(tokenizer, path: str | Path | None, **options) -> dict:
    """The tokenizer's ``unique_identifiers``, which megatron-core's dataset cache keys read off it."""
    return {"class": type(tokenizer).__name__, "tokenizer_path": [str(path)], **options}


class SentencePieceTokenizer:
    def __init__(self, model_path: str | Path):
        import sentencepiece

        if not Path(model_path).is_file():
            raise UserError(f"tokenizer model {model_path} does not exist; give an existing .model file")
        self.model_path = str(model_path)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        self.pad = -1
        self.unique_identifiers = _identifiers(self, model_path)

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids as arrays, straight from sentencepiece's C++ (no Python int per token)."""
        if hasattr(self._sp, "encode_as_numpy"):  # sentencepiece >= 0.2
            return self._sp.encode_as_numpy(texts)
        return _arrays(self._sp.encode(texts), "int32")

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")
"""End-of-document tokens looked up, in this order, when the tokenizer's config names none."""


def hf_tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` of a Hugging Face tokenizer given as its directory or as the file."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise UserError(
                f"tokenizer directory {path} holds no tokenizer.json (the fast tokenizer's file); give a Hugging Face "
                "tokenizer directory as saved by save_pretrained, or the tokenizer.json itself"
            )
    elif not p.is_file():
        raise UserError(f"tokenizer {path} does not exist; give a Hugging Face tokenizer directory or its tokenizer.json")
    return p


def configured_token(directory: Path, key: str) -> str | None:
    """``key`` (e.g. ``eos_token``) as transformers reads it: ``special_tokens_map.json`` over
    ``tokenizer_config.json``; a string or an AddedToken mapping (``content``)."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        f = directory / name
        if not f.is_file():
            continue
        try:
            value = json.loads(f.read_text()).get(key)
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as exc:
            raise UserError(f"{f} is not a JSON object ({exc}); fix or remove the file") from None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


class HuggingFaceTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) through the ``tokenizers`` package, as
    Megatron-LM's default tokenizer system (``megatron.core.tokenizers``, core_v0.16) uses it:
    text -> tokens without special tokens (``tokenizer.tokenize`` + ``convert_tokens_to_ids``), the
    end of document = the configured ``eos_token``, vocabulary = ``len(tokenizer)`` (added tokens
    included)."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("tokenizer type huggingface needs the optional `tokenizers` package; `pip install -e .[hf]`") from None
        json_path = hf_tokenizer_file(path)
        self.model_path = str(path)
        try:
            self._tok = Tokenizer.from_file(str(json_path))
        except Exception as exc:  # the Rust parser's error: "expected `,` or `}` at line 3 column 5"
            raise UserError(f"{json_path} does not load as a Hugging Face tokenizer ({exc}); fix or replace the file") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        configured = configured_token(json_path.parent, "eos_token")
        if configured is not None:
            eod = self._tok.token_to_id(configured)
            if eod is None:
                raise UserError(f"{json_path.parent}: eos_token {configured!r} (tokenizer config) is not in the vocabulary; "
                                "fix the tokenizer's config")
        else:
            eod = next((self._tok.token_to_id(t) for t in EOD_NAMES if self._tok.token_to_id(t) is not None), None)
        if eod is None:
            raise UserError(
                f"{json_path} defines no end-of-document token: no eos_token in tokenizer_config.json and none of "
                f"{', '.join(EOD_NAMES)}; set eos_token in the directory's tokenizer_config.json"
            )
        self.eod = eod
        self.pad = -1
        self.unique_identifiers = _identifiers(self, json_path)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return _arrays((e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)), "int32")

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class NullTokenizer:
    """Megatron-LM's NullTokenizer: ids are the text's integers; eod = vocab_size."""

    def __init__(self, vocab_size: int):
        self.model_path = None
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        self.pad = -1
        self.unique_identifiers = _identifiers(self, None, vocab_size=vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def tokenize_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return _arrays(map(self.tokenize, texts), "int64")

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def train_sentencepiece(documents: Iterable[str], vocab_size: int, model_path: Path) -> Path:
    """Train a BPE sentencepiece model on ``documents``; writes ``model_path``."""
    import sentencepiece

    buffer = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=(line for doc in documents for line in doc.splitlines() if line.strip()),
            model_writer=buffer, vocab_size=vocab_size, model_type="bpe", character_coverage=1.0, byte_fallback=True,
            num_threads=1, max_sentence_length=16384, minloglevel=2)
    except RuntimeError as exc:
        raise UserError(
            f"sentencepiece cannot train vocab_size={vocab_size} on this corpus ({str(exc).split('] ')[-1]}); "
            "change data.tokenizer.vocab_size (at least 300: 256 byte pieces + specials)"
        ) from None
    model_path.parent.mkdir(parents=True, exist_ok=True)
    model_path.write_bytes(buffer.getvalue())
    return model_path


def check_tokenizer(params: TokenizerParams) -> None:
    """Load the tokenizer a run names, as its ranks will: a UserError before anything starts if
    it does not (a sentencepiece model still to be trained on the corpus is not checked here)."""
    if params.type != "sentencepiece" or params.model_path:
        load_tokenizer(params)


def load_tokenizer(params: TokenizerParams, model_path: str | None = None):
    """The tokenizer ``params`` describe; ``model_path`` overrides params.model_path."""
    path = model_path or params.model_path
    if params.type == "null":
        return NullTokenizer(params.vocab_size)
    if params.type == "huggingface":
        return HuggingFaceTokenizer(path)
    if path is None:
        raise UserError("sentencepiece tokenizer needs model_path, or data prepared with --vocab-size")
    return SentencePieceTokenizer(path)
