"""SQLFlow's extended SQL: a standard SELECT followed by one of three extension clauses.

::

    <select> TO TRAIN <model> [WITH attrs] [COLUMN exprs [FOR name] ...] [LABEL column] INTO <name> [;]
    <select> TO PREDICT <table>.<column> [WITH attrs] USING <name> [;]
    <select> TO EVALUATE <name> [WITH attrs] [LABEL column] INTO <table> [;]

The SELECT (everything before the first ``TO TRAIN|PREDICT|EVALUATE`` outside quotes, comments and
parentheses) is checked with sqlglot in its dialect-neutral form; the extension clauses are parsed here by
hand. ``attrs`` are ``dotted.name = value`` separated by commas, each value a Python-ish literal: a number, a
quoted string, ``true``/``false``, a bare word (a string) or a ``[list]`` of those. A ``COLUMN`` clause is
a list of column expressions (a name or ``FUNC(arg, ...)``, whose arguments are expressions, literals or
lists); several ``COLUMN ... FOR name`` clauses give column groups (``FOR linear`` and ``FOR dnn`` for a
wide-and-deep model, as SQLFlow's ``linear_feature_columns``/``dnn_feature_columns``). A name may be
double- or back-quoted (``LABEL "label"``). Keywords are case-insensitive.

A syntax error is one :class:`SqlFlowSyntaxError` naming the clause and the 1-based character position in
the statement: ``TO TRAIN: expected INTO <name> at position 87 (found ';')``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from edl_argo.errors import ConfigError

#: Attribute values: scalars, or (nested) lists of them.
AttrValue = Any


class SqlFlowSyntaxError(ConfigError):
    """A statement that does not parse; the message names the clause and the position."""


@dataclass(frozen=True)
class Name:
    """A column named in a COLUMN or LABEL clause, at ``position`` (1-based) of the statement."""

    name: str
    position: int = 0


@dataclass(frozen=True)
class Call:
    """A feature-column function applied to arguments: ``CATEGORY_ID(workclass, 16)``."""

    function: str
    args: tuple[Any, ...]
    position: int = 0


#: A COLUMN clause's expression: a :class:`Name`, a :class:`Call`, or a literal argument of a call.
ColumnExpr = Any


@dataclass(frozen=True)
class TrainStatement:
    """``TO TRAIN``: ``columns`` maps each ``FOR`` group (``""`` for a clause without one) to its
    expressions; empty when the statement has no COLUMN clause (the columns are then derived)."""

    select: str
    model: str
    attrs: dict[str, AttrValue] = field(default_factory=dict)
    columns: dict[str, tuple[ColumnExpr, ...]] = field(default_factory=dict)
    label: str = ""
    into: str = ""


@dataclass(frozen=True)
class PredictStatement:
    """``TO PREDICT table.column``: the rows of ``select`` and the prediction go to a new ``table``."""

    select: str
    table: str
    column: str
    attrs: dict[str, AttrValue] = field(default_factory=dict)
    using: str = ""


@dataclass(frozen=True)
class EvaluateStatement:
    """``TO EVALUATE model``: one row of ``model``'s metrics on ``select`` goes to a new table ``into``."""

    select: str
    model: str
    attrs: dict[str, AttrValue] = field(default_factory=dict)
    label: str = ""
    into: str = ""


