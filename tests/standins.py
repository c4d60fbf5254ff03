"""Inputs several test modules make up (a test module imports none of another's:
tests/test_structure.py): a Megatron-LM checkout stand-in with the flags a render gives, the
secrets a run is given and a scan of every command line for them, the Megatron-LM loop's data set."""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import threading
import time
from pathlib import Path

from megatron_ext.data.prepare import planned_prepared
from megatron_ext.run_spec.params import RunOverrides, load_run_params, with_batch_geometry
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.megatron_lm.flags import split_flags
from orchestration.megatron_lm.render import NodeKernels, render_pretrain_gpt


def lm_params(model="gpt_smoke", data="smoke", stage=0, world=2, **training):
    """A preset pair's params for ENGINE=megatron-lm at ``stage`` on ``world`` ranks, with ``training`` fields replaced."""
    params = with_batch_geometry(load_run_params(model, data, RunOverrides(stage, "megatron-lm")), world)[0]
    return dataclasses.replace(params, training=dataclasses.replace(params.training, **training)) if training else params


def render(model="gpt_smoke", data="smoke", stage=0, version=(0, 16), tmp=Path("/tmp/artifacts"), run="r", params=None, **kw):
    """``render_pretrain_gpt`` of ``params`` (else ``lm_params(model, data, stage)``); ``kw``: its own keywords."""
    params = params or lm_params(model, data, stage)
    paths = RunPaths(tmp, run)
    return render_pretrain_gpt(params, planned_prepared(params.data, paths.data_cache_dir), paths, version, **kw)


def write_checkout(root: Path, version: tuple[int, int, int], flags: list[str], extra: str = "") -> Path:
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = {version[0]}\nMINOR = {version[1]}\nPATCH = {version[2]}\nPRE_RELEASE = ''\n")
    lines = ["import argparse", "def _add(parser):", "    group = parser.add_argument_group('x')"]
    for flag in flags:
        choices = {"--normalization": "['LayerNorm', 'RMSNorm']", "--tokenizer-type": "['SentencePieceTokenizer', 'NullTokenizer']",
                   "--position-embedding-type": "['learned_absolute', 'rope']", "--lr-decay-style": "['constant', 'cosine']",
                   "--data-parallel-sharding-strategy": "['no_shard', 'optim', 'optim_grads', 'optim_grads_params']",
                   "--ckpt-format": "['torch', 'torch_dist', 'fsdp_dtensor']"}.get(flag)
        lines.append(f"    group.add_argument({flag!r}{', choices=' + choices if choices else ''})")
    (root / "megatron" / "training" / "arguments.py").write_text("\n".join(lines) + "\n" + extra)
    (root / "pretrain_gpt.py").write_text("# stand-in: never run here\n")
    return root


def all_rendered_flags(version=(0, 16)) -> list[str]:
    """Every flag a render may give (every stage, and the kernel flags of every kind of node)."""
    kinds = (NodeKernels(), NodeKernels(gpus=False), NodeKernels(transformer_engine=False, apex=False))
    return sorted({f for stage, kernels in itertools.product(range(4), kinds)
                   for f, _ in split_flags(render("qwen3_1p7b", "qwen3_1p7b_smoke", stage, version, kernels=kernels).args)})


STANDIN_PRETRAIN_GPT = '''\
"""Stand-in for Megatron-LM's pretrain_gpt.py: Megatron-LM's training needs CUDA (and main needs
Python >= 3.12), so it cannot run on these machines. This records what it was given and prints
iteration lines in Megatron-LM's exact format from the last rank, as Megatron-LM does."""
import json, os, sys, time
args = sys.argv[1:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"seen_rank{rank}.json")
json.dump({"argv": args, "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "LAUNCHER_RUN": os.environ.get("LAUNCHER_RUN")}, open(out, "w"))
iters = int(args[args.index("--train-iters") + 1]); gbs = int(args[args.index("--global-batch-size") + 1])
for it in range(1, iters + 1):
    time.sleep(0.2)
    if rank == world - 1:
        print(f"[2026-11-29 10:00:00] iteration {it:8d}/{iters:8d} | consumed samples: {it * gbs:12d} | "
              f"elapsed time per iteration (ms): {200.0:.1f} | throughput per GPU (TFLOP/s/GPU): {1.5:.1f} | "
              f"learning rate: {3e-4:.6E} | global batch size: {gbs:5d} | lm loss: {10.0 / it:.6E} | loss scale: {1.0:.1f} | "
              f"grad norm: {1.0:.3f} | number of skipped iterations: {0:3d} | number of nan iterations: {0:3d} |", flush=True)
'''


