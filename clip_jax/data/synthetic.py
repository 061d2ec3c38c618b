"""``dataset_type="synthetic"``: random images and captions' tokens, for timing the step without a loader.

Batch ``n`` of process ``p`` is a pure function of ``(seed, p, n)`` (a Philox stream keyed by them), so the data is
the same on every run and the iterator resumes exactly from its state ``{"batch": n}``. Batches are built whole in
the training process (no worker processes: there is nothing to decode), images already normalised (uniform in
[-1, 1)), tokens as the tokenizer lays them out (SOT, random ids, EOT, zero padding).
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

SOT, EOT = 49406, 49407


def synthetic_batch(seed: int, process_index: int, number: int, batch_size: int, image_size: int,
                    context_length: int) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.Philox(key=[seed % 2**64, process_index], counter=[0, 0, number, 3]))
    images = rng.random((batch_size, image_size, image_size, 3), dtype=np.float32)
    images *= 2
    images -= 1
    lengths = rng.integers(1, context_length - 1, batch_size)  # text tokens between SOT and EOT
    body = rng.integers(1, SOT, (batch_size, context_length), dtype=np.int32)
    columns = np.arange(context_length)
    tokens = np.where((columns >= 1) & (columns <= lengths[:, None]), body, 0).astype(np.int32)
    tokens[:, 0] = SOT
    tokens[np.arange(batch_size), lengths + 1] = EOT
    return {"images": images, "tokens": tokens}


class SyntheticDataset(grain.IterDataset):
    def __init__(self, *, batch_size: int, image_size: int, context_length: int, seed: int = 0,
                 process_index: int = 0):
        super().__init__()
        self.batch_size, self.image_size, self.context_length = batch_size, image_size, context_length
        self.seed, self.process_index = seed, process_index

    def __iter__(self) -> "SyntheticIterator":
        return SyntheticIterator(self)

    def __str__(self) -> str:
        return f"SyntheticDataset(batch {self.batch_size}, {self.image_size} px, seed {self.seed})"


class SyntheticIterator(grain.DatasetIterator):
    def __init__(self, ds: SyntheticDataset):
        super().__init__()
        self._ds = ds
        self._number = 0

    def __next__(self) -> dict[str, np.ndarray]:
        ds = self._ds
        batch = synthetic_batch(ds.seed, ds.process_index, self._number, ds.batch_size, ds.image_size,
                                ds.context_length)
        self._number += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"batch": self._number}

    def set_state(self, state: dict[str, Any]) -> None:
        self._number = int(state["batch"])
