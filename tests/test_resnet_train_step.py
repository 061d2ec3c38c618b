"""The train step of a ResNet image tower: BatchNorm on the statistics of the global batch, running statistics in
the train state. A few steps on 8 devices equal an independent single-device loop (plain model.apply, the loss
written out, optax's SGD); the weight-decay mask follows OpenCLIP's groups; a checkpoint restores batch_stats."""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_model import SGD, SGD_LR, assert_same_update

from clip_jax.errors import InvalidInput
from clip_jax.interop import convert
from clip_jax.models import create_model, init_variables
from clip_jax.optim.adamw import LOGIT_SCALE_MAX, decay_mask
from clip_jax.runtime.checkpoints import CheckpointMeta, RunCheckpoints
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import StepSpec, build_step

# One block a stage and a 1x1 grid: the sharded step compiles in seconds
TINY_STEP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 128},
    "text_cfg": {"context_length": 8, "vocab_size": 50, "width": 16, "heads": 2, "layers": 1},
}
GLOBAL_BATCH, STEPS = 16, 3


def _batches():
    rng = np.random.default_rng(7)
    return [{"images": rng.normal(size=(GLOBAL_BATCH, 32, 32, 3)).astype(np.float32),
             "tokens": rng.integers(1, 50, size=(GLOBAL_BATCH, 8)).astype(np.int32)} for _ in range(STEPS)]


@pytest.fixture(scope="module")
def start():
    return jax.tree.map(np.asarray, init_variables(create_model(TINY_STEP), jax.random.key(3)))


def _reference(variables):
    """STEPS steps on one device, written out: train-mode forward over the whole batch, CLIP's symmetric
    cross-entropy, SGD, the logit scale clamped to [0, ln 100]."""
    model, optimizer = create_model(TINY_STEP), optax.sgd(SGD_LR)
    params, stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, stats, batch):
        (image, text, scale), updated = model.apply({"params": params, "batch_stats": stats}, batch["images"],
                                                    batch["tokens"], train=True, mutable=["batch_stats"])
        logits = scale * image @ text.T
        labels = jnp.arange(logits.shape[0])
        loss = (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2
        return loss, updated["batch_stats"]

    @jax.jit  # the whole step compiled once: op by op, the update's ops took seconds to compile one by one
    def sgd_step(params, stats, opt_state, batch):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = {**params, "logit_scale": jnp.clip(params["logit_scale"], 0.0, LOGIT_SCALE_MAX)}
        return params, stats, opt_state, loss

    opt_state, losses = optimizer.init(params), []
    for batch in _batches():
        params, stats, opt_state, loss = sgd_step(params, stats, opt_state, batch)
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, stats)


def _sharded_steps(variables, n_devices: int):
    mesh = create_mesh(jax.devices()[:n_devices])
    step = build_step(StepSpec.for_model(TINY_STEP, optimizer=SGD), mesh)
    state = step.state_from_params(variables["params"], variables["batch_stats"])
    losses, stats_after = [], []
    for batch in _batches():
        state, metrics = step(state, make_global_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
        stats_after.append(jax.tree.map(np.asarray, state.batch_stats))  # copied: the next step donates the state
    return losses, state, stats_after


@pytest.fixture(scope="module")
def eight_devices(start):
    return _sharded_steps(start, 8)


@pytest.mark.slow
def test_eight_devices_equal_an_independent_single_device_loop(start, eight_devices):
    losses, state, _ = eight_devices
    expected_losses, expected_params, expected_stats = _reference(start)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert losses[0] != losses[-1]
    stats = jax.tree.map(np.asarray, state.batch_stats)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), stats, expected_stats)
    assert int(stats["visual"]["layer2"]["0"]["bn2"]["num_batches_tracked"]) == STEPS
    moved = np.abs(stats["visual"]["bn1"]["mean"] - start["batch_stats"]["visual"]["bn1"]["mean"]).max()
    assert moved > 1e-3
    # the key bias of a one-query attention shifts every logit alike: the softmax ignores it, its gradient is 0
    k_bias = lambda tree: tree["visual"]["attnpool"]["k_proj"].pop("bias")  # noqa: E731
    before, after, expected = (jax.tree.map(np.array, t) for t in (start["params"], state.params, expected_params))
    np.testing.assert_allclose(k_bias(after), k_bias(before), atol=1e-6)
    k_bias(expected)
    assert_same_update(before, after, expected, rtol=1e-4)


