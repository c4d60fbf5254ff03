"""The flags argument files give: their words split by Megatron-LM's flag table, checked, merged file over file.

    python -m orchestration import-megatron-args model.sh data.sh --model-out m.yaml --data-out d.yaml

:func:`collect_flags` splits a file's words with :func:`orchestration.megatron_lm.flags.split_flags`
(each flag takes the values its nargs allow) and checks each flag's count of values and choices;
:func:`merge_flags` lets a later file override an earlier one. Pure.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Sequence

from megatron_ext.run_spec.errors import UserError
from orchestration.import_args.shell import ShellWord
from orchestration.megatron_lm.flags import FlagTable, StrayWord, split_flags


@dataclass(frozen=True)
class GivenFlag:
    flag: str
    values: tuple[ShellWord, ...]
    where: str

    def text(self) -> str:
        return " ".join([self.flag, *(w.text for w in self.values)])


def _wanted(nargs: str) -> str:
    return {"0": "no value", "1": "one value", "?": "at most one value", "*": "any number of values",
            "+": "one or more values"}.get(nargs, f"{nargs} values")


def _stray_error(stray: StrayWord, table: FlagTable) -> UserError:
    word = stray.word
    if word.unresolved:
        return UserError(f"{word.where}: {word.text} stands where a flag should be and cannot be expanded "
                         f"({word.unresolved}); set it, or give its flags in the file")
    after = ""
    if stray.split:
        flag, values = stray.split[-1]
        last = GivenFlag(flag.text, tuple(values), flag.where)
        after = f" after {last.text()}, which takes {_wanted(table.flags[last.flag].nargs)}"
    return UserError(f"{word.where}: {word.text!r}{after}: Megatron-LM takes no positional arguments; "
                     "remove it or fix the flag before it")


def collect_flags(words: Sequence[ShellWord], table: FlagTable) -> tuple[list[GivenFlag], list[GivenFlag]]:
    """``[--flag, value, ...]`` -> (known flags, unknown flags), values taken by each flag's nargs."""
    try:
        split, stray = split_flags(words, table), None
    except StrayWord as exc:
        split, stray = exc.split, exc
    known, unknown = [], []
    for flag, values in split:
        given = GivenFlag(flag.text, tuple(values), flag.where)
        spec = table.flags.get(flag.text)
        if spec is None:
            unknown.append(given)
            continue
        nargs = spec.nargs
        if (nargs == "0" and values) or (nargs in ("1", "+") and not values) or (nargs.isdigit() and len(values) != int(nargs)):
            raise UserError(f"{flag.where}: {given.text()}: Megatron-LM's {flag.text} takes {_wanted(nargs)}; fix the file")
        for value in values:
            if spec.choices and value.unresolved is None and value.text not in spec.choices:
                raise UserError(f"{value.where}: {flag.text} {value.text} is not one of Megatron-LM's choices "
                                f"({', '.join(spec.choices)}); fix the file")
        known.append(given)
    if stray is not None:  # after the flags before it, as they come in the file
        raise _stray_error(stray, table)
    return known, unknown


def merge_flags(per_file: Sequence[Sequence[GivenFlag]], table: FlagTable) -> dict[str, GivenFlag]:
    """Later files override earlier ones (``--no-x`` cancels ``--x`` and back)."""
    merged: dict[str, GivenFlag] = {}
    for flags in per_file:
        for given in flags:
            name = given.flag
            opposite = "--" + name[5:] if name.startswith("--no-") else "--no-" + name[2:]
            if opposite in table.flags:
                merged.pop(opposite, None)
            merged[name] = given
    return merged


def unknown_flags_error(unknown: Sequence[GivenFlag], table: FlagTable) -> UserError:
    items = []
    for given in unknown:
        close = difflib.get_close_matches(given.flag, list(table.flags), n=1, cutoff=0.8)
        items.append(f"{given.flag} ({given.where}{'; did you mean ' + close[0] + '?' if close else ''})")
    return UserError(f"Megatron-LM {table.release} defines no {', '.join(items)}; fix the spelling, or give "
                     "--megatron-lm-dir DIR (or MEGATRON_LM_DIR) for the Megatron-LM checkout the files are written for")
