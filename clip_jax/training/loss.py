"""CLIP's contrastive (InfoNCE) loss and SigLIP's pairwise sigmoid loss over the global batch, sharded over the
mesh's batch axes (`"data"`, or `("replica", "data")` on an FSDP grid: every device either way).

Contrastive: each device scores only its own rows against every column: local image features x all text features
and local text features x all image features, `[B_local, B_global]` logits, never `[B_global, B_global]`. The
gather is differentiable (its transpose is a reduce-scatter), so gradients reach the features of every device.

Sigmoid: every pair is a binary task of its own, so no row needs all its columns at once. Each device scores its
own images against one `[B_local, E]` chunk of texts at a time, the chunks passed round the ring of devices
(`ppermute`, whose transpose is the reverse ring): `[B_local, B_local]` logits at a time whatever the device
count. The backward keeps what each block needs (autodiff through the ring), `[B_local, B_global]` in all, as much
as the softmax loss's logits: the memory per device falls with the device count alike, never `[B_global]^2`.

Value and gradients of both equal the single-device loss on the global batch.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from clip_jax.runtime.mesh import DATA_AXIS, batch_axes, data_parallel_size


def _local_rows(image_features, text_features, logit_scale, *, axes):
    """Summed cross-entropy and top-1 hits of this device's rows, in both directions (all fp32); `axes`: the mesh
    axes the batch is split over."""
    image_features = image_features.astype(jnp.float32)  # [B_local, E]
    text_features = text_features.astype(jnp.float32)
    logit_scale = logit_scale.astype(jnp.float32)
    all_image_features = jax.lax.all_gather(image_features, axes, tiled=True)  # [B_global, E]
    all_text_features = jax.lax.all_gather(text_features, axes, tiled=True)

    b_local = image_features.shape[0]
    labels = jax.lax.axis_index(axes) * b_local + jnp.arange(b_local)  # global column of each local row

    logits_per_image = logit_scale * image_features @ all_text_features.T  # [B_local, B_global]
    logits_per_text = logit_scale * text_features @ all_image_features.T  # [B_local, B_global]

    def cross_entropy_sum(logits):
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(log_probs, labels[:, None], axis=-1).sum()

    def hits(logits):
        return (jnp.argmax(logits, axis=-1) == labels).sum()

    loss_sum = cross_entropy_sum(logits_per_image) + cross_entropy_sum(logits_per_text)
    hit_count = hits(logits_per_image) + hits(logits_per_text)
    return jax.lax.psum(loss_sum, axes), jax.lax.psum(hit_count, axes)


def _check_inputs(name: str, image_features, text_features, mesh: Mesh):
    """(device count, batch axes) of `mesh`, once the features are seen to split evenly over it."""
    if image_features.shape != text_features.shape or image_features.ndim != 2:
        raise ValueError(
            f"{name}: image features {image_features.shape} and text features "
            f"{text_features.shape} must both be [batch, embed_dim]"
        )
    if DATA_AXIS not in mesh.shape:
        raise ValueError(
            f"{name}: the mesh has axes {tuple(mesh.shape)}, not '{DATA_AXIS}'; build it with "
            "clip_jax.runtime.mesh.create_mesh"
        )
    n_shards, batch = data_parallel_size(mesh), image_features.shape[0]
    if batch % n_shards:
        raise ValueError(
            f"{name}: global batch {batch} is not divisible by the {n_shards} devices of the "
            f"mesh; choose a batch size that is a multiple of {n_shards}"
        )
    return n_shards, batch_axes(mesh)


def contrastive_loss_and_accuracy(image_features, text_features, logit_scale, *, mesh: Mesh):
    """(loss, accuracy) of CLIP's symmetric contrastive task over the global batch.

    image_features, text_features: [B_global, E], batch split over every device; logit_scale: the exponentiated
    scale (a scalar). loss: mean of the image->text and text->image cross-entropies, as OpenCLIP's `ClipLoss`.
    accuracy: fraction of rows, both directions together, whose highest logit is their own pair.
    """
    n_shards, axes = _check_inputs("contrastive_loss", image_features, text_features, mesh)
    batch = image_features.shape[0]
    sharded = jax.shard_map(
        partial(_local_rows, axes=axes),
        mesh=mesh,
        in_specs=(P(axes), P(axes), P()),
        out_specs=(P(), P()),
    )
    loss_sum, hit_count = sharded(image_features, text_features, jnp.asarray(logit_scale))
    return loss_sum / (2 * batch), hit_count / (2 * batch)


def contrastive_loss(image_features, text_features, logit_scale, *, mesh: Mesh):
    """CLIP's contrastive loss over the global batch (see `contrastive_loss_and_accuracy`)."""
    return contrastive_loss_and_accuracy(image_features, text_features, logit_scale, mesh=mesh)[0]


