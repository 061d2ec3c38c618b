"""The sample filters' expression language: a tokenizer, the parsed terms (which evaluate on a metadata record),
and a recursive-descent parser; never handed to Python's ``eval``::

    punsafe < 0.5 and pwatermark < 0.8 and similarity >= 0.28 and NSFW != 'NSFW'

- comparisons ``<  <=  >  >=  ==  !=`` between field names, numbers (``0.5``, ``-3``, ``1e-3``), quoted strings
  (``'NSFW'`` or ``"NSFW"``) and ``true`` / ``false``; ``and``, ``or``, ``not`` and parentheses.
- Numbers compare with numbers, strings with strings (by code point), booleans only with ``==`` / ``!=``.

A field a comparison reads that is absent, ``null`` (or NaN), or of the other kind raises :class:`FieldProblem`;
:func:`split_rules` gives the top-level ``and`` terms with their text, which :mod:`clip_jax.data.filters` makes
its rules.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from clip_jax.errors import InvalidInput

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<number>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<op><=|>=|==|!=|<|>)
  | (?P<paren>[()])
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
""", re.VERBOSE)
_KEYWORDS = ("and", "or", "not", "true", "false")
_COMPARE = {
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}


class FilterSyntaxError(InvalidInput):
    """An expression that does not parse; the message names the column."""


@dataclasses.dataclass(frozen=True)
class Token:
    kind: str  # number | string | op | paren | name | keyword | end
    text: str
    column: int  # 0-based offset in the expression


def tokenize(expression: str) -> list[Token]:
    tokens, position = [], 0
    while position < len(expression):
        match = _TOKEN.match(expression, position)
        if match is None:
            raise _syntax_error(expression, position, f"unexpected character {expression[position]!r}")
        kind, text = match.lastgroup, match.group()
        if kind == "name" and text in _KEYWORDS:
            kind = "keyword"
        if kind != "space":
            tokens.append(Token(kind, text, position))
        position = match.end()
    tokens.append(Token("end", "", len(expression)))
    return tokens


def _syntax_error(expression: str, column: int, message: str) -> FilterSyntaxError:
    return FilterSyntaxError(f"cannot parse the filter {expression!r} at column {column + 1}: {message}")


# -- the parsed expression -------------------------------------------------------------------------------------


class FieldProblem(Exception):
    """A field a comparison reads is missing, null, or of the other kind; ``kind`` is missing | null | type."""

    def __init__(self, kind: str, field: str):
        super().__init__(f"{kind} {field}")
        self.kind, self.field = kind, field


@dataclasses.dataclass(frozen=True)
class Literal:
    value: Any

    def get(self, record: Mapping[str, Any]) -> Any:
        return self.value

    def fields(self) -> tuple[str, ...]:
        return ()


@dataclasses.dataclass(frozen=True)
class Field:
    name: str

    def get(self, record: Mapping[str, Any]) -> Any:
        if self.name not in record:
            raise FieldProblem("missing", self.name)
        value = record[self.name]
        if value is None or (isinstance(value, float) and math.isnan(value)):  # parquet writes NaN for nulls
            raise FieldProblem("null", self.name)
        return value

    def fields(self) -> tuple[str, ...]:
        return (self.name,)


def value_kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return None


@dataclasses.dataclass(frozen=True)
class Compare:
    op: str
    left: Literal | Field
    right: Literal | Field

    def holds(self, record: Mapping[str, Any]) -> bool:
        a, b = self.left.get(record), self.right.get(record)
        kind_a, kind_b = value_kind(a), value_kind(b)
        if kind_a is None or kind_a != kind_b or (kind_a == "bool" and self.op not in ("==", "!=")):
            culprit = next(iter(self.left.fields() + self.right.fields()), "")
            raise FieldProblem("type", culprit)
        return _COMPARE[self.op](a, b)

    def fields(self) -> tuple[str, ...]:
        return self.left.fields() + self.right.fields()


@dataclasses.dataclass(frozen=True)
class Not:
    term: Any

    def holds(self, record: Mapping[str, Any]) -> bool:
        return not self.term.holds(record)

    def fields(self) -> tuple[str, ...]:
        return self.term.fields()


