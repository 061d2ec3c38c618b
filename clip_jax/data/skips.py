"""Why samples and shards are skipped, and the counts of them that iterator states carry.

Each stage that drops something counts it by reason in its iterator's state, under ``"skipped"``: the webdataset
sample assembly (:mod:`clip_jax.data.webdataset`), the tar shard reader, the decoding stage, csv rows, and sample
filters (reasons starting ``"filter: "``, :mod:`clip_jax.data.filters`). :func:`skip_counts` sums them over a whole
state (the data workers' included), :func:`skip_scalars` makes the run's metrics of them.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Mapping
from typing import Any

from clip_jax.data import filters

# Reasons a sample or shard is skipped (keys of the ``skipped`` counters).
JSON_ONLY = "json_only"  # neither image nor caption (e.g. only ``KEY.json``)
NO_IMAGE = "no_image"
NO_CAPTION = "no_caption"
EMPTY_CAPTION = "empty_caption"
BAD_CAPTION = "bad_caption"  # not UTF-8
EMPTY_IMAGE = "empty_image"
CORRUPT_IMAGE = "corrupt_image"  # counted by the decoding stage
TOO_MANY_PIXELS = "too_many_pixels"  # over max_image_pixels (a decompression bomb guard); the decoding stage
MISSING_IMAGE = "missing_image"  # a csv row whose image file cannot be read
UNREADABLE_SHARD = "unreadable_shard"
TRUNCATED_SHARD = "truncated_shard"
CORRUPT_SHARD = "corrupt_shard"
SKIP_REASONS = (JSON_ONLY, NO_IMAGE, NO_CAPTION, EMPTY_CAPTION, BAD_CAPTION, EMPTY_IMAGE, CORRUPT_IMAGE,
                TOO_MANY_PIXELS, MISSING_IMAGE, UNREADABLE_SHARD, TRUNCATED_SHARD, CORRUPT_SHARD)


def skip_counts(state_or_iterator: Any) -> dict[str, int]:
    """Skip counters by reason, summed over every ``"skipped"`` mapping of an iterator state (or an iterator's)."""
    state = state_or_iterator.get_state() if hasattr(state_or_iterator, "get_state") else state_or_iterator
    if isinstance(state, (bytes, str)):
        state = json.loads(state)
    totals: collections.Counter = collections.Counter()

    def visit(node: Any) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                if key == "skipped" and isinstance(value, Mapping):
                    totals.update({k: int(v) for k, v in value.items()})
                else:
                    visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(state)
    return {reason: totals[reason] for reason in sorted(totals) if totals[reason]}


def skip_scalars(counts: Mapping[str, int]) -> dict[str, int]:
    """Metrics from :func:`skip_counts`: totals of bad (``skipped_samples``) and filtered (``filtered_samples``)
    samples, and one ``skipped/REASON`` or ``filtered/RULE`` scalar per reason (names made tag-safe)."""
    out = {"skipped_samples": 0, "filtered_samples": 0}
    for reason, count in counts.items():
        filtered = reason.startswith(filters.PREFIX)
        name = reason.removeprefix(filters.PREFIX)
        out["filtered_samples" if filtered else "skipped_samples"] += count
        tag = ("filtered/" if filtered else "skipped/") + re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")
        out[tag] = out.get(tag, 0) + count
    return out
