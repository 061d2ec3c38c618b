"""Eval images and fixed-size batches: OpenCLIP's eval transform of one image, and zero-padded batches.

Every eval image, whatever set it comes from, goes through `eval_image` (decode or convert to RGB, bicubic resize of
the shortest side, center crop) and then `transforms.normalize`. Every eval step has one shape, so the towers
compile once per set: short batches are padded with zero rows, and classification batches carry `valid` to mark the
real ones.
"""

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np
from PIL import Image

from clip_jax.data import transforms


def eval_image(image: "bytes | np.ndarray", image_size: int) -> np.ndarray:
    """OpenCLIP's eval transform of encoded bytes or a uint8 array [H, W(, 3)]: RGB, bicubic shortest-side resize,
    center crop -> uint8 [S, S, 3]. Bytes that do not decode raise `transforms.ImageDecodeError`."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        pil = transforms.decode_rgb(bytes(image))
    else:
        pil = Image.fromarray(np.asarray(image, np.uint8)).convert("RGB")
    return transforms.eval_crop(pil, image_size)


def pad_rows(rows: np.ndarray, size: int, fill=0) -> np.ndarray:
    """`rows` [n, ...] followed by `size - n` rows of `fill`: [max(n, size), ...]."""
    pad = size - len(rows)
    if pad <= 0:
        return rows
    return np.concatenate([rows, np.full((pad, *rows.shape[1:]), fill, rows.dtype)])


@dataclasses.dataclass(frozen=True)
class EvalItem:
    """A classification item `{"image": bytes or uint8 array, "label": int}` -> `{"image": uint8 [S, S, 3],
    "label": int32}`; a picklable class so Grain can run it in its threads."""

    image_size: int

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"image": eval_image(item["image"], self.image_size), "label": np.int32(item["label"])}


@dataclasses.dataclass(frozen=True)
class PaddedCollate:
    """Stacks up to `batch_size` items, normalised, padded to `batch_size`: `{"images": float32 [B, S, S, 3],
    "labels": int32 [B] (-1 for padding), "valid": bool [B]}`."""

    batch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
        images = transforms.normalize(np.stack([item["image"] for item in items]), self.mean, self.std)
        labels = np.asarray([item["label"] for item in items], np.int32)
        return {"images": pad_rows(images, self.batch_size), "labels": pad_rows(labels, self.batch_size, -1),
                "valid": np.arange(self.batch_size) < len(items)}


def classification_batches(source, *, batch_size: int, image_size: int, mean: Sequence[float],
                           std: Sequence[float], num_threads: int = 8, process_index: int = 0,
                           process_count: int = 1, steps: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Padded batches (see `PaddedCollate`) of items `process_index`, `process_index + process_count`, ... of a
    random-access `source`, in order, decoded by `num_threads` threads.

    With `steps`, exactly that many batches: once this process's share has ended the rest are all padding, so every
    process takes part in every step of a multi-process evaluation.
    """
    items = grain.MapDataset.source(source)[process_index::process_count].map(EvalItem(image_size))
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * batch_size)
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