@dataclasses.dataclass(frozen=True)
class Junction:
    op: str  # and | or
    terms: tuple[Any, ...]

    def holds(self, record: Mapping[str, Any]) -> bool:
        if self.op == "and":
            return all(t.holds(record) for t in self.terms)
        return any(t.holds(record) for t in self.terms)

    def fields(self) -> tuple[str, ...]:
        return tuple(f for t in self.terms for f in t.fields())


class _Parser:
    """Recursive descent: or_expr := and_expr ('or' and_expr)*; and_expr := not_expr ('and' not_expr)*;
    not_expr := 'not' not_expr | '(' or_expr ')' | operand OP operand."""

    def __init__(self, expression: str):
        self.expression = expression
        self.tokens = tokenize(expression)
        self.index = 0

    def peek(self) -> Token:
        return self.tokens[self.index]

    def take(self) -> Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def error(self, token: Token, message: str) -> FilterSyntaxError:
        found = "the end" if token.kind == "end" else repr(token.text)
        return _syntax_error(self.expression, token.column, f"{message}, found {found}")

    def or_expr(self) -> Any:
        terms = [self.and_expr()]
        while self.peek().kind == "keyword" and self.peek().text == "or":
            self.take()
            terms.append(self.and_expr())
        return terms[0] if len(terms) == 1 else Junction("or", tuple(terms))

    def and_expr(self) -> Any:
        terms = [self.not_expr()]
        while self.peek().kind == "keyword" and self.peek().text == "and":
            self.take()
            terms.append(self.not_expr())
        return terms[0] if len(terms) == 1 else Junction("and", tuple(terms))

    def not_expr(self) -> Any:
        token = self.peek()
        if token.kind == "keyword" and token.text == "not":
            self.take()
            return Not(self.not_expr())
        if token.kind == "paren" and token.text == "(":
            self.take()
            term = self.or_expr()
            closing = self.take()
            if closing.text != ")":
                raise self.error(closing, "expected ')'")
            return term
        left = self.operand()
        op = self.take()
        if op.kind != "op":
            raise self.error(op, "expected a comparison (<, <=, >, >=, ==, !=)")
        return Compare(op.text, left, self.operand())

    def operand(self) -> Literal | Field:
        token = self.take()
        if token.kind == "number":
            value = float(token.text)
            return Literal(int(value) if re.fullmatch(r"[+-]?\d+", token.text) else value)
        if token.kind == "string":
            return Literal(_unquote(token.text))
        if token.kind == "keyword" and token.text in ("true", "false"):
            return Literal(token.text == "true")
        if token.kind == "name":
            return Field(token.text)
        raise self.error(token, "expected a field name, a number or a quoted string")


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text[1:-1])


def split_rules(expression: str) -> tuple[tuple[str, Any], ...]:
    """The top-level 'and' terms of ``expression``, each with its text (its slice of the expression); an expression
    whose top level is an 'or' is one term. FilterSyntaxError names the column of a mistake.
    """
    if not expression.strip():
        return ()
    parser = _Parser(expression)
    try:
        term = parser.or_expr()
    except RecursionError:
        raise _syntax_error(expression, 0, "nested too deeply") from None
    token = parser.peek()
    if token.kind != "end":
        raise parser.error(token, "expected 'and', 'or' or the end")
    terms = term.terms if isinstance(term, Junction) and term.op == "and" else (term,)
    # Each top-level term's text: the source between its first token and the 'and' after it.
    bounds, depth, start = [], 0, 0
    for tok in parser.tokens:
        if tok.kind == "paren":
            depth += 1 if tok.text == "(" else -1
        elif (tok.kind == "keyword" and tok.text == "and" and depth == 0 and len(terms) > 1) or tok.kind == "end":
            bounds.append((start, tok.column))
            start = tok.column + len(tok.text)
    if len(bounds) != len(terms):  # top-level 'or': one rule, the whole expression
        return ((expression.strip(), term),)
    return tuple((expression[a:b].strip(), t) for (a, b), t in zip(bounds, terms))
