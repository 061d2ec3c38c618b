"""The training input pipeline: shards -> raw samples -> decode + augment -> batches of images and tokens.

A run's data comes from its config in three calls: ``TrainDataConfig.from_run_config(config)``, then
``resolve_train_shards`` (once: the same shard list feeds ``steps_per_epoch`` and the pipeline), then
``build_train_iterator``, whose :class:`TrainIterator` yields, per process,
``{"images": float32 [B_proc, S, S, 3] (normalised), "tokens": int32 [B_proc, context_length]}`` forever, reports
``skipped_samples()``, and resumes exactly through ``get_state()``/``set_state()`` (Orbax saves it with
``grain.checkpoint.CheckpointSave``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from clip_jax.data import csv_source, filters, skips, synthetic, tar_dataset, transforms, webdataset
from clip_jax.data import shards as shards_lib
from clip_jax.errors import InvalidInput

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainDataConfig:
    """What a run config says about its data; :meth:`from_run_config` reads it from one."""

    shards: str  # e.g. "/data/laion2B-en/{00000..23295}.tar", sources joined with "::"
    weights: str | None = None  # per-source draw weights "1::2" (resampled mode)
    resampled: bool = True  # draw shards with replacement (else: every shard once per epoch)
    train_num_samples: int | None = None  # virtual epoch size (None: counted from *_stats.json when present)
    seed: int = 0
    workers: int = 0  # data worker processes per training process (0: read in the training process)
    shuffle_window: int = 1000  # samples shuffled together, per worker
    shards_in_flight: int = 4  # shards read in turn, per worker
    prefetch_batches: int = 2  # batches buffered per worker
    check_shards_exist: bool = True
    make_from: str | None = None  # "fashion-mnist": write the shards when missing (make_shards.write_missing_shards)
    dataset_type: str = "webdataset"  # webdataset | csv (shards: the csv file) | synthetic (random batches)
    sample_filter: filters.SampleFilter | None = None  # which samples are kept (filters.py)
    image_keys: str = "jpg;png;jpeg;webp"  # webdataset image extensions, in preference order
    caption_key: str = "txt"  # webdataset caption: an extension, or "json:FIELD"
    max_image_pixels: int | None = None  # images declaring more pixels are skipped (too_many_pixels)
    csv_img_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = "\t"
    augment: transforms.TrainAugment = transforms.TrainAugment()  # OpenCLIP's aug_cfg (augment_from_config)

    def __post_init__(self):
        if self.dataset_type not in DATASET_TYPES:
            raise InvalidInput(f"dataset_type={self.dataset_type!r}: choose one of {DATASET_TYPES}")
        if self.sample_filter is not None and self.sample_filter.rules and self.dataset_type != "webdataset":
            raise InvalidInput("train_data_filter reads each sample's .json, which only webdataset shards have; "
                               f"a {self.dataset_type} run takes train_data_min_image_size and "
                               "train_data_min_caption_chars only")

    @property
    def sample_format(self) -> webdataset.SampleFormat:
        return webdataset.SampleFormat.parse(self.image_keys, self.caption_key, self.sample_filter)

    @classmethod
    def from_run_config(cls, config: Any, *, seed: int | None = None) -> "TrainDataConfig":
        """The data part of a run config (``clip_jax.training.config``); ``seed`` replaces ``config.seed`` (the data
        seed of a run resumed without its data position)."""
        return cls(
            shards=config.train_data, weights=config.train_data_upsampling_factors or None,
            resampled=config.dataset_resampled, train_num_samples=config.train_num_samples or None,
            seed=config.seed if seed is None else seed, workers=config.workers, shuffle_window=config.shuffle_window,
            make_from=config.make_train_data or None, dataset_type=config.dataset_type,
            sample_filter=filters.SampleFilter.from_run_config(config), image_keys=config.train_data_image_key,
            caption_key=config.train_data_caption_key, max_image_pixels=config.max_image_pixels or None,
            csv_img_key=config.csv_img_key, csv_caption_key=config.csv_caption_key,
            csv_separator=config.csv_separator, augment=augment_from_config(config.aug_cfg))


DATASET_TYPES = ("webdataset", "csv", "synthetic")
AUG_CFG_KEYS = ("scale", "color_jitter", "color_jitter_prob", "gray_scale_prob")  # OpenCLIP's, without timm
AUG_CFG_TIMM_KEYS = ("use_timm", "scale", "ratio", "re_prob", "re_count")  # with use_timm: timm's transform


def augment_from_config(aug_cfg: Mapping[str, Any]) -> transforms.TrainAugment:
    """OpenCLIP's ``aug_cfg`` as a :class:`~clip_jax.data.transforms.TrainAugment`.

    Without ``use_timm``: ``scale``, ``color_jitter`` (4 values) with ``color_jitter_prob``, ``gray_scale_prob``.
    With ``use_timm`` (timm's transform, as OpenCLIP builds it: no flip, no jitter, bicubic): ``scale``, ``ratio``,
    ``re_prob``, ``re_count``. A key OpenCLIP would not apply in that mode, or one not implemented here (timm's colour
    jitter), is refused by name. Zero / empty values are the defaults, as an unset key in OpenCLIP.
    """
    use_timm = bool(aug_cfg.get("use_timm", False))
    allowed = AUG_CFG_TIMM_KEYS if use_timm else AUG_CFG_KEYS + ("use_timm",)
    given = {k for k, v in aug_cfg.items() if k in ("scale", "use_timm") or (v is not None and _set(v))}
    unknown = sorted(given - set(allowed))
    if unknown:
        mode = "with use_timm" if use_timm else "without use_timm"
        raise InvalidInput(f"aug_cfg {', '.join(unknown)}: not supported {mode}; supported: {', '.join(allowed)}")
    jitter = tuple(float(v) for v in aug_cfg.get("color_jitter") or ())
    ratio = tuple(float(v) for v in aug_cfg.get("ratio") or ())
    ratio = ratio if any(ratio) else transforms.TRAIN_RATIO
    try:
        return transforms.TrainAugment(
            scale=tuple(float(v) for v in aug_cfg.get("scale", transforms.TRAIN_SCALE)),
            color_jitter=jitter if any(jitter) else None,
            color_jitter_prob=float(aug_cfg.get("color_jitter_prob") or 0.0),
            gray_scale_prob=float(aug_cfg.get("gray_scale_prob") or 0.0),
            ratio=ratio, re_prob=float(aug_cfg.get("re_prob") or 0.0), re_count=int(aug_cfg.get("re_count") or 1))
    except (TypeError, ValueError) as e:
        raise InvalidInput(str(e)) from None


def _set(value: Any) -> bool:
    """A value that asks for something (not 0, False, empty, or all zeros)."""
    if isinstance(value, (tuple, list)):
        return any(_set(v) for v in value)
    return bool(value)


Source = shards_lib.ShardList | csv_source.CsvTable | None  # what resolve_train_shards gives, by dataset type


def resolve_train_shards(cfg: TrainDataConfig) -> Source:
    """The shards a run reads, resolved once so that the epoch length and the pipeline see the same list.

    A csv run gets its table (read once), a synthetic run None.

    With ``cfg.make_from`` set the shards are written first when missing: once, however many processes of a run ask
    at the same time (see :func:`clip_jax.data.make_shards.write_missing_shards`).
    """
    if cfg.make_from:
        from clip_jax.data import make_shards  # PIL's encoders; only the demo writes its shards

        make_shards.write_missing_shards(cfg.shards, cfg.make_from)
    if cfg.dataset_type == "csv":
        return csv_source.read_csv(cfg.shards, cfg.csv_img_key, cfg.csv_caption_key, cfg.csv_separator)
    if cfg.dataset_type == "synthetic":
        return None
    return shards_lib.resolve_shards(cfg.shards, cfg.weights, check_exists=cfg.check_shards_exist)


class DecodedDataset(grain.IterDataset):
    """Raw samples -> ``{"image": uint8 [S, S, 3], "caption": str}``; undecodable images are skipped and counted."""

    def __init__(self, parent: grain.IterDataset, *, image_size: int, train: bool, seed: int = 0,
                 scale: Sequence[float] = transforms.TRAIN_SCALE, ratio: Sequence[float] = transforms.TRAIN_RATIO,
                 max_pixels: int | None = None, augment: transforms.TrainAugment | None = None):
        super().__init__(parent)
        self.image_size, self.train, self.seed, self.max_pixels = image_size, train, seed, max_pixels
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
                        return {"image": pixels, "caption": sample.caption, "erase": erase}
                else:
                    pixels = transforms.train_crop(image, ds.image_size, rng, ds.scale, ds.ratio)
            else:
                pixels = transforms.eval_crop(image, ds.image_size)
            return {"image": pixels, "caption": sample.caption}

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "skipped": dict(self.skipped)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self.skipped = collections.Counter(state["skipped"])

    def __str__(self) -> str:
        return f"DecodedIterator(train={self._ds.train}, size={self._ds.image_size})"


Tokenizer = Callable[..., np.ndarray]  # (texts, context_length=L) -> int [N, L]


def clip_tokenize(texts: list[str], context_length: int = 77) -> np.ndarray:
    """OpenCLIP's tokenizer (``clip_jax.tokenizer.tokenize``)."""
    from clip_jax.tokenizer import tokenize

    return tokenize(texts, context_length=context_length)


@dataclasses.dataclass(frozen=True)
class Collate:
    """Stacks decoded samples into ``{"images": float32 [B, S, S, 3], "tokens": int32 [B, L]}``."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    context_length: int = 77
    tokenize: Tokenizer = clip_tokenize  # a module-level function, so that worker processes can unpickle it

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        images = np.stack([s["image"] for s in samples])  # [B, S, S, 3] uint8
        tokens = self.tokenize([s["caption"] for s in samples], context_length=self.context_length)
        images = transforms.normalize(images, self.mean, self.std)
        for image, sample in zip(images, samples):
            if "erase" in sample:  # timm's random erasing acts on the normalised image
                transforms.apply_erasing(image, sample["erase"])
        return {"images": images, "tokens": np.asarray(tokens, np.int32)}


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
) -> grain.IterDataset:
    """The per-process training dataset (see :func:`build_train_iterator`); ``shard_list``: the run's resolved
    shards (:func:`resolve_train_shards`), resolved here when not given."""
    batch_size = per_process_batch_size(global_batch_size, process_count)
    if cfg.dataset_type == "synthetic":
        return synthetic.SyntheticDataset(batch_size=batch_size, image_size=image_size, context_length=context_length,
                                          seed=cfg.seed, process_index=process_index)
    if shard_list is None:
        shard_list = resolve_train_shards(cfg)
    if cfg.dataset_type == "csv":
        ds = csv_source.CsvDataset(shard_list, seed=cfg.seed, process_index=process_index,
                                   process_count=process_count, sample_filter=cfg.sample_filter)
        if len(shard_list) < process_count * max(cfg.workers, 1):
            raise InvalidInput(f"{cfg.shards} has {len(shard_list)} rows for {process_count} processes x "
                               f"{max(cfg.workers, 1)} workers")
        return _decode_batch_prefetch(ds, cfg, batch_size, image_size, mean, std, context_length, tokenize)
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
    return _decode_batch_prefetch(ds, cfg, batch_size, image_size, mean, std, context_length, tokenize)


def _decode_batch_prefetch(ds: grain.IterDataset, cfg: TrainDataConfig, batch_size: int, image_size: int,
                           mean: Sequence[float], std: Sequence[float], context_length: int,
                           tokenize: Tokenizer) -> grain.IterDataset:
    """Raw samples -> decoded, augmented, batched (in worker processes when ``cfg.workers`` > 0)."""
    ds = DecodedDataset(ds, image_size=image_size, train=True, seed=cfg.seed, max_pixels=cfg.max_image_pixels,
                        scale=cfg.augment.scale, ratio=cfg.augment.ratio, augment=cfg.augment)
    ds = ds.batch(batch_size, drop_remainder=True,
                  batch_fn=Collate(tuple(mean), tuple(std), context_length, tokenize))
    if cfg.workers > 0:
        _ensure_absl_flags_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.workers,
                                                         per_worker_buffer_size=cfg.prefetch_batches))
    return ds


def _ensure_absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; outside ``absl.app.run`` they are unparsed (use the defaults)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def build_train_iterator(cfg: TrainDataConfig, **kwargs) -> "TrainIterator":
    """Per-process iterator of ``{"images": float32 [B_proc, S, S, 3], "tokens": int32 [B_proc, L]}``, infinite.

    Keyword arguments as :func:`build_train_dataset`: ``global_batch_size``, ``image_size``, ``mean``, ``std``,
    ``process_index``, ``process_count``, ``context_length``, ``tokenize``, ``shard_list``.
    """
    return TrainIterator(iter(build_train_dataset(cfg, **kwargs)))


class TrainIterator(grain.DatasetIterator):
    """The training iterator: Grain's, plus :meth:`skipped_samples` for metrics.

    Its state is the wrapped iterator's, unchanged, so checkpoints read and written through it are Grain's own.
    """

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state)

    def skipped_samples(self) -> dict[str, int]:
        """Samples and shards skipped so far, by reason (``{"corrupt_image": 3, ...}``), summed over all workers.

        Data workers keep their counters in their own processes; the iterator state is what carries them back.
        """
        return skips.skip_counts(self.get_state())

    def __str__(self) -> str:
        return f"TrainIterator({self._parent})"


def count_samples(shard_list: shards_lib.ShardList) -> int | None:
    """Samples in the shards from img2dataset's ``NNNNN_stats.json`` (``successes``); None if any is missing.

    A statistics file that exists but cannot be read or holds no sample count is a ValueError naming it.
    """
    import fsspec

    total = 0
    for url in shard_list.urls:
        stats_url = url.rsplit(".", 1)[0] + "_stats.json"
        try:
            with fsspec.open(stats_url, "r") as f:
                total += _successes(json.load(f))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # unreadable, not JSON, or no count in it
            raise InvalidInput(
                f"cannot read the sample count of {stats_url}: {e}; fix or delete that file, or set "
                "train_num_samples"
            ) from e
    return total


def _successes(stats: Any) -> int:
    """img2dataset's count of the samples written into a shard."""
    if not isinstance(stats, Mapping) or "successes" not in stats:
        raise ValueError("it has no 'successes' field")
    try:
        return int(stats["successes"])
    except (TypeError, ValueError):
        raise ValueError(f"'successes' is {stats['successes']!r}, not a sample count") from None


def steps_per_epoch(cfg: TrainDataConfig, global_batch_size: int, shard_list: Source = None) -> int:
    """Optimizer steps per (virtual) epoch, counted as OpenCLIP counts them so that schedules match:
    ``ceil(train_num_samples / global_batch_size)`` rounded up to a multiple of ``workers``.

    Without ``train_num_samples`` the samples are counted in ``shard_list`` (the run's resolved shards; resolved
    here when not given).
    """
    num_samples = cfg.train_num_samples
    if num_samples is None and cfg.dataset_type == "synthetic":
        raise InvalidInput("a synthetic run needs train_num_samples (the samples per virtual epoch)")
    if num_samples is None:
        source = shard_list if shard_list is not None else resolve_train_shards(cfg)
        num_samples = len(source) if isinstance(source, csv_source.CsvTable) else count_samples(source)
    if num_samples is None:
        raise InvalidInput(
            f"cannot tell the epoch size of {cfg.shards!r}: set train_num_samples (no *_stats.json next to the shards)"
        )
    workers = max(1, cfg.workers)
    return math.ceil(math.ceil(num_samples / global_batch_size) / workers) * workers
