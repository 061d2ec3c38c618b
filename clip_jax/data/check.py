"""Validates webdataset shards before a long run: reads every sample, decodes every image, tokenizes every caption.

    python -m clip_jax.data.check "/data/laion2B-en/{00000..23295}.tar" --workers 16 --max-shards 200
    python -m clip_jax.data.check "/data/{00000..00099}.tar" --filter "punsafe < 0.5 and similarity >= 0.28" \
        --min-image-size 64 --min-caption-chars 5
    python -m clip_jax.data.check --parquet laion/part-00000.parquet --filter "punsafe < 0.5 and pwatermark < 0.8"

Prints samples, bad samples and shards by reason, image sizes, caption lengths (characters and tokens) and how many
captions the tokenizer truncates. With a filter (the run config's ``train_data_filter``,
``train_data_min_image_size``, ``train_data_min_caption_chars``) it also prints how many samples the run would drop,
by the reason the pipeline counts (the first rule a sample fails), and what each rule alone would drop. With
``--parquet`` it reads LAION's metadata files instead of shards and reports the filter's counts on their rows.
Exits with 1 when no good sample is found (or, with ``--strict``, when any sample or shard is bad).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import io
import json
import multiprocessing
import sys
import warnings
from collections.abc import Sequence

import numpy as np
from PIL import Image

from clip_jax.data import filters, skips, transforms, webdataset
from clip_jax.data import shards as shards_lib
from clip_jax.runtime import entry, ownership

SIDE_BINS = (0, 64, 128, 256, 512, 1024, 2048)  # histogram of the shorter image side
CHAR_BINS = (0, 10, 20, 50, 100, 200, 500, 1000)
TOKEN_BINS = (0, 5, 10, 20, 40, 60)  # then context_length - 2: a full context


class Distribution:
    """Counts of non-negative integers, exact below ``cap`` (larger values share the last bin), plus exact
    minimum, maximum and sum: constant memory however many shards are checked."""

    def __init__(self, cap: int):
        self.counts = np.zeros(cap + 1, np.int64)
        self.minimum, self.maximum, self.total = None, None, 0

    def add(self, values: Sequence[int]) -> None:
        if len(values) == 0:
            return
        v = np.asarray(values, np.int64)
        self.counts += np.bincount(np.minimum(v, len(self.counts) - 1), minlength=len(self.counts))
        low, high = int(v.min()), int(v.max())
        self.minimum = low if self.minimum is None else min(self.minimum, low)
        self.maximum = high if self.maximum is None else max(self.maximum, high)
        self.total += int(v.sum())

    def merge(self, other: "Distribution") -> "Distribution":
        merged = Distribution(len(self.counts) - 1)
        merged.counts = self.counts + other.counts
        known = [d for d in (self, other) if d.minimum is not None]
        if known:
            merged.minimum = min(d.minimum for d in known)
            merged.maximum = max(d.maximum for d in known)
        merged.total = self.total + other.total
        return merged

    def __add__(self, other: "Distribution") -> "Distribution":
        return self.merge(other)

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def spread(self) -> str:
        if not self.count:
            return "-"
        median = int(np.searchsorted(np.cumsum(self.counts), (self.count + 1) // 2))
        median_text = f">={median:,}" if median == len(self.counts) - 1 else f"{median:,}"
        return (f"min {self.minimum:,}  median {median_text}  mean {self.total / self.count:,.1f}  "
                f"max {self.maximum:,}")

    def histogram(self, bins: Sequence[int], last_label: str | None = None) -> str:
        edges = [min(b, len(self.counts)) for b in bins] + [len(self.counts)]
        counts = [int(self.counts[lo:hi].sum()) for lo, hi in zip(edges[:-1], edges[1:])]
        labels = [f"{lo}-{hi - 1}" for lo, hi in zip(bins[:-1], bins[1:])] + [last_label or f">={bins[-1]}"]
        return "  ".join(f"{label}: {count:,}" for label, count in zip(labels, counts) if count)


@dataclasses.dataclass
class Report:
    shards: int = 0
    samples: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    greyscale: int = 0
    truncated_captions: int = 0
    widths: Distribution = dataclasses.field(default_factory=lambda: Distribution(4096))
    heights: Distribution = dataclasses.field(default_factory=lambda: Distribution(4096))
    shorter_sides: Distribution = dataclasses.field(default_factory=lambda: Distribution(4096))
    caption_chars: Distribution = dataclasses.field(default_factory=lambda: Distribution(4096))
    caption_tokens: Distribution = dataclasses.field(default_factory=lambda: Distribution(1024))  # text tokens kept
    bad_shards: list[str] = dataclasses.field(default_factory=list)
    rules_alone: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # filter rule -> drops

    def merge(self, other: "Report") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def _image_info(data: bytes) -> tuple[int, int, bool] | None:
    """(width, height, stored as greyscale) of an image that decodes, else None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                size, grey = image.size, image.mode in ("L", "LA", "1", "I;16", "I")
        transforms.decode_rgb(data)
    except (OSError, SyntaxError, ValueError, transforms.ImageDecodeError):
        return None
    return size[0], size[1], grey


