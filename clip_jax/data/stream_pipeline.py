"""The training input read as a fixed number of data streams, so that the batches do not depend on the topology.

A run's data is ``S`` streams (``TrainDataConfig.streams``, chosen at the run's start and kept by its checkpoints).
Stream ``s`` of ``S`` is the pipeline :func:`~clip_jax.data.pipeline.build_train_dataset` builds for "process s of
S" without workers, at the run's global batch ``G``: its shard draws, shuffle windows and augmentations are keyed
by (seed, s) alone, and each of its batches is ``G / S`` samples. Every global batch takes one such batch from every
stream, stream-major: rows ``[s * G/S, (s+1) * G/S)`` come from stream ``s``. Process ``p`` of ``P`` owns the
contiguous block :func:`~clip_jax.data.streams.owned` and lays its rows out in stream order, so the processes' rows
concatenated in process order (``runtime.mesh.make_global_batch``) are that global batch on every ``P`` dividing
``S``. A process's data workers share its streams in contiguous chunks (:func:`~clip_jax.data.streams.worker_chunks`);
each worker hands over one *part* per step (its chunk's rows), and :class:`StreamTrainIterator` joins the parts.

The position of a run's data is each stream's own iterator state (``{"data_streams": S, "streams": {s: state}}``),
not Grain's nested worker state: saved per process, it is read back by stream on any process count
(``runtime.checkpoints.read_stream_positions``), and its ``"skipped"`` counters travel with their streams.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from clip_jax.data import skips, streams as streams_lib
from clip_jax.errors import RunFailed
from clip_jax.runtime import private_apis, stop_signals

log = logging.getLogger(__name__)

POSITIONS = "positions"  # a part's stream states after it, as JSON bytes (a plain array for Grain's transfers)
KEYS = "keys"


class StreamsDataset(grain.IterDataset):
    """Parts of a process's streams: ``make_stream(s)`` is stream ``s``'s dataset of ``G / S``-row batches;
    ``start`` maps a stream to its saved state (absent: from its beginning). ``mp_prefetch`` gives each worker a
    contiguous chunk of the streams (``set_slice``)."""

    def __init__(self, make_stream: Callable[[int], grain.IterDataset], streams: Sequence[int],
                 start: Mapping[int, Any] | None = None):
        super().__init__()
        self.make_stream, self.streams, self.start = make_stream, tuple(streams), dict(start or {})
        self.chunk = self.streams

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Makes this copy worker ``sl.start`` of ``sl.step``: it reads that worker's chunk of the streams."""
        del sequential_slice
        chunks = streams_lib.worker_chunks(range(len(self.streams)), sl.step or 1)
        self.chunk = tuple(self.streams[i] for i in chunks[sl.start or 0])

    def __iter__(self) -> "StreamsIterator":
        return StreamsIterator(self)

    def __str__(self) -> str:
        return f"StreamsDataset(streams {self.chunk[0]}..{self.chunk[-1]})"