def secret_env() -> dict[str, str]:
    return {"WANDB_API_KEY": secrets.token_hex(20), "HF_TOKEN": "hf_" + secrets.token_hex(16),
            "MEGATRON_STORE_PASSWORD": secrets.token_hex(12)}


def scan_cmdlines(values: list[bytes], hits: list[str], stop: threading.Event) -> None:
    """Every process's command line, every 50 ms, until ``stop``: any that holds a value is a hit."""
    while not stop.is_set():
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                hits += [f"{entry.name}: {cmdline[:200]!r}" for v in values if v in cmdline]
        time.sleep(0.05)


def megatron_lm_data_set(path: Path, train_iters: int, save_interval: int = 0, log_interval: int = 1, resilience: str = "") -> str:
    path.write_text(
        "data:\n  source: embedded\n  split: \"95,5,0\"\n  tokenizer: {type: sentencepiece, vocab_size: 2048}\n"
        f"training:\n  seq_length: 128\n  micro_batch_size: 4\n  global_batch_size: 16\n  train_iters: {train_iters}\n"
        f"  lr: 3.0e-3\n  min_lr: 3.0e-4\n  lr_warmup_iters: 3\n  weight_decay: 0.01\n  eval_iters: 1\n"
        f"  log_interval: {log_interval}\n" + (f"  save_interval: {save_interval}\n" if save_interval else "")
        + (f"  resilience: {{{resilience}}}\n" if resilience else ""))
    return str(path)


PAD_BYTES = int(float(os.environ.get("CHECKPOINT_PAD_GB", "1")) * 1e9)
"""How large the resume tests make the checkpoint they resume from (:func:`pad_checkpoint`): 1 GB
in the suite; ``CHECKPOINT_PAD_GB=100`` by hand for a user's size (docs/testing.md, "At the
user's size")."""


def pad_checkpoint(folder: Path, total_bytes: int, writers: tuple[int, ...]) -> list[Path]:
    """A checkpoint made as large as a user's without the disk (issue 54): a sparse file per writer
    of ``writers``, ``__<w>_99.distcp`` (the writer's name, so whoever verifies that writer's files
    reads it; each engine's loader reads only the files its metadata names), ``total_bytes`` in all,
    each recorded with its true digest where the checkpoint records its files: this program's
    ``checksums/rank<w>.json`` (size and CRC-32), Megatron-LM's ``integrity.json`` (SHA-256). Every
    verification then reads it through, as it would a real one."""
    import json

    from megatron_ext.run_spec.checksums import INTEGRITY_FILE, crc32_of, record_path, sha256_of

    pads = []
    for writer in writers:
        pad = folder / f"__{writer}_99.distcp"
        with open(pad, "wb") as fh:
            fh.truncate(total_bytes // len(writers))
        pads.append(pad)
        record = record_path(folder, writer)
        if record.is_file():
            entries = json.loads(record.read_text())
            size, crc = crc32_of(pad)
            entries["files"][pad.name] = {"bytes": size, "crc32": crc}
            record.write_text(json.dumps(entries))
    manifest = folder / INTEGRITY_FILE
    if manifest.is_file():
        entries = json.loads(manifest.read_text())
        entries["files"].update({pad.name: sha256_of(pad) for pad in pads})
        manifest.write_text(json.dumps(entries, indent=2))
    return pads
