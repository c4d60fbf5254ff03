"""Read Megatron-LM argument files (bash) the way ``source`` would, without running anything.

    python -m orchestration import-megatron-args model.sh data.sh --model-out m.yaml --data-out d.yaml

Understood: comments, ``\\`` line continuations, single and double quotes, ``NAME=value``
(``export``/``declare``/``readonly`` too), arrays ``NAME=( ... )`` and ``NAME+=( ... )`` over
many lines, ``$NAME``, ``${NAME}``, ``${NAME:-default}`` (``-``, ``:=``, ``=``, ``:+``, ``+``),
``${NAME[@]}``/``${NAME[*]}``/``${NAME[i]}``, integer ``$(( ... ))``, word splitting of unquoted
expansions, redirections and pipes after a command. A file's Megatron-LM arguments are the words
after the ``*.py`` script of its training command (``torchrun ... pretrain_gpt.py ...``), or, in
a file without one, its arrays (in order) and lines of bare ``--flags``.

Not run: command substitution (``$(...)``, backticks), ``$1`` and other script arguments (unless
given with ``--var 1=...``), variables no file sets (unless ``--var``), assignments inside
``if``/``for``/``while``/``case``/functions. A word that needs one of them is kept with the
reason (:attr:`ShellWord.unresolved`); the importer fails on it only where the value is needed.

The text becomes tokens in :mod:`orchestration.import_args.shell_lexer`; here they become commands,
and their words are expanded. Pure: file texts in, words out.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from megatron_ext.run_spec.errors import UserError
from orchestration.import_args.shell_lexer import Lexer, Token


@dataclass(frozen=True)
class ShellWord:
    """One argument after expansion."""

    text: str
    """The expanded text; for an unresolved word, its source text."""
    where: str
    """``path:line`` where it was written."""
    unresolved: str | None = None
    """Why it cannot be expanded (None = expanded)."""


@dataclass(frozen=True)
class FileArgs:
    """What one file gives."""

    path: str
    args: tuple[ShellWord, ...]
    """Megatron-LM's arguments: after the training command's script, or the file's arrays."""
    launcher_args: tuple[ShellWord, ...] = ()
    """The training command's words between its program (torchrun, python) and the script."""
    origin: str = ""
    """Where the arguments came from, for the report: ``the command at line 12`` / ``arrays A, B``."""
    notes: tuple[str, ...] = ()
    """Lines the reader ignored on purpose (``source``, commands in blocks), for the report."""


@dataclass
class ShellState:
    """Variables carried from file to file (sourcing in order)."""

    scalars: dict[str, ShellWord] = field(default_factory=dict)
    arrays: dict[str, tuple[ShellWord, ...]] = field(default_factory=dict)
    positional: dict[str, str] = field(default_factory=dict)


def state_with_variables(variables: Mapping[str, str]) -> ShellState:
    """``--var NAME=VALUE`` seeds: names are variables, digits are the script's arguments ($1)."""
    state = ShellState()
    for name, value in variables.items():
        if name.isdigit():
            state.positional[name] = value
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            state.scalars[name] = ShellWord(value, f"--var {name}")
        else:
            raise UserError(f"--var {name}={value}: {name!r} is not a shell variable name; use NAME=VALUE or 1=VALUE")
    return state


# -- expansion ------------------------------------------------------------------------------------


