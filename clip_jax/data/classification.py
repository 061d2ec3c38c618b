"""Labelled images, for evaluation and fine-tuning alike: OpenCLIP's eval transform of one image (`eval_image`),
zero-padded batches of them (`PaddedCollate`), and the batches a classification fine-tune trains on
(`FinetuneBatches`).

The fine-tuning batches are a pure function of (seed, step): epoch e reads the images in the order `permutation(N)`
of a generator seeded with (seed, e), `global_batch` at a time; the last partial batch of an epoch is dropped. Step
s's global batch is rows `s * B ... s * B + B - 1` of that run-long sequence, and process p of P takes its `B / P`
consecutive rows (the global batch is the processes' rows in process order, `runtime.mesh.make_global_batch`), so
the global batch is the same whatever the process count. A run resumed at step s builds its iterator at s and reads
exactly what it would have read: no position needs saving. The iterator never ends (a rollback goes on reading);
images get the eval transform and the model's normalisation, no augmentation, decoded by Grain's threads.
"""

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from clip_jax.data import transforms
from clip_jax.data.naflex import NaFlexResize, naflex_pixels


def eval_image(image: "bytes | np.ndarray | Image.Image", image_size: int,
               resize_mode: "str | NaFlexResize" = "shortest") -> np.ndarray:
    """OpenCLIP's eval transform of encoded bytes, a uint8 array [H, W(, 3)] or a PIL image: RGB, bicubic
    shortest-side resize, center crop -> uint8 [S, S, 3] (`resize_mode` "squash": the whole image resized to S x S, as
    a SigLIP folder's processor does; a `NaFlexResize`: the image at its own aspect ratio as NaFlex rows, pixels
    0-255, whatever S). Bytes that do not decode raise `transforms.ImageDecodeError`."""
    if isinstance(resize_mode, NaFlexResize):
        return naflex_pixels(transforms.to_rgb(image), resize_mode.patch_size, resize_mode.max_num_patches)
    return transforms.eval_crop(transforms.to_rgb(image), image_size, resize_mode)


def pad_rows(rows: np.ndarray, size: int, fill=0) -> np.ndarray:
    """`rows` [n, ...] followed by `size - n` rows of `fill`: [max(n, size), ...]."""
    pad = size - len(rows)
    if pad <= 0:
        return rows
    return np.concatenate([rows, np.full((pad, *rows.shape[1:]), fill, rows.dtype)])


@dataclasses.dataclass(frozen=True)
class EvalItem:
    """A classification item `{"image": bytes or uint8 array, "label": int}` -> `{"image": uint8 [S, S, 3],
    "label": int32}` (`resize_mode`: `eval_image`'s); a picklable class so Grain can run it in its threads."""

    image_size: int
    resize_mode: str = "shortest"

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"image": eval_image(item["image"], self.image_size, self.resize_mode),
                "label": np.int32(item["label"])}


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


def epoch_order(num_images: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, 0xF17E, epoch]).permutation(num_images)


class _StepRows:
    """Item k of this process's sequence from step `start` on: (image index) -> source item."""

    def __init__(self, source, *, seed: int, global_batch: int, steps_per_epoch: int, start: int,
                 process_index: int, process_count: int):
        self.source, self.seed, self.global_batch = source, seed, global_batch
        self.per_epoch = steps_per_epoch * global_batch
        self.start, self.local = start, global_batch // process_count
        self.offset = process_index * self.local

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        return epoch_order(len(self.source), self.seed, epoch)

    def image_index(self, k: int) -> int:
        step, row = self.start + k // self.local, k % self.local
        position = step * self.global_batch + self.offset + row
        return int(self._order(position // self.per_epoch)[position % self.per_epoch])

    def __call__(self, k: int):
        return self.source[self.image_index(k)]


class FinetuneBatches:
    """This process's rows of the batches of steps `start`, `start + 1`, ...: `{"images": float32 [B / P, S, S, 3],
    "labels": int32 [B / P]}` of a random-access labelled `source` (items `{"image", "label"}`). `close()` stops
    its threads."""

    def __init__(self, source, *, global_batch: int, steps_per_epoch: int, start: int, seed: int, image_size: int,
                 mean: Sequence[float], std: Sequence[float], num_threads: int, process_index: int = 0,
                 process_count: int = 1):
        rows = _StepRows(source, seed=seed, global_batch=global_batch, steps_per_epoch=steps_per_epoch, start=start,
                         process_index=process_index, process_count=process_count)
        local = global_batch // process_count
        items = grain.MapDataset.range(sys.maxsize).map(rows).map(EvalItem(image_size))
        options = grain.ReadOptions(num_threads=max(num_threads, 1), prefetch_buffer_size=2 * local)
        collate = PaddedCollate(local, tuple(mean), tuple(std))
        self._batches = iter(items.to_iter_dataset(options).batch(local, batch_fn=collate))

    def __iter__(self) -> "FinetuneBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._batches)
        return {"images": batch["images"], "labels": batch["labels"]}

    def close(self) -> None:
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()
