"""The sharded contrastive loss and its gradients equal the single-device CLIP loss on the global batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from open_clip.loss import ClipLoss

from clip_jax.runtime.mesh import batch_sharding, create_mesh
from clip_jax.training.loss import contrastive_loss, contrastive_loss_and_accuracy

EMBED_DIM = 32


def unit_rows(rng, batch, dim=EMBED_DIM):
    x = rng.normal(size=(batch, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def reference_loss_and_grads(image, text, scale):
    """CLIP loss and its gradients in float64, written out by hand."""
    image, text = image.astype(np.float64), text.astype(np.float64)
    batch = image.shape[0]
    similarity = image @ text.T
    logits = scale * similarity  # [B, B], row i: image i against every text

    def softmax_rows(z):
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def mean_cross_entropy(z):
        z_max = z.max(axis=1)
        log_sum_exp = np.log(np.exp(z - z_max[:, None]).sum(axis=1)) + z_max
        return np.mean(log_sum_exp - np.diag(z))

    loss = 0.5 * (mean_cross_entropy(logits) + mean_cross_entropy(logits.T))
    eye = np.eye(batch)
    # dL/dlogits from both directions: image->text over rows, text->image over columns
    d_logits = 0.5 / batch * ((softmax_rows(logits) - eye) + (softmax_rows(logits.T) - eye).T)
    d_image = scale * d_logits @ text
    d_text = scale * d_logits.T @ image
    d_scale = np.sum(d_logits * similarity)
    return loss, d_image, d_text, d_scale


def relative_error(actual, expected):
    return np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8
    return create_mesh()


def sharded_value_and_grad(mesh):
    def loss(image, text, scale):
        return contrastive_loss(image, text, scale, mesh=mesh)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("per_device_batch", [1, 3, 16])
def test_loss_and_gradients_equal_float64_reference(mesh, per_device_batch):
    rng = np.random.default_rng(per_device_batch)
    global_batch = 8 * per_device_batch
    image, text = unit_rows(rng, global_batch), unit_rows(rng, global_batch)
    # correlate the pairs so the loss is not near log(B) everywhere
    text = 0.3 * image + text
    text = (text / np.linalg.norm(text, axis=1, keepdims=True)).astype(np.float32)
    scale = np.float32(1 / 0.07)

    sharding = batch_sharding(mesh)
    loss, (d_image, d_text, d_scale) = sharded_value_and_grad(mesh)(
        jax.device_put(image, sharding), jax.device_put(text, sharding), jnp.float32(scale)
    )
    ref_loss, ref_d_image, ref_d_text, ref_d_scale = reference_loss_and_grads(image, text, float(scale))

    assert d_image.sharding.is_equivalent_to(sharding, 2)
    assert abs(float(loss) - ref_loss) / ref_loss < 1e-5
    assert relative_error(d_image, ref_d_image) < 1e-5
    assert relative_error(d_text, ref_d_text) < 1e-5
    assert abs(float(d_scale) - ref_d_scale) / abs(ref_d_scale) < 1e-5


def test_equals_open_clip_clip_loss(mesh):
    rng = np.random.default_rng(7)
    image, text = unit_rows(rng, 64), unit_rows(rng, 64)
    scale = np.float32(20.0)

    torch_image = torch.tensor(image, dtype=torch.float64, requires_grad=True)
    torch_text = torch.tensor(text, dtype=torch.float64, requires_grad=True)
    torch_scale = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    torch_loss = ClipLoss()(torch_image, torch_text, torch_scale)
    torch_loss.backward()

    sharding = batch_sharding(mesh)
    loss, (d_image, d_text, d_scale) = sharded_value_and_grad(mesh)(
        jax.device_put(image, sharding), jax.device_put(text, sharding), jnp.float32(scale)
    )
    assert abs(float(loss) - torch_loss.item()) / torch_loss.item() < 1e-5
    assert relative_error(d_image, torch_image.grad.numpy()) < 1e-5
    assert relative_error(d_text, torch_text.grad.numpy()) < 1e-5
    assert abs(float(d_scale) - torch_scale.grad.item()) / abs(torch_scale.grad.item()) < 1e-5


def test_accuracy_counts_rows_whose_own_pair_scores_highest(mesh):
    rng = np.random.default_rng(3)
    image = unit_rows(rng, 16)
    text = unit_rows(rng, 16)
    text[:10] = image[:10]  # pairs 0..9 match exactly, so they win in both directions
    logits = image.astype(np.float64) @ text.T.astype(np.float64)
    expected = 0.5 * (
        np.mean(logits.argmax(axis=1) == np.arange(16)) + np.mean(logits.argmax(axis=0) == np.arange(16))
    )
    _, accuracy = jax.jit(lambda i, t: contrastive_loss_and_accuracy(i, t, 10.0, mesh=mesh))(image, text)
    assert float(accuracy) == pytest.approx(expected)
    assert expected >= 10 / 16


def compiled_loss_and_grad(mesh, global_batch):
    sharding = batch_sharding(mesh)
    features = jax.ShapeDtypeStruct((global_batch, EMBED_DIM), jnp.float32, sharding=sharding)
    scale = jax.ShapeDtypeStruct((), jnp.float32)

    def loss(image, text, scale):
        return contrastive_loss(image, text, scale, mesh=mesh)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(features, features, scale).compile()


def test_each_device_holds_local_rows_by_global_columns_only():
    global_batch = 1024
    one_device = compiled_loss_and_grad(create_mesh(jax.devices()[:1]), global_batch)
    eight_devices = compiled_loss_and_grad(create_mesh(), global_batch)

    temp_one = one_device.memory_analysis().temp_size_in_bytes
    temp_eight = eight_devices.memory_analysis().temp_size_in_bytes
    logits_bytes = global_batch * global_batch * 4
    assert temp_one >= logits_bytes  # the single device holds at least one [B, B] fp32 logits matrix
    assert temp_eight * 4 < temp_one, (temp_one, temp_eight)
    assert f"f32[{global_batch},{global_batch}]" in one_device.as_text()
    assert f"f32[{global_batch},{global_batch}]" not in eight_devices.as_text()
    assert f"f32[{global_batch // 8},{global_batch}]" in eight_devices.as_text()


def test_batch_not_divisible_by_devices_is_rejected(mesh):
    features = np.zeros((12, EMBED_DIM), np.float32)
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        contrastive_loss(features, features, 1.0, mesh=mesh)
    with pytest.raises(ValueError, match="must both be"):
        contrastive_loss(features, features[:, :4], 1.0, mesh=mesh)