def check_shard(url: str, context_length: int = 77, decode: bool = True,
                fmt: webdataset.SampleFormat = webdataset.DEFAULT_FORMAT) -> Report:
    """Reads one shard completely and reports on it; ``fmt.sample_filter`` drops (and counts) as a run would."""
    from clip_jax.text.clip_tokenizer import tokenize

    report = Report(shards=1)
    shard_skips = collections.Counter()
    captions, sizes = [], []
    sample_filter = fmt.sample_filter
    unfiltered = dataclasses.replace(fmt, sample_filter=None)
    for sample in webdataset.iter_shard(url, shard_skips, unfiltered):
        if sample_filter is not None:
            report.rules_alone.update(sample_filter.failed(sample.metadata, sample.image, sample.caption))
            reason = sample_filter.check(sample.metadata, sample.image, sample.caption)
            if reason is not None:
                report.skipped[reason] += 1
                continue
        if decode:
            info = _image_info(sample.image)
            if info is None:
                report.skipped[skips.CORRUPT_IMAGE] += 1
                continue
            sizes.append(info[:2])
            report.greyscale += info[2]
        captions.append(sample.caption)
        report.samples += 1
    if sizes:
        sizes = np.asarray(sizes)  # [N, 2] width, height
        report.widths.add(sizes[:, 0])
        report.heights.add(sizes[:, 1])
        report.shorter_sides.add(sizes.min(axis=1))
    report.skipped.update(shard_skips)
    if any(shard_skips[r] for r in (skips.UNREADABLE_SHARD, skips.TRUNCATED_SHARD, skips.CORRUPT_SHARD)):
        report.bad_shards.append(url)
    if captions:
        tokens, truncated = tokenize(captions, context_length=context_length, return_truncated=True)
        eot = np.argmax(tokens == tokens.max(axis=1, keepdims=True), axis=1)  # EOT is the largest id of a row
        report.caption_tokens.add(eot - 1)
        report.truncated_captions = int(truncated.sum())
        report.caption_chars.add([len(c) for c in captions])
    return report


def summary(report: Report, context_length: int) -> str:
    skipped = sum(v for k, v in report.skipped.items()
                  if not k.endswith("_shard") and not k.startswith(filters.PREFIX))
    lines = [
        f"shards            {report.shards:,} read, {len(report.bad_shards):,} bad (unreadable/truncated/corrupt)",
        f"samples           {report.samples:,} good, {skipped:,} skipped",
    ]
    for reason in skips.SKIP_REASONS:
        if report.skipped[reason]:
            lines.append(f"  {reason:<16}{report.skipped[reason]:,}")
    lines += filter_lines(report.skipped, report.rules_alone)
    if report.widths.count:
        lines += [
            f"image width       {report.widths.spread()}",
            f"image height      {report.heights.spread()}",
            f"shorter side      {report.shorter_sides.histogram(SIDE_BINS)}",
            f"greyscale images  {report.greyscale:,}",
        ]
    if report.caption_chars.count:
        share = 100.0 * report.truncated_captions / max(report.samples, 1)
        lines += [
            f"caption chars     {report.caption_chars.spread()}",
            f"                  {report.caption_chars.histogram(CHAR_BINS)}",
            f"caption tokens    {report.caption_tokens.spread()} (without SOT/EOT, after truncation)",
            f"                  {report.caption_tokens.histogram((*TOKEN_BINS, context_length - 2), 'full')}",
            f"truncated at {context_length:<4} {report.truncated_captions:,} captions ({share:.2f}%)",
        ]
    for url in report.bad_shards[:10]:
        lines.append(f"bad shard         {url}")
    if len(report.bad_shards) > 10:
        lines.append(f"                  ... and {len(report.bad_shards) - 10} more")
    return "\n".join(lines)


