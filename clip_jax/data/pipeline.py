"""The training input pipeline: raw samples -> decode + augment -> batches of images and tokens, per process.

A run's data comes from its config in three calls: ``TrainDataConfig.from_run_config(config)`` and
``resolve_train_shards`` (:mod:`clip_jax.data.train_config`; once: the same shard list feeds
:func:`~clip_jax.data.epochs.steps_per_epoch` and the pipeline), then :func:`build_train_iterator`, whose
:class:`TrainIterator` yields, per process,
``{"images": float32 [B_proc, S, S, 3] (normalised), "tokens": int32 [B_proc, context_length]}`` forever, reports
``skipped_samples()``, and resumes exactly through ``get_state()``/``set_state()`` (Orbax saves it with
``grain.checkpoint.CheckpointSave``). Raw samples come from :mod:`clip_jax.data.tar_dataset` (webdataset shards),
:mod:`clip_jax.data.csv_source` or :mod:`clip_jax.data.synthetic` (whole batches).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from clip_jax.data import csv_source, skips, stream_pipeline, synthetic, tar_dataset, transforms, webdataset
from clip_jax.data.sample_keys import csv_sample_name, sample_key_hashes, shard_sample_name
from clip_jax.data.train_config import Source, TrainDataConfig, resolve_train_shards
from clip_jax.errors import InvalidInput
from clip_jax.runtime import private_apis, stop_signals

log = logging.getLogger(__name__)


class DecodedDataset(grain.IterDataset):
    """Raw samples -> ``{"image": uint8 [S, S, 3], "caption": str, "key": str}``; undecodable images are skipped
    and counted. ``key``: the sample's name, by ``sample_name`` (:mod:`clip_jax.data.sample_keys`)."""

    def __init__(self, parent: grain.IterDataset, *, image_size: int, train: bool, seed: int = 0,
                 scale: Sequence[float] = transforms.TRAIN_SCALE, ratio: Sequence[float] = transforms.TRAIN_RATIO,
                 max_pixels: int | None = None, augment: transforms.TrainAugment | None = None,
                 sample_name: Callable[[webdataset.RawSample], str] = shard_sample_name):
        super().__init__(parent)
        self.image_size, self.train, self.seed, self.max_pixels = image_size, train, seed, max_pixels
        self.sample_name = sample_name
        self.augment = augment if augment is not None and not augment.plain else None
        self.scale, self.ratio = tuple(scale), tuple(ratio)

    def __iter__(self) -> "DecodedIterator":
        return DecodedIterator(self._parent.__iter__(), self)


class DecodedIterator(grain.DatasetIterator):
    """Iterator of :class:`DecodedDataset`; its state is the parent's plus the decode-failure counter."""

    def __init__(self, parent: grain.DatasetIterator, ds: DecodedDataset):
        super().__init__(parent)
        self._ds = ds
        self.skipped: collections.Counter = collections.Counter()

    def __next__(self) -> dict[str, Any]:
        ds = self._ds
        while True:
            sample: webdataset.RawSample = next(self._parent)
            try:
                image = transforms.decode_rgb(sample.image, ds.max_pixels)
            except transforms.TooManyPixels as e:
                log.debug("skipping %s in %s: %s", sample.key, sample.shard, e)
                self.skipped[skips.TOO_MANY_PIXELS] += 1
                continue
            except transforms.ImageDecodeError as e:
                log.debug("skipping %s in %s: %s", sample.key, sample.shard, e)
                self.skipped[skips.CORRUPT_IMAGE] += 1
                continue
            if ds.train:
                rng = np.random.Generator(np.random.Philox(key=[ds.seed % 2**64, sample.stream],
                                                           counter=[0, 0, sample.number, 2]))
                if ds.augment is not None:
                    pixels = transforms.train_augment(image, ds.image_size, rng, ds.augment)
                    erase = transforms.random_erasing(rng, ds.image_size, ds.augment.re_prob, ds.augment.re_count)
                    if erase:
                        return {"image": pixels, "caption": sample.caption, "key": ds.sample_name(sample),
                                "erase": erase}
                else:
                    pixels = transforms.train_crop(image, ds.image_size, rng, ds.scale, ds.ratio)
            else:
                pixels = transforms.eval_crop(image, ds.image_size)
            return {"image": pixels, "caption": sample.caption, "key": ds.sample_name(sample)}

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "skipped": dict(self.skipped)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self.skipped = collections.Counter(state["skipped"])

    def __str__(self) -> str:
        return f"DecodedIterator(train={self._ds.train}, size={self._ds.image_size})"


