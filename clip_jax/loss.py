"""CLIP's contrastive (InfoNCE) loss over the global batch, sharded over the mesh's batch axes (`"data"`, or
`("replica", "data")` on an FSDP grid: every device either way).

Each device scores only its own rows against every column: local image features x all text features and local
text features x all image features, `[B_local, B_global]` logits, never `[B_global, B_global]`. The gather is
differentiable (its transpose is a reduce-scatter), so gradients reach the features of every device. Value and
gradients equal the single-device loss on the global batch.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from clip_jax.parallel import DATA_AXIS, batch_axes, data_parallel_size


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


def contrastive_loss_and_accuracy(image_features, text_features, logit_scale, *, mesh: Mesh):
    """(loss, accuracy) of CLIP's symmetric contrastive task over the global batch.

    image_features, text_features: [B_global, E], batch split over every device; logit_scale: the exponentiated
    scale (a scalar). loss: mean of the image->text and text->image cross-entropies, as OpenCLIP's `ClipLoss`.
    accuracy: fraction of rows, both directions together, whose highest logit is their own pair.
    """
    if image_features.shape != text_features.shape or image_features.ndim != 2:
        raise ValueError(
            f"contrastive_loss: image features {image_features.shape} and text features "
            f"{text_features.shape} must both be [batch, embed_dim]"
        )
    if DATA_AXIS not in mesh.shape:
        raise ValueError(
            f"contrastive_loss: the mesh has axes {tuple(mesh.shape)}, not '{DATA_AXIS}'; build it with "
            "clip_jax.parallel.create_mesh"
        )
    n_shards, axes = data_parallel_size(mesh), batch_axes(mesh)
    batch = image_features.shape[0]
    if batch % n_shards:
        raise ValueError(
            f"contrastive_loss: global batch {batch} is not divisible by the {n_shards} devices of the "
            f"mesh; choose a batch size that is a multiple of {n_shards}"
        )
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
