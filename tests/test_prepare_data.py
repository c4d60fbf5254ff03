"""Data preparation: JSONL/text -> Megatron indexed dataset, read back by megatron-core."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron_ext.data.corpus import embedded_documents
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import DataParams, TokenizerParams
from megatron_ext.data.prepare import ensure_prepared
from megatron_ext.data.tokenizers import SentencePieceTokenizer

from conftest import REPO, TEST_DATA


def test_embedded_corpus_is_half_a_megabyte_of_stdlib_docstrings():
    docs = embedded_documents()
    size = sum(map(len, docs))
    assert 400_000 <= size <= 700_000
    assert docs == embedded_documents()  # deterministic order


def test_prepare_cli_from_jsonl_and_text(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    jsonl = tmp_path / "a.jsonl"
    docs = [f"Document number {i} talks about tokens, batches and shards." * 3 for i in range(60)]
    jsonl.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    text = tmp_path / "b.txt"
    text.write_text("A plain text file is one document.\n" * 20)
    prefix = tmp_path / "out" / "corpus"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.data.prepare", "--input", str(jsonl), str(text),
         "--output-prefix", str(prefix), "--vocab-size", "300", "--workers", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(f"{prefix}_text_document")
    assert len(ds) == 61
    tok = SentencePieceTokenizer(f"{prefix}.model")
    first = ds[0]
    assert first[-1] == tok.eod  # every document ends with end-of-document
    assert list(first[:-1]) == tok.tokenize(docs[0])
    assert isinstance(first, np.ndarray)


def test_same_bytes_as_megatron_lm_preprocess_data(tmp_path):
    """tests/data/prepare/small.jsonl (empty and whitespace-only documents among them) with a
    fixed sentencepiece model: the .bin/.idx Megatron-LM core_v0.16.1's tools/preprocess_data.py
    --append-eod wrote (checksums, lengths and document index recorded by hand, see README): an
    empty document adds no sequence and no end-of-document, only a document boundary."""
    import hashlib

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = TEST_DATA / "prepare"
    expected = json.loads((data / "small_expected.json").read_text())
    prefix = tmp_path / "ours"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.data.prepare", "--input", str(data / "small.jsonl"),
         "--tokenizer-model", str(data / "sp512.model"), "--output-prefix", str(prefix), "--workers", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(f"{prefix}_text_document")
    assert list(ds.sequence_lengths) == expected["sequence_lengths"]
    assert list(ds.document_indices) == expected["document_indices"]
    for suffix in ("bin", "idx"):
        digest = hashlib.sha256(open(f"{prefix}_text_document.{suffix}", "rb").read()).hexdigest()
        assert digest == expected[f"{suffix}_sha256"], suffix


def test_bad_jsonl_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.data.prepare", "--input", str(bad), "--output-prefix", str(tmp_path / "x")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "bad.jsonl:2 is not a JSON object with a 'text' field" in proc.stderr


def test_missing_data_path_is_a_params_error(tmp_path):
    data = DataParams(source="files", paths=(str(tmp_path / "nope.jsonl"),))
    with pytest.raises(UserError, match="nope.jsonl does not exist"):
        ensure_prepared(data, tmp_path)


def test_ensure_prepared_caches_once(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7} jumps over the lazy dog {i % 13}\n" for i in range(400)))
    data = DataParams(source="files", paths=(str(corpus),), tokenizer=TokenizerParams(vocab_size=320))
    first = ensure_prepared(data, tmp_path / "cache", workers=1)
    mtime = (tmp_path / "cache").stat().st_mtime_ns
    second = ensure_prepared(data, tmp_path / "cache", workers=1)
    assert first == second
    assert first.vocab_size == 320
    assert len(list((tmp_path / "cache").glob("files-*"))) == 1
    assert (tmp_path / "cache").stat().st_mtime_ns == mtime


def test_the_other_ranks_take_rank_0_s_manifest_and_wait_for_its_files(tmp_path):
    """training/agreement.py over a real store (a HashStore, as the process group's TCPStore
    answers): rank 0 prepares and announces; another rank, waiting before the announcement (it
    says so), takes rank 0's manifest whatever cache folder it would have named; files that never
    show are one error naming the path; a UserError of rank 0's reaches the others."""
    import threading

    import torch.distributed as dist

    from megatron_ext.run_spec.shared_fs import NotVisibleHere
    from megatron_ext.training.agreement import DATA_KEY, agree_on_data

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7} jumps over the lazy dog {i % 13}\n" for i in range(400)))
    data = DataParams(source="files", paths=(str(corpus),), tokenizer=TokenizerParams(vocab_size=320))
    store, said, got = dist.HashStore(), [], []
    waiting = threading.Thread(target=lambda: got.append(agree_on_data(data, tmp_path / "elsewhere", 1, say=said.append,
                                                                       store=store, wait_s=0.2)))
    waiting.start()
    prepared = agree_on_data(data, tmp_path / "cache", 0, workers=1, store=store)
    waiting.join(timeout=30)
    assert got == [prepared] and prepared.prefixes[0].startswith(str(tmp_path / "cache"))
    assert said[0] == f"waiting for rank 0 to prepare the data cache under {tmp_path / 'elsewhere'}", said
    assert not (tmp_path / "elsewhere").exists()

    gone = dict(json.loads(store.get(DATA_KEY))["prepared"], prefixes=[str(tmp_path / "gone" / "corpus_text_document")])
    stale = dist.HashStore()
    stale.set(DATA_KEY, json.dumps({"prepared": gone}))
    with pytest.raises(NotVisibleHere, match=r"gone/corpus_text_document.bin \(the data cache rank 0 prepared\) does not "
                                             r"show on .* ARTIFACT_ROOT is one shared file system"):
        agree_on_data(data, tmp_path / "cache", 1, store=stale, visible_s=0.3)
    refused = dist.HashStore()
    with pytest.raises(UserError, match="does not exist"):
        agree_on_data(DataParams(source="files", paths=(str(tmp_path / "nope.jsonl"),)), tmp_path / "cache", 0, store=refused)
    with pytest.raises(UserError, match="nope.jsonl does not exist"):
        agree_on_data(data, tmp_path / "cache", 1, store=refused)