Tokenizer = Callable[..., np.ndarray]  # (texts, context_length=L) -> int [N, L]


def clip_tokenize(texts: list[str], context_length: int = 77) -> np.ndarray:
    """OpenCLIP's tokenizer (``clip_jax.text.clip_tokenizer.tokenize``)."""
    from clip_jax.text.clip_tokenizer import tokenize

    return tokenize(texts, context_length=context_length)


@dataclasses.dataclass(frozen=True)
class Collate:
    """Stacks decoded samples into ``{"images": float32 [B, S, S, 3], "tokens": int32 [B, L]}``; with ``keys``,
    also ``"keys": uint64 [B]``, the samples' name hashes (:func:`~clip_jax.data.sample_keys.sample_key_hash`)."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    context_length: int = 77
    tokenize: Tokenizer = clip_tokenize  # a module-level function, so that worker processes can unpickle it
    keys: bool = False

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        images = np.stack([s["image"] for s in samples])  # [B, S, S, 3] uint8
        tokens = self.tokenize([s["caption"] for s in samples], context_length=self.context_length)
        images = transforms.normalize(images, self.mean, self.std)
        for image, sample in zip(images, samples):
            if "erase" in sample:  # timm's random erasing acts on the normalised image
                transforms.apply_erasing(image, sample["erase"])
        batch = {"images": images, "tokens": np.asarray(tokens, np.int32)}
        if self.keys:
            batch["keys"] = sample_key_hashes(s["key"] for s in samples)
        return batch


def per_process_batch_size(global_batch_size: int, process_count: int) -> int:
    if global_batch_size % process_count:
        raise InvalidInput(f"global batch size {global_batch_size} is not divisible by {process_count} processes")
    return global_batch_size // process_count


def build_train_dataset(
    cfg: TrainDataConfig,
    *,
    global_batch_size: int,
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    process_index: int = 0,
    process_count: int = 1,
    context_length: int = 77,
    tokenize: Tokenizer = clip_tokenize,
    shard_list: Source = None,
    sample_keys: bool = False,
) -> grain.IterDataset:
    """The per-process training dataset (see :func:`build_train_iterator`); ``shard_list``: the run's resolved
    shards (:func:`resolve_train_shards`), resolved here when not given; ``sample_keys``: batches also carry
    ``"keys"``, uint64 [B_proc] (:mod:`clip_jax.data.sample_keys`)."""
    batch_size = per_process_batch_size(global_batch_size, process_count)
    if cfg.dataset_type == "synthetic":
        return synthetic.SyntheticDataset(batch_size=batch_size, image_size=image_size, context_length=context_length,
                                          seed=cfg.seed, process_index=process_index, keys=sample_keys)
    if shard_list is None:
        shard_list = resolve_train_shards(cfg)
    if cfg.dataset_type == "csv":
        ds = csv_source.CsvDataset(shard_list, seed=cfg.seed, process_index=process_index,
                                   process_count=process_count, sample_filter=cfg.sample_filter)
        if len(shard_list) < process_count * max(cfg.workers, 1):
            raise InvalidInput(f"{cfg.shards} has {len(shard_list)} rows for {process_count} processes x "
                               f"{max(cfg.workers, 1)} workers")
        return _decode_batch_prefetch(ds, cfg, batch_size, image_size, mean, std, context_length, tokenize,
                                      sample_keys)
    if cfg.weights is not None and not cfg.resampled:
        raise InvalidInput("data weights need resampled mode (resampled=True): epoch mode reads every shard once")
    ds = tar_dataset.TarShardDataset(
        shard_list, resampled=cfg.resampled, seed=cfg.seed, process_index=process_index,
        process_count=process_count, shuffle_window=cfg.shuffle_window, shards_in_flight=cfg.shards_in_flight,
        sample_format=cfg.sample_format,
    )
    streams = process_count * max(cfg.workers, 1)
    if not cfg.resampled and len(shard_list) < streams:
        raise InvalidInput(
            f"epoch mode needs at least one shard per process x worker: {len(shard_list)} shards for "
            f"{process_count} processes x {max(cfg.workers, 1)} workers; use resampled mode or fewer workers"
        )
    return _decode_batch_prefetch(ds, cfg, batch_size, image_size, mean, std, context_length, tokenize, sample_keys)


def _decode_batch_prefetch(ds: grain.IterDataset, cfg: TrainDataConfig, batch_size: int, image_size: int,
                           mean: Sequence[float], std: Sequence[float], context_length: int,
                           tokenize: Tokenizer, sample_keys: bool = False) -> grain.IterDataset:
    """Raw samples -> decoded, augmented, batched (in worker processes when ``cfg.workers`` > 0)."""
    name = csv_sample_name if isinstance(ds, csv_source.CsvDataset) else shard_sample_name
    ds = DecodedDataset(ds, image_size=image_size, train=True, seed=cfg.seed, max_pixels=cfg.max_image_pixels,
                        scale=cfg.augment.scale, ratio=cfg.augment.ratio, augment=cfg.augment, sample_name=name)
    ds = ds.batch(batch_size, drop_remainder=True,
                  batch_fn=Collate(tuple(mean), tuple(std), context_length, tokenize, sample_keys))
    if cfg.workers > 0:
        private_apis.let_grain_start_workers()  # outside absl.app.run too
        stop_signals.start_resource_tracker()  # now: its start would let stop signals through to the workers
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.workers,
                                                         per_worker_buffer_size=cfg.prefetch_batches),
                            worker_init_fn=stop_signals.ignore_in_worker)
    return ds


def build_train_iterator(cfg: TrainDataConfig, **kwargs) -> "TrainIterator":
    """Per-process iterator of ``{"images": float32 [B_proc, S, S, 3], "tokens": int32 [B_proc, L]}``, infinite.

    Keyword arguments as :func:`build_train_dataset`: ``global_batch_size``, ``image_size``, ``mean``, ``std``,
    ``process_index``, ``process_count``, ``context_length``, ``tokenize``, ``shard_list``. With ``cfg.streams``
    the data is read as that many streams (:func:`build_streams`; ``start``: their saved states).
    """
    if cfg.streams:
        return build_streams(cfg, **kwargs)
    dataset = build_train_dataset(cfg, **kwargs)
    with stop_signals.held_back():
        return TrainIterator(iter(dataset))


def build_streams(cfg: TrainDataConfig, *, process_index: int = 0, process_count: int = 1,
                  start: Mapping[int, Any] | None = None, **kwargs) -> "stream_pipeline.StreamTrainIterator":
    """This process's iterator over ``cfg.streams`` data streams (:mod:`clip_jax.data.stream_pipeline`), from the
    saved stream states ``start``; each stream is :func:`build_train_dataset`'s "process s of S" without workers."""
    make_stream = stream_pipeline.stream_factory(build_train_dataset, cfg.streams,
                                                 cfg=dataclasses.replace(cfg, workers=0), sample_keys=True, **kwargs)
    return stream_pipeline.build_stream_iterator(
        make_stream, streams=cfg.streams, process_index=process_index, process_count=process_count,
        workers=cfg.workers, prefetch_batches=cfg.prefetch_batches, start=start)


class TrainIterator(grain.DatasetIterator):
    """The training iterator: Grain's, plus :meth:`skipped_samples` for metrics.

    Its state is the wrapped iterator's, unchanged, so checkpoints read and written through it are Grain's own.
    Every call holds SIGINT and SIGTERM back in its thread, so that the worker processes and threads Grain starts
    in it leave them to the main process (:mod:`clip_jax.runtime.stop_signals`); `close` stops the workers.
    """

    def __next__(self) -> dict[str, np.ndarray]:
        with stop_signals.held_back():
            return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        with stop_signals.held_back():
            return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        with stop_signals.held_back():
            self._parent.set_state(state)

    def close(self) -> None:
        if self._closed:  # also called again by `__del__`, maybe as the interpreter exits
            return
        with stop_signals.held_back():
            super().close()
        private_apis.finish_grain_shared_memory_deletes()

    def skipped_samples(self) -> dict[str, int]:
        """Samples and shards skipped so far, by reason (``{"corrupt_image": 3, ...}``), summed over all workers.

        Data workers keep their counters in their own processes; the iterator state is what carries them back.
        """
        return skips.skip_counts(self.get_state())

    def __str__(self) -> str:
        return f"TrainIterator({self._parent})"
