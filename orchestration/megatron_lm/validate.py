"""Megatron-LM's own ``parse_args`` + ``validate_args`` on a rendered ``pretrain_gpt.py`` argv, before launch.

    python -m orchestration.megatron_lm.validate /opt/Megatron-LM 32 9 -- --num-layers 28 ...

:func:`validate_with_megatron` runs this module in a subprocess with the launcher's interpreter
(node 0's: wherever ``pretrain_gpt.py`` will run, it imports), the checkout first on
``sys.path``, ``WORLD_SIZE`` = nodes x processes, ``RANK=0`` and the environment the ranks will
get (``-- -``: several, a JSON list of ``{"argv", "env"}`` on standard input, each checked under its
own environment: a sweep's stages, one import of Megatron-LM). One JSON line per list: accepted,
refused (Megatron's own message), tokenizer (the run's tokenizer does not build as the ranks would
build it), or unavailable (the checkout does not import here, e.g. a login node without torch) —
then the launcher falls back to the source reader (:mod:`orchestration.megatron_lm.checkout`).

Without a GPU, ``validate_args`` cannot ask the device for its compute capability (it does for
Megatron-FSDP and tensor/context parallelism); the child then answers for a Hopper GPU
(capability 9, the H100/H200 this launcher targets; ``MEGATRON_DEVICE_ARCH``, read by the launcher,
overrides) and says so. The child imports Megatron-LM (and torch) inside :func:`_check` only, after
putting the checkout first on ``sys.path``: what it imports is the checkout's. Side effects: one
subprocess.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from megatron_ext.import_hooks import runs_no_model_code

VALIDATION_TIMEOUT_S = 120.0
NO_TOKENIZER = "--no-tokenizer"
"""The child's option: check the arguments only (the tokenizer file is made later, by the data preparation)."""
FROM_STDIN = "-"
DEFAULT_DEVICE_ARCH = 9
"""Compute capability assumed when node 0 has no GPU (Hopper: H100, H200)."""


@dataclass(frozen=True)
class Validation:
    status: str
    """accepted, refused, tokenizer (it does not build as the ranks would) or unavailable."""
    message: str
    """Megatron's own message (refused), why it could not run (unavailable), or notes (accepted)."""


def validate_with_megatron(checkout: Path, checks: Sequence[tuple[Sequence[str], Mapping[str, str]]], world_size: int,
                           device_arch: int = DEFAULT_DEVICE_ARCH, python: str = sys.executable,
                           timeout_s: float = VALIDATION_TIMEOUT_S, build_tokenizer: bool = True) -> tuple[Validation, ...]:
    """Run Megatron-LM's parse_args + validate_args on each (argv, the ranks' environment) of
    ``checks`` in one child process (``device_arch``: the compute capability assumed when the child
    sees no GPU); then build the tokenizer as the ranks will, unless ``build_tokenizer`` is False
    (its file does not exist yet). One verdict per check, in order."""
    ranks = {"WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    cmd = [python, "-m", "orchestration.megatron_lm.validate", str(checkout), str(world_size), str(device_arch),
           *([] if build_tokenizer else [NO_TOKENIZER]), "--", FROM_STDIN]
    given = [{"argv": list(argv), "env": {**env, **ranks}} for argv, env in checks]
    limit = timeout_s * max(1, len(given))
    try:
        proc = subprocess.run(cmd, env=given[0]["env"] if given else ranks, cwd=str(Path(__file__).resolve().parents[2]),
                              capture_output=True, text=True, timeout=limit, input=json.dumps(given))
    except subprocess.TimeoutExpired:
        return (Validation("unavailable", f"Megatron-LM's argument check did not finish within {limit:.0f}s"),) * len(checks)
    verdicts = []
    for line in proc.stdout.splitlines():
        try:
            raw = json.loads(line) if line.startswith('{"status": ') else None
            verdicts += [Validation(raw["status"], raw["message"])] if raw else []
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    missing = Validation("unavailable", f"the check exited with code {proc.returncode}: {tail[-300:]}")
    return tuple(verdicts[:len(checks)]) + (missing,) * (len(checks) - len(verdicts))  # those it answered kept


# -- the child --------------------------------------------------------------------------------

def _answer(status: str, message: str, times: int = 1) -> int:
    for _ in range(times):
        print(json.dumps({"status": status, "message": message}), file=sys.__stdout__, flush=True)
    return 0


