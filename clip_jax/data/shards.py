"""Shard lists: brace expansion, weighted sources, existence checks and the draw order of shards.

A shard pattern is one or more sources joined with ``::`` (as OpenCLIP's ``--train-data``), each a path or fsspec
URL with bash-style braces: ``/data/laion2B-en/{00000..23295}.tar::gs://bucket/cc12m/{000..999}.tar``. Weights, one
per source (``"1::2"``), are relative per-shard draw rates in resampled mode, like OpenCLIP's
``--train-data-upsampling-factors``: with weights 1 and 2, each shard of the second source is drawn twice as often as
each shard of the first.

Which shard a data worker reads next is a pure function of ``(seed, process, worker, draw)``, so the reading
position of a worker is one integer and resumption needs no RNG state.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import logging
import os
import posixpath
import re
from collections.abc import Sequence

import numpy as np

from clip_jax.data.shard_checks import no_shard_found
from clip_jax.errors import InvalidInput

log = logging.getLogger(__name__)

SOURCE_SEPARATOR = "::"
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
_ALPHA_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])$")
_GLOB_CHARS = ("*", "?", "[")


class ShardPatternError(InvalidInput):
    """A shard pattern that cannot be expanded or that matches no shard."""


def _find_group(pattern: str, start: int) -> tuple[int, int] | None:
    """Returns (open, close) of the first top-level ``{...}`` group at or after ``start`` that expands."""
    i = pattern.find("{", start)
    while i != -1:
        depth, j = 0, i
        while j < len(pattern):
            if pattern[j] == "{":
                depth += 1
            elif pattern[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if depth != 0:
            raise ShardPatternError(f"unbalanced '{{' at position {i} in shard pattern {pattern!r}")
        body = pattern[i + 1 : j]
        if _split_alternatives(body) is not None or _RANGE.match(body) or _ALPHA_RANGE.match(body):
            return i, j
        i = pattern.find("{", i + 1)
    return None


def _split_alternatives(body: str) -> list[str] | None:
    """Splits ``a,b,{c,d}`` on top-level commas; None when there is no top-level comma."""
    parts, depth, last = [], 0, 0
    for k, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[last:k])
            last = k + 1
    if not parts:
        return None
    parts.append(body[last:])
    return parts


def _expand_range(body: str) -> list[str]:
    m = _ALPHA_RANGE.match(body)
    if m:
        a, b = ord(m.group(1)), ord(m.group(2))
        step = 1 if b >= a else -1
        return [chr(c) for c in range(a, b + step, step)]
    m = _RANGE.match(body)
    first, last = m.group(1), m.group(2)
    step = abs(int(m.group(3))) if m.group(3) else 1
    if step == 0:
        raise ShardPatternError(f"range step 0 in {{{body}}}")
    lo, hi = int(first), int(last)
    padded = any(len(s.lstrip("-")) > 1 and s.lstrip("-").startswith("0") for s in (first, last))
    width = max(len(first), len(last)) if padded else 0
    values = range(lo, hi + 1, step) if hi >= lo else range(lo, hi - 1, -step)
    return [f"{v:0{width}d}" if v >= 0 else "-" + f"{-v:0{max(width - 1, 0)}d}" for v in values]


def expand_braces(pattern: str) -> list[str]:
    """Bash-style brace expansion: ``{a,b}``, ``{0..9}``, ``{000..123}`` (zero padded), ``{0..10..2}``, nesting.

    Groups expand left to right, the rightmost varying fastest. A ``{...}`` holding neither a comma nor a range
    stays literal, as in bash.
    """
    depth = 0
    for k, ch in enumerate(pattern):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            raise ShardPatternError(f"unbalanced '}}' at position {k} in shard pattern {pattern!r}")
    if depth:
        raise ShardPatternError(f"unbalanced '{{' in shard pattern {pattern!r}")
    return _expand(pattern)


def _expand(pattern: str) -> list[str]:
    group = _find_group(pattern, 0)
    if group is None:
        return [pattern]
    i, j = group
    prefix, body, suffix = pattern[:i], pattern[i + 1 : j], pattern[j + 1 :]
    alternatives = _split_alternatives(body)
    items = alternatives if alternatives is not None else _expand_range(body)
    tails = _expand(suffix)
    out = []
    for item in items:
        heads = _expand(item) if alternatives is not None else [item]
        out.extend(prefix + head + tail for head in heads for tail in tails)
    return out


def split_sources(pattern: str) -> list[str]:
    """Splits a ``::``-joined shard pattern into its sources (empty parts are an error)."""
    sources = [s.strip() for s in pattern.split(SOURCE_SEPARATOR)]
    if not pattern.strip() or any(not s for s in sources):
        raise ShardPatternError(f"empty source in shard pattern {pattern!r}")
    return sources


def parse_weights(weights: str | Sequence[float] | None, num_sources: int, pattern: str) -> list[float]:
    """Weights as ``"1::2.5"`` or a sequence, one per source; None means all 1."""
    if weights is None:
        return [1.0] * num_sources
    values = weights.split(SOURCE_SEPARATOR) if isinstance(weights, str) else list(weights)
    try:
        values = [float(w) for w in values]
    except ValueError as e:
        raise ShardPatternError(f"weights {weights!r} must be numbers joined with '::'") from e
    if len(values) != num_sources:
        raise ShardPatternError(
            f"{len(values)} weights {weights!r} for {num_sources} sources in shard pattern {pattern!r}: "
            "give one weight per '::'-separated source"
        )
    if any(not np.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
        raise ShardPatternError(f"weights {weights!r} must be finite, >= 0, and not all 0")
    return values


def _filesystem(url: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ShardPatternError(
            f"cannot open {url!r}: {e} (s3:// and gs:// need pip install 'clipjax-train[remote]'; another URL "
            "scheme, its fsspec filesystem)"
        ) from e


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _existing(urls: list[str]) -> list[str]:
    """The URLs that exist; remote ones are checked with one listing per directory."""
    if not urls:
        return []
    if all(_is_local(u) for u in urls):
        return [u for u in urls if os.path.isfile(u.removeprefix("file://"))]
    fs, _ = _filesystem(urls[0])
    listings: dict[str, set[str] | None] = {}
    kept = []
    for url in urls:
        _, path = _filesystem(url)
        parent = posixpath.dirname(path)
        if parent not in listings:
            try:
                listings[parent] = {posixpath.basename(p.rstrip("/")) for p in fs.ls(parent, detail=False)}
            except FileNotFoundError:
                listings[parent] = set()
            except Exception as e:  # noqa: BLE001 - listing not allowed: trust the pattern
                log.warning("cannot list %s (%s); not checking that its shards exist", parent, e)
                listings[parent] = None
        names = listings[parent]
        if names is None or posixpath.basename(path) in names:
            kept.append(url)
    return kept


def _glob(url: str) -> list[str]:
    if _is_local(url):
        return sorted(globlib.glob(url.removeprefix("file://")))
    fs, path = _filesystem(url)
    protocol = url.split("://", 1)[0]
    return sorted(f"{protocol}://{p.lstrip('/') if protocol == 'memory' else p}" for p in fs.glob(path))


@dataclasses.dataclass(frozen=True)
class ShardList:
    """Expanded shards with one draw weight each; ``sources[i]`` is the pattern shard ``i`` came from."""

    urls: tuple[str, ...]
    weights: tuple[float, ...]
    sources: tuple[str, ...]
    missing: int = 0  # names the pattern expanded to that do not exist (dropped with a warning)

    def __len__(self) -> int:
        return len(self.urls)


def resolve_shards(
    pattern: str,
    weights: str | Sequence[float] | None = None,
    *,
    check_exists: bool = True,
) -> ShardList:
    """Expands a shard pattern (braces, ``::`` sources, globs) into a :class:`ShardList`.

    Shards that do not exist are dropped with a warning (img2dataset leaves gaps); a source that matches nothing
    is an error naming that source and what its folder holds (``shard_checks.no_shard_found``).
    """
    sources = split_sources(pattern)
    source_weights = parse_weights(weights, len(sources), pattern)
    urls, per_shard, origin, missing_count = [], [], [], 0
    for source, weight in zip(sources, source_weights):
        expanded = []
        for url in expand_braces(source):
            expanded.extend(_glob(url) if any(c in url for c in _GLOB_CHARS) else [url])
        found = _existing(expanded) if check_exists else expanded
        if not found:
            raise ShardPatternError(no_shard_found(source, expand_braces(source), len(expanded)))
        if len(found) < len(expanded):
            missing = sorted(set(expanded) - set(found))
            missing_count += len(missing)
            log.warning("%d of %d shards of %r do not exist (first: %s)", len(missing), len(expanded), source,
                        missing[0])
        urls.extend(found)
        per_shard.extend([weight] * len(found))
        origin.extend([source] * len(found))
    return ShardList(tuple(urls), tuple(per_shard), tuple(origin), missing_count)


# ---------------------------------------------------------------------------------------------------------------
# Draw order: which shard a (process, worker) stream reads at its draw number ``d``.


def _uniform(*key: int) -> float:
    """A float in [0, 1) that is a pure function of the integer key."""
    bits = np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint64)[0]
    return float(int(bits) >> 11) * 2.0**-53


@dataclasses.dataclass(frozen=True)
class ShardOrder:
    """Maps a stream's draw number to a shard index.

    ``resampled``: every draw picks a shard with replacement, with probability proportional to its weight, from an
    RNG keyed by ``(seed, process_index, worker_index, draw)`` (independent streams per process and worker).
    ``epoch``: each epoch is a permutation of all shards keyed by ``(seed, epoch)``; stream ``(p, w)`` reads the
    permuted positions ``p + P * (w + W * k)``, so the streams of all processes and workers are disjoint and
    together read every shard once per epoch.
    """

    num_shards: int
    cumulative_weights: tuple[float, ...]
    resampled: bool
    seed: int
    process_index: int = 0
    process_count: int = 1
    worker_index: int = 0
    worker_count: int = 1

    @classmethod
    def create(cls, weights: Sequence[float], *, resampled: bool, seed: int, process_index: int = 0,
               process_count: int = 1, worker_index: int = 0, worker_count: int = 1) -> "ShardOrder":
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, process_count={process_count})")
        if not 0 <= worker_index < worker_count:
            raise ValueError(f"worker_index {worker_index} not in [0, worker_count={worker_count})")
        cumulative = tuple(float(c) for c in np.cumsum(np.asarray(weights, np.float64)))
        order = cls(len(weights), cumulative, resampled, int(seed), process_index, process_count, worker_index,
                    worker_count)
        if not resampled and order.shards_per_epoch == 0:
            raise InvalidInput(
                f"{len(weights)} shards cannot be split over {process_count} processes x {worker_count} workers in "
                "epoch mode: use resampled mode, fewer workers, or more shards"
            )
        return order

    @property
    def streams(self) -> int:
        return self.process_count * self.worker_count

    @property
    def stream_index(self) -> int:
        return self.process_index + self.process_count * self.worker_index

    @property
    def shards_per_epoch(self) -> int:
        """Shards this stream reads per epoch (epoch mode)."""
        return len(range(self.stream_index, self.num_shards, self.streams))

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 0x5EED, epoch]).permutation(self.num_shards)

    def epoch_of(self, draw: int) -> int:
        return 0 if self.resampled else draw // self.shards_per_epoch

    def shard(self, draw: int, permutation: np.ndarray | None = None) -> int:
        """The shard index read at ``draw``; pass the epoch's permutation to avoid recomputing it."""
        if self.resampled:
            u = _uniform(self.seed, self.process_index, self.worker_index, draw) * self.cumulative_weights[-1]
            return min(int(np.searchsorted(self.cumulative_weights, u, side="right")), self.num_shards - 1)
        epoch, k = divmod(draw, self.shards_per_epoch)
        if permutation is None:
            permutation = self.epoch_permutation(epoch)
        return int(permutation[self.stream_index + self.streams * k])
