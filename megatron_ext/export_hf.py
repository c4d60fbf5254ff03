"""A run's checkpoint -> a Hugging Face model directory transformers, vLLM and lm-eval load.

    python -m megatron_ext.export_hf --artifact-root ART --run RUN --out OUT_DIR [--iteration N]

(``python -m orchestration export-hf RUN OUT_DIR`` / ``training_scripts/export_hf.sh`` run this.)
Reads the run's resolved parameters and one checkpoint (the latest, or ``--iteration``) of any
ZeRO stage and data-parallel size: torch.distributed.checkpoint reads the full tensors out of
every rank's shards in one process (``no_dist``), so nothing needs the run's world size. A run of
ENGINE=megatron-lm is read from Megatron-LM's own checkpoints (torch_dist or torch format:
megatron_ext/training/megatron_lm_weights.py). Writes
``config.json``, the weights as safetensors (sharded above 5 GB, with the index),
``generation_config.json`` and, when the run used a Hugging Face tokenizer, its files. The
weights keep the checkpoint's dtype (fp32 on CPU runs, bf16 on GPU runs); padded vocabulary rows
are dropped (megatron_ext/training/hf_weights.py). The directory is written beside OUT_DIR and
renamed into place: a failed export leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megatron_ext.data.tokenizers import HuggingFaceTokenizer, configured_token, hf_tokenizer_file
from megatron_ext.import_hooks import runs_no_model_code
from megatron_ext.run_spec.engines import Engine, engine_named
from megatron_ext.run_spec.checkpoints import iteration_dir_name, latest_iteration
from megatron_ext.run_spec.errors import EXIT_USER_ERROR, UserError
from megatron_ext.run_spec.flops import padded_vocab_size
from megatron_ext.run_spec.hf_config import hf_config_from_preset, hf_model_type
from megatron_ext.run_spec.params import RunParams
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.training.hf_weights import local_name, megatron_to_hf, write_hf_state_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
"""What save_pretrained writes for a tokenizer (those that exist are copied)."""


def checkpoint_to_export(paths: RunPaths, iteration: int | None) -> Path:
    where = paths.checkpoints_dir
    if iteration is None:
        iteration = latest_iteration(where)
        if iteration is None:
            raise UserError(f"run {paths.run} has no complete checkpoint under {where}; train with "
                            "training.save_interval > 0 (a checkpoint is also written at the end)")
    target = where / iteration_dir_name(iteration)
    if not (target / "meta.json").is_file():
        saved = sorted(p.name for p in where.glob("iter_*") if (p / "meta.json").is_file())
        raise UserError(f"run {paths.run} has no complete checkpoint of iteration {iteration} ({target}); "
                        f"saved: {', '.join(saved) or 'none'}")
    return target


def read_model_weights(checkpoint: Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint, by the names of ``template`` (a model's state dict):
    the checkpoint's ``model.`` entries, matched by name after any ``module.`` wrappers' prefixes
    (DDP, Float16Module on GPUs), transformer-engine's fused-norm names read as the local spec's,
    SwiGLU's fc1 halves joined (:data:`SWIGLU_HALVES`); megatron-core's torch_dist checkpoints
    (CUDA stages 0-1) through training/checkpoint.py, which reads both."""
    from megatron_ext.training.checkpoint import is_torch_dist, load_stored_tensors, read_torch_dist_model_weights, stored_tensors

    def not_this_model(exc: ValueError) -> UserError:  # a tensor the template names is missing
        return UserError(f"{exc}; it was not written by this run's model")

    if is_torch_dist(checkpoint):
        try:
            return read_torch_dist_model_weights(checkpoint, template)
        except ValueError as exc:
            raise not_this_model(exc) from None
    stored = stored_tensors(checkpoint)
    by_name: dict[str, tuple[str | None, ...]] = {}
    for key in (key for key in stored if key.startswith("model.")):
        name = key.removeprefix("model.")
        while name.startswith("module."):
            name = name.removeprefix("module.")
        half = SWIGLU_HALVES.get(name.rsplit("_", 1)[-1]) if name.endswith(("weight_w", "weight_v")) else None
        if half is None:
            by_name[local_name(name)] = (key,)
        else:  # Megatron-LM's fsdp_dtensor layout: SwiGLU's fc1 as its two halves, rows of w then v
            parts = list(by_name.get(local_name(name[:-2]), (None, None)))
            parts[half] = key
            by_name[local_name(name[:-2])] = tuple(parts)
    try:
        state = load_stored_tensors(checkpoint, stored, by_name, template)
    except ValueError as exc:
        raise not_this_model(exc) from None
    return {name: torch.cat([state[key] for key in by_name[name]]) if len(by_name[name]) > 1 else state[by_name[name][0]]
            for name in template}