def _check(checkout: str, _world_size: int, device_arch: int, checks: list[dict], build_tokenizer: bool = True) -> int:
    """One answer per check ({"argv", "env" or none: this process's}), Megatron-LM imported once."""
    def parser_error(self, message):  # argparse would print usage and exit; keep its message
        raise ValueError(f"{self.prog}: error: {message}")

    argparse.ArgumentParser.error = parser_error
    warnings.simplefilter("ignore")
    runs_no_model_code()  # ~2.5 s of this child here
    sys.path.insert(0, checkout)
    notes = []
    with contextlib.redirect_stdout(sys.stderr):  # validate_args prints every argument
        try:
            import megatron
            from megatron.training import arguments
        except Exception as exc:  # ImportError, or a broken install raising anything else
            return _answer("unavailable", f"cannot import megatron.training.arguments from {checkout} "
                                          f"({type(exc).__name__}: {exc})", len(checks))
        if not (hasattr(arguments, "parse_args") and hasattr(arguments, "validate_args")):
            return _answer("unavailable", f"{checkout}'s megatron.training.arguments has no parse_args / validate_args", len(checks))
        where = os.path.abspath(list(megatron.__path__)[0])
        if not where.startswith(os.path.abspath(checkout) + os.sep):
            return _answer("unavailable", f"megatron imports from {where}, not from the checkout {checkout}", len(checks))
        try:
            import torch

            has_gpu = torch.cuda.is_available()
        except Exception:
            has_gpu = False
        if not has_gpu and hasattr(arguments, "get_device_arch_version"):
            arguments.get_device_arch_version = lambda: device_arch
            notes.append(f"no GPU here: checked as for compute capability {device_arch}")
        for check in checks:
            if "env" in check:  # what validate_args reads of it (CUDA_DEVICE_MAX_CONNECTIONS, ...) is the ranks'
                os.environ.clear()
                os.environ.update(check["env"])
            _answer(*_check_one(arguments, checkout, check["argv"], list(notes), build_tokenizer))
    return 0


def _check_one(arguments, checkout: str, argv: list[str], notes: list[str], build_tokenizer: bool) -> tuple[str, str]:
    """(status, message) of one argument list, with ``arguments`` (megatron.training.arguments) imported."""
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        args = arguments.parse_args()
        arguments.validate_args(args, {})
        per_step = args.micro_batch_size * args.data_parallel_size
        if args.global_batch_size % per_step:  # what initialize_megatron's microbatch calculator asserts next
            raise AssertionError(
                f"global batch size ({args.global_batch_size}) is not divisible by micro batch size "
                f"({args.micro_batch_size}) times data parallel size ({args.data_parallel_size})")
    except SystemExit as exc:
        return "refused", f"Megatron-LM exited with code {exc.code} while checking the arguments"
    except Exception as exc:  # AssertionError / ValueError / RuntimeError raised by Megatron
        return "refused", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if build_tokenizer:
        try:
            notes += _build_tokenizers(checkout, args)
        except Exception as exc:  # whatever the tokenizer library raises (OSError, ValueError, ...)
            return "tokenizer", f"{type(exc).__name__}: {str(exc)[:600]}"
    return "accepted", "; ".join(notes)


def _build_tokenizers(checkout: str, args) -> list[str]:
    """Build the tokenizer as the ranks will: ``initialize_megatron`` builds it through
    ``megatron.training.global_vars._build_tokenizer`` (the legacy ``build_tokenizer`` up to
    core_v0.16, megatron.core.tokenizers in 0.19), then pretrain_gpt.py builds its own with the
    ``build_tokenizer`` it imports (megatron.core.tokenizers; core_v0.15-0.16 unless
    --legacy-tokenizer). A failure raises what Megatron-LM would raise on every rank."""
    try:
        from megatron.training import global_vars
    except ImportError as exc:
        return [f"the tokenizer was not built here (no megatron.training.global_vars: {exc})"]
    if hasattr(global_vars, "unset_global_variables"):  # the previous argument list's (Megatron-LM's own reset
        global_vars.unset_global_variables()  # "for multiple runs", core_v0.16.1 and core_v0.19.0 alike)
    global_vars._build_tokenizer(args)
    source = Path(checkout, "pretrain_gpt.py")
    tree = ast.parse(source.read_text()) if source.is_file() else ast.Module(body=[], type_ignores=[])
    module = next((n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                   and any(a.name == "build_tokenizer" for a in n.names)), None)
    if module is None or getattr(args, "legacy_tokenizer", False):
        return []
    importlib.import_module(module).build_tokenizer(args)
    return [f"the tokenizer builds as initialize_megatron and pretrain_gpt.py ({module}) build it"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    build_tokenizer = not (len(argv) > 3 and argv[3] == NO_TOKENIZER)
    if not build_tokenizer:
        del argv[3]
    if len(argv) < 4 or argv[3] != "--":
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    checks = json.load(sys.stdin) if argv[4:] == [FROM_STDIN] else [{"argv": argv[4:]}]
    return _check(argv[0], int(argv[1]), int(argv[2]), checks, build_tokenizer)


if __name__ == "__main__":
    sys.exit(main())
