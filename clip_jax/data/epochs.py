"""The length of a (virtual) epoch: samples counted from img2dataset's ``*_stats.json`` when the run does not say
(``train_num_samples``), and the optimizer steps per epoch, counted as OpenCLIP counts them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from clip_jax.data import csv_source
from clip_jax.data import shards as shards_lib
from clip_jax.data.train_config import Source, TrainDataConfig, resolve_train_shards
from clip_jax.errors import InvalidInput


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