SWIGLU_HALVES = {"w": 0, "v": 1}
"""``linear_fc1.weight_w`` / ``_v``: the halves Megatron-LM's fsdp_dtensor checkpoints (and this
project's CUDA stages 2-3) keep SwiGLU's fc1 as (megatron-core's ``handle_swiglu_in_state_dict``):
the first rows, then the rest."""


def tokenizer_ids(params: RunParams) -> tuple[int | None, int | None, Path | None]:
    """(eos, bos, tokenizer directory) of a run's Hugging Face tokenizer; (None, None, None) otherwise."""
    tok = params.data.tokenizer
    if tok.type != "huggingface":
        return None, None, None
    loaded = HuggingFaceTokenizer(tok.model_path)
    directory = hf_tokenizer_file(tok.model_path).parent
    bos_token = configured_token(directory, "bos_token")
    bos = loaded.token_id(bos_token) if bos_token else None
    return loaded.eod, bos, directory


@dataclass(frozen=True)
class RunModel:
    """What an export needs to know about a run's model."""

    params: RunParams
    vocab: int
    """The real vocabulary (the tokenizer's, or the preset's)."""
    padded: int
    """Rows of the embedding (the vocabulary padded as Megatron pads it)."""
    engine: Engine
    """The engine that ran it (its checkpoints' format)."""


def read_run_model(paths: RunPaths) -> RunModel:
    from megatron_ext.data.prepare import planned_prepared
    from megatron_ext.training.model import model_vocab_size

    resolved = read_resolved(paths.params_path)
    if resolved is None:
        raise UserError(f"no run {paths.run!r} under {paths.root} (no {paths.params_path}); give the run name a start "
                        "printed, or set ARTIFACT_ROOT to where it ran")
    params, m = resolved.params, resolved.params.model
    prepared = planned_prepared(params.data, paths.data_cache_dir)
    vocab = model_vocab_size(m, prepared.vocab_size if prepared.vocab_size > 0 else None)
    return RunModel(params, vocab, padded_vocab_size(vocab, m.make_vocab_size_divisible_by), engine_named(resolved.runtime.engine))


def model_template(run: RunModel, padded: int | None = None, device: str = "meta"):
    """The run's megatron-core GPTModel (local spec), on the meta device unless ``device``, uninitialised."""
    from megatron_ext.training.model import build_gpt_model

    with torch.device(device):
        return build_gpt_model(run.params.model, padded or run.padded, run.params.training.seq_length,
                               perform_initialization=False)


def tensors_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def megatron_lm_checkpoint_to_export(paths: RunPaths, iteration: int | None):
    """A Megatron-LM run's checkpoint (its --save is the run's checkpoints folder)."""
    from megatron_ext.run_spec.megatron_lm_checkpoints import find_megatron_lm_checkpoint

    where = paths.checkpoints_dir
    target = where if iteration is None else where / iteration_dir_name(iteration)
    if iteration is not None and not target.is_dir():
        saved = sorted(p.name for p in where.glob("iter_*"))
        raise UserError(f"run {paths.run} has no checkpoint of iteration {iteration} ({target}); saved: "
                        f"{', '.join(saved) or 'none'}")
    return find_megatron_lm_checkpoint(target, what=f"run {paths.run}'s checkpoint")


