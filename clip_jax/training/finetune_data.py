"""The fine-tuning batches: a classification split read in a new shuffled order each epoch, as a pure function of
(seed, step).

Epoch e reads the images in the order `permutation(N)` of a generator seeded with (seed, e), `global_batch` at a
time; the last partial batch of an epoch is dropped. Step s's global batch is rows `s * B ... s * B + B - 1` of that
run-long sequence, and process p of P takes its `B / P` consecutive rows (the global batch is the processes' rows in
process order, `runtime.mesh.make_global_batch`). Nothing needs saving to resume: a run continued at step s reads
exactly what it would have read. Images get the eval transform (bicubic resize of the shortest side, centre crop)
and the model's normalisation; there is no augmentation.
"""

import functools
from collections.abc import Iterator, Sequence

import grain
import numpy as np

from clip_jax.evaluation.batches import EvalItem, PaddedCollate


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


def train_batches(source, *, global_batch: int, steps_per_epoch: int, start: int, stop: int, seed: int,
                  image_size: int, mean: Sequence[float], std: Sequence[float], num_threads: int,
                  process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of the batches of steps `start` ... `stop - 1`: `{"images": float32 [B / P, S, S, 3],
    "labels": int32 [B / P]}`."""
    rows = _StepRows(source, seed=seed, global_batch=global_batch, steps_per_epoch=steps_per_epoch, start=start,
                     process_index=process_index, process_count=process_count)
    local = global_batch // process_count
    items = grain.MapDataset.range((stop - start) * local).map(rows).map(EvalItem(image_size))
    options = grain.ReadOptions(num_threads=max(num_threads, 1), prefetch_buffer_size=2 * local)
    collate = PaddedCollate(local, tuple(mean), tuple(std))
    for batch in items.to_iter_dataset(options).batch(local, batch_fn=collate):
        yield {"images": batch["images"], "labels": batch["labels"]}
