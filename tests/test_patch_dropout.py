"""Patch dropout (FLIP): the train step keeps the class token and K random patches per sample; eval never drops."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY_MODEL as TINY_WITHOUT
from tiny_model import assert_same_update, random_batch

from clip_jax.models import create_model, get_model_config, init_params
from clip_jax.models.flops import forward_flops, image_forward_flops, image_tokens, train_flops
from clip_jax.models.layers import LayerNorm, Transformer
from clip_jax.models.vit import kept_patch_count, kept_patch_indices
from clip_jax.run_config import default_config
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.config_checks import check_config
from clip_jax.training.loss import contrastive_loss_and_accuracy
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step
from clip_jax.training.train_step import TrainState, patch_dropout_key

TINY = {**TINY_WITHOUT, "vision_cfg": {**TINY_WITHOUT["vision_cfg"], "patch_dropout": 0.5}}  # 16 patches, 8 kept
GLOBAL_BATCH = 16
SGD = OptimizerSpec("sgd", lr=0.5)
MODEL = create_model(TINY)


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, init_params(MODEL, jax.random.key(0)))


@pytest.fixture(scope="module")
def batch():
    return random_batch(GLOBAL_BATCH)


def kept_for_step(seed: int, step: int, rows: int = GLOBAL_BATCH) -> jax.Array:
    return kept_patch_indices(patch_dropout_key(seed, jnp.int32(step)), rows, 16, kept_patch_count(16, 0.5))


def sgd_step(params, batch, *, n_devices=1, accum_steps=1, step=0, seed=0, patch_dropout=None):
    """(params after one SGD step from a state at `step`, as numpy; metrics as floats)."""
    mesh = create_mesh(jax.devices()[:n_devices])
    spec = StepSpec.for_model(TINY, optimizer=SGD, accum_steps=accum_steps, seed=seed, patch_dropout=patch_dropout)
    train_step = build_step(spec, mesh)
    state = train_step.state_from_params(params)
    state = TrainState(state.params, state.opt_state, jnp.full_like(state.step, step))
    state, metrics = train_step(state, make_global_batch(batch, mesh))
    return jax.tree.map(np.asarray, state.params), {k: float(v) for k, v in metrics.items()}


def test_kept_patches_are_distinct_sorted_and_counted_as_openclip():
    assert kept_patch_count(196, 0.5) == 98 and kept_patch_count(256, 0.75) == 64
    assert kept_patch_count(4, 0.9) == 1  # max(1, int(N * (1 - p)))
    kept = np.asarray(kept_for_step(seed=0, step=0))
    assert kept.shape == (GLOBAL_BATCH, 8) and kept.dtype == np.int32
    assert np.all(np.diff(kept, axis=1) > 0) and kept.min() >= 0 and kept.max() < 16
    assert len({tuple(row) for row in kept}) > 1  # drawn per sample


@pytest.mark.slow
def test_kept_token_features_equal_the_tower_run_on_exactly_those_tokens(params, batch):
    images, kept = batch["images"][:4], kept_for_step(seed=0, step=0, rows=4)
    features = MODEL.apply({"params": params}, images, normalize=False, kept_patches=kept, method="encode_image")

    # By hand: embed the patches, keep the class token and the chosen patches with their positional embeddings,
    # then ln_pre, the blocks, ln_post of the class token and the projection.
    v, p = MODEL.config.vision, params["visual"]
    g, s = v.grid_size, v.patch_size
    pixels = images.reshape(4, g, s, g, s, 3).transpose(0, 1, 3, 2, 4, 5).reshape(4, g * g, s * s * 3)
    patches = pixels @ p["conv1"]["kernel"].reshape(s * s * 3, v.width)  # [4, 16, W]
    tokens = jnp.concatenate([jnp.broadcast_to(p["class_embedding"], (4, 1, v.width)),
                              jnp.take_along_axis(patches, kept[:, :, None], axis=1)], axis=1)
    positions = jnp.concatenate([jnp.zeros((4, 1), jnp.int32), kept + 1], axis=1)  # [4, 1 + K]
    x = tokens + p["positional_embedding"][positions]
    x = LayerNorm().apply({"params": p["ln_pre"]}, x)
    x = Transformer(v.width, v.layers, v.heads, v.mlp_width, causal=False).apply({"params": p["transformer"]}, x)
    expected = LayerNorm().apply({"params": p["ln_post"]}, x[:, 0]) @ p["proj"]
    np.testing.assert_allclose(features, expected, rtol=1e-4, atol=1e-5)

    # and the dropped patches' pixels play no part
    dropped = np.ones((4, g * g), bool)
    np.put_along_axis(dropped, np.asarray(kept), False, axis=1)
    noisy = np.where(np.repeat(np.repeat(dropped.reshape(4, g, g), s, 1), s, 2)[..., None], 7.0, images)
    assert np.array_equal(
        MODEL.apply({"params": params}, noisy, normalize=False, kept_patches=kept, method="encode_image"), features)


@pytest.mark.slow
def test_eval_output_is_unchanged_by_the_setting(params, batch):
    without = create_model(TINY_WITHOUT)
    assert MODEL.config.vision.patch_dropout == 0.5
    # eval calls apply without kept patches: every patch, bit for bit as without the setting
    outputs = [m.apply({"params": params}, batch["images"], batch["tokens"]) for m in (MODEL, without)]
    for a, b in zip(*outputs):
        assert np.array_equal(a, b)
    images = [m.apply({"params": params}, batch["images"], method="encode_image") for m in (MODEL, without)]
    assert np.array_equal(*images)


@pytest.mark.slow
def test_the_step_drops_the_patches_its_seed_and_step_counter_draw(params, batch):
    """The step's loss is the loss of the model on the patches kept_patch_indices(patch_dropout_key(seed, step))
    gives: a resumed run (a fresh step, the state restored at the same step) drops the same patches."""
    _, metrics = sgd_step(params, batch, step=5, seed=3)
    features = MODEL.apply({"params": params}, batch["images"], batch["tokens"], kept_for_step(seed=3, step=5))
    loss, _ = contrastive_loss_and_accuracy(*features, mesh=create_mesh(jax.devices()[:1]))
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-5)
    full, _ = contrastive_loss_and_accuracy(*MODEL.apply({"params": params}, batch["images"], batch["tokens"]),
                                            mesh=create_mesh(jax.devices()[:1]))
    assert metrics["loss"] != pytest.approx(float(full), rel=1e-3)  # patches were dropped

    after_resume, resumed = sgd_step(params, batch, step=5, seed=3)  # built again: a restarted process
    assert resumed["loss"] == metrics["loss"]
    assert sgd_step(params, batch, step=6, seed=3)[1]["loss"] != metrics["loss"]  # the next step: other patches
    # another seed: other patches (seed 0, the step `one_device_step` below compiles: the seed is part of the
    # program, the step counter is not, so one of the two is read back from the session's compilation cache)
    assert sgd_step(params, batch, step=5, seed=0)[1]["loss"] != metrics["loss"]
    assert np.array_equal(kept_for_step(3, 5), kept_for_step(3, 5))


@pytest.mark.slow
def test_force_patch_dropout_zero_trains_on_every_patch(params, batch):
    _, forced = sgd_step(params, batch, step=5, patch_dropout=0.0)
    full, _ = contrastive_loss_and_accuracy(*MODEL.apply({"params": params}, batch["images"], batch["tokens"]),
                                            mesh=create_mesh(jax.devices()[:1]))
    assert forced["loss"] == pytest.approx(float(full), rel=1e-5)


@pytest.fixture(scope="module")
def one_device_step(params, batch):
    return sgd_step(params, batch, step=2)


@pytest.mark.slow
def test_eight_devices_drop_the_patches_one_device_drops(params, batch, one_device_step):
    after_8, metrics_8 = sgd_step(params, batch, n_devices=8, step=2)
    after_1, metrics_1 = one_device_step
    assert metrics_8["loss"] == pytest.approx(metrics_1["loss"], rel=1e-5)
    assert_same_update(params, after_8, after_1)


@pytest.mark.slow
def test_accumulation_drops_the_patches_the_full_batch_step_drops(params, batch, one_device_step):
    after_accum, metrics_accum = sgd_step(params, batch, n_devices=8, accum_steps=2, step=2)
    after_1, metrics_1 = one_device_step
    assert metrics_accum["loss"] == pytest.approx(metrics_1["loss"], rel=1e-5)
    assert_same_update(params, after_accum, after_1)


def test_patch_dropout_is_read_from_openclip_configs_and_checked():
    assert get_model_config(TINY).vision.patch_dropout == 0.5
    assert get_model_config("ViT-B-16").vision.patch_dropout == 0.0
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="patch_dropout"):
            get_model_config({**TINY, "vision_cfg": {**TINY["vision_cfg"], "patch_dropout": bad}})
        with pytest.raises(ValueError, match="patch_dropout"):
            StepSpec.for_model(TINY, patch_dropout=bad)


@pytest.mark.parametrize("force, rate", [(-1.0, 0.5), (0.0, 0.0), (0.25, 0.25)])
def test_force_patch_dropout_overrides_the_model_config(force, rate, tmp_path):
    model_json = tmp_path / "tiny.json"
    model_json.write_text(json.dumps(TINY))
    config = default_config()
    config.model, config.train_data, config.force_patch_dropout = str(model_json), "/data/x.tar", force
    check_config(config, num_devices=8)
    spec = StepSpec.from_config(config, platform="cpu")
    assert spec.model.vision.patch_dropout == rate
    assert dataclasses.replace(spec, precision="bf16").model.vision.patch_dropout == rate


@pytest.mark.parametrize("force", [1.0, -0.5, 2.0])
def test_bad_force_patch_dropout_fails_before_compiling(force):
    config = default_config()
    config.train_data, config.force_patch_dropout = "/data/x.tar", force
    with pytest.raises(ValueError, match="force_patch_dropout"):
        check_config(config, num_devices=8)


def test_train_flops_count_the_kept_tokens_and_eval_flops_all():
    config = get_model_config("ViT-B-16")
    dropped = StepSpec.for_model(config, patch_dropout=0.5).model
    assert image_tokens(dropped.vision) == 197 and image_tokens(dropped.vision, train=True) == 99
    assert forward_flops(dropped) == forward_flops(config)  # eval
    assert image_forward_flops(dropped, train=True) < 0.5 * image_forward_flops(config)
    assert 0.55 < train_flops(dropped) / train_flops(config) < 0.6
    assert train_flops(StepSpec.for_model(dropped, patch_dropout=0.0).model) == train_flops(config)


@pytest.mark.slow
def test_the_planners_xla_count_of_the_step_agrees_with_the_kept_token_count():
    from clip_jax import plan as planner

    spec = StepSpec.for_model("ViT-B-32", "fp32", patch_dropout=0.5)  # 49 patches, 24 kept
    flops = planner.flops_per_sample(spec, create_mesh(jax.devices()[:1]), 4)
    assert flops.train_analytic == 3 * forward_flops(spec.model, train=True) < 0.75 * 3 * flops.forward_analytic
    assert 1.0 <= flops.train_xla / flops.train_analytic < 1.05  # the planner's per-block loop correction included