class _Unresolved(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_ARITH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Div: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _arith(text: str, state: ShellState, raw: str) -> int:
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            word = state.scalars.get(node.id)
            if word is None or word.unresolved or not re.fullmatch(r"-?\d+", word.text.strip()):
                raise _Unresolved(f"{raw}: {node.id} is not a known integer")
            return int(word.text)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise _Unresolved(f"{raw} is not integer arithmetic the importer evaluates")

    try:
        return value(ast.parse(text.strip().replace("/", "//").replace("////", "//"), mode="eval").body)
    except (SyntaxError, ZeroDivisionError):
        raise _Unresolved(f"{raw} is not integer arithmetic the importer evaluates") from None


class _Expander:
    def __init__(self, state: ShellState, where: str):
        self.state, self.where = state, where

    def scalar(self, parts: list[tuple]) -> str:
        """A word without splitting (assignment values, ``${X:-default}``)."""
        return "".join(" ".join(w.text for w in self._part_words(part, quoted=True)) for part in parts)

    def _param(self, name: str, op: str, arg_parts: list[tuple]) -> str:
        """The parameter's value after ``op``; :class:`_Unresolved` when it is unset and ``op`` gives no value."""
        if name.isdigit():
            value = self.state.positional.get(name)
            word = ShellWord(value, "--var") if value is not None else None
            reason = f"${name} is the script's argument {name} (give it with --var {name}=VALUE)"
        else:
            word = self.state.scalars.get(name)
            if word is None and name in self.state.arrays:
                elements = self.state.arrays[name]
                word = elements[0] if elements else ShellWord("", self.where)
            reason = f"{name} is not set in these files (give it with --var {name}=VALUE)"
        if word is not None and word.unresolved:
            raise _Unresolved(word.unresolved)
        value = word.text if word is not None else None
        if op in (":-", ":=", ":+") and value == "":
            value = None
        if op in (":-", "-", ":=", "="):
            if value is None:
                value = self.scalar(arg_parts)
                if op in (":=", "=") and not name.isdigit():
                    self.state.scalars[name] = ShellWord(value, self.where)
            return value
        if op in (":+", "+"):
            return self.scalar(arg_parts) if value is not None else ""
        if value is None:
            raise _Unresolved(reason)
        return value

    def _part_words(self, part: tuple, quoted: bool) -> list[ShellWord]:
        kind = part[0]
        if kind == "lit":
            return [ShellWord(part[1], self.where)]
        if kind == "unres":
            raise _Unresolved(part[2])
        if kind == "param":
            return [ShellWord(self._param(part[1], part[2], part[3]), self.where)]
        if kind == "arith":
            return [ShellWord(str(_arith(self.scalar(part[2]), self.state, part[1])), self.where)]
        if kind == "array":
            name, index = part[1], part[2]
            if name not in self.state.arrays:
                if name in self.state.scalars and index in ("@", "*", "0"):
                    return self._part_words(("param", name, "", [], quoted), quoted)
                raise _Unresolved(f"array {name} is not set in these files")
            elements = self.state.arrays[name]
            if index.isdigit():
                elements = elements[int(index):int(index) + 1]
            if index == "*" and quoted:
                if any(e.unresolved for e in elements):
                    raise _Unresolved(next(e.unresolved for e in elements if e.unresolved))
                return [ShellWord(" ".join(e.text for e in elements), self.where)]
            return list(elements)
        raise AssertionError(kind)

    def words(self, parts: list[tuple], raw: str) -> list[ShellWord]:
        """A word's fields after expansion and splitting (bash semantics, without globbing)."""
        fields: list[list[ShellWord]] = [[]]
        keep_empty = any(p[-1] is True for p in parts if p[0] in ("lit", "param", "array", "arith"))
        try:
            for part in parts:
                quoted = part[-1] is True if part[0] != "unres" else True
                pieces = self._part_words(part, quoted)
                for k, piece in enumerate(pieces):
                    if k:  # "${A[@]}": each element its own field
                        fields.append([])
                    if not quoted and part[0] != "lit" and not piece.unresolved:
                        self._split_into(fields, piece)
                    else:
                        fields[-1].append(piece)
        except _Unresolved as exc:
            return [ShellWord(raw, self.where, exc.reason)]
        out = []
        for f in fields:
            if any(w.unresolved for w in f):
                if len(f) == 1:
                    out.append(f[0])
                    continue
                reason = next(w.unresolved for w in f if w.unresolved)
                return [ShellWord(raw, self.where, reason)]
            text = "".join(w.text for w in f)
            if f and (text or keep_empty):
                origin = next((w.where for w in f if w.where != self.where), self.where)
                out.append(ShellWord(text, origin))
        return out

    @staticmethod
    def _split_into(fields: list[list[ShellWord]], word: ShellWord) -> None:
        pieces = re.split(r"[ \t\n]+", word.text)
        for k, piece in enumerate(pieces):
            if k:
                fields.append([])
            if piece:
                fields[-1].append(ShellWord(piece, word.where))


# -- commands -------------------------------------------------------------------------------------

_BLOCK_OPEN = {"if", "for", "while", "until", "select", "{", "case", "("}
_BLOCK_CLOSE = {"fi", "done", "}", "esac", ")"}
_LEADING_KEYWORDS = {"then", "do", "else", "elif", "!", "time", "exec", "nohup"}
_NOT_TRAINING = {"echo", "printf", "cat", "ls", "cp", "mv", "rm", "cd", "mkdir", "test", "[", "[[", "chmod", "touch",
                 "tee", "wget", "curl", "git", "pip", "pip3", "source", ".", "export", "sed", "grep", "awk", "head",
                 "tail", "python-config", "which", "realpath", "dirname", "basename"}
_DECLARE = {"export", "declare", "typeset", "local", "readonly"}


def _is_assignment_prefix(parts: list[tuple]) -> bool:
    text = "".join(p[1] for p in parts if p[0] == "lit" and not p[2])
    return bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\+?=", text)) and all(p[0] == "lit" and not p[2] for p in parts)


def _split_commands(tokens: list[Token]) -> list[list[Token]]:
    """Simple commands: token runs between ``;``, ``&&``, ``||``, ``|``, ``&`` and newlines; an
    array assignment's parentheses (and newlines in them) stay in its command."""
    commands: list[list[Token]] = []
    current: list[Token] = []
    depth = 0
    for tok in tokens:
        op = tok.value if tok.kind == "op" else None
        prev = current[-1] if current else None
        if op == "(" and (depth or (prev is not None and prev.kind == "word" and prev.raw.endswith("=")
                                    and _is_assignment_prefix(prev.value))):
            depth += 1
        elif op == ")" and depth:
            depth -= 1
        elif op == "\n" and depth:
            continue
        elif op in ("\n", ";", ";;", "&&", "||", "|", "|&", "&"):
            if current:
                commands.append(current)
            current = []
            continue
        current.append(tok)
    if depth:
        raise UserError("an array's ( is never closed by )")
    return commands


def read_file_args(path: str, text: str, state: ShellState) -> FileArgs:
    """The Megatron-LM arguments ``text`` gives, updating ``state`` with its variables."""
    blocks: list[tuple[str, int]] = []
    arrays_here: list[str] = []
    bare: list[ShellWord] = []
    training: tuple[int, list[ShellWord], list[ShellWord]] | None = None
    notes: list[str] = []
    awaiting_body = False
    for cmd in _split_commands(Lexer(text, path).run()):
        line = cmd[0].line
        where = f"{path}:{line}"
        tokens = [t for i, t in enumerate(cmd) if t.kind != "redir" and not (i and cmd[i - 1].kind == "redir")]
        while tokens and tokens[0].kind == "word" and tokens[0].raw in _LEADING_KEYWORDS:
            keyword, tokens = tokens[0].raw, tokens[1:]
            if keyword == "elif":  # its condition follows
                break
        if not tokens:
            continue
        head = tokens[0]
        name = head.raw if head.kind == "word" else head.value  # an operator: a subshell's or a stray parenthesis
        if name in _BLOCK_CLOSE:
            if blocks:
                blocks.pop()
            continue
        function = head.kind == "word" and (name == "function" or [t.value for t in tokens[1:3]] == ["(", ")"])  # `function f`, `f()`
        if name == "{" and awaiting_body:  # the body of `f()` on the line after it
            awaiting_body = False
            continue
        if name in _BLOCK_OPEN or function:
            blocks.append((name if name in _BLOCK_OPEN else "function", line))
            if name not in ("case", "("):
                awaiting_body = function and not any(t.kind == "word" and t.raw == "{" for t in tokens)
            continue
        inside = f"inside the {blocks[-1][0]!r} block at {path}:{blocks[-1][1]}" if blocks else None
        if any(b[0] == "case" for b in blocks):  # patterns and branches: only note what they assign
            for t in tokens:
                m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\+?=", t.raw) if t.kind == "word" else None
                if m:
                    state.arrays.pop(m.group(1), None)
                    state.scalars[m.group(1)] = ShellWord(f"${m.group(1)}", f"{path}:{t.line}",
                                                          f"{m.group(1)} is assigned {inside}, which the importer does not run")
            continue
        rest = tokens[1:] if name in _DECLARE else tokens
        while name in _DECLARE and rest and rest[0].kind == "word" and rest[0].raw.startswith("-"):  # its options (-a, -x)
            rest = rest[1:]
        rest = rest[_assignments(rest, path, state, inside, arrays_here):]
        if name in _DECLARE or not rest:
            continue
        words: list[ShellWord] = []
        for t in rest:
            if t.kind != "word":
                raise UserError(f"{where}: unexpected {t.value!r}; the importer reads simple commands, assignments and arrays")
            words += _Expander(state, f"{path}:{t.line}").words(t.value, t.raw)
        if not words:
            continue
        program = words[0].text
        if program.startswith("--") and not inside:
            bare += words
            continue
        script = next((i for i, w in enumerate(words) if not w.unresolved and w.text.endswith(".py")), None)
        if script is None or program.rsplit("/", 1)[-1] in _NOT_TRAINING:
            if program in ("source", "."):
                notes.append(f"{where}: `{' '.join(w.text for w in words)}` is not followed; give the files it "
                             "sources to import-megatron-args, before this one")
            continue
        if inside:
            raise UserError(f"{where}: the training command is {inside}; the importer does not run shell control "
                            "flow: move the command out of the block, or put its flags in arrays outside it")
        if training is not None:
            raise UserError(f"{where}: a second training command (the first is at {path}:{training[0]}); give one "
                            "training command per file")
        training = (line, words[1:script] if script else [], words[script + 1:])
    if training is not None:
        return FileArgs(path, tuple(training[2]), tuple(training[1]), f"the command at line {training[0]}", tuple(notes))
    args = [w for name in dict.fromkeys(arrays_here) for w in state.arrays.get(name, ())] + bare
    origin = ", ".join(f"array {n}" for n in dict.fromkeys(arrays_here)) + (", bare flags" if bare else "")
    return FileArgs(path, tuple(args), (), origin or "nothing", tuple(notes))


def _assignments(tokens: list[Token], path: str, state: ShellState, inside: str | None, arrays_here: list[str]) -> int:
    """Apply the leading ``NAME=value`` / ``NAME=( ... )`` of a command; returns how many tokens
    they took. Assignments before a program apply to it only and are skipped."""
    k, applied = 0, []
    while k < len(tokens):
        tok = tokens[k]
        if tok.kind != "word":
            break
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?=)", tok.raw)
        if not m or not tok.value or tok.value[0][0] != "lit" or tok.value[0][2]:
            break
        name, element, op = m.group(1), m.group(2), m.group(3)
        where = f"{path}:{tok.line}"
        if k + 1 < len(tokens) and tokens[k + 1].kind == "op" and tokens[k + 1].value == "(" and tok.raw.endswith("="):
            end = k + 2
            while not (tokens[end].kind == "op" and tokens[end].value == ")"):
                end += 1
            elements: list[ShellWord] = []
            for t in tokens[k + 2:end]:
                if t.kind == "word":
                    elements += _Expander(state, f"{path}:{t.line}").words(t.value, t.raw)
            applied.append(("array", name, op, elements, where))
            k = end + 1
            continue
        value_parts = _strip_prefix(tok.value, len(m.group(0)))
        try:
            text = _Expander(state, where).scalar(value_parts)
            word = ShellWord(text, where)
        except _Unresolved as exc:
            word = ShellWord(tok.raw[len(m.group(0)):], where, f"{name} is set from {tok.raw[len(m.group(0)):]} at {where}: "
                             f"{exc.reason}")
        applied.append(("element" if element else "scalar", name, op, word, where))
        k += 1
    if k < len(tokens):  # prefix assignments of a command: its environment only
        return k
    for kind, name, op, value, where in applied:
        if inside:
            reason = f"{name} is assigned {inside}, which the importer does not run"
            state.arrays.pop(name, None)
            state.scalars[name] = ShellWord(f"${name}", where, reason)
        elif kind == "array":
            old = state.arrays.get(name, ()) if op == "+=" else ()
            state.arrays[name] = tuple(old) + tuple(value)
            state.scalars.pop(name, None)
            arrays_here.append(name)
        elif kind == "element":
            state.arrays.pop(name, None)
            state.scalars[name] = ShellWord(f"${name}", where, f"{name} has an element assignment at {where}, which "
                                            "the importer does not evaluate")
        else:
            if op == "+=" and name in state.scalars and not value.unresolved:
                old = state.scalars[name]
                value = ShellWord(old.text + value.text, where, old.unresolved)
            state.scalars[name] = value
            state.arrays.pop(name, None)
    return k


def _strip_prefix(parts: list[tuple], n: int) -> list[tuple]:
    """``parts`` without its first ``n`` characters (the ``NAME=`` of an assignment, all literal)."""
    out, left = [], n
    for part in parts:
        if left and part[0] == "lit":
            take = min(left, len(part[1]))
            left -= take
            if part[1][take:]:
                out.append(("lit", part[1][take:], part[2]))
            continue
        out.append(part)
    return out


def read_files(files: Sequence[tuple[str, str]], variables: Mapping[str, str] | None = None) -> list[FileArgs]:
    """Every file's arguments, reading ``(path, text)`` pairs in order with one shared state."""
    state = state_with_variables(variables or {})
    return [read_file_args(path, text, state) for path, text in files]
