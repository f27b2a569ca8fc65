"""A strict reader of the TOML that fork.toml uses, for Pythons without tomllib (3.10) or tomli.

`deploy` runs with an image's own Python, as it is: on 3.10 that Python may have neither tomllib
(3.11+) nor tomli. fork.toml needs only a small part of TOML, and this reads exactly that part:

    # comments, blank lines
    [table]  [table.sub]  [table."quoted key"]  [[array of tables]]
    key = "basic string" | 'literal string' | true | false | 123 | ["one-line", "array"]

Anything else (multi-line strings or arrays, inline tables, dates, floats, dotted keys on the left
of `=`, redefinitions) raises TOMLDecodeError naming the line, so nothing is ever misread.
config.py prefers tomllib, then tomli, and uses this only when both are missing.
"""

from __future__ import annotations

import re
from typing import Any

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_SCALAR = re.compile(r"(true|false|[+-]?(0|[1-9](_?[0-9])*))(?=[ \t#,\]]|$)")
_ESCAPES = {'"': '"', "\\": "\\", "b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r"}


class TOMLDecodeError(ValueError):
    pass


class _Line:
    def __init__(self, text: str, number: int):
        self.s, self.i, self.n = text, 0, number

    def error(self, what: str) -> TOMLDecodeError:
        return TOMLDecodeError(f"{what} (line {self.n}, column {self.i + 1}; this Python has no tomllib/tomli, "
                               "and fork.toml may use only simple TOML here)")  # fmt: skip

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, ch: str) -> None:
        self.ws()
        if self.peek() != ch:
            raise self.error(f"expected {ch!r}")
        self.i += 1

    def end(self) -> None:
        self.ws()
        if self.peek() not in ("", "#"):
            raise self.error("unexpected text")

    def key(self) -> str:
        self.ws()
        if self.peek() in ('"', "'"):
            return self.string()
        m = _BARE.match(self.s, self.i)
        if not m:
            raise self.error("expected a key")
        self.i = m.end()
        return m.group()

    def string(self) -> str:
        quote = self.peek()
        self.i += 1
        if self.s.startswith(quote * 2, self.i):
            raise self.error("multi-line strings are not supported")
        out = []
        while True:
            ch = self.peek()
            if ch == "":
                raise self.error("unterminated string")
            self.i += 1
            if ch == quote:
                return "".join(out)
            if ch == "\\" and quote == '"':
                esc = self.peek()
                self.i += 1
                if esc in _ESCAPES:
                    out.append(_ESCAPES[esc])
                elif esc in ("u", "U"):
                    width = 4 if esc == "u" else 8
                    digits = self.s[self.i : self.i + width]
                    if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                        raise self.error("bad unicode escape")
                    out.append(chr(int(digits, 16)))
                    self.i += width
                else:
                    raise self.error(f"bad escape \\{esc}")
            else:
                out.append(ch)

    def value(self) -> Any:
        self.ws()
        ch = self.peek()
        if ch in ('"', "'"):
            return self.string()
        if ch == "[":
            self.i += 1
            items = []
            while True:
                self.ws()
                if self.peek() == "]":
                    self.i += 1
                    return items
                items.append(self.value())
                self.ws()
                if self.peek() == ",":
                    self.i += 1
                elif self.peek() != "]":
                    raise self.error("expected ',' or ']' (arrays must fit on one line)")
        m = _SCALAR.match(self.s, self.i)
        if not m:
            raise self.error("unsupported value")
        self.i = m.end()
        word = m.group(1)
        if word in ("true", "false"):
            return word == "true"
        return int(word.replace("_", ""))


def loads(text: str) -> dict[str, Any]:
    root: dict[str, Any] = {}
    table = root
    defined: set[tuple[str, ...]] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = _Line(raw, number)
        line.ws()
        if line.peek() in ("", "#"):
            continue
        if line.peek() == "[":
            array = line.s.startswith("[[", line.i)
            line.i += 2 if array else 1
            path = [line.key()]
            line.ws()
            while line.peek() == ".":
                line.i += 1
                path.append(line.key())
                line.ws()
            line.expect("]")
            if array:
                line.expect("]")
            line.end()
            node = root
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if isinstance(node, list):
                    node = node[-1]
                if not isinstance(node, dict):
                    raise line.error(f"{part!r} is not a table")
            last = path[-1]
            if array:
                arr = node.setdefault(last, [])
                if not isinstance(arr, list):
                    raise line.error(f"{last!r} is not an array of tables")
                table = {}
                arr.append(table)
            else:
                if tuple(path) in defined or not isinstance(node.setdefault(last, {}), dict):
                    raise line.error(f"table {'.'.join(path)!r} defined twice")
                defined.add(tuple(path))
                table = node[last]
            continue
        key = line.key()
        line.expect("=")
        value = line.value()
        line.end()
        if key in table:
            raise line.error(f"key {key!r} defined twice")
        table[key] = value
    return root
