"""A Grain dataset of raw (image bytes, caption) samples streamed from webdataset tar shards.

Each data stream (one per process and worker) keeps ``shards_in_flight`` shards open and takes samples from them in
turn; a shard that ends is replaced by the next one of the stream's :class:`~clip_jax.data.shards.ShardOrder`.
Samples are shuffled in windows: ``shuffle_window`` consecutive samples are read, then returned in a random order.
The iterator state is the reading position at the start of the current window (shard and byte offset of each open
shard, the next draw number) plus the position inside the window, so a restore re-reads one window of raw bytes
and continues exactly where the saved iterator was. Bad data is skipped and counted by reason in the state;
samples a :class:`~clip_jax.data.webdataset.SampleFormat`'s filter drops are counted the same way, under reasons
starting ``"filter: "``.
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Iterator
from typing import Any, BinaryIO

import grain
import numpy as np

from clip_jax.data import shards as shards_lib
from clip_jax.data import tar_format, webdataset
from clip_jax.errors import InvalidInput

log = logging.getLogger(__name__)

EMPTY_SHARD = "empty_shard"  # a shard that ends before its first sample (counted in the error below only)
BAD_SAMPLES_ONLY = "bad_samples_only"  # a shard whose every sample was skipped or filtered


class NoUsableShards(InvalidInput, RuntimeError):
    """Shard after shard gives no usable sample: the data set as given cannot train (a bad path, corrupt or empty
    shards, a filter that drops everything)."""


def _log_bad_shard(reason: str, url: str, error: Exception) -> None:
    log.warning("%s %s: %s", reason.replace("_", " "), url, error)


class _OpenShard:
    """One shard being read: its draw number, shard index, and the offset of the next unread group."""

    def __init__(self, draw: int, shard: int, url: str, offset: int = 0):
        self.draw, self.shard, self.url, self.offset = draw, shard, url, offset
        self.groups_read = 1 if offset else 0  # restored part way: it had samples
        self._stream: BinaryIO | None = None
        self._groups: Iterator[tar_format.Group] | None = None

    def next_group(self) -> tar_format.Group | None:
        """The next group, or None at the end of the shard; raises OSError / TarError."""
        if self.offset < 0:  # read to the end already
            return None
        if self._groups is None:
            self._stream = webdataset.open_shard(self.url)
            if self.offset:
                self._stream.seek(self.offset)
            self._groups = tar_format.iter_groups(tar_format.iter_members(self._stream, self.offset))
        group = next(self._groups, None)
        if group is not None:
            self.offset = group.end
            self.groups_read += 1
        return group

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream, self._groups = None, None

    def state(self) -> dict[str, int]:
        return {"draw": self.draw, "shard": self.shard, "offset": self.offset}


class TarShardDataset(grain.IterDataset):
    """Infinite stream of :class:`~clip_jax.data.webdataset.RawSample` from tar shards, resampled or in epochs, per
    process and worker.

    ``mp_prefetch`` workers each read a disjoint stream (``set_slice``); processes are told their index here.
    """

    def __init__(
        self,
        shard_list: shards_lib.ShardList,
        *,
        resampled: bool,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        shuffle_window: int = 1000,
        shards_in_flight: int = 4,
        sample_format: webdataset.SampleFormat = webdataset.DEFAULT_FORMAT,
    ):
        super().__init__()
        self.sample_format = sample_format
        if shuffle_window < 1 or shards_in_flight < 1:
            raise InvalidInput(
                f"shuffle_window ({shuffle_window}) and shards_in_flight ({shards_in_flight}) must be >= 1"
            )
        self.shard_list = shard_list
        self.resampled = resampled
        self.seed = seed
        self.process_index, self.process_count = process_index, process_count
        self.worker_index, self.worker_count = 0, 1
        self.shuffle_window = shuffle_window
        self.shards_in_flight = shards_in_flight
        self.order()  # fail early on a split that cannot work

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Makes this copy the stream of worker ``sl.start`` of ``sl.step`` (called by ``mp_prefetch``)."""
        del sequential_slice
        self.worker_index, self.worker_count = sl.start or 0, sl.step or 1
        self.order()

    def order(self) -> shards_lib.ShardOrder:
        return shards_lib.ShardOrder.create(
            self.shard_list.weights, resampled=self.resampled, seed=self.seed, process_index=self.process_index,
            process_count=self.process_count, worker_index=self.worker_index, worker_count=self.worker_count,
        )

    def __iter__(self) -> "TarShardIterator":
        return TarShardIterator(self)

    def __str__(self) -> str:
        mode = "resampled" if self.resampled else "epoch"
        return (f"TarShardDataset({len(self.shard_list)} shards, {mode}, process {self.process_index}/"
                f"{self.process_count}, worker {self.worker_index}/{self.worker_count})")


