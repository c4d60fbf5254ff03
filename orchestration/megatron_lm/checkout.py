"""Read a Megatron-LM checkout without importing it: its version and every flag its parser has.

    python -m orchestration.megatron_lm.checkout /opt/Megatron-LM     # prints version and flag count
    python -m orchestration.megatron_lm.checkout /opt/Megatron-LM core_v0.16.1 > orchestration/megatron_lm/flags_core_v0.16.1.tsv

Version: ``megatron/core/package_info.py`` (MAJOR, MINOR, PATCH). Flags, one pass over
``megatron/training/arguments.py`` giving each its :class:`FlagSpec` (nargs, choices, optional):
the literal ``add_argument`` calls (nargs from ``action=``/``nargs=``; a call under ``if HAVE_X:``
is optional), plus the ones generated from config dataclasses by ``ArgumentGroupFactory`` (0.16+):
field ``foo_bar`` -> ``--foo-bar``; a bool defaulting to True -> ``--no-foo-bar`` and
``--disable-foo-bar``, no value; ``Literal[...]`` -> choices; ``list[...]`` -> one or more values;
``metadata={"argparse_meta": {...}}`` overrides names, choices and nargs. Given a release name, the
command writes the flags as a table (:func:`orchestration.megatron_lm.flags.format_flag_table`).
The Python it needs: ``requires-python`` in its ``pyproject.toml`` (core_v0.19: ``>=3.12``; a
checkout without the file states none), which every node's preflight checks
(:mod:`megatron_ext.run_spec.python_version`). Reads files; nothing else.
"""

from __future__ import annotations

import ast
import enum
import importlib
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.python_version import PythonRequirement
from orchestration.megatron_lm.flags import FlagSpec, FlagTable, format_flag_table

_NO_VALUE_ACTIONS = {"store_true", "store_false", "store_const", "count", "help", "version"}


@dataclass(frozen=True, kw_only=True)
class Checkout:
    root: Path
    version: tuple[int, int, int]
    table: FlagTable
    """Every option string of its parser, optional ones included."""
    skipped: tuple[str, ...] = ()
    """Config fields whose annotation the reader could not read (their flags are missing)."""
    requires_python: str | None = None
    """``requires-python`` of its ``pyproject.toml`` (``>=3.12``); None: the checkout states none."""
    gpt_model_deprecated: bool = False
    """Its GPTModel says it is deprecated as it is built (core_v0.19.0: in favour of HybridModel)."""

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))

    @property
    def python_requirement(self) -> PythonRequirement | None:
        """The Python every node must run, as the preflight checks it (None: not stated)."""
        if self.requires_python is None:
            return None
        return PythonRequirement(f"Megatron-LM {self.version_text} (MEGATRON_LM_DIR={self.root})", self.requires_python,
                                 "requires-python in its pyproject.toml")

    @property
    def flags(self) -> dict[str, tuple[str, ...]]:
        """The option strings the parser always has -> their choices (empty = any value)."""
        return {flag: spec.choices for flag, spec in self.table.flags.items() if not spec.optional}

    @property
    def optional_flags(self) -> dict[str, tuple[str, ...]]:
        """The option strings it adds only when an optional package imports -> their choices."""
        return {flag: spec.choices for flag, spec in self.table.flags.items() if spec.optional}


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


def read_requires_python(root: Path) -> str | None:
    """``[project] requires-python`` of the checkout's ``pyproject.toml``; None without the file or the key."""
    path = root / "pyproject.toml"
    if not path.is_file():
        return None
    try:
        project = tomllib.loads(path.read_text()).get("project", {})
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path} is not TOML ({exc}); restore the checkout's pyproject.toml, which states the Python "
                        "it needs") from None
    value = project.get("requires-python") if isinstance(project, dict) else None
    return value.strip() if isinstance(value, str) and value.strip() else None


GPT_MODEL_DEPRECATION = "GPTModel IS DEPRECATED"
"""What core_v0.19.0's GPTModel logs on every rank as it is built (megatron/core/models/gpt/gpt_model.py
~L118-124: bug fixes only, the migration to HybridModel in its docs/user-guide/hybrid-model-migration.md)."""


