"""Digests of the samples a step read: equal digests say two runs (on any topology) trained on the same samples.

A batch's ``"keys"`` (uint64, :mod:`clip_jax.data.sample_keys`) are per process; :func:`global_digest` gathers
every process's and digests the global batch, independently of how it was split or ordered::

    sha256(np.sort(keys).astype("<u8").tobytes()).hexdigest()[:16]
"""

from __future__ import annotations

import hashlib

import numpy as np
from jax.experimental import multihost_utils


def digest(keys: np.ndarray) -> str:
    """``sha256`` of the keys sorted ascending as little-endian uint64 bytes, hex, first 16 characters."""
    ordered = np.sort(np.asarray(keys, np.uint64).ravel()).astype("<u8")
    return hashlib.sha256(ordered.tobytes()).hexdigest()[:16]


def global_digest(local_keys: np.ndarray) -> str:
    """:func:`digest` of every process's keys together (a collective: every process calls it, with as many keys).

    The keys travel as uint32 pairs ([B, 2]): JAX without 64-bit types would truncate uint64.
    """
    pairs = np.asarray(local_keys, np.uint64).astype("<u8").view("<u4").reshape(-1, 2)  # [B_proc, 2]
    gathered = multihost_utils.process_allgather(pairs, tiled=True)  # [B_global, 2]
    keys = np.ascontiguousarray(np.asarray(gathered, "<u4")).view("<u8")  # [B_global, 1]
    return digest(keys)
