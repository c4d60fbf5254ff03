"""Megatron-LM's flags, one model: what each option string takes (nargs, choices) and how a command line splits.

    python -m orchestration.megatron_lm.checkout /opt/Megatron-LM core_v0.16.1 > orchestration/megatron_lm/flags_core_v0.16.1.tsv

A :class:`FlagTable` is one release's flags; :mod:`orchestration.megatron_lm.checkout` reads one
from a checkout's source, and :func:`shipped_flag_table` reads the table shipped next to this file.
Its TSV form is a row ``--flag<TAB>nargs<TAB>choices`` per flag: nargs ``0`` for a flag without a
value (store_true, store_false, BooleanOptionalAction), ``1`` for one value, else argparse's ``?``,
``*``, ``+`` or a count. The shipped table (``flags_core_v0.16.1.tsv``) was written from a
core_v0.16.1 checkout by the command above; its flags and choices are those of
``tests/data/megatron_lm/flags_core_v0.16.1.tsv`` (made by importing Megatron-LM, checked by the
tests), and its nargs were checked against the parser built by importing that release.

:func:`split_flags` splits a command line into flags and their values, for the launcher's check of
a render (:func:`orchestration.megatron_lm.render.check_flags`) and for the importer of argument
files (:mod:`orchestration.import_args.given_flags`). Pure, but for reading the shipped table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence, TypeVar

from megatron_ext.run_spec.errors import UserError

SHIPPED_RELEASE = "core_v0.16.1"
SHIPPED_TABLE = Path(__file__).with_name(f"flags_{SHIPPED_RELEASE}.tsv")


@dataclass(frozen=True)
class FlagSpec:
    nargs: str = "*"
    """``0`` (no value), ``1``, ``?``, ``*``, ``+`` or a count."""
    choices: tuple[str, ...] = ()
    """Accepted values (empty = any)."""
    optional: bool = False
    """The parser adds it only when an optional package imports (``if HAVE_KITCHEN:``)."""

    @property
    def most_values(self) -> int | None:
        """How many words after the flag are its values at most (None = no limit)."""
        return {"0": 0, "1": 1, "?": 1}.get(self.nargs, int(self.nargs) if self.nargs.isdigit() else None)


@dataclass(frozen=True)
class FlagTable:
    release: str
    """The Megatron-LM release the flags are from (``core_v0.16.1``, or a checkout's version)."""
    flags: dict[str, FlagSpec]

    def without_optional(self) -> FlagTable:
        """The flags the parser has without its optional packages."""
        return FlagTable(self.release, {flag: spec for flag, spec in self.flags.items() if not spec.optional})


def parse_flag_table(text: str, source: str) -> FlagTable:
    """A table in the TSV form above (its first ``# Megatron-LM RELEASE ...`` line names the release)."""
    release, flags = "unknown release", {}
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("# Megatron-LM "):
            release = line.split()[2]
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        if len(cells) != 3 or not cells[0].startswith("--"):
            raise UserError(f"{source}:{number}: expected --flag<TAB>nargs<TAB>choices, got {line!r}")
        flags[cells[0]] = FlagSpec(cells[1], tuple(c for c in cells[2].split(",") if c))
    return FlagTable(release, flags)


def format_flag_table(table: FlagTable, origin: str = "") -> str:
    """The TSV form of ``table`` (it has no column for :attr:`FlagSpec.optional`: write
    :meth:`FlagTable.without_optional`, the flags every install of the release has)."""
    lines = [f"# Megatron-LM {table.release} {origin}: option strings, values each takes (nargs), choices".rstrip()]
    lines += [f"{flag}\t{spec.nargs}\t{','.join(spec.choices)}" for flag, spec in sorted(table.flags.items())]
    return "\n".join(lines) + "\n"


def shipped_flag_table() -> FlagTable:
    """Megatron-LM core_v0.16.1's flags, for reading argument files without a checkout."""
    return parse_flag_table(SHIPPED_TABLE.read_text(), str(SHIPPED_TABLE))


# -- splitting a command line ---------------------------------------------------------------------


class Word(Protocol):
    """A word of an argument file (:class:`orchestration.import_args.shell.ShellWord`)."""

    text: str
    unresolved: str | None


W = TypeVar("W", str, Word)


class StrayWord(ValueError):
    """A word that is no flag's value: before the first flag, or after a flag has all its values."""

    def __init__(self, word, split: list[tuple]):
        super().__init__(f"{word!r} is no flag's value")
        self.word = word
        self.split = split
        """The flags and values before the word (the last one is the flag it follows)."""


def _flag_text(word: str | Word) -> str | None:
    """The word's text where it is a flag (``--x``, ``--x=value``), else None."""
    text = word if isinstance(word, str) else word.text if word.unresolved is None else None
    return text if text is not None and text.startswith("--") else None


def _with_text(word: W, text: str) -> W:
    return text if isinstance(word, str) else dataclasses.replace(word, text=text)


def split_flags(words: Sequence[W], table: FlagTable | None = None) -> list[tuple[W, list[W]]]:
    """``[--flag, value, ...]`` -> ``[(--flag, [values])]``, each flag a word like the values (its text
    the option string). A flag takes the words after it up to the next flag, and no more than its
    nargs in ``table`` allow (a flag ``table`` lacks, or any flag without a table, takes them all);
    ``--flag=value`` gives its first value inline. Raises :class:`StrayWord` for a word that is no
    flag's value."""
    out: list[tuple[W, list[W]]] = []
    i = 0
    while i < len(words):
        word, text = words[i], _flag_text(words[i])
        if text is None:
            raise StrayWord(word, out)
        name, eq, inline = text.partition("=")
        values = [_with_text(word, inline)] if eq else []
        spec = table.flags.get(name) if table is not None else None
        limit = spec.most_values if spec is not None else None
        i += 1
        while i < len(words) and _flag_text(words[i]) is None and (limit is None or len(values) < limit):
            values.append(words[i])
            i += 1
        out.append((_with_text(word, name), values))
    return out