class StreamsIterator(grain.DatasetIterator):
    """One part per ``next``: a batch from each stream of the chunk, in stream order, and their states after it.
    The streams open on the first ``next`` (Grain may build a copy only to ask for its state)."""

    def __init__(self, ds: StreamsDataset):
        super().__init__()
        self._ds = ds
        self._streams: dict[int, grain.DatasetIterator] | None = None

    def _open(self) -> dict[int, grain.DatasetIterator]:
        opened = {}
        for s in self._ds.chunk:
            opened[s] = iter(self._ds.make_stream(s))
            if self._ds.start.get(s) is not None:
                opened[s].set_state(self._ds.start[s])
        return opened

    def __next__(self) -> dict[str, np.ndarray]:
        if self._streams is None:
            self._streams = self._open()
        parts = [next(it) for it in self._streams.values()]
        part = parts[0] if len(parts) == 1 else {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        part[POSITIONS] = np.frombuffer(json.dumps(self.get_state()["streams"]).encode(), np.uint8)
        return part

    def get_state(self) -> dict[str, Any]:
        if self._streams is None:
            return {"streams": {str(s): self._ds.start.get(s) for s in self._ds.chunk}}
        return {"streams": {str(s): it.get_state() for s, it in self._streams.items()}}

    def set_state(self, state: dict[str, Any]) -> None:
        self.close()
        self._ds.start = {int(s): v for s, v in state["streams"].items()}
        self._streams = None

    def close(self) -> None:
        for it in (self._streams or {}).values():
            close = getattr(it, "close", None)
            if close is not None:
                close()
        self._streams = None


def process_streams(streams: int, process_index: int, process_count: int, workers: int) -> tuple[range, int]:
    """(the streams process ``process_index`` owns, the workers that read them): no more workers than streams."""
    block = streams_lib.owned(streams, process_count, process_index)
    return block, min(max(workers, 1), len(block))


def build_stream_iterator(make_stream: Callable[[int], grain.IterDataset], *, streams: int, process_index: int,
                          process_count: int, workers: int, prefetch_batches: int,
                          start: Mapping[int, Any] | None = None) -> "StreamTrainIterator":
    """This process's iterator over its streams of ``streams`` (see the module docstring); ``workers`` 0 reads
    in this process, else ``min(workers, owned streams)`` worker processes share the streams (said in a line
    when fewer than asked); ``start``: saved stream states (``runtime.checkpoints.read_stream_positions``)."""
    block, used = process_streams(streams, process_index, process_count, workers)
    if workers > used and process_index == 0:
        log.info("data: %d workers per process read its %d data streams (workers=%d: one stream is read by one "
                 "worker)", used, len(block), workers)
    dataset: grain.IterDataset = StreamsDataset(make_stream, block, start)
    if workers > 0:
        private_apis.let_grain_start_workers()
        stop_signals.start_resource_tracker()
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=used,
                                                                   per_worker_buffer_size=prefetch_batches),
                                      worker_init_fn=stop_signals.ignore_in_worker)
    parts = 1 if workers == 0 else used
    with stop_signals.held_back():
        return StreamTrainIterator(iter(dataset), streams=streams, block=block, parts=parts, start=start)


class StreamTrainIterator(grain.DatasetIterator):
    """The training iterator over data streams: each ``next`` joins one part from each worker (in worker order,
    checked to tile the process's streams) into ``{"images", "tokens"}`` rows in stream order; ``last_keys`` holds
    their sample keys (``uint64``, see ``data.pipeline``). Its state is the streams' own (module docstring)."""

    def __init__(self, parent: grain.DatasetIterator, *, streams: int, block: range, parts: int,
                 start: Mapping[int, Any] | None):
        super().__init__(parent)
        self.streams, self.block, self.parts = streams, block, parts
        self.positions: dict[str, Any] = {str(s): (start or {}).get(s) for s in block}
        self.last_keys: np.ndarray | None = None

    def __next__(self) -> dict[str, np.ndarray]:
        with stop_signals.held_back():
            parts = [next(self._parent) for _ in range(self.parts)]
        positions = [json.loads(part.pop(POSITIONS).tobytes()) for part in parts]
        order = [int(s) for p in positions for s in p]
        if order != list(self.block):
            raise RunFailed(f"data workers handed over streams {order}, not this process's {list(self.block)} in "
                            "order: the step's rows would be out of place")
        for p in positions:
            self.positions.update(p)
        batch = parts[0] if len(parts) == 1 else {key: np.concatenate([part[key] for part in parts])
                                                   for key in parts[0]}  # a copy only when workers share them
        self.last_keys = batch.pop(KEYS, None)
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"data_streams": self.streams, "streams": dict(self.positions)}

    def set_state(self, state: dict[str, Any]) -> None:
        raise RunFailed("a stream iterator starts at its saved positions (build_stream_iterator's start); it is "
                        "not moved afterwards")

    def close(self) -> None:
        if self._closed:
            return
        with stop_signals.held_back():
            super().close()
        private_apis.finish_grain_shared_memory_deletes()

    def skipped_samples(self) -> dict[str, int]:
        """Samples and shards skipped so far by this process's streams, by reason (see ``TrainIterator``)."""
        return skips.skip_counts(self.get_state())

    def __str__(self) -> str:
        return f"StreamTrainIterator(streams {self.block.start}..{self.block.stop - 1} of {self.streams})"


def stream_factory(build: Callable[..., grain.IterDataset], streams: int, **kwargs) -> Callable[[int], Any]:
    """``make_stream(s)`` for :class:`StreamsDataset`: ``build(process_index=s, process_count=streams, **kwargs)``
    (picklable: the workers build their streams themselves)."""
    return functools.partial(_make_stream, build, streams, kwargs)


def _make_stream(build, streams: int, kwargs: dict, s: int) -> grain.IterDataset:
    return build(process_index=s, process_count=streams, **kwargs)