def read_run_weights(paths: RunPaths, run: RunModel, iteration: int | None) -> tuple[str, dict[str, torch.Tensor]]:
    """(the checkpoint's folder name, its model tensors by local-spec name) of either engine's run.
    A Megatron-LM checkpoint may hold more embedding rows than this program would pad to (Megatron-LM
    before the launcher rendered --padded-vocab-size: its tokenizer's special tokens): read as they are;
    the export keeps the real vocabulary."""
    if not run.engine.runs_checkout:
        checkpoint = checkpoint_to_export(paths, iteration)
        return checkpoint.name, read_model_weights(checkpoint, tensors_of(model_template(run)))
    from megatron_ext.training.megatron_lm_weights import read_megatron_lm_weights, stored_vocab_rows

    checkpoint = megatron_lm_checkpoint_to_export(paths, iteration)
    rows = stored_vocab_rows(checkpoint)
    template = model_template(run, rows if rows and rows >= run.vocab else None)
    return checkpoint.directory.name, read_megatron_lm_weights(checkpoint, template, run.params.model.name)


def check_out(out: Path, force: bool) -> None:
    """A non-empty ``out`` is refused unless ``force`` (checked before any weights are read)."""
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty; choose another directory or pass --force to replace it")


def write_atomically(out: Path, write: Callable[[Path], list[str]]) -> list[str]:
    """``write`` fills a folder beside ``out``, which is then renamed into place (replacing ``out``):
    a failed export leaves nothing half-written."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        written = write(tmp)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def export(paths: RunPaths, out: Path, iteration: int | None = None, force: bool = False) -> list[str]:
    run = read_run_model(paths)
    params, m, vocab = run.params, run.params.model, run.vocab
    kind = hf_model_type(m)
    check_out(out, force)
    name, weights = read_run_weights(paths, run, iteration)
    padded = weights["embedding.word_embeddings.weight"].shape[0]
    hf_state = megatron_to_hf(weights, m, kind, vocab)
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[next(iter(hf_state.values())).dtype]
    eos, bos, tokenizer_dir = tokenizer_ids(params)

    def write(tmp: Path) -> list[str]:
        written = write_hf_state_dict(hf_state, tmp)
        for file, content in (("config.json", hf_config_from_preset(m, vocab, dtype, eos, bos)),
                              ("generation_config.json", {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos})):
            (tmp / file).write_text(json.dumps(content, indent=2) + "\n")
            written.append(file)
        for file in TOKENIZER_FILES if tokenizer_dir else ():
            if (tokenizer_dir / file).is_file():
                shutil.copy2(tokenizer_dir / file, tmp / file)
                written.append(file)
        return written

    written = write_atomically(out, write)
    source = f"{name} of run {paths.run}" + (f" ({run.engine.tag}'s)" if run.engine.tag else "")
    return [f"exported {source} ({kind}, {dtype}, vocabulary {vocab}"
            + (f", {padded - vocab} padded rows dropped" if padded > vocab else "") + f") to {out}: "
            + ", ".join(written)]


def run_exporter(export_fn: Callable[..., list[str]], prog: str, doc: str, out_help: str, argv: list[str] | None) -> int:
    """The exporters' command line: ``--artifact-root --run --out [--iteration] [--force]``; a
    UserError is one line and exit code 2."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--artifact-root", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--out", required=True, help=out_help)
    parser.add_argument("--iteration", type=int, help="the checkpoint's iteration (default: the latest)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    args = parser.parse_args(argv)
    runs_no_model_code()  # an export builds the model to read weights into, never runs it
    try:
        from megatron_ext.training.model import ensure_model_parallel

        ensure_model_parallel()
        for line in export_fn(RunPaths(Path(args.artifact_root), args.run), Path(args.out).expanduser().resolve(),
                              args.iteration, args.force):
            print(line)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_exporter(export, "python -m megatron_ext.export_hf", __doc__, "the Hugging Face model directory to write", argv)


if __name__ == "__main__":
    sys.exit(main())
