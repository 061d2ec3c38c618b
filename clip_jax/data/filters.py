"""Sample filters on the metadata img2dataset writes next to each sample (``KEY.json``): LAION's ``punsafe``,
``pwatermark``, ``similarity``, ``NSFW``, ``width``, ``height``, ...; plus a minimum image size and caption length.

An expression (the language of :mod:`clip_jax.data.filter_expression`, parsed there and never handed to Python's
``eval``)::

    punsafe < 0.5 and pwatermark < 0.8 and similarity >= 0.28 and NSFW != 'NSFW'

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
import warnings
from collections.abc import Mapping
from typing import Any

from clip_jax.data.filter_expression import FieldProblem, split_rules, value_kind
from clip_jax.errors import InvalidInput

log = logging.getLogger(__name__)

PREFIX = "filter: "  # every reason a filter drops a sample for starts with this
NO_JSON = PREFIX + "no json"  # the expression needs metadata and the sample has no KEY.json
BAD_JSON = PREFIX + "bad json"  # KEY.json is not a JSON object
MIN_IMAGE_SIZE = PREFIX + "min_image_size"
MIN_CAPTION_CHARS = PREFIX + "min_caption_chars"


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


def parse_rules(expression: str) -> tuple[Rule, ...]:
    """The rules of ``expression`` (its top-level 'and' terms); FilterSyntaxError names the column of a mistake.

    An expression whose top level is an 'or' is one rule.
    """
    return tuple(Rule(text, term) for text, term in split_rules(expression))


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
    if value_kind(width) == "number" and value_kind(height) == "number":
        return min(width, height)
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(image)) as im:
                return min(im.size)
    except Exception:  # noqa: BLE001 - Pillow raises many kinds; the decoder counts the sample
        return math.inf
