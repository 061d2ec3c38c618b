"""Placing eval inputs on the mesh and encoding them data-parallel: batch split over `"data"`, params as given.

Every function here works with several processes: host arrays that every process holds in full are split with
`jax.make_array_from_callback`, and encoded features come back replicated, so every process can read them.
"""

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from clip_jax.parallel import batch_sharding, replicated


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Host arrays (numpy, the same on every process) -> arrays replicated over the mesh. `jax.Array` leaves that
    already span the mesh's devices are kept as they are (e.g. FSDP-sharded params of a running trainer)."""
    devices = set(mesh.devices.flat)

    def place(leaf):
        if isinstance(leaf, jax.Array) and leaf.sharding.device_set == devices:
            return leaf
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, replicated(mesh), lambda index: leaf[index])

    return jax.tree.map(place, tree)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shard_rows(rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array every process holds in full, padded with zero rows to a multiple of the mesh size and split
    over `"data"` on its first axis."""
    pad = round_up(len(rows), mesh.size) - len(rows)
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, *rows.shape[1:]), rows.dtype)])
    return jax.make_array_from_callback(rows.shape, batch_sharding(mesh), lambda index: rows[index])


@functools.partial(jax.jit, static_argnums=(0, 1))
def encode_text_rows(model, mesh, params, tokens):
    """Normalised text features [B, E], replicated, of tokens [B, L] split over the mesh."""
    features = model.apply({"params": params}, tokens, method="encode_text")
    return jax.lax.with_sharding_constraint(features, replicated(mesh))


@functools.partial(jax.jit, static_argnums=(0, 1))
def encode_image_rows(model, mesh, params, images):
    """Normalised image features [B, E], replicated, of images [B, S, S, 3] split over the mesh."""
    features = model.apply({"params": params}, images, method="encode_image")
    return jax.lax.with_sharding_constraint(features, replicated(mesh))


def encode_texts(model, params, tokens: np.ndarray, mesh: Mesh, batch_size: int, progress=None) -> np.ndarray:
    """Normalised text features float32 [N, E] of tokens int32 [N, L], `batch_size` rows per step (at most N,
    rounded up to a multiple of the mesh size; every step has one shape). `progress(n)` is called after each
    step."""
    batch_size = round_up(min(batch_size, len(tokens)), mesh.size)
    out = []
    for start in range(0, len(tokens), batch_size):
        chunk = tokens[start:start + batch_size]
        if len(chunk) < batch_size:
            chunk = np.concatenate([chunk, np.zeros((batch_size - len(chunk), chunk.shape[1]), chunk.dtype)])
        features = encode_text_rows(model, mesh, params, shard_rows(chunk, mesh))
        out.append(np.asarray(features)[:len(tokens) - start])
        if progress:
            progress(min(batch_size, len(tokens) - start))
    return np.concatenate(out) if out else np.zeros((0, model.config.embed_dim), np.float32)


def encode_image_batch(model, params, images: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Normalised image features float32 [B, E] of one batch of normalised images [B, S, S, 3] that every process
    holds in full (B a multiple of the mesh size)."""
    return np.asarray(encode_image_rows(model, mesh, params, shard_rows(images, mesh)))[:len(images)]