Statement = TrainStatement | PredictStatement | EvaluateStatement

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|--[^\n]*)
  | (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
  | (?P<string>'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.)*"|`[^`]*`)
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[()\[\],=.;])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Token:
    kind: str  # number, string, word, punct, end
    text: str
    position: int  # 0-based offset in the statement

    @property
    def shown(self) -> str:
        return "the end of the statement" if self.kind == "end" else repr(self.text)


def _tokens(statement: str, start: int, clause: str) -> list[_Token]:
    tokens = []
    offset = start
    while offset < len(statement):
        match = _TOKEN.match(statement, offset)
        if match is None:
            raise SqlFlowSyntaxError(
                f"{clause}: unexpected character {statement[offset]!r} at position {offset + 1}"
            )
        if match.lastgroup != "space":
            tokens.append(_Token(match.lastgroup or "", match.group(), offset))
        offset = match.end()
    tokens.append(_Token("end", "", len(statement)))
    return tokens


def _split(statement: str) -> tuple[str, int, str]:
    """(the SELECT, the offset of its ``TO``, the verb TRAIN/PREDICT/EVALUATE): the first ``TO <verb>`` at
    depth 0, outside quotes and comments."""
    depth = 0
    i = 0
    pattern = re.compile(r"TO\s+(TRAIN|PREDICT|EVALUATE)\b", re.IGNORECASE)
    while i < len(statement):
        char = statement[i]
        if char in "'\"`":
            end = statement.find(char, i + 1)
            while end != -1 and char == "'" and statement[end + 1 : end + 2] == "'":
                end = statement.find(char, end + 2)  # '' inside a SQL string
            if end == -1:
                raise SqlFlowSyntaxError(f"SELECT: unterminated quote {char} at position {i + 1}")
            i = end + 1
            continue
        if statement.startswith("--", i):
            newline = statement.find("\n", i)
            i = len(statement) if newline == -1 else newline + 1
            continue
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif depth == 0 and (i == 0 or not (statement[i - 1].isalnum() or statement[i - 1] == "_")):
            match = pattern.match(statement, i)
            if match:
                return statement[:i].strip(), i, match.group(1).upper()
        i += 1
    raise SqlFlowSyntaxError(
        f"statement: expected TO TRAIN, TO PREDICT or TO EVALUATE after the SELECT at position "
        f"{len(statement.rstrip().rstrip(';').rstrip()) + 1}"
    )


def check_select(select: str) -> str:
    """``select`` if sqlglot parses it as one query (SELECT, WITH ..., UNION); else SqlFlowSyntaxError."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import ParseError

    if not select:
        raise SqlFlowSyntaxError("SELECT: the statement must start with a SELECT at position 1")
    try:
        parsed = sqlglot.parse(select)
    except ParseError as error:
        detail = error.errors[0] if error.errors else {}
        where = f" at line {detail.get('line')} column {detail.get('col')}" if detail else ""
        message = str(detail.get("description") or error).splitlines()[0]
        raise SqlFlowSyntaxError(f"SELECT: {message}{where}") from None
    if len(parsed) != 1 or not isinstance(parsed[0], exp.Query):
        raise SqlFlowSyntaxError("SELECT: the statement must start with one SELECT query at position 1")
    return select


class _Parser:
    """A cursor over the extension clauses' tokens."""

    def __init__(self, statement: str, start: int, clause: str) -> None:
        self.clause = clause
        self.tokens = _tokens(statement, start, clause)
        self.index = 0

    @property
    def token(self) -> _Token:
        return self.tokens[self.index]

    def fail(self, expected: str) -> SqlFlowSyntaxError:
        token = self.token
        return SqlFlowSyntaxError(
            f"{self.clause}: expected {expected} at position {token.position + 1} (found {token.shown})"
        )

    def keyword(self, *words: str) -> str | None:
        """The next token if it is one of the keywords ``words`` (consumed), else None."""
        if self.token.kind == "word" and self.token.text.upper() in words:
            self.index += 1
            return self.tokens[self.index - 1].text.upper()
        return None

    def expect_keyword(self, word: str, what: str) -> None:
        if self.keyword(word) is None:
            raise self.fail(f"{word} {what}".strip())

    def punct(self, char: str) -> bool:
        if self.token.kind == "punct" and self.token.text == char:
            self.index += 1
            return True
        return False

    def identifier(self, what: str) -> Name:
        """A plain or quoted name (``"label"``, `` `label` ``)."""
        token = self.token
        if token.kind == "word" or (token.kind == "string" and token.text[0] in '"`'):
            self.index += 1
            text = token.text if token.kind == "word" else token.text[1:-1]
            return Name(text, token.position + 1)
        raise self.fail(what)

    def dotted(self, what: str, parts: int = 0) -> str:
        """``a.b.c`` (``parts``: exactly that many parts, if not 0)."""
        names = [self.identifier(what).name]
        while self.punct("."):
            names.append(self.identifier(what).name)
        if parts and len(names) != parts:
            self.index -= 1
            raise self.fail(what)
        return ".".join(names)

    def literal(self, what: str = "a value") -> AttrValue:
        token = self.token
        if self.punct("["):
            items = []
            if not self.punct("]"):
                items.append(self.literal())
                while self.punct(","):
                    items.append(self.literal())
                if not self.punct("]"):
                    raise self.fail("',' or ']'")
            return items
        if token.kind == "number":
            self.index += 1
            text = token.text
            return float(text) if any(c in text for c in ".eE") else int(text)
        if token.kind == "string" and token.text[0] in "'\"":
            self.index += 1
            quote = token.text[0]
            body = token.text[1:-1].replace(quote * 2, quote) if quote == "'" else token.text[1:-1]
            return re.sub(r"\\(.)", r"\1", body)
        if token.kind == "word":
            self.index += 1
            lowered = token.text.lower()
            return {"true": True, "false": False}.get(lowered, token.text)
        raise self.fail(what)

    def attrs(self) -> dict[str, AttrValue]:
        """``name = value [, name = value ...]`` after WITH."""
        attrs: dict[str, AttrValue] = {}
        while True:
            position = self.token.position + 1
            name = self.dotted("an attribute name (e.g. model.hidden_units)")
            if name in attrs:
                raise SqlFlowSyntaxError(
                    f"{self.clause}: attribute {name} given twice at position {position}"
                )
            if not self.punct("="):
                raise self.fail(f"'=' after {name}")
            attrs[name] = self.literal(f"a value for {name}")
            if not self.punct(","):
                return attrs

    def column_expr(self) -> ColumnExpr:
        token = self.token
        if token.kind == "word" and self.tokens[self.index + 1].text == "(":
            self.index += 2
            args: list[ColumnExpr] = []
            if not self.punct(")"):
                args.append(self.column_arg())
                while self.punct(","):
                    args.append(self.column_arg())
                if not self.punct(")"):
                    raise self.fail("',' or ')'")
            return Call(token.text.upper(), tuple(args), token.position + 1)
        return self.identifier("a column name or a feature column such as NUMERIC(col)")

    def column_arg(self) -> ColumnExpr:
        token = self.token
        if self.punct("["):
            items: list[ColumnExpr] = []
            if not self.punct("]"):
                items.append(self.column_arg())
                while self.punct(","):
                    items.append(self.column_arg())
                if not self.punct("]"):
                    raise self.fail("',' or ']'")
            return items
        if token.kind == "word" and self.tokens[self.index + 1].text == "(":
            return self.column_expr()
        if token.kind == "word" and token.text.lower() not in ("true", "false"):
            return self.identifier("a column name")
        if token.kind == "string" and token.text[0] == "`":
            return self.identifier("a column name")
        return self.literal("a column, number, string or list")

    def columns(self) -> tuple[ColumnExpr, ...]:
        exprs = [self.column_expr()]
        while self.punct(","):
            exprs.append(self.column_expr())
        return tuple(exprs)

    def end(self) -> None:
        self.punct(";")
        if self.token.kind != "end":
            raise self.fail("the end of the statement")


def parse(statement: str) -> Statement:
    """``statement`` as a :class:`TrainStatement`, :class:`PredictStatement` or
    :class:`EvaluateStatement`; :class:`SqlFlowSyntaxError` naming the clause and position otherwise."""
    select, start, verb = _split(statement)
    check_select(select)
    clause = f"TO {verb}"
    parser = _Parser(statement, start, clause)
    parser.keyword("TO")
    parser.keyword(verb)
    if verb == "TRAIN":
        return _train(parser, select)
    if verb == "PREDICT":
        return _predict(parser, select)
    return _evaluate(parser, select)


_KEYWORDS = ("WITH", "COLUMN", "LABEL", "INTO", "USING", "FOR")


def _name(parser: _Parser, what: str) -> str:
    """A dotted name that is not one of the clauses' keywords."""
    if parser.token.kind == "word" and parser.token.text.upper() in _KEYWORDS:
        raise parser.fail(what)
    return parser.dotted(what)


def _train(parser: _Parser, select: str) -> TrainStatement:
    model = _name(parser, "a model name (e.g. DNNClassifier)")
    attrs = parser.attrs() if parser.keyword("WITH") else {}
    columns: dict[str, tuple[ColumnExpr, ...]] = {}
    while parser.keyword("COLUMN"):
        parser.clause = "COLUMN"
        exprs = parser.columns()
        group = parser.identifier("a column group name after FOR").name if parser.keyword("FOR") else ""
        if group in columns:
            raise parser.fail(f"a COLUMN clause for a group other than {group or 'the default'}")
        columns[group] = exprs
    if "" in columns and len(columns) > 1:
        raise SqlFlowSyntaxError(
            "COLUMN: either one COLUMN clause or COLUMN ... FOR <group> clauses, not both"
        )
    label = ""
    if parser.keyword("LABEL"):
        parser.clause = "LABEL"
        label = parser.identifier("a label column").name
    parser.clause = "TO TRAIN"
    if parser.keyword("INTO") is None:
        raise parser.fail("COLUMN, LABEL or INTO <name>" if not columns and not label else "INTO <name>")
    into = parser.dotted("a model name after INTO")
    parser.end()
    return TrainStatement(select, model, attrs, columns, label, into)


def _predict(parser: _Parser, select: str) -> PredictStatement:
    token = parser.token
    target = parser.dotted("<table>.<column> (the result table and its predicted column)")
    if "." not in target:
        parser.index -= 1
        raise SqlFlowSyntaxError(
            f"TO PREDICT: expected <table>.<column> at position {token.position + 1} (found {token.shown})"
        )
    table, _, column = target.rpartition(".")
    attrs = parser.attrs() if parser.keyword("WITH") else {}
    parser.expect_keyword("USING", "<model name>")
    using = parser.dotted("a model name after USING")
    parser.end()
    return PredictStatement(select, table, column, attrs, using)


def _evaluate(parser: _Parser, select: str) -> EvaluateStatement:
    model = _name(parser, "a model name")
    attrs = parser.attrs() if parser.keyword("WITH") else {}
    label = ""
    if parser.keyword("LABEL"):
        parser.clause = "LABEL"
        label = parser.identifier("a label column").name
        parser.clause = "TO EVALUATE"
    parser.expect_keyword("INTO", "<table>")
    into = parser.dotted("a table name after INTO")
    parser.end()
    return EvaluateStatement(select, model, attrs, label, into)
