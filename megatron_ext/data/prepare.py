"""Text -> Megatron indexed dataset (``.bin``/``.idx``), and the cache the training run reads.

    python -m megatron_ext.data.prepare --output-prefix /tmp/corpus --vocab-size 2048
    python -m megatron_ext.data.prepare --input a.jsonl b.txt --tokenizer-model sp.model \\
        --output-prefix data/my_corpus --workers 4

Inputs: JSONL files with a ``text`` field (Megatron-LM ``preprocess_data.py``'s convention) or
plain text files (one document per file); no input = the embedded corpus (standard-library
docstrings). Output: ``<prefix>_text_document.bin/.idx`` in megatron-core's format, byte for byte what
Megatron-LM's ``tools/preprocess_data.py
--append-eod`` writes with the same tokenizer: one sequence per document, its tokens followed by
the end-of-document token; a document with no tokens adds no sequence (only a document boundary);
``uint16`` below 65,500 tokens of vocabulary, else ``int32``. With ``--vocab-size`` and no model, a sentencepiece model is trained on
the corpus and written to ``<prefix>.model``. Encoding runs in ``--workers`` processes.

Side effects: reads inputs, writes the outputs. :func:`ensure_prepared` prepares a cache with no
lock anywhere: into a folder of its own (a name no other preparer uses), renamed into place with
its manifest; a preparer that finds the finished cache there first (two starts at once) discards
its own. A training run prepares on global rank 0 alone, which announces the manifest to the
other ranks over the network (megatron_ext/training/agreement.py); the launcher prepares on its
own machine before any rank starts (docs/design.md, "What the nodes agree on, and where").
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from megatron_ext.run_spec.shared_fs import SHARED_FS_LAG_S, wait_for_files
from megatron_ext.run_spec.convert import structure
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import DataParams, TokenizerParams
from megatron_ext.data.indexed_format import optimal_dtype, write_index
from megatron_ext.data.tokenizers import load_tokenizer, train_sentencepiece

logger = logging.getLogger(__name__)

DOCUMENT_SUFFIX = "_text_document"
MANIFEST = "prepared.json"
"""A prepared cache's manifest (:class:`PreparedData`, its paths relative to the cache folder)."""


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    """What the dataset builder needs: indexed-dataset prefixes, weights and the tokenizer."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...]
    tokenizer_type: str
    tokenizer_path: str | None
    vocab_size: int
    """Tokenizer vocabulary (unpadded)."""
    eod: int


def read_documents(paths: Iterable[str]) -> Iterator[str]:
    """Documents from JSONL (``text`` field) and plain-text files, in order (for training a tokenizer)."""
    for chunk in chunks_from_files(paths):
        for i, item in enumerate(chunk.items):
            text = _json_text(item, chunk.source, chunk.first_line + i) if chunk.jsonl else item
            if text is not None:
                yield text


CHUNK_CHARS = 1 << 20
"""Documents travel to the encoding workers in chunks of about this many characters."""
CHUNK_DOCUMENTS = 512


@dataclass(frozen=True)
class _Chunk:
    """Consecutive documents for one worker: raw JSONL lines (parsed in the worker) or texts."""

    source: str
    first_line: int
    jsonl: bool
    items: list[str]


def _chunks(items: Iterable[str], source: str, jsonl: bool) -> Iterator[_Chunk]:
    batch: list[str] = []
    size, first = 0, 1
    for lineno, item in enumerate(items, 1):
        batch.append(item)
        size += len(item)
        if size >= CHUNK_CHARS or len(batch) >= CHUNK_DOCUMENTS:
            yield _Chunk(source, first, jsonl, batch)
            batch, size, first = [], 0, lineno + 1
    if batch:
        yield _Chunk(source, first, jsonl, batch)


def chunks_from_documents(documents: Iterable[str]) -> Iterator[_Chunk]:
    """Chunks of documents already in memory (the embedded corpus, a corpus read for training a tokenizer)."""
    return _chunks(documents, "documents", jsonl=False)


def chunks_from_files(paths: Iterable[str]) -> Iterator[_Chunk]:
    """Chunks of JSONL lines (one document each, parsed by the workers) and whole text files."""
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"data path {path} does not exist; give an existing .jsonl or text file")
        if p.suffix in (".jsonl", ".json"):
            with p.open(encoding="utf-8") as fh:
                yield from _chunks(fh, str(path), jsonl=True)
        else:
            yield _Chunk(str(path), 1, False, [p.read_text(encoding="utf-8", errors="replace")])


def _json_text(line: str, source: str, lineno: int) -> str | None:
    if not line.strip():
        return None  # a blank line is no document
    try:
        return json.loads(line)["text"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(
            f"{source}:{lineno} is not a JSON object with a 'text' field; fix the line or pass a plain text file"
        ) from None


_worker_tokenizer = None
_worker_dtype = None


def _init_worker(tokenizer_type: str, tokenizer_path: str | None, vocab_size: int, dtype) -> None:
    global _worker_tokenizer, _worker_dtype
    # A forked worker inherits the parent's Python signal handlers (a sweep raises on SIGTERM): the
    # pool's terminate() SIGTERMs its workers, which must then simply end, not raise mid-send.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    _worker_tokenizer = load_tokenizer(TokenizerParams(tokenizer_type, tokenizer_path, vocab_size))
    _worker_dtype = dtype


def _encode_chunk(chunk: _Chunk) -> tuple[bytes, list[int], int]:
    """Megatron-LM ``tools/preprocess_data.py --append-eod`` for a chunk of documents: each
    document's tokens and one end-of-document token, or nothing for a document with no tokens.
    Returns the chunk's tokens as the dataset's bytes, each document's length (0 = empty) and the
    characters read."""
    texts = chunk.items
    if chunk.jsonl:
        texts = [t for i, line in enumerate(chunk.items) if (t := _json_text(line, chunk.source, chunk.first_line + i)) is not None]
    encoded = _worker_tokenizer.tokenize_arrays(texts)
    eod = np.asarray([_worker_tokenizer.eod], dtype=_worker_dtype)
    lengths = [len(ids) + 1 if len(ids) else 0 for ids in encoded]
    pieces = [piece for ids in encoded if len(ids) for piece in (ids.astype(_worker_dtype, copy=False), eod)]
    tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=_worker_dtype)
    return tokens.tobytes(), lengths, sum(len(item) for item in chunk.items)


def default_progress_interval_s() -> float:
    """2 s on a terminal, 30 s in a log."""
    return 2.0 if sys.stderr.isatty() else 30.0


@dataclass(kw_only=True)
class PrepareProgress:
    """Documents, MB read, tokens, their rates and (input size known) the ETA, every
    ``interval_s`` (2 s on a terminal, 30 s in a log), as Megatron-LM's preprocess_data.py reports
    documents/s and MB/s."""

    total_bytes: int | None = None
    interval_s: float = field(default_factory=default_progress_interval_s)
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    documents: int = 0
    read_bytes: int = 0
    tokens: int = 0

    def update(self, documents: int, read_bytes: int, tokens: int) -> None:
        self.documents += documents
        self.read_bytes += read_bytes
        self.tokens += tokens
        if time.monotonic() - self.last >= self.interval_s:
            self.report()

    def report(self, final: bool = False) -> None:
        self.last = time.monotonic()
        elapsed = max(self.last - self.started, 1e-9)
        rate = self.read_bytes / elapsed
        line = (f"{'prepared' if final else 'preparing:'} {self.documents:,} documents, {self.read_bytes / 1e6:,.1f} MB "
                f"read, {self.tokens:,} tokens in {elapsed:,.0f} s ({self.documents / elapsed:,.0f} docs/s, "
                f"{rate / 1e6:,.2f} MB/s, {self.tokens / elapsed:,.0f} tokens/s)")
        if self.total_bytes and not final and rate > 0:
            left = max(self.total_bytes - self.read_bytes, 0)
            line += (f", {100 * min(self.read_bytes / self.total_bytes, 1):.0f}% of {self.total_bytes / 1e6:,.1f} MB, "
                     f"ETA {left / rate:,.0f} s")
        print(line, file=sys.stderr, flush=True)


def input_bytes(paths: Iterable[str]) -> int | None:
    """The inputs' total size, for the ETA (None when a path is not a file)."""
    sizes = [Path(p).stat().st_size for p in paths if Path(p).is_file()]
    return sum(sizes) if sizes else None