def _local_sigmoid_rows(image_features, text_features, logit_scale, logit_bias, *, axes, n_shards: int):
    """Summed -log sigmoid of this device's images against every text, and top-1 hits in both directions (fp32).

    The local text chunk goes round the ring: after step k the device holds the chunk of the device k places
    before it. With each chunk travel its positive logits and its running column maximum, so that the device
    holding it last counts its text->image hits; the image->text hits need only this device's row maxima.
    """
    image_features = image_features.astype(jnp.float32)  # [B_local, E]
    logit_scale, logit_bias = logit_scale.astype(jnp.float32), logit_bias.astype(jnp.float32)

    def logits(texts):
        return logit_scale * image_features @ texts.T + logit_bias  # [B_local, B_local]

    own = logits(text_features.astype(jnp.float32))
    labels = 2 * jnp.eye(own.shape[0], dtype=jnp.float32) - 1  # +1 for a pair, -1 for every other image-text
    loss_sum = -jax.nn.log_sigmoid(labels * own).sum()
    seen = jax.lax.stop_gradient(own)  # the maxima and positives decide hits, never gradients
    positives, row_max, column_max = jnp.diagonal(seen), jnp.max(seen, axis=1), jnp.max(seen, axis=0)

    ring = [(i, (i + 1) % n_shards) for i in range(n_shards)]

    def score_next_chunk(carry, _):
        loss_sum, row_max, chunk = carry
        texts, chunk_positives, chunk_column_max = jax.lax.ppermute(chunk, axes, ring)
        negatives = logits(texts)  # no pair here: the chunk came from another device
        seen = jax.lax.stop_gradient(negatives)
        loss_sum = loss_sum - jax.nn.log_sigmoid(-negatives).sum()
        chunk = (texts, chunk_positives, jnp.maximum(chunk_column_max, jnp.max(seen, axis=0)))
        return (loss_sum, jnp.maximum(row_max, jnp.max(seen, axis=1)), chunk), None

    chunk = (text_features.astype(jnp.float32), positives, column_max)
    (loss_sum, row_max, chunk), _ = jax.lax.scan(score_next_chunk, (loss_sum, row_max, chunk), None,
                                                 length=n_shards - 1)
    _, chunk_positives, chunk_column_max = chunk  # every device has now scored this chunk
    hit_count = (positives >= row_max).sum() + (chunk_positives >= chunk_column_max).sum()
    return jax.lax.psum(loss_sum, axes), jax.lax.psum(hit_count, axes)


def sigmoid_loss_and_accuracy(image_features, text_features, logit_scale, logit_bias, *, mesh: Mesh):
    """(loss, accuracy) of SigLIP's pairwise sigmoid task over the global batch.

    image_features, text_features: [B_global, E], batch split over every device; logit_scale: the exponentiated
    scale; logit_bias: the learned bias (scalars). loss: `-sum log sigmoid(z (scale x.y + bias)) / B_global` over
    every image-text pair, z = 1 for a pair and -1 otherwise. That is OpenCLIP's `SigLipLoss` on one device given the
    global batch; on N GPUs each rank's `SigLipLoss` divides its share by its local batch instead, and the mean of
    those (DDP averages their gradients) is this. accuracy: as `contrastive_loss_and_accuracy` (the bias moves
    every logit alike, so the ranking is the softmax loss's), a row counting as a hit when its pair's logit is the
    row's highest.
    """
    n_shards, axes = _check_inputs("sigmoid_loss", image_features, text_features, mesh)
    batch = image_features.shape[0]
    sharded = jax.shard_map(
        partial(_local_sigmoid_rows, axes=axes, n_shards=n_shards),
        mesh=mesh,
        in_specs=(P(axes), P(axes), P(), P()),
        out_specs=(P(), P()),
    )
    loss_sum, hit_count = sharded(image_features, text_features, jnp.asarray(logit_scale), jnp.asarray(logit_bias))
    return loss_sum / batch, hit_count / (2 * batch)


# The train step's losses by name: (image_features, text_features, logit_scale[, logit_bias], *, mesh) ->
# (loss, accuracy). The softmax loss takes no bias: a bias shifts a row's logits alike and cancels in it.
LOSSES = {"clip": contrastive_loss_and_accuracy, "siglip": sigmoid_loss_and_accuracy}
