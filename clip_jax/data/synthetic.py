"""``dataset_type="synthetic"``: random images and captions' tokens, for timing the step without a loader.

Batch ``n`` of process ``p`` is a pure function of ``(seed, p, n)`` (Philox streams keyed by them), so the data is
the same on every run and the iterator resumes exactly from its state ``{"batch": n}``. So that the loader costs
nothing next to the step, the images are drawn once per process from ``(seed, p)`` (already normalised: uniform in
[-1, 1)) and the same array is handed out with every batch; the tokens are drawn for every batch, laid out as the
tokenizer lays them out (SOT, random ids, EOT, zero padding). Batches are built in the training process (``workers``
is not used: there is nothing to decode). With ``keys``, a batch also holds ``"keys"``, uint64 [B]: the hashes of
the names ``"synthetic/{p}/{n}/{row}"`` (:mod:`clip_jax.data.sample_keys`).
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from clip_jax.data.sample_keys import sample_key_hashes

SOT, EOT = 49406, 49407


def synthetic_images(seed: int, process_index: int, batch_size: int, image_size: int) -> np.ndarray:
    """float32 [B, S, S, 3] uniform in [-1, 1), from ``(seed, process_index)``."""
    rng = np.random.Generator(np.random.Philox(key=[seed % 2**64, process_index], counter=[0, 0, 0, 3]))
    images = rng.random((batch_size, image_size, image_size, 3), dtype=np.float32)
    images *= 2
    images -= 1
    return images


def synthetic_tokens(seed: int, process_index: int, number: int, batch_size: int, context_length: int) -> np.ndarray:
    """int32 [B, L] of batch ``number``: SOT, 1 to L - 2 random ids below SOT, EOT, zeros."""
    rng = np.random.Generator(np.random.Philox(key=[seed % 2**64, process_index], counter=[0, 0, number, 5]))
    lengths = rng.integers(1, context_length - 1, batch_size)  # text tokens between SOT and EOT
    body = rng.integers(1, SOT, (batch_size, context_length), dtype=np.int32)
    columns = np.arange(context_length)
    tokens = np.where((columns >= 1) & (columns <= lengths[:, None]), body, 0).astype(np.int32)
    tokens[:, 0] = SOT
    tokens[np.arange(batch_size), lengths + 1] = EOT
    return tokens


class SyntheticDataset(grain.IterDataset):
    def __init__(self, *, batch_size: int, image_size: int, context_length: int, seed: int = 0,
                 process_index: int = 0, keys: bool = False):
        super().__init__()
        self.batch_size, self.image_size, self.context_length = batch_size, image_size, context_length
        self.seed, self.process_index, self.keys = seed, process_index, keys

    def __iter__(self) -> "SyntheticIterator":
        return SyntheticIterator(self)

    def __str__(self) -> str:
        return f"SyntheticDataset(batch {self.batch_size}, {self.image_size} px, seed {self.seed})"


class SyntheticIterator(grain.DatasetIterator):
    def __init__(self, ds: SyntheticDataset):
        super().__init__()
        self._ds = ds
        self._number = 0
        self._images = synthetic_images(ds.seed, ds.process_index, ds.batch_size, ds.image_size)
        self._images.flags.writeable = False  # shared by every batch

    def __next__(self) -> dict[str, np.ndarray]:
        ds = self._ds
        tokens = synthetic_tokens(ds.seed, ds.process_index, self._number, ds.batch_size, ds.context_length)
        batch = {"images": self._images, "tokens": tokens}
        if ds.keys:
            prefix = f"synthetic/{ds.process_index}/{self._number}"
            batch["keys"] = sample_key_hashes(f"{prefix}/{row}" for row in range(ds.batch_size))
        self._number += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"batch": self._number}

    def set_state(self, state: dict[str, Any]) -> None:
        self._number = int(state["batch"])