def reads_gpt_model_deprecated(root: Path) -> bool:
    """Whether the checkout's GPTModel says it is deprecated (:data:`GPT_MODEL_DEPRECATION`)."""
    path = root / "megatron" / "core" / "models" / "gpt" / "gpt_model.py"
    return path.is_file() and GPT_MODEL_DEPRECATION in path.read_text(errors="replace")


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _choices(node: ast.AST | None, index: "_ClassIndex | None" = None) -> tuple[str, ...]:
    """The ``choices=`` of an ``add_argument`` call: a literal list, ``range(...)``, or
    ``[e.value for e in SomeEnum]`` over an enum defined in the checkout."""
    if node is None:
        return ()
    value = _literal(node)
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    if (index is not None and isinstance(node, ast.Call) and getattr(node.func, "id", None) == "list"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Name)):  # list(SomeEnum)
        members = index.enum_members(node.args[0].id)
        if members is not None:
            return tuple(members)
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "range":
        bounds = [_literal(a) for a in node.args]
        if bounds and all(isinstance(b, int) for b in bounds):
            return tuple(str(v) for v in range(*bounds))
    if (index is not None and isinstance(node, ast.ListComp) and len(node.generators) == 1
            and isinstance(node.generators[0].iter, ast.Name) and isinstance(node.elt, ast.Attribute)):
        members = index.enum_members(node.generators[0].iter.id)
        if members is not None:
            return tuple(str(v) for v in (members.values() if node.elt.attr == "value" else members))
    return ()


def _is_boolean_optional(call: ast.Call) -> bool:
    action = _keyword(call, "action")
    return isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction"


def _call_nargs(call: ast.Call) -> str:
    """How many values an ``add_argument`` call's flag takes."""
    if _is_boolean_optional(call) or _literal(_keyword(call, "action")) in _NO_VALUE_ACTIONS:
        return "0"
    nargs = _literal(_keyword(call, "nargs"))
    return "1" if nargs is None else str(nargs)


def _guarded_by_optional_package(test: ast.AST) -> bool:
    """``if HAVE_KITCHEN:`` and the like: a block that exists only when an optional package imports."""
    return isinstance(test, ast.Name) and test.id.startswith("HAVE_")


def literal_add_argument_flags(tree: ast.AST, index: "_ClassIndex | None" = None) -> dict[str, FlagSpec]:
    """Flags of the literal ``add_argument('--x', ...)`` calls (``BooleanOptionalAction`` adds
    ``--no-x``). Flags added only when an optional package imports (``if HAVE_X:``) are optional:
    the parser has them only where that package is installed (one it also adds unconditionally is not)."""
    flags: dict[str, FlagSpec] = {}

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.If) and _guarded_by_optional_package(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, optional)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
            if _is_boolean_optional(node):
                names += [f"--no-{n[2:]}" for n in names]
            spec = FlagSpec(_call_nargs(node), _choices(_keyword(node, "choices"), index), optional)
            for name in names:
                if not (optional and name in flags and not flags[name].optional):
                    flags[name] = spec
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(tree, False)
    return flags