class TarShardIterator(grain.DatasetIterator):
    """Iterator of :class:`TarShardDataset`; its state is a small JSON-able dict."""

    def __init__(self, ds: TarShardDataset):
        super().__init__()
        self._urls, self._missing = ds.shard_list.urls, ds.shard_list.missing
        self._order = ds.order()
        self._seed = ds.seed
        self._format = ds.sample_format
        self._window_size = ds.shuffle_window
        in_flight = ds.shards_in_flight if ds.resampled else min(ds.shards_in_flight, self._order.shards_per_epoch)
        self._slots: list[_OpenShard | None] = [None] * in_flight  # epoch mode: never one shard twice at once
        self._cursor = 0
        self._next_draw = 0
        self._window_index = -1  # no window read yet
        self._window: list[webdataset.RawSample] = []
        self._position = 0
        self._window_start: dict[str, Any] = self._reader_state()
        self.skipped: collections.Counter = collections.Counter()
        self._barren = 0  # shards ended or failed since the last good sample
        self._barren_shards: dict[str, tuple[str, str]] = {}  # url -> (reason, detail) since the last good sample
        self._usable_seen = False  # bad-shard warnings wait for the first good sample (none at all: one error)
        self._warned: set[str] = set()
        self._held: list[tuple[str, str, Exception]] = []
        self._permutation_cache: tuple[int, np.ndarray] | None = None
        self._avoid_open_shards = ds.resampled and len(set(ds.shard_list.weights)) == 1

    # -- reading -------------------------------------------------------------------------------------------------

    def _shard_at(self, draw: int) -> int:
        if self._order.resampled:
            return self._order.shard(draw)
        epoch = self._order.epoch_of(draw)
        if self._permutation_cache is None or self._permutation_cache[0] != epoch:
            self._permutation_cache = (epoch, self._order.epoch_permutation(epoch))
        return self._order.shard(draw, self._permutation_cache[1])

    def _open_next(self) -> _OpenShard:
        """Opens the next shard of the draw order.

        With equal weights, resampled mode passes over shards this stream already has open (two slots reading one
        shard in step would put the same samples in one window); by symmetry this keeps every shard equally
        likely. With unequal weights it would favour light shards, so draws are taken as they come.
        """
        open_now = {s.shard for s in self._slots if s is not None} if self._avoid_open_shards else set()
        for _ in range(100):
            draw = self._next_draw
            self._next_draw += 1
            shard = self._shard_at(draw)
            if shard not in open_now or len(open_now) >= len(self._urls):
                break
        return _OpenShard(draw, shard, self._urls[shard])

    def _may_open_next(self) -> bool:
        """Epoch mode starts the next epoch's shards only once every shard of the current one is done."""
        if self._order.resampled:
            return True
        next_epoch = self._order.epoch_of(self._next_draw)
        return all(self._order.epoch_of(s.draw) >= next_epoch for s in self._slots if s is not None)

    def _retire(self, index: int, reason: str | None = None, detail: str = "") -> None:
        """Closes a finished or failed shard (`reason`: why it failed); its slot opens the next shard when its turn
        comes again. Too many in a row without a usable sample end the stream with one error, counting the shards
        by what was wrong with them."""
        slot = self._slots[index]
        slot.close()
        self._slots[index] = None
        self._cursor = (index + 1) % len(self._slots)
        self._barren += 1
        if reason is None:
            reason = BAD_SAMPLES_ONLY if slot.groups_read else EMPTY_SHARD
        self._barren_shards.setdefault(slot.url, (reason, detail))
        limit = max(64, 3 * len(self._urls))
        if self._barren > limit:
            self._held.clear()  # told by the error, not one warning per shard
            raise NoUsableShards(self._barren_message())

    def _barren_message(self) -> str:
        by_reason = collections.Counter(reason for reason, _ in self._barren_shards.values())
        url, (reason, detail) = next(iter(self._barren_shards.items()))
        samples = {k: v for k, v in self.skipped.items() if k not in by_reason}
        return (f"{self._barren} shards in a row gave no usable sample ({len(self._barren_shards)} distinct of the "
                f"data set's {len(self._urls)}: " + ", ".join(f"{k} {n}" for k, n in sorted(by_reason.items()))
                + (f", and {self._missing} named shards do not exist" if self._missing else "")
                + f"; first: {url}" + (f": {detail}" if detail else f", {reason}") + ")"
                + (f"; samples skipped: {dict(sorted(samples.items()))}" if samples else "")
                + "; check the shards with `python -m clip_jax.data.check PATTERN`")

    def _warn_bad_shard(self, reason: str, url: str, error: Exception) -> None:
        """One warning per shard and process, held back until the stream has read a usable sample: a data set
        with no usable shard at all gets the one error of `_retire` instead."""
        if url in self._warned:
            return
        self._warned.add(url)
        if not self._usable_seen:
            self._held.append((reason, url, error))
            return
        _log_bad_shard(reason, url, error)

    def _next_raw(self, number: int) -> webdataset.RawSample:
        while True:
            slot = self._slots[self._cursor]
            if slot is None:
                if not self._may_open_next():
                    self._cursor = (self._cursor + 1) % len(self._slots)
                    continue
                slot = self._slots[self._cursor] = self._open_next()
            try:
                group = slot.next_group()
            except (tar_format.TarError, OSError) as e:
                reason = webdataset.shard_error_reason(e)
                self._warn_bad_shard(reason, slot.url, e)
                self.skipped[reason] += 1
                self._retire(self._cursor, reason, str(e))
                continue
            if group is None:
                self._retire(self._cursor)
                continue
            self._cursor = (self._cursor + 1) % len(self._slots)
            sample = webdataset.sample_from_group(group, slot.url, self._order.stream_index, number, self._format)
            if isinstance(sample, str):
                self.skipped[sample] += 1
                continue
            if self._barren or not self._usable_seen:
                self._barren, self._barren_shards, self._usable_seen = 0, {}, True
                held, self._held = self._held, []
                for reason, url, error in held:
                    _log_bad_shard(reason, url, error)
            return sample

    def _reader_state(self) -> dict[str, Any]:
        return {
            "next_draw": self._next_draw,
            "cursor": self._cursor,
            "slots": [None if s is None else s.state() for s in self._slots],
        }

    def _set_reader_state(self, state: dict[str, Any]) -> None:
        for slot in self._slots:
            if slot is not None:
                slot.close()
        self._next_draw, self._cursor = state["next_draw"], state["cursor"]
        self._slots = [None if s is None else _OpenShard(s["draw"], s["shard"], self._urls[s["shard"]], s["offset"])
                       for s in state["slots"]]

    def _read_window(self) -> None:
        self._window_index += 1
        self._window_start = self._reader_state()
        first = self._window_index * self._window_size
        window = [self._next_raw(first + i) for i in range(self._window_size)]
        if self._window_size > 1:
            rng = np.random.Generator(np.random.Philox(key=[self._seed % 2**64, self._order.stream_index],
                                                       counter=[0, 0, self._window_index, 1]))
            window = [window[i] for i in rng.permutation(self._window_size)]
        self._window, self._position = window, 0

    def __next__(self) -> webdataset.RawSample:
        if self._position >= len(self._window):
            self._read_window()
        sample = self._window[self._position]
        self._position += 1
        return sample

    # -- state ---------------------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epoch of the last shard opened before the current window (epoch mode; always 0 when resampled)."""
        return self._order.epoch_of(max(self._window_start["next_draw"] - 1, 0))

    def get_state(self) -> dict[str, Any]:
        return {
            "window_index": self._window_index,
            "position": self._position,
            "reader": copy.deepcopy(self._window_start),
            "epoch": self.epoch,
            "skipped": dict(self.skipped),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._set_reader_state(state["reader"])
        self._window, self._position, self._window_index = [], 0, -1
        if state["window_index"] >= 0:  # re-read the current window from its start
            self._window_index = state["window_index"] - 1
            self._read_window()
            self._position = state["position"]
        self.skipped = collections.Counter(state["skipped"])
        self._barren, self._barren_shards = 0, {}

    def close(self) -> None:
        for slot in self._slots:
            if slot is not None:
                slot.close()

    def __str__(self) -> str:
        return f"TarShardIterator(stream {self._order.stream_index} of {self._order.streams})"