def filter_lines(skipped: collections.Counter, rules_alone: collections.Counter) -> list[str]:
    """The filter's drops: by the reason a run counts (first rule failed), then each rule alone."""
    dropped = {k: v for k, v in skipped.items() if k.startswith(filters.PREFIX)}
    if not dropped and not rules_alone:
        return []
    lines = [f"filtered          {sum(dropped.values()):,} samples (a run counts each under the first rule it fails)"]
    lines += [f"  {reason}  {count:,}" for reason, count in sorted(dropped.items())]
    lines.append("each rule alone would drop")
    lines += [f"  {rule}  {count:,}" for rule, count in rules_alone.items()]
    return lines


def run(pattern: str, *, workers: int = 1, max_shards: int | None = None, context_length: int = 77,
        decode: bool = True, fmt: webdataset.SampleFormat = webdataset.DEFAULT_FORMAT) -> Report:
    urls = list(shards_lib.resolve_shards(pattern).urls)
    if max_shards is not None and max_shards < len(urls):
        picks = np.random.default_rng(0).choice(len(urls), max_shards, replace=False)
        urls = [urls[i] for i in sorted(picks)]
    total = Report()
    if workers <= 1:
        for url in urls:
            total.merge(check_shard(url, context_length, decode, fmt))
        return total
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for report in pool.map(check_shard, urls, [context_length] * len(urls), [decode] * len(urls),
                               [fmt] * len(urls)):
            total.merge(report)
    return total


@entry.command(stopped="before the counts were written", user_error=1)
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.data.check", description=__doc__.split("\n")[0])
    parser.add_argument("pattern", nargs="?", help='shard pattern, e.g. "/data/shards/{00000..00099}.tar" (quote it)')
    parser.add_argument("--parquet", nargs="+", default=None, metavar="FILE",
                        help="count what --filter drops on these parquet metadata files instead of shards")
    parser.add_argument("--workers", type=int, default=1, help="processes reading shards in parallel")
    parser.add_argument("--max-shards", type=int, default=None, help="check a random subset of this many shards")
    parser.add_argument("--context-length", type=int, default=77)
    parser.add_argument("--no-decode", action="store_true", help="do not decode images (faster, checks less)")
    parser.add_argument("--filter", default="", help="a train_data_filter expression, e.g. \"punsafe < 0.5\"")
    parser.add_argument("--min-image-size", type=int, default=0, help="as train_data_min_image_size")
    parser.add_argument("--min-caption-chars", type=int, default=0, help="as train_data_min_caption_chars")
    parser.add_argument("--image-key", default=";".join(webdataset.IMAGE_EXTENSIONS), help="as train_data_image_key")
    parser.add_argument("--caption-key", default=webdataset.CAPTION_EXTENSION, help="as train_data_caption_key")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any sample or shard is bad")
    parser.add_argument("--json", default=None, help="also write the counts to this JSON file")
    args = parser.parse_args(argv)
    if (args.pattern is None) == (args.parquet is None):
        parser.error("give a shard pattern or --parquet FILE..., not both")
    if args.json:  # before the counting, not after it
        ownership.claim_file(args.json, writing="the counts", change="give another --json")
    sample_filter = filters.SampleFilter(args.filter, args.min_image_size, args.min_caption_chars)
    if args.parquet is not None:
        return _main_parquet(args.parquet, sample_filter, args.json)
    fmt = webdataset.SampleFormat.parse(args.image_key, args.caption_key,
                                        sample_filter if sample_filter.active else None)
    report = run(args.pattern, workers=args.workers, max_shards=args.max_shards,
                 context_length=args.context_length, decode=not args.no_decode, fmt=fmt)
    print(summary(report, args.context_length))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shards": report.shards, "samples": report.samples, "skipped": dict(report.skipped),
                       "filter_rules_alone": dict(report.rules_alone),
                       "bad_shards": report.bad_shards, "truncated_captions": report.truncated_captions,
                       "greyscale": report.greyscale}, f, indent=2)
    if report.samples == 0:
        print("error: no good sample found", file=sys.stderr)
        return 1
    bad = {k: v for k, v in report.skipped.items() if v and not k.startswith(filters.PREFIX)}
    if args.strict and (bad or report.bad_shards):
        return 1
    return 0


def _main_parquet(paths: list[str], sample_filter: filters.SampleFilter, json_path: str | None) -> int:
    from clip_jax.data import parquet_filter

    report = parquet_filter.count(paths, sample_filter)
    print(f"parquet files     {report.files:,}")
    print(f"rows              {report.rows:,}, {report.kept:,} kept")
    print("\n".join(filter_lines(report.dropped, report.rules_alone)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"files": report.files, "rows": report.rows, "kept": report.kept,
                       "dropped": dict(report.dropped), "filter_rules_alone": dict(report.rules_alone)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