def write_indexed_dataset(chunks: Iterable[_Chunk], tokenizer_params: TokenizerParams, output_prefix: Path, workers: int = 2,
                          progress: PrepareProgress | None = None) -> Path:
    """Encode ``chunks`` (see :func:`chunks_from_files`, :func:`chunks_from_documents`) in
    ``workers`` processes into ``<output_prefix>_text_document.bin/.idx`` (megatron-core's format,
    :mod:`megatron_ext.data.indexed_format`)."""
    tokenizer = load_tokenizer(tokenizer_params)
    dtype = optimal_dtype(tokenizer.vocab_size)
    prefix = Path(f"{output_prefix}{DOCUMENT_SUFFIX}")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    initargs = (tokenizer_params.type, tokenizer_params.model_path, tokenizer_params.vocab_size, dtype)
    ctx = multiprocessing.get_context("spawn" if "torch" in sys.modules else "fork")
    sequence_lengths: list[int] = []
    document_indices = [0]
    with ctx.Pool(max(1, workers), initializer=_init_worker, initargs=initargs) as pool, open(f"{prefix}.bin", "wb") as out:
        progress = progress or PrepareProgress()
        for data, lengths, read in pool.imap(_encode_chunk, chunks):
            # As Megatron-LM's tool: an empty document adds no sequence, only a document boundary.
            out.write(data)
            progress.update(len(lengths), read, len(data) // np.dtype(dtype).itemsize)
            for n in lengths:
                if n:
                    sequence_lengths.append(n)
                document_indices.append(len(sequence_lengths))
    num_docs, num_tokens = len(document_indices) - 1, sum(sequence_lengths)
    if num_tokens == 0:
        raise UserError("the input holds no tokens; give a non-empty JSONL or text file")
    write_index(Path(f"{prefix}.idx"), dtype, sequence_lengths, document_indices)
    progress.report(final=True)
    logger.info("wrote %s.{bin,idx}: %d documents, %d tokens", prefix, num_docs, num_tokens)
    return prefix


def _is_indexed_prefix(path: str) -> bool:
    return Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()


def _cache_dir(data: DataParams, cache_root: Path) -> Path:
    """The one directory a corpus + tokenizer is prepared into."""
    return cache_root / f"{data.source}-{_cache_key(data)}"


def _cache_key(data: DataParams) -> str:
    """Stable key for a corpus + tokenizer, so every run with the same inputs shares one copy."""
    parts = [data.source, data.tokenizer.type, str(data.tokenizer.vocab_size), str(data.tokenizer.model_path),
             *_file_stamps(data.tokenizer)]
    if data.source == "embedded":
        parts.append(f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}")
    for path in data.paths:
        st = Path(path).stat() if Path(path).exists() else None
        parts.append(f"{Path(path).resolve()}:{st.st_size if st else 0}:{int(st.st_mtime) if st else 0}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def _file_stamps(tok: TokenizerParams) -> list[str]:
    """Size and time of the tokenizer's files: a tokenizer changed in place is prepared again."""
    if not tok.model_path:
        return []
    root = Path(tok.model_path)
    files = sorted(f for f in root.iterdir() if f.suffix == ".json") if root.is_dir() else [root]
    return [f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files if f.is_file()]


def _corpus_name(data: DataParams) -> str:
    return "embedded" if data.source == "embedded" else "corpus"


def tokenizer_and_chunks(tok: TokenizerParams, paths: list[str], model_path: Path) -> tuple[TokenizerParams, Iterable[_Chunk]]:
    """The tokenizer and the chunks to encode of ``paths`` (none: the embedded corpus); a sentencepiece
    tokenizer without a model is first trained on the corpus, into ``model_path``."""
    from megatron_ext.data.corpus import embedded_documents

    if tok.type == "sentencepiece" and tok.model_path is None:
        documents = list(read_documents(paths)) if paths else embedded_documents()
        trained = train_sentencepiece(documents, tok.vocab_size, model_path)
        return TokenizerParams("sentencepiece", str(trained), tok.vocab_size), chunks_from_documents(documents)
    return tok, chunks_from_files(paths) if paths else chunks_from_documents(embedded_documents())


def _prepare_into(data: DataParams, out_dir: Path, workers: int) -> PreparedData:
    name = _corpus_name(data)
    paths = list(data.paths) if data.source == "files" else []
    tok, chunks = tokenizer_and_chunks(data.tokenizer, paths, out_dir / f"{name}.model")
    total = input_bytes(paths) if paths else None
    prefix = write_indexed_dataset(chunks, tok, out_dir / name, workers, PrepareProgress(total_bytes=total))
    tokenizer = load_tokenizer(tok)
    return PreparedData(prefixes=(str(prefix),), weights=(1.0,), tokenizer_type=tok.type, tokenizer_path=tok.model_path,
                        vocab_size=tokenizer.vocab_size, eod=tokenizer.eod)


def _ready_made(data: DataParams) -> PreparedData | None:
    """Data that needs no preparation (mock, or indexed prefixes), else None."""
    if data.source == "mock":
        tokenizer = load_tokenizer(data.tokenizer)
        return PreparedData(prefixes=(), weights=(), tokenizer_type="null", tokenizer_path=None,
                            vocab_size=tokenizer.vocab_size, eod=tokenizer.eod)
    check_data_paths(data)
    if data.source == "files":
        if all(_is_indexed_prefix(p) for p in data.paths):
            tokenizer = load_tokenizer(data.tokenizer)
            weights = data.weights or tuple(1.0 for _ in data.paths)
            return PreparedData(
                prefixes=tuple(data.paths), weights=weights, tokenizer_type=data.tokenizer.type, tokenizer_path=data.tokenizer.model_path,
                vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
            )
    return None


def check_data_paths(data: DataParams) -> None:
    """A UserError for a data path that does not exist (neither a file nor an indexed prefix) or
    blend weights over files not prepared yet; reads only the paths given."""
    if data.source != "files":
        return
    missing = [p for p in data.paths if not (_is_indexed_prefix(p) or Path(p).is_file())]
    if missing:
        raise UserError(
            f"data path {missing[0]} does not exist (neither a file nor an indexed-dataset "
            f"prefix with .bin/.idx); fix data.paths or run python -m megatron_ext.data.prepare"
        )
    if data.weights and len(data.paths) > 1 and not all(_is_indexed_prefix(p) for p in data.paths):
        raise UserError("blend weights need prepared .bin/.idx prefixes; prepare each file first")


def is_prepared(data: DataParams, cache_root: Path) -> bool:
    """Whether ``data`` needs no preparation: ready-made prefixes, or :func:`ensure_prepared` ran."""
    return _ready_made(data) is not None or (_cache_dir(data, cache_root) / MANIFEST).is_file()


def planned_prepared(data: DataParams, cache_root: Path) -> PreparedData:
    """Where :func:`ensure_prepared` puts (or has put) ``data``, without preparing anything."""
    ready = _ready_made(data)
    if ready is not None:
        return ready
    out_dir = _cache_dir(data, cache_root)
    if (out_dir / MANIFEST).is_file():
        return _read_manifest(out_dir / MANIFEST)
    name, tok = _corpus_name(data), data.tokenizer
    model = tok.model_path or (str(out_dir / f"{name}.model") if tok.type == "sentencepiece" else None)
    return PreparedData(prefixes=(str(out_dir / f"{name}{DOCUMENT_SUFFIX}"),), weights=(1.0,), tokenizer_type=tok.type,
                        tokenizer_path=model, vocab_size=tok.vocab_size, eod=-1)


def _write_manifest(prepared: PreparedData, directory: Path) -> None:
    """``prepared.json`` with paths inside ``directory`` stored relative to it, so the directory
    can be renamed into place (and the cache moved) without rewriting it."""
    def rel(path: str | None) -> str | None:
        return os.path.relpath(path, directory) if path and Path(path).is_relative_to(directory) else path

    raw = dict(prepared.__dict__, prefixes=[rel(p) for p in prepared.prefixes], tokenizer_path=rel(prepared.tokenizer_path))
    (directory / MANIFEST).write_text(json.dumps(raw, indent=1))


def _read_manifest(path: Path) -> PreparedData:
    raw = json.loads(path.read_text())

    def resolve(p: str | None) -> str | None:
        return str(path.parent / p) if p and not os.path.isabs(p) else p

    raw["prefixes"] = [resolve(p) for p in raw["prefixes"]]
    raw["tokenizer_path"] = resolve(raw["tokenizer_path"])
    return structure(PreparedData, raw)


def ensure_prepared(data: DataParams, cache_root: Path, workers: int = 2,
                    visible_s: float = SHARED_FS_LAG_S) -> PreparedData:
    """Indexed datasets for ``data``, prepared once into ``cache_root`` with no lock: into a folder
    no other preparer names (host, pid, a random token), then renamed into place. When the rename
    finds the finished cache there (another start prepared it meanwhile: ENOTEMPTY or EEXIST by
    POSIX, EPERM on sshfs) this preparer's own copy is discarded and the one in place is used,
    waiting up to ``visible_s`` for its manifest to show through a shared file system."""
    ready = _ready_made(data)
    if ready is not None:
        return ready
    out_dir = _cache_dir(data, cache_root)
    manifest = out_dir / MANIFEST
    if manifest.is_file():
        return _read_manifest(manifest)
    cache_root.mkdir(parents=True, exist_ok=True)
    own = cache_root / f".{out_dir.name}.preparing-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        _write_manifest(_prepare_into(data, own, workers), own)
        try:
            os.rename(own, out_dir)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EPERM):
                raise
            logger.info("%s was prepared by another start meanwhile: using it, discarding this one's copy", out_dir)
            wait_for_files([manifest], visible_s, f"the data cache another start prepared ({out_dir} is there)")
    finally:
        shutil.rmtree(own, ignore_errors=True)
    return _read_manifest(manifest)


def prepared_files(prepared: PreparedData) -> list[Path]:
    """What a rank reads of ``prepared``: each prefix's ``.bin`` and ``.idx``, and the tokenizer's
    model (a file, or a Hugging Face tokenizer's directory)."""
    files = [Path(f"{prefix}{suffix}") for prefix in prepared.prefixes for suffix in (".bin", ".idx")]
    return files + ([Path(prepared.tokenizer_path)] if prepared.tokenizer_path else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="*", default=[], help="JSONL (text field) or text files; none = embedded corpus")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>_text_document.{bin,idx}")
    parser.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface"], default="sentencepiece")
    parser.add_argument("--tokenizer-model", help="sentencepiece .model, or a Hugging Face tokenizer directory or its tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=4096, help="train a sentencepiece model of this size (no --tokenizer-model)")
    parser.add_argument("--progress-interval-s", type=float, default=default_progress_interval_s(),
                        help="seconds between progress lines (default 2 on a terminal, 30 otherwise)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)), help="encoding processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.tokenizer_model is None and args.tokenizer_type != "sentencepiece":
            raise UserError("--tokenizer-type huggingface needs --tokenizer-model (a tokenizer directory or its tokenizer.json)")
        tok, chunks = tokenizer_and_chunks(TokenizerParams(args.tokenizer_type, args.tokenizer_model, args.vocab_size),
                                           args.input, Path(f"{args.output_prefix}.model"))
        if args.tokenizer_model is None:
            print(f"trained tokenizer {tok.model_path}")
        progress = PrepareProgress(total_bytes=input_bytes(args.input), interval_s=args.progress_interval_s)
        prefix = write_indexed_dataset(chunks, tok, Path(args.output_prefix), args.workers, progress)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
