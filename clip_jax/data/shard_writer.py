"""Writes samples as webdataset shards in img2dataset's format (``python -m clip_jax.data.make_shards`` and the demo's
shards use it).

Each ``NNNNN.tar`` holds ``KEY.jpg`` (or the source's .png/.webp), ``KEY.txt`` (caption, no trailing newline) and
``KEY.json`` (url, caption, key, status, error_message, width, height, original_width, original_height, exif,
sha256), with 9-digit keys ``shard * 10**4 + row``. Beside it: ``NNNNN_stats.json`` and, when pyarrow is
installed, ``NNNNN.parquet`` with one row per sample. A shard is written whole or not at all; a writer that stops
before its first shard is complete leaves no folder it made.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from PIL import Image

from clip_jax.data.write_once import folders_to_make
from clip_jax.errors import InvalidInput
from clip_jax.runtime import ownership, stop_signals

ROWS_PER_SHARD_MAX = 10_000  # keys are shard * 10**4 + row
FIXED_MTIME = 1_700_000_000  # tar member times, so that the same input gives the same bytes
SHARD_FILE = re.compile(r"\d{5}(\.tar|\.tar\.tmp|_stats\.json|\.parquet)$")  # the names write_shard writes


class Sample(NamedTuple):
    image: bytes  # encoded
    extension: str  # "jpg", "png" or "webp"
    caption: str
    url: str
    width: int
    height: int
    original_width: int
    original_height: int


def encode_jpeg(image: Image.Image, quality: int = 95) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _add(tar, name: str, data: bytes) -> None:
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), FIXED_MTIME, 0o444
    tar.addfile(info, io.BytesIO(data))


def _write_parquet(path: str, rows: list[dict]) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_shard(samples: list[Sample], out_dir: str, shard_index: int) -> str:
    """Writes one shard (tar, stats json, parquet) atomically; returns the tar path."""
    if len(samples) > ROWS_PER_SHARD_MAX:
        raise ValueError(f"{len(samples)} samples in one shard; at most {ROWS_PER_SHARD_MAX} fit 9-digit keys")
    start = time.time()
    name = f"{shard_index:05d}"
    path = os.path.join(out_dir, f"{name}.tar")
    ownership.record(out_dir, [f"{name}.tar", f"{name}.tar.tmp", f"{name}_stats.json", f"{name}.parquet"])
    try:
        rows = _write_tar(samples, path + ".tmp", shard_index)
    except BaseException:  # a half-written shard never remains
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise
    os.replace(path + ".tmp", path)
    end = time.time()
    stats = {"count": len(samples), "successes": len(samples), "failed_to_download": 0, "failed_to_resize": 0,
             "duration": end - start, "start_time": start, "end_time": end, "status_dict": {"success": len(samples)}}
    with open(os.path.join(out_dir, f"{name}_stats.json"), "w") as f:
        json.dump(stats, f, indent=4)
    _write_parquet(os.path.join(out_dir, f"{name}.parquet"), rows)
    return path


def _write_tar(samples: list[Sample], path: str, shard_index: int) -> list[dict]:
    """The samples as one tar at ``path``; returns their metadata rows."""
    import tarfile

    rows = []
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for row, sample in enumerate(samples):
            key = f"{shard_index * ROWS_PER_SHARD_MAX + row:09d}"
            meta = {
                "url": sample.url, "caption": sample.caption, "key": key, "status": "success",
                "error_message": None, "width": sample.width, "height": sample.height,
                "original_width": sample.original_width, "original_height": sample.original_height,
                "exif": None, "sha256": hashlib.sha256(sample.image).hexdigest(),
            }
            _add(tar, f"{key}.{sample.extension}", sample.image)
            _add(tar, f"{key}.txt", sample.caption.encode("utf-8"))
            _add(tar, f"{key}.json", json.dumps(meta).encode("utf-8"))
            rows.append(meta)
    return rows


def write_shards(samples: Iterable[Sample], out_dir: str, samples_per_shard: int = ROWS_PER_SHARD_MAX, *,
                 change: str = "write them into another folder",
                 should_stop: Callable[[], bool] = stop_signals.never) -> list[str]:
    """Writes ``samples`` into ``out_dir/00000.tar, 00001.tar, ...`` (the folder made with the first shard); returns
    the tar paths. Other files in ``out_dir`` are left alone; shard files there that clip_jax did not write stop it
    before it writes anything (``ownership.ForeignFiles``, ending with ``change``). ``should_stop()`` true before a
    shard ends the writing there (``stop_signals.CutShort``). Stopped (an error, a stop signal, samples that end in
    an error) before its first shard is complete, it leaves no folder it made."""
    if not 1 <= samples_per_shard <= ROWS_PER_SHARD_MAX:
        raise InvalidInput(f"samples_per_shard must be in [1, {ROWS_PER_SHARD_MAX}], got {samples_per_shard}")
    shard_files = [name for name in (os.listdir(out_dir) if os.path.isdir(out_dir) else []) if SHARD_FILE.match(name)]
    ownership.refuse_foreign(out_dir, shard_files, writing="writing shards", change=change)
    made = folders_to_make(out_dir)  # made with the first shard: no sample, no folder
    paths, pending = [], []
    try:
        for sample in samples:
            pending.append(sample)
            if len(pending) == samples_per_shard:
                stop_signals.cut_short_if(should_stop)  # a stop signal ends the writing between shards
                paths.append(_write_next(pending, out_dir, len(paths)))
                pending = []
        if pending:
            stop_signals.cut_short_if(should_stop)
            paths.append(_write_next(pending, out_dir, len(paths)))
    except BaseException:
        if not paths:
            _remove_unfilled(out_dir, made)
        raise
    return paths


def _write_next(samples: list[Sample], out_dir: str, shard_index: int) -> str:
    if shard_index == 0:
        os.makedirs(out_dir, exist_ok=True)
    return write_shard(samples, out_dir, shard_index)


def _remove_unfilled(out_dir: str, made: list[str]) -> None:
    """After a writer failed before its first shard was complete: removes the folders it ``made`` (outermost first,
    ``out_dir`` last) that hold nothing, or in ``out_dir`` nothing but the manifest it wrote."""
    manifest = os.path.join(out_dir, ownership.MANIFEST)
    if made and os.path.isdir(out_dir) and os.listdir(out_dir) == [ownership.MANIFEST]:
        os.remove(manifest)
    for folder in reversed(made):
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def shard_pattern(paths: list[str]) -> str:
    """The brace pattern naming ``paths`` written by :func:`write_shards`."""
    folder = os.path.dirname(paths[0])
    if len(paths) == 1:
        return paths[0]
    return os.path.join(folder, f"{{00000..{len(paths) - 1:05d}}}.tar")
