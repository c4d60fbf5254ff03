"""Megatron-LM argument files -> this project's model preset and data set YAML.

    python -m orchestration import-megatron-args model.sh data.sh --model-out params/models/m.yaml --data-out params/data/d.yaml

The files are read as bash would source them, in order (:mod:`orchestration.import_args.shell`);
their flags are split with the flag table of Megatron-LM core_v0.16.1, or of the checkout given
with ``--megatron-lm-dir`` / MEGATRON_LM_DIR (:func:`load_flag_table`); a later file's flag
overrides an earlier file's (:mod:`orchestration.import_args.given_flags`). Flags of older releases
the checkout retired are translated, dropped or refused first, one line each in the report
(:func:`retire_old_flags`). Each flag then either
maps onto a field of the params or is listed (:mod:`orchestration.import_args.mapping`);
:mod:`orchestration.import_args.yaml_files` writes the result.

Pure apart from :func:`read_arg_files` and :func:`load_flag_table`, which read files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

from megatron_ext.run_spec.errors import UserError
from orchestration.import_args.flag_reader import LAUNCHER, TORCHRUN_FLAGS, TORCHRUN_REASON, NotImported
from orchestration.import_args.given_flags import GivenFlag, collect_flags, merge_flags, unknown_flags_error
from orchestration.import_args.mapping import ImportedArgs, map_flags
from orchestration.import_args.shell import FileArgs, ShellWord, read_files
from orchestration.megatron_lm.checkout import read_checkout
from orchestration.megatron_lm.flags import FlagTable, shipped_flag_table
from orchestration.megatron_lm.retired_flags import retire_flags


def load_flag_table(megatron_lm_dir: str | None) -> FlagTable:
    """The checkout's flags (those its parser has without optional packages) when a checkout is
    given, else the shipped core_v0.16.1 table."""
    if megatron_lm_dir:
        return read_checkout(megatron_lm_dir).table.without_optional()
    return shipped_flag_table()


def retire_old_flags(files: Sequence[FileArgs], table: FlagTable) -> tuple[list[FileArgs], list[str]]:
    """The files with the flags of older releases that ``table``'s checkout retired translated or
    dropped (:mod:`orchestration.megatron_lm.retired_flags`), and one line per change; a UserError
    naming file and line for a flag it refuses."""
    words, lines = retire_flags([(i, w) for i, f in enumerate(files) for w in f.args], table, where=lambda w: w[1].where,
                                text=lambda w: w[1].text if w[1].unresolved is None else None,
                                rename=lambda w, flag: (w[0], dataclasses.replace(w[1], text=flag)))
    return [dataclasses.replace(f, args=tuple(w for i, w in words if i == n)) for n, f in enumerate(files)], lines


def import_flags(files: Sequence[FileArgs], table: FlagTable) -> ImportedArgs:
    """Map the files' flags (later files override) onto the params; everything else is listed."""
    files, retired = retire_old_flags(files, table)
    per_file, unknown, launcher = [], [], []
    for f in files:
        known, strange = collect_flags(f.args, table)
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
        raise unknown_flags_error(unknown, table)
    skipped = [NotImported(flag=g.flag, values=tuple(w.text for w in g.values), reason=TORCHRUN_REASON, where=g.where, kind=LAUNCHER)
               for g in launcher]
    return map_flags(merge_flags(per_file, table), table.release, [f"{f.path} ({f.origin})" for f in files],
                     [n for f in files for n in f.notes] + retired, skipped)


def read_arg_files(paths: Sequence[str]) -> list[tuple[str, str]]:
    """``(path, text)`` of each file."""
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
    (:mod:`orchestration.import_args.yaml_files` writes the result)."""
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
