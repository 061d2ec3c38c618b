"""Sample keys: the name of each training sample, and its 64-bit hash as batches carry it (``"keys"``).

A webdataset sample is named ``"{shard file name}/{sample key}"`` (``"00012.tar/000120045"``), a csv row by the
image path it reads, a synthetic sample ``"synthetic/{process}/{batch}/{row}"``. The hash is
``int.from_bytes(blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")``, so digests of the samples a
run read (:mod:`clip_jax.training.sample_digest`) can be recomputed from the shards alone.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Iterable

import numpy as np

from clip_jax.data.webdataset import RawSample


def shard_sample_name(sample: RawSample) -> str:
    """A webdataset sample's name: its shard's file name (not the folder or bucket) and its key."""
    return f"{posixpath.basename(sample.shard)}/{sample.key}"


def csv_sample_name(sample: RawSample) -> str:
    """A csv row's name: the image path it reads (its key in :mod:`clip_jax.data.csv_source`)."""
    return sample.key


def sample_key_hash(key: str) -> int:
    """BLAKE2b-64 of the name's UTF-8 bytes, read as a little-endian unsigned integer.

    A tar member name that is not UTF-8 hashes as the bytes stored (the reader keeps them as surrogate escapes).
    """
    data = key.encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def sample_key_hashes(keys: Iterable[str]) -> np.ndarray:
    """uint64 [N]: :func:`sample_key_hash` of each name."""
    return np.fromiter((sample_key_hash(k) for k in keys), dtype=np.uint64)
