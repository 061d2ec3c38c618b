"""Eval images and fixed-size batches: OpenCLIP's eval transform of one image, and zero-padded batches, built on
`clip_jax.data.classification` (where fine-tuning's batches are made the same way).

Every eval image, whatever set it comes from, goes through `eval_image` (decode or convert to RGB, bicubic resize of
the shortest side, center crop) and then `transforms.normalize`. Every eval step has one shape, so the towers
compile once per set: short batches are padded with zero rows, and classification batches carry `valid` to mark the
real ones. Sets read by index go through `classification_batches`; streamed ones (retrieval shards, read in order,
perhaps from a bucket) through `streamed_batches`, which hands it a window of the stream at a time, and embed's
samples (some skipped) through `decoded`, windows too: one path, Grain's threads decoding, for every eval image.
"""

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import grain
import numpy as np

from clip_jax.data.classification import EvalItem, PaddedCollate, eval_image, pad_rows  # noqa: F401 - also ours


def classification_batches(source, *, batch_size: int, image_size: int, mean: Sequence[float],
                           std: Sequence[float], num_threads: int | None = None, process_index: int = 0,
                           process_count: int = 1, steps: int | None = None,
                           item: Callable[[dict], dict] | None = None,
                           resize_mode: str = "shortest") -> Iterator[dict[str, np.ndarray]]:
    """Padded batches (see `PaddedCollate`) of items `process_index`, `process_index + process_count`, ... of a
    random-access `source`, in order, decoded by `num_threads` threads (None: one a CPU, up to 8; `item`: the
    transform of one item, a picklable callable; `EvalItem(image_size, resize_mode)` when None).

    With `steps`, exactly that many batches: once this process's share has ended the rest are all padding, so every
    process takes part in every step of a multi-process evaluation.
    """
    items = grain.MapDataset.source(source)[process_index::process_count].map(item or EvalItem(image_size,
                                                                                              resize_mode))
    options = grain.ReadOptions(num_threads=num_threads or min(8, os.cpu_count() or 1),
                                prefetch_buffer_size=2 * batch_size)
    batches = iter(items.to_iter_dataset(options).batch(batch_size,
                                                        batch_fn=PaddedCollate(batch_size, tuple(mean), tuple(std))))
    if steps is None:
        yield from batches
        return
    for _ in range(steps):
        batch = next(batches, None)
        if batch is None:  # this process's share ended before the others'
            batch = {"images": np.zeros((batch_size, image_size, image_size, 3), np.float32),
                     "labels": np.full(batch_size, -1, np.int32), "valid": np.zeros(batch_size, bool)}
        yield batch


def streamed_batches(items: Iterable[dict], *, batch_size: int, image_size: int, mean: Sequence[float],
                     std: Sequence[float], num_threads: int | None = None, window_batches: int = 8,
                     item: Callable[[dict], dict] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """`classification_batches` of a stream of items (read once, in order), `window_batches` batches' items held at
    a time: every batch is whole but the stream's last."""
    items = iter(items)
    while window := list(itertools.islice(items, batch_size * window_batches)):
        yield from classification_batches(window, batch_size=batch_size, image_size=image_size, mean=mean, std=std,
                                          num_threads=num_threads, item=item)


def decoded(items: Iterable, transform: Callable, *, num_threads: int = 8, ahead: int = 16,
            window: int = 512) -> Iterator:
    """`transform(item)` of each of a stream of items, in order, run by Grain's `num_threads` threads up to `ahead`
    items ahead of the consumer, `window` items held at a time (`transform`: picklable)."""
    items = iter(items)
    options = grain.ReadOptions(num_threads=max(num_threads, 1), prefetch_buffer_size=max(ahead, 1))
    while chunk := list(itertools.islice(items, window)):
        yield from grain.MapDataset.source(chunk).map(transform).to_iter_dataset(options)
