"""Flags older Megatron-LM releases had and a newer checkout renamed, inverted or removed: one table.

    python -m orchestration.megatron_lm.retired_flags /opt/Megatron-LM     # the rows that apply to that checkout

Argument files and extra arguments written for core_v0.16 may name them: ``MEGATRON_LM_EXTRA_ARGS``
and ``training.megatron_lm_extra_args`` (:func:`orchestration.megatron_lm.program.plan_program`) and
the files ``import-megatron-args`` reads (:mod:`orchestration.import_args.importer`). Each row says
what the launcher does with the old flag: :data:`TRANSLATE` it to the checkout's flag, :data:`DROP` it
(the checkout does by default what it asked for, or it had no effect), or :data:`REFUSE` it before
anything starts (what it asked for is gone). Every change is one line: the flag, what the checkout
has instead, what was done.

A row with a replacement applies to a checkout whose flag table lacks the old flag and has the
replacement: decided from the checkout's flags, not its version (core_v0.17.1 has both
``--tokenizer-hf-use-fast`` and its opt-out: no row applies there). For a row without one, a
missing flag alone cannot tell "not yet" from "no longer" (core_v0.14.0 has no ``--legacy-tokenizer``:
its legacy tokenizers were the only ones), so it applies from :attr:`RetiredFlag.removed_in`, the
first release whose flag table lacks it (``tests/data/megatron_lm/flags_*.tsv``, checked by the
tests). The rows were read in core_v0.16.1's and core_v0.19.0's source
(``tests/data/megatron_lm/retired_flags.tsv`` says where; the tests read both checkouts). Pure.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from megatron_ext.run_spec.errors import UserError
from orchestration.megatron_lm.checkout import read_checkout
from orchestration.megatron_lm.flags import FlagTable

TRANSLATE, DROP, REFUSE = "translate", "drop", "refuse"
OLDER_CHECKOUT = "core_v0.16.1"
"""A release that has every old flag of the table (the tests check it), for the refusals' fix."""


@dataclass(frozen=True, kw_only=True)
class RetiredFlag:
    flag: str
    """The old option string (it takes no value: the tests check it in core_v0.16.1's table)."""
    action: str
    """:data:`TRANSLATE`, :data:`DROP` or :data:`REFUSE`."""
    replacement: str | None
    """The checkout's own flag for it (translate: what it becomes; drop: the opt-out of the new
    default); None where the checkout has none."""
    instead: str
    """What the checkout has instead, in words."""
    fix: str = ""
    """:data:`REFUSE`: what the user does instead."""
    removed_in: tuple[int, int] | None = None
    """Without a replacement: the first release (major, minor) without the flag."""

    def applies_to(self, table: FlagTable) -> bool:
        """Whether the checkout of ``table`` retired the flag."""
        if self.flag in table.flags:
            return False
        if self.replacement is not None:
            return self.replacement in table.flags
        version = release_version(table.release)
        return version is not None and self.removed_in is not None and version >= self.removed_in

    def describe(self, release: str) -> str:
        """``--x: not in Megatron-LM 0.19.1 (what it has instead): dropped``."""
        done = {TRANSLATE: f"translated to {self.replacement}", DROP: "dropped", REFUSE: "refused"}[self.action]
        return f"{self.flag}: not in Megatron-LM {release} ({self.instead}): {done}"


RETIRED_FLAGS: tuple[RetiredFlag, ...] = (
    RetiredFlag(flag="--tokenizer-hf-use-fast", action=DROP, replacement="--tokenizer-hf-no-use-fast",
                instead="fast tokenizers are its default; the opt-out is --tokenizer-hf-no-use-fast"),
    RetiredFlag(flag="--tokenizer-hf-include-special-tokens", action=DROP, replacement="--tokenizer-hf-no-include-special-tokens",
                instead="including special tokens is its default; the opt-out is --tokenizer-hf-no-include-special-tokens"),
    RetiredFlag(flag="--muon-use-nesterov", action=TRANSLATE, replacement="--muon-nesterov",
                instead="its name for the same switch is --muon-nesterov"),
    RetiredFlag(flag="--no-scatter-gather-tensors-in-pipeline", action=DROP, replacement=None,
                instead="no such option: the flag had no effect in core_v0.16.1 either, where nothing read "
                "scatter_gather_tensors_in_pipeline", removed_in=(0, 18)),
    RetiredFlag(flag="--legacy-tokenizer", action=REFUSE, replacement=None,
                instead="the legacy tokenizers are gone: megatron.core.tokenizers builds every --tokenizer-type",
                fix="remove it to have megatron.core.tokenizers build the same --tokenizer-type (the same ids for "
                "tokenizers that add no BOS: docs/own-assets.md)", removed_in=(0, 17)),
    RetiredFlag(flag="--use-legacy-models", action=REFUSE, replacement=None,
                instead="the legacy models are gone: it builds Megatron-Core models only",
                fix="remove it to train Megatron-Core's GPT model (another implementation: a legacy model's checkpoint "
                "does not load into it)", removed_in=(0, 18)),
)
"""Every retired flag, once: the extra arguments and the importer both read it."""


def release_version(release: str) -> tuple[int, int] | None:
    """(major, minor) of a flag table's release (``0.19.1 (/opt/Megatron-LM)``, ``core_v0.16.1``)."""
    found = re.search(r"(\d+)\.(\d+)", release)
    return (int(found[1]), int(found[2])) if found else None


W = TypeVar("W")


def retire_flags(words: Sequence[W], table: FlagTable, where: Callable[[W], str], text: Callable[[W], str | None],
                 rename: Callable[[W, str], W]) -> tuple[list[W], list[str]]:
    """``words`` for the checkout of ``table``: the old flags of the rows that apply translated or
    dropped, and one line per change (``where(word): ...``). A row that refuses raises one UserError
    naming every refused flag, where it stands and the fix. ``text``: a word's text (None: a word
    that could not be expanded, never a retired flag); ``rename``: the word with another text."""
    rows = {row.flag: row for row in RETIRED_FLAGS if row.applies_to(table)}
    release = table.release.split()[0]
    out, lines, refused = [], [], []
    for word in words:
        row = rows.get(text(word) or "")
        if row is None:
            out.append(word)
            continue
        line = f"{where(word)}: {row.describe(release)}"
        if row.action == REFUSE:
            refused.append(f"{line}; {row.fix}, or use a checkout that has it ({OLDER_CHECKOUT} does)")
        elif row.action == TRANSLATE:
            out.append(rename(word, row.replacement))
        lines.append(line)
    if refused:
        raise UserError("; ".join(refused))
    return out, lines


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        checkout = read_checkout(argv[0])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    applying = [row for row in RETIRED_FLAGS if row.applies_to(checkout.table)]
    for row in applying:
        print(row.describe(checkout.version_text))
    print(f"{len(applying)} of {len(RETIRED_FLAGS)} retired flags apply to Megatron-LM {checkout.version_text} ({checkout.root})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
