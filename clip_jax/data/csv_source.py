"""``dataset_type="csv"``: OpenCLIP's csv/tsv of image paths and captions, as a Grain stream of raw samples.

The file has a header row; ``img_key`` and ``caption_key`` name the columns (OpenCLIP's ``--csv-img-key`` /
``--csv-caption-key``, defaults ``filepath`` / ``title``), ``separator`` the delimiter (default tab). Image paths
are relative to the csv's folder unless absolute. Rows are read in epochs: epoch ``e`` is a permutation of all rows
drawn from ``(seed, e)``, dealt round-robin to the data streams (process x worker). The iterator state is
``{"epoch", "position", "skipped"}``, so a restore continues exactly. A row whose image file cannot be read is
skipped and counted (``missing_image``); one that does not decode is counted by the decoding stage.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import os
from typing import Any

import grain
import numpy as np

from clip_jax.data import filters, skips, webdataset
from clip_jax.errors import InvalidInput, MissingInput


@dataclasses.dataclass(frozen=True)
class CsvTable:
    """The rows of one csv: image paths (resolved) and captions."""

    path: str
    images: tuple[str, ...]
    captions: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.images)


def read_csv(path: str, img_key: str = "filepath", caption_key: str = "title", separator: str = "\t") -> CsvTable:
    """Reads the table; a missing file or column is a clear error naming it (and the columns present)."""
    if not os.path.isfile(path):
        raise MissingInput(f"csv file {path!r} does not exist")
    folder = os.path.dirname(os.path.abspath(path))
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=separator)
        columns = reader.fieldnames or []
        missing = [k for k in (img_key, caption_key) if k not in columns]
        if missing:
            raise InvalidInput(
                f"{path}: no column {', '.join(repr(m) for m in missing)} (columns: {columns}); set csv_img_key / "
                f"csv_caption_key, or csv_separator (now {separator!r}) if the columns are not split"
            )
        images, captions = [], []
        for row in reader:
            images.append(os.path.join(folder, row[img_key] or ""))
            captions.append(row[caption_key] or "")
    if not images:
        raise InvalidInput(f"{path} has no rows")
    return CsvTable(path, tuple(images), tuple(captions))


class CsvDataset(grain.IterDataset):
    """Infinite stream of :class:`~clip_jax.data.webdataset.RawSample` from a :class:`CsvTable`, in epochs."""

    def __init__(self, table: CsvTable, *, seed: int = 0, process_index: int = 0, process_count: int = 1,
                 sample_filter: filters.SampleFilter | None = None):
        super().__init__()
        self.table, self.seed, self.sample_filter = table, seed, sample_filter
        self.process_index, self.process_count = process_index, process_count
        self.worker_index, self.worker_count = 0, 1
        self._check_split()

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        del sequential_slice
        self.worker_index, self.worker_count = sl.start or 0, sl.step or 1
        self._check_split()

    @property
    def streams(self) -> int:
        return self.process_count * self.worker_count

    @property
    def stream_index(self) -> int:
        return self.process_index * self.worker_count + self.worker_index

    def _check_split(self) -> None:
        if len(self.table) < self.streams:
            raise InvalidInput(f"{self.table.path} has {len(self.table)} rows for {self.streams} data streams "
                               "(processes x workers): use fewer workers")

    def __iter__(self) -> "CsvIterator":
        return CsvIterator(self)


class CsvIterator(grain.DatasetIterator):
    def __init__(self, ds: CsvDataset):
        super().__init__()
        self._ds = ds
        self._epoch, self._position = 0, 0
        self._rows: np.ndarray | None = None
        self.skipped: collections.Counter = collections.Counter()

    def _epoch_rows(self) -> np.ndarray:
        if self._rows is None:
            ds = self._ds
            rng = np.random.Generator(np.random.Philox(key=[ds.seed % 2**64, 0], counter=[0, 0, self._epoch, 4]))
            self._rows = rng.permutation(len(ds.table))[ds.stream_index::ds.streams]
        return self._rows

    def __next__(self) -> webdataset.RawSample:
        ds = self._ds
        barren = 0
        while True:
            rows = self._epoch_rows()
            if self._position >= len(rows):
                self._epoch, self._position, self._rows = self._epoch + 1, 0, None
                continue
            row = int(rows[self._position])
            number = self._epoch * len(rows) + self._position
            self._position += 1
            reason, sample = self._sample(row, number)
            if sample is not None:
                return sample
            self.skipped[reason] += 1
            barren += 1
            if barren > 10 * len(rows) + 100:
                raise RuntimeError(f"no usable row in {ds.table.path} (skipped so far: {dict(self.skipped)})")

    def _sample(self, row: int, number: int) -> tuple[str | None, webdataset.RawSample | None]:
        ds = self._ds
        caption = ds.table.captions[row]
        if not caption.strip():
            return skips.EMPTY_CAPTION, None
        path = ds.table.images[row]
        try:
            with open(path, "rb") as f:
                image = f.read()
        except OSError:
            return skips.MISSING_IMAGE, None
        if not image:
            return skips.EMPTY_IMAGE, None
        if ds.sample_filter is not None:
            reason = ds.sample_filter.check(None, image, caption)
            if reason is not None:
                return reason, None
        return None, webdataset.RawSample(image, caption, path, ds.table.path, ds.stream_index, number)

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position, "skipped": dict(self.skipped)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._position, self._rows = int(state["epoch"]), int(state["position"]), None
        self.skipped = collections.Counter(state["skipped"])
