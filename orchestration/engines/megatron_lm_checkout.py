"""Read a Megatron-LM checkout without importing it: its version and every flag its parser has.

    python -m orchestration.engines.megatron_lm_checkout /opt/Megatron-LM     # prints version and flag count

Version: ``megatron/core/package_info.py`` (MAJOR, MINOR, PATCH). Flags: the literal
``add_argument`` calls in ``megatron/training/arguments.py``, plus the ones generated from
config dataclasses by ``ArgumentGroupFactory`` (0.16+): field ``foo_bar`` -> ``--foo-bar``; a bool
defaulting to True -> ``--no-foo-bar`` and ``--disable-foo-bar``; ``Literal[...]`` -> choices;
``metadata={"argparse_meta": {...}}`` overrides names and choices. Reads files; nothing else.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.spec.errors import UserError


@dataclass(frozen=True)
class Checkout:
    root: Path
    version: tuple[int, int, int]
    flags: dict[str, tuple[str, ...]]
    """Every option string -> its choices (empty = any value)."""

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def read_version(root: Path) -> tuple[int, int, int]:
    path = root / "megatron" / "core" / "package_info.py"
    if not path.is_file():
        raise UserError(
            f"MEGATRON_LM_DIR={root} is not a Megatron-LM checkout: no megatron/core/package_info.py; "
            "point MEGATRON_LM_DIR at the directory that holds pretrain_gpt.py"
        )
    values = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", path.read_text(), re.M))
    try:
        return int(values["MAJOR"]), int(values["MINOR"]), int(values["PATCH"])
    except KeyError:
        raise UserError(f"{path} defines no MAJOR/MINOR/PATCH; cannot tell the Megatron-LM version") from None


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _choices(node: ast.AST | None) -> tuple[str, ...]:
    value = _literal(node) if node is not None else None
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else ()


def literal_add_argument_flags(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    flags: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
            for name in names:
                flags[name] = _choices(_keyword(node, "choices"))
    return flags


def _factory_calls(tree: ast.AST) -> list[tuple[str, set[str]]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ArgumentGroupFactory":
            if node.args and isinstance(node.args[0], ast.Name):
                exclude = _literal(_keyword(node, "exclude")) or []
                out.append((node.args[0].id, set(exclude)))
    return out


class _ClassIndex:
    """Class definitions under ``megatron/``, found by name on demand."""

    def __init__(self, root: Path):
        self.files = list((root / "megatron").rglob("*.py"))
        self.cache: dict[str, ast.ClassDef | None] = {}

    def find(self, name: str) -> ast.ClassDef | None:
        if name not in self.cache:
            self.cache[name] = None
            pattern = re.compile(rf"^class {re.escape(name)}\b", re.M)
            for path in self.files:
                text = path.read_text(errors="replace")
                if pattern.search(text):
                    tree = ast.parse(text)
                    self.cache[name] = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
                    break
        return self.cache[name]


def _annotation_kind(node: ast.AST | None) -> tuple[str, tuple[str, ...]]:
    """('bool' | 'literal' | 'other', choices) for a field annotation."""
    if node is None:
        return "other", ()
    text = ast.unparse(node)
    literal = re.search(r"Literal\[(.*)\]", text)
    if literal:
        values = _literal(ast.parse(f"({literal.group(1)},)", mode="eval").body)
        return "literal", tuple(str(v) for v in values or ())
    if re.fullmatch(r"(Optional\[)?bool\]?|bool\s*\|\s*None", text):
        return "bool", ()
    return "other", ()


def dataclass_flags(cls: ast.ClassDef, index: _ClassIndex, exclude: set[str]) -> dict[str, tuple[str, ...]]:
    flags: dict[str, tuple[str, ...]] = {}
    for base in cls.bases:
        base_cls = index.find(base.id) if isinstance(base, ast.Name) else None
        if base_cls is not None:
            flags.update(dataclass_flags(base_cls, index, exclude))
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)) or stmt.target.id in exclude:
            continue
        name = stmt.target.id
        default, meta = stmt.value, {}
        if isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, "id", getattr(stmt.value.func, "attr", "")) == "field":
            if _literal(_keyword(stmt.value, "init")) is False:
                continue
            default = _keyword(stmt.value, "default")
            metadata = _keyword(stmt.value, "metadata")
            if isinstance(metadata, ast.Dict):
                for k, v in zip(metadata.keys, metadata.values):
                    if _literal(k) == "argparse_meta" and isinstance(v, ast.Dict):
                        meta = {_literal(mk): mv for mk, mv in zip(v.keys, v.values)}
        kind, choices = _annotation_kind(stmt.annotation)
        dashed = name.replace("_", "-")
        if kind == "bool" and _literal(default) is True:
            names = [f"--no-{dashed}", f"--disable-{dashed}"]
        else:
            names = [f"--{dashed}"]
        if "arg_names" in meta and isinstance(_literal(meta["arg_names"]), (list, tuple)):
            names = list(_literal(meta["arg_names"]))
        if "choices" in meta:
            choices = _choices(meta["choices"]) or choices
        for flag in names:
            flags[flag] = choices
    return flags


def read_flags(root: Path) -> dict[str, tuple[str, ...]]:
    path = root / "megatron" / "training" / "arguments.py"
    if not path.is_file():
        raise UserError(f"MEGATRON_LM_DIR={root} has no megatron/training/arguments.py; is it a Megatron-LM checkout?")
    tree = ast.parse(path.read_text())
    flags = literal_add_argument_flags(tree)
    factories = _factory_calls(tree)
    if factories:
        index = _ClassIndex(root)
        for name, exclude in factories:
            cls = index.find(name)
            if cls is not None:
                for flag, choices in dataclass_flags(cls, index, exclude).items():
                    flags.setdefault(flag, choices)
    return flags


def read_checkout(root: str | Path) -> Checkout:
    root = Path(root)
    if not (root / "pretrain_gpt.py").is_file():
        raise UserError(f"MEGATRON_LM_DIR={root} has no pretrain_gpt.py; point it at a Megatron-LM checkout")
    return Checkout(root, read_version(root), read_flags(root))


if __name__ == "__main__":
    c = read_checkout(sys.argv[1])
    print(f"Megatron-LM {c.version_text}: {len(c.flags)} flags")
