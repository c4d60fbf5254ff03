"""Megatron-LM's flags with how many values each takes, for reading argument files.

    python -m orchestration.engines.megatron_lm_flag_table /opt/Megatron-LM core_v0.16.1 > orchestration/engines/megatron_lm_flags_core_v0.16.1.tsv

A table row is ``--flag<TAB>nargs<TAB>choices``: nargs ``0`` for a flag without a value
(store_true, store_false, BooleanOptionalAction), ``1`` for one value, else argparse's ``?``,
``*``, ``+`` or a count. The shipped table (``megatron_lm_flags_core_v0.16.1.tsv`` next to this
file) was written by this module from a core_v0.16.1 checkout; its flags and choices are those of
``tests/data/megatron_lm/flags_core_v0.16.1.tsv`` (made by importing Megatron-LM, checked by the
tests), and its nargs were checked against the parser built by importing that release.

With a checkout (``--megatron-lm-dir`` / MEGATRON_LM_DIR) the flags come from
:mod:`orchestration.engines.megatron_lm_checkout` and the nargs from the same source, read with
``ast``: the ``action=``/``nargs=`` of ``add_argument`` calls, and for the flags generated from
config dataclasses the field's type (bool: none, ``list[...]``: ``+``, ``argparse_meta`` nargs).
Reads files; nothing else.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.run_spec.errors import UserError
from orchestration.engines import megatron_lm_checkout as checkout

SHIPPED_RELEASE = "core_v0.16.1"
SHIPPED_TABLE = Path(__file__).with_name(f"megatron_lm_flags_{SHIPPED_RELEASE}.tsv")
_NO_VALUE_ACTIONS = {"store_true", "store_false", "store_const", "count", "help", "version"}


@dataclass(frozen=True)
class FlagSpec:
    nargs: str
    """``0`` (no value), ``1``, ``?``, ``*``, ``+`` or a count."""
    choices: tuple[str, ...] = ()
    """Accepted values (empty = any)."""


@dataclass(frozen=True)
class FlagTable:
    release: str
    """The Megatron-LM release the flags are from (``core_v0.16.1``, or a checkout's version)."""
    flags: dict[str, FlagSpec]


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
    lines = [f"# Megatron-LM {table.release} {origin}: option strings, values each takes (nargs), choices".rstrip()]
    lines += [f"{flag}\t{spec.nargs}\t{','.join(spec.choices)}" for flag, spec in sorted(table.flags.items())]
    return "\n".join(lines) + "\n"


def _nargs_of_call(call: ast.Call) -> str:
    action = checkout._keyword(call, "action")
    if isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction":
        return "0"
    if checkout._literal(action) in _NO_VALUE_ACTIONS:
        return "0"
    nargs = checkout._literal(checkout._keyword(call, "nargs"))
    return "1" if nargs is None else str(nargs)


def literal_nargs(tree: ast.AST) -> dict[str, str]:
    """nargs of every literal ``add_argument('--x', ...)`` (optional-package blocks included)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("--")]
            if isinstance(checkout._keyword(node, "action"), ast.Attribute):
                names += [f"--no-{n[2:]}" for n in names]
            for name in names:
                out[name] = _nargs_of_call(node)
    return out


def _is_list(node: ast.AST | None) -> bool:
    members = checkout._union_members(node) if node is not None else None
    if members is not None:
        inner = [m for m in members if not checkout._is_none(m)]
        return len(inner) == 1 and _is_list(inner[0])
    if isinstance(node, ast.Subscript):
        name = checkout._subscript_name(node)
        if name == "Annotated":
            return _is_list(checkout._slice_items(node)[0])
        return name in ("list", "List")
    return False


def dataclass_nargs(cls: ast.ClassDef, index, exclude: set[str]) -> dict[str, str]:
    """nargs of the flags ``ArgumentGroupFactory`` generates from ``cls`` (names as
    :func:`megatron_lm_checkout.dataclass_flags` gives them)."""
    out: dict[str, str] = {}
    for base in cls.bases:
        base_cls = index.find(base.id) if isinstance(base, ast.Name) else None
        if base_cls is not None:
            out.update(dataclass_nargs(base_cls, index, exclude))
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)) or stmt.target.id in exclude:
            continue
        single = ast.ClassDef(name=cls.name, bases=[], keywords=[], body=[stmt], decorator_list=[])
        flags = checkout.dataclass_flags(single, index, exclude)
        meta: dict = {}
        value = stmt.value
        if isinstance(value, ast.Call):
            metadata = checkout._keyword(value, "metadata")
            if isinstance(metadata, ast.Dict):
                for k, v in zip(metadata.keys, metadata.values):
                    if checkout._literal(k) == "argparse_meta" and isinstance(v, ast.Dict):
                        meta = {checkout._literal(mk): mv for mk, mv in zip(v.keys, v.values)}
        try:
            kind, _ = checkout.annotation_kind(stmt.annotation, index)
        except checkout.UnknownAnnotation:
            kind = "other"
        if "nargs" in meta:
            nargs = str(checkout._literal(meta["nargs"]))
        elif checkout._literal(meta.get("action")) in _NO_VALUE_ACTIONS or (kind == "bool" and "type" not in meta):
            nargs = "0"
        elif _is_list(stmt.annotation):
            nargs = "+"
        else:
            nargs = "1"
        for flag in flags:
            out[flag] = nargs
    return out


def read_checkout_flag_table(root: str | Path) -> FlagTable:
    """The flags of a Megatron-LM checkout, with their nargs (flags whose nargs the reader cannot
    tell take any number of values: ``*``)."""
    found = checkout.read_checkout(root)
    tree = ast.parse((Path(root) / "megatron" / "training" / "arguments.py").read_text())
    index = checkout._ClassIndex(Path(root))
    nargs = literal_nargs(tree)
    for name, exclude in checkout._factory_calls(tree):
        cls = index.find(name)
        if cls is not None:
            for flag, n in dataclass_nargs(cls, index, exclude).items():
                nargs.setdefault(flag, n)
    flags = {flag: FlagSpec(nargs.get(flag, "*"), choices) for flag, choices in found.flags.items()}
    return FlagTable(f"{found.version_text} ({found.root})", flags)


def load_flag_table(megatron_lm_dir: str | None) -> FlagTable:
    """The checkout's flags when a checkout is given, else the shipped core_v0.16.1 table."""
    if megatron_lm_dir:
        return read_checkout_flag_table(megatron_lm_dir)
    return parse_flag_table(SHIPPED_TABLE.read_text(), str(SHIPPED_TABLE))


if __name__ == "__main__":
    table = read_checkout_flag_table(sys.argv[1])
    release = sys.argv[2] if len(sys.argv) > 2 else table.release.split()[0]
    sys.stdout.write(format_flag_table(FlagTable(release, table.flags), "read from its arguments.py by megatron_lm_flag_table.py"))