@pytest.mark.slow
def test_the_statistics_are_those_of_the_global_batch(start, eight_devices):
    """Per-device statistics (2 rows each) would differ from the whole batch's: the state holds the latter."""
    first = _batches()[0]["images"]
    # the stem's first BatchNorm sees conv1(images): its batch mean over all 16 rows moves the running mean
    kernel = start["params"]["visual"]["conv1"]["kernel"]
    conv = jax.lax.conv_general_dilated(first, kernel, (2, 2), ((1, 1), (1, 1)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    expected_after_one = 0.9 * start["batch_stats"]["visual"]["bn1"]["mean"] + 0.1 * np.asarray(conv).mean((0, 1, 2))
    after_one = eight_devices[2][0]["visual"]["bn1"]["mean"]
    np.testing.assert_allclose(after_one, expected_after_one, rtol=1e-4, atol=1e-6)
    per_device = 0.9 * start["batch_stats"]["visual"]["bn1"]["mean"] + 0.1 * np.asarray(conv[:2]).mean((0, 1, 2))
    assert not np.allclose(after_one, per_device, rtol=1e-3)


@pytest.mark.slow
def test_weight_decay_follows_open_clips_groups(start):
    """OpenCLIP decays a parameter unless it has ndim < 2 or 'bn', 'ln', 'bias' or 'logit_scale' in its name."""
    mask = jax.tree.map(lambda decays, p: np.full(p.shape, bool(decays)), decay_mask(start["params"]), start["params"])
    mask = convert.variables_to_open_clip({"params": mask, "batch_stats": start["batch_stats"]}, TINY_STEP)
    for key, decays in mask.items():
        if key.endswith(("running_mean", "running_var", "num_batches_tracked")):
            continue  # statistics, not params
        excluded = decays.ndim < 2 or any(s in key for s in ("bn", "ln", "bias", "logit_scale"))
        assert np.all(decays == (not excluded)), key
    assert mask["visual.layer1.0.conv2.weight"].all() and not mask["visual.layer1.0.downsample.1.weight"].any()
    assert mask["visual.attnpool.positional_embedding"].all() and not mask["visual.attnpool.q_proj.bias"].any()


@pytest.mark.slow
def test_a_checkpoint_restores_batch_stats(eight_devices, orbax_writes_replicated_arrays_whole, tmp_path):
    state = eight_devices[1]
    checkpoints = RunCheckpoints(str(tmp_path / "checkpoints"), async_save=False)
    meta = CheckpointMeta(step=STEPS, model="tiny-rn", precision="fp32", global_batch=GLOBAL_BATCH,
                          samples_seen=STEPS * GLOBAL_BATCH, epoch=0.0)
    checkpoints.save(STEPS, state, iter(grain.MapDataset.range(4).to_iter_dataset()), meta)
    checkpoints.wait()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored, _ = checkpoints.restore(STEPS, abstract)
    checkpoints.close()
    assert restored.batch_stats is not None
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.batch_stats), jax.device_get(state.batch_stats))


def test_patch_dropout_is_refused():
    """What else the ResNet step takes (FSDP, remat, accumulation, a locked tower): tests/test_resnet_step_options.py"""
    with pytest.raises(InvalidInput, match="patch_dropout=0.5"):
        StepSpec.for_model(TINY_STEP, patch_dropout=0.5)


@pytest.mark.slow
def test_a_state_without_batch_stats_is_refused(start):
    step = build_step(StepSpec.for_model(TINY_STEP, optimizer=SGD), create_mesh(jax.devices()[:1]))
    with pytest.raises(InvalidInput, match="batch_stats"):
        step.state_from_params(start["params"])