def test_too_small_vocabulary_is_a_params_error(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("tiny corpus\n" * 10)
    data = DataParams(source="files", paths=(str(corpus),), tokenizer=TokenizerParams(vocab_size=50))
    with pytest.raises(UserError, match="cannot train vocab_size=50"):
        ensure_prepared(data, tmp_path / "cache", workers=1)


def test_huggingface_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")  # the optional `hf` extra (setup_env.sh installs it)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    docs = [f"Sample {i}: sharded optimizer states save memory." for i in range(50)]
    tok.train_from_iterator(docs, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    data = DataParams(source="files", paths=(str(corpus),), tokenizer=TokenizerParams(type="huggingface", model_path=str(path)))
    prepared = ensure_prepared(data, tmp_path / "cache", workers=2)
    assert prepared.eod == tok.token_to_id("<|endoftext|>") and prepared.vocab_size == tok.get_vocab_size()
    ds = IndexedDataset(prepared.prefixes[0])
    assert len(ds) == 50 and list(ds[3][:-1]) == tok.encode(docs[3], add_special_tokens=False).ids and ds[3][-1] == prepared.eod


def test_huggingface_tokenizer_directory_same_bytes_as_megatron_lm(tmp_path):
    """A Qwen-style tokenizer directory (tests/data/hf_tokenizer/qwen_style): the .bin/.idx equal
    what Megatron-LM core_v0.16.1's tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
    --append-eod wrote on the same directory (checksums recorded by hand, see README)."""
    import hashlib

    pytest.importorskip("tokenizers")
    expected = json.loads((TEST_DATA / "prepare" / "hf_qwen_style_expected.json").read_text())
    prefix = tmp_path / "ours"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.data.prepare", "--input", str(TEST_DATA / "prepare" / "small.jsonl"),
         "--tokenizer-type", "huggingface", "--tokenizer-model", str(TEST_DATA / "hf_tokenizer" / "qwen_style"),
         "--output-prefix", str(prefix), "--workers", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for suffix in ("bin", "idx"):
        digest = hashlib.sha256(open(f"{prefix}_text_document.{suffix}", "rb").read()).hexdigest()
        assert digest == expected[f"{suffix}_sha256"], suffix


def test_preparation_reports_progress(tmp_path):
    """Documents, MB, tokens, rates, and the ETA when the input size is known (every chunk here:
    --progress-interval-s 0)."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.data.prepare", "--input", str(TEST_DATA / "prepare" / "small.jsonl"),
         "--tokenizer-model", str(TEST_DATA / "prepare" / "sp512.model"), "--output-prefix", str(tmp_path / "p"),
         "--workers", "1", "--progress-interval-s", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"preparing: \d+ documents, [\d.]+ MB read, [\d,]+ tokens in .* MB/s, .*% of [\d.]+ MB, ETA \d+ s",
                     proc.stderr), proc.stderr
    assert re.search(r"prepared \d+ documents, .* docs/s", proc.stderr), proc.stderr


def test_huggingface_end_of_document_from_the_tokenizer_config(tmp_path):
    """eos_token from the directory's config first (special_tokens_map.json over
    tokenizer_config.json, as transformers reads them), then the known names; the directory and
    its tokenizer.json are the same tokenizer; a broken file is one UserError."""
    from megatron_ext.data.tokenizers import HuggingFaceTokenizer

    pytest.importorskip("tokenizers")
    tok = tmp_path / "llama3_style"
    shutil.copytree(TEST_DATA / "hf_tokenizer" / "qwen_style", tok)
    raw = json.loads((tok / "tokenizer.json").read_text())
    raw["added_tokens"].append({**raw["added_tokens"][0], "id": 403, "content": "<|end_of_text|>"})
    (tok / "tokenizer.json").write_text(json.dumps(raw))
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|end_of_text|>"}))
    assert HuggingFaceTokenizer(tok).eod == 403 == HuggingFaceTokenizer(tok / "tokenizer.json").eod
    (tok / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert HuggingFaceTokenizer(tok).eod == 402
    (tok / "special_tokens_map.json").unlink()
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    assert HuggingFaceTokenizer(tok).eod == 400  # <|endoftext|>, the first known name
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|missing|>"}))
    with pytest.raises(UserError, match=r"eos_token '<\|missing\|>' \(tokenizer config\) is not in the vocabulary"):
        HuggingFaceTokenizer(tok)
    (tok / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(UserError, match=r"tokenizer.json does not load as a Hugging Face tokenizer \(.*line 1"):
        HuggingFaceTokenizer(tok)
    with pytest.raises(UserError, match=r"holds no tokenizer.json"):
        HuggingFaceTokenizer(tmp_path)


def test_blend_of_two_prepared_datasets_with_weights_and_split(tmp_path):
    """Two indexed datasets, blend weights 0.25/0.75, a train/valid split: megatron-core builds a
    BlendedDataset drawing from both, as Megatron-LM's --data-path 0.25 A 0.75 B would."""
    from pathlib import Path

    from megatron.core.datasets.blended_dataset import BlendedDataset

    from megatron_ext.training.datasets import build_datasets
    from megatron_ext.data.prepare import chunks_from_documents, write_indexed_dataset

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("".join(f"alpha document {i} speaks of optimizers and shards\n" for i in range(300)))
    b.write_text("".join(f"beta document {i} speaks of gradients and buckets\n" for i in range(300)))
    first = ensure_prepared(DataParams(source="files", paths=(str(a),), tokenizer=TokenizerParams(vocab_size=320)), tmp_path / "cache",
                            workers=1)
    shared = TokenizerParams("sentencepiece", first.tokenizer_path, 320)
    docs_b = [line for line in b.read_text().splitlines()]
    prefix_b = write_indexed_dataset(chunks_from_documents(docs_b), shared, tmp_path / "b", workers=1)
    # Split "a" into documents too, so both have many documents to split train/valid.
    prefix_a = write_indexed_dataset(chunks_from_documents(a.read_text().splitlines()), shared, tmp_path / "a", workers=1)
    data = DataParams(source="files", paths=(str(prefix_a), str(prefix_b)), weights=(0.25, 0.75), split="90,10,0", tokenizer=shared)
    prepared = ensure_prepared(data, tmp_path / "cache")
    assert prepared.prefixes == (str(prefix_a), str(prefix_b)) and prepared.weights == (0.25, 0.75)
    from megatron_ext.training.model import ensure_model_parallel

    ensure_model_parallel()  # the builder asks for the rank (a one-process gloo group here)
    train, valid = build_datasets(prepared, data, seq_length=32, seed=1, num_train_samples=200, num_valid_samples=20,
                                  cache_dir=tmp_path / "index")
    assert isinstance(train, BlendedDataset) and len(train) >= 200 and len(valid) >= 20
    drawn = [int(train.dataset_index[i]) for i in range(200)]
    assert 0.15 < drawn.count(0) / 200 < 0.35  # about a quarter from the first dataset
    assert Path(f"{prefix_b}.idx").is_file()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_index_writer_matches_megatron_core_builder(tmp_path, dtype):
    """The .bin/.idx this project writes without megatron-core equal megatron-core's own builder's."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_ext.data.indexed_format import write_index

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=n) for n in (5, 0, 17, 1, 0, 0, 300)]
    builder = IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=dtype)
    for ids in docs:
        builder.add_document(torch.from_numpy(ids), [len(ids)] if len(ids) else [])
    builder.finalize(str(tmp_path / "mc.idx"))
    lengths = [len(ids) for ids in docs if len(ids)]
    indices = [0]
    for ids in docs:
        indices.append(indices[-1] + (1 if len(ids) else 0))
    (tmp_path / "ours.bin").write_bytes(b"".join(ids.astype(dtype).tobytes() for ids in docs))
    write_index(tmp_path / "ours.idx", dtype, lengths, indices)
    for suffix in ("bin", "idx"):
        assert (tmp_path / f"ours.{suffix}").read_bytes() == (tmp_path / f"mc.{suffix}").read_bytes(), suffix
