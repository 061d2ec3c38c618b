"""The one encoder of every evaluation: a model's image and text towers, data-parallel over the mesh.

Rows (images or token ids) are split over `"data"`; params are used as placed (replicated from the host, or as a
running trainer holds them, e.g. FSDP-sharded). Features are computed in the model's compute dtype (fp32 unless the
model was created with another) and are L2-normalised. Every function works with several processes: host arrays
that every process holds in full are split with `jax.make_array_from_callback`, and features meant for the host come
back replicated, so every process can read them.

What the functions call `params` is a model's weights as `model.apply` needs them: a ViT model's params tree, or
the variables `{"params": ..., "batch_stats": ...}` of a ResNet image tower, whose BatchNorm layers evaluate with
their running statistics (eval mode). Either form is accepted for a ViT.

Each method that encodes a batch takes a `should_stop` and asks it first: a stop cuts an evaluation short within one
batch (`CutShort`, `clip_jax.runtime.stop_signals`). A running trainer hands its stop agreed across processes, a
collective that every process then asks at the same batch; without one (`never`) the encoding runs to the end.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from clip_jax.errors import InvalidInput
from clip_jax.evaluation.batches import pad_rows
from clip_jax.models.config import is_resnet
from clip_jax.models.variables import as_variables
from clip_jax.runtime.mesh import batch_sharding, replicated
from clip_jax.runtime.stop_signals import cut_short_if, never, reached


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
    rows = pad_rows(rows, round_up(len(rows), mesh.size))
    return jax.make_array_from_callback(rows.shape, batch_sharding(mesh), lambda index: rows[index])


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _features(model, tower: str, out_sharding: NamedSharding | None, params, rows):
    """Features [B, E] of `rows` [B, ...] by `model.<tower>`; placed as `out_sharding`, or as XLA chooses (split like
    the rows) when it is None. One compilation per model, tower, placement and shape."""
    features = model.apply(as_variables(params), rows, method=tower)
    return features if out_sharding is None else jax.lax.with_sharding_constraint(features, out_sharding)


def _before_batch(should_stop: Callable[[], bool]) -> None:
    cut_short_if(should_stop)
    reached("batch")  # a moment the test seam of clip_jax.runtime.stop_signals may name


class ShardedEncoder:
    """Image and text features of `model` over `mesh`, for params given at each call (they change as a model
    trains; the compiled towers do not)."""

    def __init__(self, model, mesh: Mesh):
        self.model, self.mesh = model, mesh

    def place(self, params):
        """Params (or variables) ready for every call below (see `replicate`); place them once per evaluation. A
        ResNet image tower's need their BatchNorm statistics."""
        if is_resnet(self.model.config) and "batch_stats" not in as_variables(params):
            raise InvalidInput(f"{self.model.config.name}: a ResNet image tower evaluates with its BatchNorm running "
                               "statistics: give the variables {'params': ..., 'batch_stats': ...} (e.g. "
                               "clip_jax.runtime.run_directory.read_variables, "
                               "clip_jax.interop.opener.load_pretrained_variables), "
                               "not its params alone")
        return replicate(params, self.mesh)

    # Every batch an evaluation encodes goes through one of the three methods below: each asks `should_stop` first
    # (see the module docstring).

    def image_features(self, params, images: jax.Array, *, should_stop: Callable[[], bool] = never) -> jax.Array:
        """Features [B, E] of images [B, S, S, 3] already on the mesh, left split over it like the images."""
        _before_batch(should_stop)
        return _features(self.model, "encode_image", None, params, images)

    def text_features(self, params, tokens: np.ndarray, *, should_stop: Callable[[], bool] = never) -> jax.Array:
        """Features [B', E], replicated, of host token ids int32 [B, L] (B' is B rounded up to a multiple of the
        mesh size; the extra rows encode padding)."""
        _before_batch(should_stop)
        return _features(self.model, "encode_text", replicated(self.mesh), params, shard_rows(tokens, self.mesh))

    def encode_images(self, params, images: np.ndarray, *, should_stop: Callable[[], bool] = never) -> np.ndarray:
        """Features float32 [B, E] of one host batch of normalised images [B, S, S, 3] that every process holds in
        full."""
        _before_batch(should_stop)
        features = _features(self.model, "encode_image", replicated(self.mesh), params,
                             shard_rows(images, self.mesh))
        return np.asarray(features)[:len(images)]

    def encode_texts(self, params, tokens: np.ndarray, batch_size: int, progress=None, *,
                     should_stop: Callable[[], bool] = never) -> np.ndarray:
        """Features float32 [N, E] of token ids int32 [N, L], `batch_size` rows per step (at most N, rounded up to a
        multiple of the mesh size; every step has one shape). `progress(n)` is called after each step."""
        batch_size = round_up(min(batch_size, len(tokens)), self.mesh.size)
        out = []
        for start in range(0, len(tokens), batch_size):
            features = self.text_features(params, pad_rows(tokens[start:start + batch_size], batch_size),
                                          should_stop=should_stop)
            out.append(np.asarray(features)[:len(tokens) - start])
            if progress:
                progress(min(batch_size, len(tokens) - start))
        return np.concatenate(out) if out else np.zeros((0, self.model.config.embed_dim), np.float32)
