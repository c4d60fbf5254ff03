"""The tokens of a bash file: words (as parts to expand later), operators and redirections.

    python -m orchestration import-megatron-args model.sh data.sh --model-out m.yaml --data-out d.yaml

:class:`Lexer` turns a file's text into :class:`Token` s for :mod:`orchestration.import_args.shell`,
which splits them into commands and expands the words: comments, ``\\`` line continuations,
single, double and ``$'...'`` quotes, here-documents (skipped), ``$NAME``, ``${...}``, ``$((...))``;
command substitution is kept as unresolved. A word is a list of parts: ("lit", text, quoted),
("param", name, op, arg_parts, quoted), ("array", name, index, quoted), ("arith", raw, parts,
quoted), ("unres", raw, reason). Pure: text in, tokens out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_ext.run_spec.errors import UserError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPECIAL = {"@": "$@ (the script's arguments)", "*": "$* (the script's arguments)", "#": "$# (the argument count)",
            "?": "$? (the last exit status)", "$": "$$ (the shell's pid)", "!": "$! (a background pid)",
            "0": "$0 (the script's name)", "-": "$- (the shell's options)"}


@dataclass
class Token:
    kind: str  # word | op | redir
    value: object
    line: int
    raw: str = ""


class Lexer:
    def __init__(self, text: str, path: str):
        self.s, self.i, self.line, self.path = text, 0, 1, path
        self.tokens: list[Token] = []
        self.heredocs: list[tuple[str, bool]] = []

    def error(self, message: str, line: int | None = None) -> UserError:
        return UserError(f"{self.path}:{line or self.line}: {message}")

    def peek(self, k: int = 0) -> str:
        """The character ``k`` ahead; NUL past the end (``"" in "<>"`` would be true)."""
        return self.s[self.i + k] if self.i + k < len(self.s) else "\0"

    def run(self) -> list[Token]:
        while self.i < len(self.s):
            c = self.peek()
            if c == "\\" and self.peek(1) == "\n":
                self.i += 2
                self.line += 1
            elif c in " \t\r":
                self.i += 1
            elif c == "\n":
                self.tokens.append(Token("op", "\n", self.line))
                self.i += 1
                self.line += 1
                self._skip_heredocs()
            elif c == "#":
                while self.i < len(self.s) and self.peek() != "\n":
                    self.i += 1
            elif c in "();|&":
                two = self.s[self.i:self.i + 2]
                op = two if two in ("&&", "||", ";;", "|&", "&>") else c
                if op == "&>":
                    self.i += 2
                    self._redirect_target("&>")
                    continue
                self.tokens.append(Token("op", op, self.line))
                self.i += len(op)
            elif c in "<>":
                self._redirect("")
            else:
                self._word()
        self.tokens.append(Token("op", "\n", self.line))
        return self.tokens

    def _redirect(self, fd: str) -> None:
        start = self.i
        while self.peek() in "<>":
            self.i += 1
        op = fd + self.s[start:self.i]
        if op.endswith("<<") and not op.endswith("<<<"):
            if self.peek() == "-":
                self.i += 1
            while self.peek() in " \t":
                self.i += 1
            m = re.match(r"['\"]?([A-Za-z_0-9]+)['\"]?", self.s[self.i:])
            if not m:
                raise self.error("a here-document without a delimiter")
            self.heredocs.append((m.group(1), True))
            self.i += m.end()
            return
        if self.peek() == "&":
            self.i += 1
            while self.peek().isdigit() or self.peek() == "-":
                self.i += 1
            return
        self._redirect_target(op)

    def _redirect_target(self, op: str) -> None:
        while self.peek() in " \t":
            self.i += 1
        self.tokens.append(Token("redir", op, self.line))

    def _skip_heredocs(self) -> None:
        for delimiter, _ in self.heredocs:
            while self.i < len(self.s):
                end = self.s.find("\n", self.i)
                end = len(self.s) if end < 0 else end
                body_line = self.s[self.i:end]
                self.i, self.line = end + 1, self.line + 1
                if body_line.strip() == delimiter:
                    break
        self.heredocs.clear()

    def _word(self) -> None:
        start, line = self.i, self.line
        parts: list[tuple] = []
        while self.i < len(self.s):
            c = self.peek()
            if c in " \t\r\n;&|<>()":
                break
            if c == "\\":
                if self.peek(1) == "\n":
                    self.i += 2
                    self.line += 1
                    continue
                parts.append(("lit", self.peek(1), True))
                self.i += 2
            elif c == "'":
                parts.append(self._single_quoted(line))
            elif c == "$" and self.peek(1) == "'":
                end = self.s.find("'", self.i + 2)
                if end < 0:
                    raise self.error("a $'...' quote is never closed", line)
                text = self.s[self.i + 2:end].encode().decode("unicode_escape")
                parts.append(("lit", text, True))
                self.i = end + 1
            elif c == '"':
                self.i += 1
                parts += self._double_quoted(line)
            elif c in "$`":  # an expansion, or command substitution (kept unresolved)
                parts.append(self._dollar(quoted=False) if c == "$" else self._backtick())
            else:
                parts.append(("lit", c, False))
                self.i += 1
        if self.peek() in "<>" and parts and all(p[0] == "lit" and not p[2] for p in parts) \
                and self.s[start:self.i].isdigit():
            self._redirect(self.s[start:self.i])
            return
        self.tokens.append(Token("word", parts, line, self.s[start:self.i]))

    def _single_quoted(self, line: int) -> tuple:
        end = self.s.find("'", self.i + 1)
        if end < 0:
            raise self.error("a single quote is never closed", line)
        text = self.s[self.i + 1:end]
        self.line += text.count("\n")
        self.i = end + 1
        return ("lit", text, True)

    def _double_quoted(self, line: int) -> list[tuple]:
        parts: list[tuple] = []
        while True:
            if self.i >= len(self.s):
                raise self.error("a double quote is never closed", line)
            c = self.peek()
            if c == '"':
                self.i += 1
                return parts or [("lit", "", True)]
            if c == "\\" and self.peek(1) in '$`"\\\n':
                if self.peek(1) == "\n":
                    self.line += 1
                else:
                    parts.append(("lit", self.peek(1), True))
                self.i += 2
            elif c in "$`":
                parts.append(self._dollar(quoted=True) if c == "$" else self._backtick())
            else:
                if c == "\n":
                    self.line += 1
                parts.append(("lit", c, True))
                self.i += 1

    def _backtick(self) -> tuple:
        end = self.s.find("`", self.i + 1)
        if end < 0:
            raise self.error("a backtick is never closed")
        raw = self.s[self.i:end + 1]
        self.i = end + 1
        return ("unres", raw, f"command substitution {raw} is not run by the importer")

    def _matching(self, open_: str, close: str, start: int) -> int:
        """Index just past the ``close`` that balances the ``open_`` before ``start``."""
        depth, i = 1, start
        while i < len(self.s):
            c = self.s[i]
            if c == "\\":
                i += 2
                continue
            if c == "'" and open_ != "{":
                i = self.s.find("'", i + 1) + 1 or len(self.s)
                continue
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        raise self.error(f"a {open_} after $ is never closed")

    def _dollar(self, quoted: bool) -> tuple:
        nxt = self.peek(1)
        if self.s.startswith("$((", self.i):
            end = self._matching("(", ")", self.i + 2)
            raw = self.s[self.i:end]
            self.i = end
            if not raw.endswith("))"):
                return ("unres", raw, f"{raw} is not run by the importer")
            inner = Lexer(raw[3:-2], self.path)
            inner.line = self.line
            return ("arith", raw, inner._expression_parts(), quoted)
        if nxt == "(":
            end = self._matching("(", ")", self.i + 2)
            raw = self.s[self.i:end]
            self.line += raw.count("\n")
            self.i = end
            return ("unres", raw, f"command substitution {raw} is not run by the importer")
        if nxt == "{":
            end = self._matching("{", "}", self.i + 2)
            raw = self.s[self.i:end]
            self.i = end
            return self._braced(raw, quoted)
        m = _NAME.match(self.s, self.i + 1)
        if m:
            self.i = m.end()
            return ("param", m.group(0), "", [], quoted)
        if nxt.isdigit():
            self.i += 2
            return ("param", nxt, "", [], quoted)
        if nxt in _SPECIAL:
            self.i += 2
            return ("unres", "$" + nxt, f"{_SPECIAL[nxt]} is not known to the importer")
        self.i += 1
        return ("lit", "$", quoted)

    def _expression_parts(self) -> list[tuple]:
        """An arithmetic expression's parts: ``$x`` expansions and the literal text between them."""
        parts: list[tuple] = []
        while self.i < len(self.s):
            if self.peek() == "$":
                parts.append(self._dollar(quoted=True))
            else:
                parts.append(("lit", self.peek(), True))
                self.i += 1
        return parts

    def _braced(self, raw: str, quoted: bool) -> tuple:
        body = raw[2:-1]
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[(@|\*|\d+)\]", body)
        if m:
            return ("array", m.group(1), m.group(2), quoted)
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|\d+)(?:(:-|-|:=|=|:\+|\+)(.*))?", body, re.S)
        if m:
            arg_parts: list[tuple] = []
            if m.group(2):
                inner = Lexer(m.group(3), self.path)
                inner.line = self.line
                arg_parts = inner._default_parts(quoted)
            return ("param", m.group(1), m.group(2) or "", arg_parts, quoted)
        return ("unres", raw, f"{raw} uses an expansion the importer does not evaluate")

    def _default_parts(self, quoted: bool) -> list[tuple]:
        """The word after ``:-`` in ``${X:-word}`` (quotes and expansions allowed)."""
        parts: list[tuple] = []
        while self.i < len(self.s):
            c = self.peek()
            if c == '"':
                self.i += 1
                parts += self._double_quoted(self.line)
            elif c == "'":
                parts.append(self._single_quoted(self.line))
            elif c == "$":
                parts.append(self._dollar(quoted))
            else:
                parts.append(("lit", c, quoted))
                self.i += 1
        return parts
