"""Data preparation speed: this project's prepare_data against Megatron-LM's tools/preprocess_data.py.

    python benchmarks/prepare_data.py --megatron-lm-dir /opt/Megatron-LM --size-mb 100 --workers 2
    python benchmarks/prepare_data.py --input corpus.jsonl --tokenizer-model sp.model

Both tools encode the same JSONL (``text`` field) with the same sentencepiece model and the same
number of worker processes, one after the other in this invocation; the table gives wall time,
tokens/s and the ratio, and whether the two outputs are byte-identical. Without
``--megatron-lm-dir`` only this project's tool runs (and the table says so). Without ``--input``
a corpus of ``--size-mb`` is made from this Python's installed ``.py`` files (one file, one
document), in a fixed order. The default tokenizer is tests/data/prepare/sp512.model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_corpus(path: Path, size_mb: float) -> Path:
    """JSONL of installed Python sources, sorted, until ``size_mb`` megabytes."""
    target = int(size_mb * 1e6)
    written = 0
    roots = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], sysconfig.get_paths()["stdlib"]})
    with path.open("w") as out:
        for root in roots:
            for dirpath, dirnames, filenames in sorted(os.walk(root)):
                dirnames.sort()
                for name in sorted(filenames):
                    if not name.endswith(".py"):
                        continue
                    try:
                        text = (Path(dirpath) / name).read_text(encoding="utf-8")
                    except (UnicodeDecodeError, OSError):
                        continue
                    line = json.dumps({"text": text}) + "\n"
                    out.write(line)
                    written += len(line)
                    if written >= target:
                        return path
    return path


def timed(cmd: list[str], env: dict, cwd: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def tokens_in(prefix: str) -> tuple[int, int]:
    sys.path.insert(0, str(REPO))
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return int(ds.sequence_lengths.sum()), len(ds)


def digest(prefix: str) -> str:
    return "".join(hashlib.sha256(Path(f"{prefix}.{s}").read_bytes()).hexdigest()[:16] for s in ("bin", "idx"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", type=Path, help="a JSONL corpus (default: made from installed .py files)")
    p.add_argument("--size-mb", type=float, default=100.0)
    p.add_argument("--tokenizer-model", type=Path, default=REPO / "tests" / "data" / "prepare" / "sp512.model")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--megatron-lm-dir", type=Path, help="a Megatron-LM checkout (tools/preprocess_data.py)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    corpus = args.input or make_corpus(work / "corpus.jsonl", args.size_mb)
    size_mb = corpus.stat().st_size / 1e6
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    ours = timed([sys.executable, "-m", "megatron_ext.data.prepare", "--input", str(corpus), "--tokenizer-model",
                  str(args.tokenizer_model), "--output-prefix", str(work / "ours"), "--workers", str(args.workers)], env, REPO)
    tokens, sequences = tokens_in(str(work / "ours_text_document"))
    rows = [("this project (megatron_ext.data.prepare)", ours, tokens, sequences, digest(str(work / "ours_text_document")))]
    if args.megatron_lm_dir:
        mlm_env = {**env, "PYTHONPATH": os.pathsep.join([str(args.megatron_lm_dir), env["PYTHONPATH"]])}
        theirs = timed([sys.executable, str(args.megatron_lm_dir / "tools" / "preprocess_data.py"), "--input", str(corpus),
                        "--output-prefix", str(work / "mlm"), "--tokenizer-type", "SentencePieceTokenizer",
                        "--tokenizer-model", str(args.tokenizer_model), "--append-eod", "--workers", str(args.workers)],
                       mlm_env, args.megatron_lm_dir)
        t2, s2 = tokens_in(str(work / "mlm_text_document"))
        rows.append((f"Megatron-LM tools/preprocess_data.py ({args.megatron_lm_dir.name})", theirs, t2, s2,
                     digest(str(work / "mlm_text_document"))))
    print(f"{corpus} ({size_mb:.1f} MB), tokenizer {args.tokenizer_model.name}, {args.workers} workers, one run each")
    print(f"{'tool':<58} {'seconds':>8} {'tokens':>12} {'sequences':>10} {'tokens/s':>12} {'x Megatron':>10}")
    base = rows[-1][2] / rows[-1][1] if len(rows) > 1 else None
    for name, seconds, tok, seqs, _ in rows:
        ratio = f"{tok / seconds / base:.2f}" if base else "-"
        print(f"{name:<58} {seconds:>8.2f} {tok:>12,} {seqs:>10,} {tok / seconds:>12,.0f} {ratio:>10}")
    if len(rows) > 1:
        print("outputs byte-identical:", "yes" if rows[0][4] == rows[1][4] else "NO")
    else:
        print("no --megatron-lm-dir given: Megatron-LM's tool was not run, so there is no ratio")


if __name__ == "__main__":
    main()
