"""The one converter between the dataclasses that cross a process or a file and plain data (JSON,
YAML): pydantic's ``TypeAdapter`` over the project's own stdlib dataclasses.

    structure(NodePlan, json.loads(text))        # a record this project wrote: unknown keys dropped
    unstructure(plan)                            # -> JSON-ready dicts, lists, strings and numbers
    structure_params(TrainingParams, raw, "smoke.yaml:training")   # a user's YAML: UserError per bad value

Why pydantic: it validates stdlib dataclasses as they are (no base class, no second model), nested
dataclasses, enums, tuples, ``Literal`` and optional fields included; every error carries the
location of the bad value, which the user's message names; its core is compiled and each
dataclass's validator is built once (:func:`adapter`); it is maintained release after release;
and Megatron-LM's own training imports it, so a GPU image that runs Megatron-LM has it already.
(cattrs would serve as well; dacite's errors carry no structured location.)

Two policies: records this project wrote (node plans and answers, the ledger, resolved
parameters) are read leniently: unknown keys dropped, so a node running a newer checkout answers
an older launcher. A user's parameter files are read strictly: an unknown key is refused with the
keys known there (a misspelling must not be ignored), and every other bad value becomes one
:class:`UserError` naming where it is, the value, the rule and the fix. Pure.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from megatron_ext.run_spec.errors import UserError

T = TypeVar("T")


@functools.cache
def adapter(cls: Any) -> TypeAdapter:
    """The validator and serializer of ``cls``, built once per process."""
    return TypeAdapter(cls)


def unstructure(obj: Any) -> Any:
    """``obj`` (a dataclass, or anything the adapter of its type knows) as plain JSON data: enums as
    their values, tuples as lists, paths as strings."""
    return adapter(type(obj)).dump_python(obj, mode="json")


def structure(cls: type[T], raw: Any) -> T:
    """``cls`` from plain data this project wrote (unknown keys dropped); a ValueError naming the
    first value that does not fit."""
    try:
        return adapter(cls).validate_python(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        where = ".".join(str(part) for part in first["loc"]) or cls.__name__
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(f"{where}: {first['msg']}{more}") from None


# -- a user's parameters ------------------------------------------------------------------------------

_RULES = {"int": "must be int", "float": "must be float", "bool": "must be bool", "string": "must be str",
          "tuple": "must be a list", "list": "must be a list", "dict": "must be a mapping", "dataclass": "must be a mapping",
          "model": "must be a mapping"}


def _known_keys(cls: Any, raw: Any, where: str) -> Any:
    """``raw`` with every mapping checked against its dataclass's fields (an unknown key is a
    UserError listing the known ones), a single value given for a list field made a list of one
    (YAML's ``paths: a.jsonl``), and an empty section (``resilience:``) its defaults."""
    if dataclasses.is_dataclass(cls) and raw is None:
        raw = {}
    if not dataclasses.is_dataclass(cls) or not isinstance(raw, dict):
        return raw
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"unknown key {unknown[0]!r} in {where}; known keys: {', '.join(sorted(known))} "
                        "(fix the spelling or remove it)")
    out = {}
    for key, value in raw.items():
        hint = hints[key]
        inner = [a for a in typing.get_args(hint) if a is not type(None)] \
            if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
        target = inner[0] if len(inner) == 1 else hint
        if typing.get_origin(target) is tuple and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        out[key] = _known_keys(target, value, f"{where}.{key}")
    return out


def _message(error: dict, where: str) -> str:
    """One pydantic error as the project's message: where, the value, the rule, the fix."""
    path = where + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return f"{path} is missing; add it"
    if kind == "literal_error":  # ctx: "'a', 'b' or 'c'"
        choices = error.get("ctx", {}).get("expected", "").replace(" or ", ", ")
        return f"{path}={value!r} is not one of [{choices}]; use one of them"
    rule = next((text for prefix, text in _RULES.items() if kind.startswith(prefix)), None)
    if rule is not None:
        return f"{path}={value!r} {rule}, got {type(value).__name__}"
    return f"{path}={value!r}: {error['msg']}"


def structure_params(cls: type[T], raw: Any, where: str) -> T:
    """``cls`` from a user's parameter file (``where`` names it in messages); every bad value a
    UserError (the first one found)."""
    if dataclasses.is_dataclass(cls) and not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping, got {raw!r}")
    checked = _known_keys(cls, raw, where)
    try:
        return adapter(cls).validate_python(checked)
    except ValidationError as exc:
        raise UserError(_message(exc.errors(include_url=False)[0], where)) from None
