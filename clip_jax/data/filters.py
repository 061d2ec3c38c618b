"""Sample filters on the metadata img2dataset writes next to each sample (``KEY.json``): LAION's ``punsafe``,
``pwatermark``, ``similarity``, ``NSFW``, ``width``, ``height``, ...

An expression is a small language, parsed here and never handed to Python's ``eval``::

    punsafe < 0.5 and pwatermark < 0.8 and similarity >= 0.28 and NSFW != 'NSFW'

- comparisons ``<  <=  >  >=  ==  !=`` between field names, numbers (``0.5``, ``-3``, ``1e-3``), quoted strings
  (``'NSFW'`` or ``"NSFW"``) and ``true`` / ``false``; ``and``, ``or``, ``not`` and parentheses.
- Numbers compare with numbers, strings with strings (by code point), booleans only with ``==`` / ``!=``.

Each top-level ``and`` term is a *rule*; a sample is kept when every rule holds, and a dropped sample is counted
under the first rule that failed: ``"filter: punsafe < 0.5"``. A field that a rule reads and that is absent from
the sample's metadata, ``null``, or of the other kind (the string ``"0.3"`` where a number is compared) drops the
sample too, counted apart under that rule: ``"filter: punsafe < 0.5 (missing punsafe)"``, ``(null punsafe)``,
``(type punsafe)``. A field no sample has (a typo, or a column the shards were not written with) is therefore
counted rather than refused -- the metadata schema is only known by reading the shards -- and warned about once
per process; ``python -m clip_jax.data.check --filter EXPR`` shows those counts before a run.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import re
import warnings
from collections.abc import Mapping
from typing import Any

from clip_jax.errors import InvalidInput

log = logging.getLogger(__name__)

PREFIX = "filter: "  # every reason a filter drops a sample for starts with this
NO_JSON = PREFIX + "no json"  # the expression needs metadata and the sample has no KEY.json
BAD_JSON = PREFIX + "bad json"  # KEY.json is not a JSON object
MIN_IMAGE_SIZE = PREFIX + "min_image_size"
MIN_CAPTION_CHARS = PREFIX + "min_caption_chars"

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


def _kind(value: Any) -> str | None:
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
        kind_a, kind_b = _kind(a), _kind(b)
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


@dataclasses.dataclass(frozen=True)
class Rule:
    text: str  # the rule as written (its slice of the expression)
    term: Any

    def check(self, record: Mapping[str, Any]) -> str | None:
        """None when the rule holds, else the reason the sample is dropped for."""
        try:
            if self.term.holds(record):
                return None
            return PREFIX + self.text
        except FieldProblem as problem:
            _warn_missing_once(problem)
            return f"{PREFIX}{self.text} ({problem.kind} {problem.field})"


_warned_fields: set[str] = set()


def _warn_missing_once(problem: FieldProblem) -> None:
    if problem.kind == "missing" and problem.field not in _warned_fields:
        _warned_fields.add(problem.field)
        log.warning("filter field %r is missing from a sample's metadata; such samples are dropped and counted",
                    problem.field)


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


def parse_rules(expression: str) -> tuple[Rule, ...]:
    """The rules of ``expression`` (its top-level 'and' terms); FilterSyntaxError names the column of a mistake.

    An expression whose top level is an 'or' is one rule.
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
        return (Rule(expression.strip(), term),)
    return tuple(Rule(expression[a:b].strip(), t) for (a, b), t in zip(bounds, terms))


# -- a sample's filter ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SampleFilter:
    """What a run keeps: ``expression`` on the metadata, a minimum shorter image side, a minimum caption length.

    The image size is the metadata's ``width``/``height`` when both are whole numbers (img2dataset's size after its
    resize), else read from the image header (no decode).
    """

    expression: str = ""
    min_image_size: int = 0
    min_caption_chars: int = 0

    def __post_init__(self):
        if self.min_image_size < 0 or self.min_caption_chars < 0:
            raise InvalidInput(f"min_image_size ({self.min_image_size}) and min_caption_chars "
                               f"({self.min_caption_chars}) must not be negative")
        object.__setattr__(self, "rules", parse_rules(self.expression))

    @classmethod
    def from_run_config(cls, config: Any) -> "SampleFilter | None":
        f = cls(config.train_data_filter, config.train_data_min_image_size, config.train_data_min_caption_chars)
        return f if f.active else None

    @property
    def active(self) -> bool:
        return bool(self.rules) or self.min_image_size > 0 or self.min_caption_chars > 0

    def reasons(self) -> list[str]:
        """The plain reasons this filter can drop for (without the per-field variants)."""
        out = [PREFIX + r.text for r in self.rules]
        if self.min_image_size:
            out.append(MIN_IMAGE_SIZE)
        if self.min_caption_chars:
            out.append(MIN_CAPTION_CHARS)
        return out

    def check_record(self, record: Mapping[str, Any]) -> str | None:
        """The expression alone on one metadata record (a parquet row): None to keep, else the reason."""
        for rule in self.rules:
            reason = rule.check(record)
            if reason is not None:
                return reason
        return None

    def failed(self, metadata: bytes | None, image: bytes, caption: str) -> list[str]:
        """Every rule (by its text), ``min_image_size`` and ``min_caption_chars`` the sample fails, each on its own
        (a missing, null or mistyped field fails its rule): what each rule would drop were it the only one."""
        record, problem = _load_metadata(metadata) if (self.rules or self.min_image_size) else ({}, None)
        out = [r.text for r in self.rules if problem is not None or r.check(record) is not None]
        if self.min_image_size and _shorter_side(record, image) < self.min_image_size:
            out.append("min_image_size")
        if self.min_caption_chars and len(caption.strip()) < self.min_caption_chars:
            out.append("min_caption_chars")
        return out

    def check(self, metadata: bytes | None, image: bytes, caption: str) -> str | None:
        """None to keep the sample, else the reason it is dropped for (rules first, then size, then caption)."""
        record = None
        if self.rules or self.min_image_size:
            record, problem = _load_metadata(metadata)
            if problem is not None and self.rules:
                return problem
            if self.rules:
                reason = self.check_record(record)
                if reason is not None:
                    return reason
        if self.min_image_size and _shorter_side(record or {}, image) < self.min_image_size:
            return MIN_IMAGE_SIZE
        if self.min_caption_chars and len(caption.strip()) < self.min_caption_chars:
            return MIN_CAPTION_CHARS
        return None


def _load_metadata(metadata: bytes | None) -> tuple[dict[str, Any], str | None]:
    if metadata is None:
        return {}, NO_JSON
    try:
        record = json.loads(metadata)
    except (ValueError, UnicodeDecodeError):
        return {}, BAD_JSON
    if not isinstance(record, dict):
        return {}, BAD_JSON
    return record, None


def _shorter_side(record: Mapping[str, Any], image: bytes) -> float:
    """The shorter side from the metadata, else from the image header; inf when neither tells (the decoding stage
    then counts an image that does not decode)."""
    width, height = record.get("width"), record.get("height")
    if _kind(width) == "number" and _kind(height) == "number":
        return min(width, height)
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(image)) as im:
                return min(im.size)
    except Exception:  # noqa: BLE001 - Pillow raises many kinds; the decoder counts the sample
        return math.inf
