"""What a run's training data is: :class:`TrainDataConfig` (from a run config, OpenCLIP's ``aug_cfg`` included) and
the shards, csv table or nothing (synthetic data) it names, resolved once by :func:`resolve_train_shards` so that
the epoch length (:mod:`clip_jax.data.epochs`) and the pipeline (:mod:`clip_jax.data.pipeline`) read the same list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from clip_jax.data import csv_source, filters, transforms, webdataset
from clip_jax.data import shards as shards_lib
from clip_jax.data.shard_checks import refuse_non_tar
from clip_jax.errors import InvalidInput
from clip_jax.runtime.stop_signals import never


@dataclasses.dataclass(frozen=True)
class TrainDataConfig:
    """What a run config says about its data; :meth:`from_run_config` reads it from one."""

    shards: str  # e.g. "/data/laion2B-en/{00000..23295}.tar", sources joined with "::"
    weights: str | None = None  # per-source draw weights "1::2" (resampled mode)
    resampled: bool = True  # draw shards with replacement (else: every shard once per epoch)
    train_num_samples: int | None = None  # virtual epoch size (None: counted from *_stats.json when present)
    seed: int = 0
    workers: int = 0  # data worker processes per training process (0: read in the training process)
    streams: int = 0  # data streams of the run (stream_pipeline; 0: one per process x worker, each read by its own)
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
        """The data part of a run config (``clip_jax.run_config``); ``seed`` replaces ``config.seed`` (the data
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


def resolve_train_shards(cfg: TrainDataConfig, *, should_stop: Callable[[], bool] = never) -> Source:
    """The shards a run reads, resolved once so that the epoch length and the pipeline see the same list.

    A csv run gets its table (read once), a synthetic run None. A shard pattern that finds no shard, or whose first
    shard is not a tar file, is one line saying what it found (:mod:`clip_jax.data.shard_checks`).

    With ``cfg.make_from`` set the shards are written first when missing: once, however many processes of a run ask
    at the same time (see :func:`clip_jax.data.make_shards.write_missing_shards`); ``should_stop()`` true between
    two shards ends that writing with ``CutShort`` (:mod:`clip_jax.runtime.stop_signals`).
    """
    if cfg.make_from:
        from clip_jax.data import make_shards  # PIL's encoders; only the demo writes its shards

        make_shards.write_missing_shards(cfg.shards, cfg.make_from, should_stop=should_stop)
    if cfg.dataset_type == "csv":
        return csv_source.read_csv(cfg.shards, cfg.csv_img_key, cfg.csv_caption_key, cfg.csv_separator)
    if cfg.dataset_type == "synthetic":
        return None
    shard_list = shards_lib.resolve_shards(cfg.shards, cfg.weights, check_exists=cfg.check_shards_exist)
    if cfg.check_shards_exist:
        refuse_non_tar(shard_list.urls, shard_list.sources)  # loose images named as shards: one line, not 65 shards
    return shard_list
