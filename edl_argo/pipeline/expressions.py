"""The part of Argo's expression language (expr-lang) that retry strategies use, for the local runner.

``retryStrategy.expression`` decides whether a failed attempt is retried, from ``lastRetry.exitCode``,
``lastRetry.status``, ``lastRetry.duration``, ``lastRetry.message`` and ``retries``. :func:`evaluate`
understands what such expressions are made of: string and number literals, those variables, ``asInt(x)``
and ``asFloat(x)``, the comparisons ``== != < <= > >=``, ``contains``, ``matches`` (a regular expression),
``!``/``not``, ``&&``/``and``, ``||``/``or`` and parentheses. Anything else is a :class:`ConfigError` naming
the expression, so a workflow the runner cannot judge is refused, not misjudged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from edl_argo.errors import ConfigError

_TOKEN = re.compile(
    r"""\s*(?:(?P<number>\d+(?:\.\d+)?)|(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')|"""
    r"""(?P<op>&&|\|\||==|!=|<=|>=|<|>|!|\(|\)|,)|(?P<name>[A-Za-z_][A-Za-z0-9_.]*))"""
)
_FUNCTIONS = {"asInt": lambda v: int(float(v)), "asFloat": float}
_WORDS = {"and": "&&", "or": "||", "not": "!"}
_COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "contains": lambda a, b: str(b) in str(a),
    "matches": lambda a, b: re.search(str(b), str(a)) is not None,
}


def evaluate(expression: str, variables: Mapping[str, Any]) -> Any:
    """The value of ``expression`` with ``variables`` (``{"lastRetry.exitCode": "137", ...}``); ``&&`` and
    ``||`` evaluate their right side only when needed, as expr does."""
    parser = _Parser(expression, variables)
    value = parser.expression()
    if parser.peek() is not None:
        parser.fail(f"unexpected {parser.peek()!r}")
    return value()


Thunk = Callable[[], Any]


class _Parser:
    def __init__(self, text: str, variables: Mapping[str, Any]) -> None:
        self.text, self.variables, self.tokens, self.position = text, variables, [], 0
        index = 0
        while index < len(text.rstrip()):
            match = _TOKEN.match(text, index)
            if match is None or match.end() == index:
                self.fail(f"cannot read {text[index:].strip()[:20]!r}")
            kind = match.lastgroup
            value = match.group(kind or "")
            if kind == "name" and value in _WORDS:
                kind, value = "op", _WORDS[value]
            self.tokens.append((kind, value))
            index = match.end()

    def fail(self, problem: str) -> NoReturn:
        raise ConfigError(f"retry expression {self.text!r}: {problem} (the local runner's subset of expr)")

    def peek(self) -> str | None:
        return self.tokens[self.position][1] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> tuple[str | None, str]:
        if self.position >= len(self.tokens):
            self.fail("it ends too early")
        token = self.tokens[self.position]
        if expected is not None and token[1] != expected:
            self.fail(f"expected {expected!r}, found {token[1]!r}")
        self.position += 1
        return token

    def expression(self) -> Thunk:
        value = self.conjunction()
        while self.peek() == "||":
            self.take()
            value = (lambda left, right: lambda: bool(left()) or bool(right()))(value, self.conjunction())
        return value

    def conjunction(self) -> Thunk:
        value = self.negation()
        while self.peek() == "&&":
            self.take()
            value = (lambda left, right: lambda: bool(left()) and bool(right()))(value, self.negation())
        return value

    def negation(self) -> Thunk:
        if self.peek() == "!":
            self.take()
            inner = self.negation()
            return lambda: not inner()
        return self.comparison()

    def comparison(self) -> Thunk:
        left = self.primary()
        operator = self.peek()
        if operator not in _COMPARISONS:
            return left
        self.take()
        right = self.primary()

        def compare() -> Any:
            a, b = left(), right()
            try:
                return _COMPARISONS[operator](a, b)
            except (TypeError, re.error) as error:
                self.fail(f"{a!r} {operator} {b!r}: {error}")

        return compare

    def primary(self) -> Thunk:
        kind, value = self.take()
        if value == "(" and kind == "op":
            inner = self.expression()
            self.take(")")
            return inner
        if kind == "number":
            number = float(value) if "." in value else int(value)
            return lambda: number
        if kind == "string":
            text = bytes(value[1:-1], "utf-8").decode("unicode_escape")
            return lambda: text
        if kind == "name" and self.peek() == "(" and value in _FUNCTIONS:
            self.take("(")
            argument = self.expression()
            self.take(")")

            def call() -> Any:
                given = argument()
                try:
                    return _FUNCTIONS[value](given)
                except (TypeError, ValueError):
                    self.fail(f"{value}({given!r}) is not a number")

            return call
        if kind == "name" and value in self.variables:
            return lambda: self.variables[value]
        self.fail(f"unknown {value!r}")