def _factory_calls(tree: ast.AST) -> list[tuple[str, set[str]]]:
    """``ArgumentGroupFactory(ConfigClass, exclude=...)`` calls; an ``exclude`` given as a local
    variable is resolved to its last literal assignment before the call, in the same function."""
    out = []
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))]:
        assigned: list[tuple[int, str, ast.AST]] = [
            (n.lineno, n.targets[0].id, n.value) for n in ast.walk(function)
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
        ]
        body = function.body if isinstance(function, ast.FunctionDef) else [
            n for n in function.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        for node in (c for stmt in body for c in ast.walk(stmt)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ArgumentGroupFactory":
                if node.args and isinstance(node.args[0], ast.Name):
                    exclude = _keyword(node, "exclude")
                    if isinstance(exclude, ast.Name):
                        earlier = [v for line, name, v in assigned if name == exclude.id and line < node.lineno]
                        exclude = earlier[-1] if earlier else None
                    out.append((node.args[0].id, set(_literal(exclude) or []) if exclude is not None else set()))
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

    def enum_members(self, name: str) -> dict[str, object] | None:
        """``{member: value}`` of an ``enum.Enum`` subclass defined in the checkout, else None."""
        cls = self.find(name)
        if cls is None or not any(getattr(b, "id", getattr(b, "attr", "")).endswith("Enum") for b in cls.bases):
            return None
        return {t.id: _literal(stmt.value) for stmt in cls.body if isinstance(stmt, ast.Assign)
                for t in stmt.targets if isinstance(t, ast.Name)}


_UNION_NAMES = {"Optional", "Union"}


def _subscript_name(node: ast.Subscript) -> str | None:
    """``Literal`` for ``Literal[...]`` and ``typing.Literal[...]``."""
    value = node.value
    return value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else None


def _slice_items(node: ast.Subscript) -> list[ast.AST]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def _union_members(node: ast.AST) -> list[ast.AST] | None:
    """The members of ``Optional[X]``, ``Union[X, Y]`` or ``X | Y``; None for anything else."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return (_union_members(node.left) or [node.left]) + (_union_members(node.right) or [node.right])
    if isinstance(node, ast.Subscript) and _subscript_name(node) in _UNION_NAMES:
        return _slice_items(node)
    return None


def _is_none(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and node.value is None) or (isinstance(node, ast.Name) and node.id == "None")


class UnknownAnnotation(ValueError):
    """An annotation construct the reader does not understand (counted, never raised to users)."""


def _enum_choices(node: ast.AST, index: _ClassIndex | None) -> tuple[str, ...] | None:
    """Member names of an enum annotation: a class in the checkout (``AttnBackend``) or a
    standard-library one (``signal.Signals``); None when ``node`` names no enum."""
    if isinstance(node, ast.Name) and index is not None:
        members = index.enum_members(node.id)
        return tuple(members) if members is not None else None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in sys.stdlib_module_names:
        cls = getattr(importlib.import_module(node.value.id), node.attr, None)
        if isinstance(cls, type) and issubclass(cls, enum.Enum):
            return tuple(m.name for m in cls)
    return None


def annotation_kind(node: ast.AST | None, index: _ClassIndex | None = None) -> tuple[str, tuple[str, ...]]:
    """('bool' | 'literal' | 'other', choices) for a field annotation, read from its syntax tree:
    ``Optional[...]``, ``Union[..., None]``, ``X | None``, ``Annotated[X, ...]``, string forward
    references and ``Literal[...]`` nested in any of them. Raises :class:`UnknownAnnotation` for a
    construct it cannot read (the caller skips the field and counts it)."""
    if node is None:
        return "other", ()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a forward reference
        try:
            return annotation_kind(ast.parse(node.value, mode="eval").body, index)
        except SyntaxError:
            raise UnknownAnnotation(node.value) from None
    members = _union_members(node)
    if members is not None:
        kinds = [annotation_kind(m, index) for m in members if not _is_none(m)]
        if len(kinds) == 1:
            return kinds[0]
        if kinds and all(kind == "literal" for kind, _ in kinds):
            return "literal", tuple(c for _, choices in kinds for c in choices)
        return "other", ()
    if isinstance(node, ast.Subscript):
        name = _subscript_name(node)
        if name == "Literal":
            values = []
            for item in _slice_items(node):
                try:
                    values.append(ast.literal_eval(item))
                except ValueError:
                    raise UnknownAnnotation(ast.unparse(node)) from None
            return "literal", tuple(str(v) for v in values)
        if name == "Annotated":
            return annotation_kind(_slice_items(node)[0], index)
        return "other", ()
    if isinstance(node, ast.Name) and node.id == "bool":
        return "bool", ()
    if isinstance(node, (ast.Name, ast.Attribute)):
        choices = _enum_choices(node, index)
        return ("literal", choices) if choices is not None else ("other", ())
    if isinstance(node, ast.Constant):
        return "other", ()
    raise UnknownAnnotation(ast.unparse(node))


def _is_list(node: ast.AST | None) -> bool:
    """``list[X]``, ``List[X]``, optional or annotated."""
    members = _union_members(node) if node is not None else None
    if members is not None:
        inner = [m for m in members if not _is_none(m)]
        return len(inner) == 1 and _is_list(inner[0])
    if isinstance(node, ast.Subscript):
        name = _subscript_name(node)
        if name == "Annotated":
            return _is_list(_slice_items(node)[0])
        return name in ("list", "List")
    return False


def _field_nargs(kind: str, annotation: ast.AST | None, meta: dict) -> str:
    """How many values the flag of a config field takes (``argparse_meta`` nargs or action first)."""
    if "nargs" in meta:
        return str(_literal(meta["nargs"]))
    if _literal(meta.get("action")) in _NO_VALUE_ACTIONS or (kind == "bool" and "type" not in meta):
        return "0"
    return "+" if _is_list(annotation) else "1"


def dataclass_flags(cls: ast.ClassDef, index: _ClassIndex, exclude: set[str],
                    skipped: list[str] | None = None) -> dict[str, FlagSpec]:
    """The flags ``ArgumentGroupFactory`` generates from ``cls`` (and its bases); fields whose
    annotation the reader cannot read are appended to ``skipped``."""
    flags: dict[str, FlagSpec] = {}
    skipped = [] if skipped is None else skipped
    for base in cls.bases:
        base_cls = index.find(base.id) if isinstance(base, ast.Name) else None
        if base_cls is not None:
            flags.update(dataclass_flags(base_cls, index, exclude, skipped))
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
        try:
            kind, choices = annotation_kind(stmt.annotation, index)
        except UnknownAnnotation:
            skipped.append(f"{cls.name}.{name}")
            continue
        dashed = name.replace("_", "-")
        # ArgumentGroupFactory: store_true only for a default of False; any other default
        # (True, None) becomes store_false, spelled --no-x and --disable-x.
        if kind == "bool" and not (default is not None and _literal(default) is False):
            names = [f"--no-{dashed}", f"--disable-{dashed}"]
        else:
            names = [f"--{dashed}"]
        if "arg_names" in meta and isinstance(_literal(meta["arg_names"]), (list, tuple)):
            names = list(_literal(meta["arg_names"]))
        if "choices" in meta:
            choices = _choices(meta["choices"], index) or choices
        spec = FlagSpec(_field_nargs(kind, stmt.annotation, meta), choices)
        for flag in names:
            flags[flag] = spec
    return flags


def read_flags(root: Path, skipped: list[str] | None = None) -> dict[str, FlagSpec]:
    """Every option string of the checkout's parser, from source; unreadable config fields are
    appended to ``skipped``. A literal ``add_argument`` wins over a generated flag of the same name,
    unless only an optional package adds it."""
    path = root / "megatron" / "training" / "arguments.py"
    if not path.is_file():
        raise UserError(f"MEGATRON_LM_DIR={root} has no megatron/training/arguments.py; is it a Megatron-LM checkout?")
    tree = ast.parse(path.read_text())
    index = _ClassIndex(root)
    flags = literal_add_argument_flags(tree, index)
    for name, exclude in _factory_calls(tree):
        cls = index.find(name)
        if cls is not None:
            for flag, spec in dataclass_flags(cls, index, exclude, skipped).items():
                if flag not in flags or flags[flag].optional:
                    flags[flag] = spec
    return flags


def read_checkout(root: str | Path) -> Checkout:
    root = Path(root)
    if not (root / "pretrain_gpt.py").is_file():
        raise UserError(f"MEGATRON_LM_DIR={root} has no pretrain_gpt.py; point it at a Megatron-LM checkout")
    skipped: list[str] = []
    flags = read_flags(root, skipped)
    version = read_version(root)
    return Checkout(root=root, version=version, table=FlagTable(f"{'.'.join(map(str, version))} ({root})", flags), skipped=tuple(skipped),
                    requires_python=read_requires_python(root), gpt_model_deprecated=reads_gpt_model_deprecated(root))


if __name__ == "__main__":
    c = read_checkout(sys.argv[1])
    if len(sys.argv) > 2:  # the table, as shipped (flags_core_v0.16.1.tsv)
        sys.stdout.write(format_flag_table(FlagTable(sys.argv[2], c.table.without_optional().flags),
                                           "read from its arguments.py by orchestration/megatron_lm/checkout.py"))
    else:
        print(f"Megatron-LM {c.version_text}: {len(c.flags)} flags"
              + (f"; Python {c.requires_python} (its pyproject.toml)" if c.requires_python else "")
              + (f"; {len(c.skipped)} config field(s) skipped: {', '.join(c.skipped)}" if c.skipped else ""))
