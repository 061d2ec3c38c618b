"""The options of a ResNet image tower's train step: FSDP, remat, gradient accumulation with BatchNorm, a locked
(frozen) image tower, and the precision policies' dtypes. Each sharded step on 8 devices is checked against an
independent single-device loop: plain `model.apply`, the loss written out, optax's SGD."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_model import assert_same_update

from clip_jax.errors import InvalidInput
from clip_jax.models import create_model, init_variables
from clip_jax.optim.adamw import LOGIT_SCALE_MAX
from clip_jax.optim.lock import LockSpec
from clip_jax.run_config import default_config
from clip_jax.runtime.mesh import make_global_batch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step, lock_spec, mesh_for

# Width 16, so the last stage's kernels (1x1x128x512, 3x3x128x128) and the attention pool's projections exceed
# FSDP's minimum size and are split over the 8 devices; one block a stage and a 1x1 grid keep compiles short.
TINY_RN = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 16, "head_width": 128},
    "text_cfg": {"context_length": 8, "vocab_size": 50, "width": 16, "heads": 2, "layers": 1},
}
GLOBAL_BATCH, STEPS, DEVICES = 16, 2, 8
# Plain SGD, the update the gradient itself; a small rate, as the second step's gradients through BatchNorm amplify
# the first step's float32 rounding (at 0.5 some BatchNorm updates of the second step differ by 1%)
SGD_LR = 0.05
SGD = OptimizerSpec("sgd", lr=SGD_LR)


def _batches():
    rng = np.random.default_rng(11)
    return [{"images": rng.normal(size=(GLOBAL_BATCH, 32, 32, 3)).astype(np.float32),
             "tokens": rng.integers(1, 50, size=(GLOBAL_BATCH, 8)).astype(np.int32)} for _ in range(STEPS)]


@jax.jit  # also called outside a compiled function: one compile, not one per op
def _clip_loss(image, text, scale):
    logits = scale * image @ text.T
    labels = jnp.arange(logits.shape[0])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


def _micro_batch_rows(accum_steps: int) -> np.ndarray:
    """[k, B / k] rows of each micro-batch: every device's part of the batch is cut into k consecutive pieces, and
    micro-batch j gathers piece j of every device (so it is split over the devices like the batch)."""
    per_piece = GLOBAL_BATCH // (DEVICES * accum_steps)
    rows = np.arange(GLOBAL_BATCH).reshape(DEVICES, accum_steps, per_piece)
    return np.stack([rows[:, j].ravel() for j in range(accum_steps)])


# The model's forward in train mode (the batch's statistics, the running ones updated) and in eval mode, each compiled
# once for the module (op by op, the first train-mode forward alone took longer than compiling both)
_train_forward = jax.jit(lambda variables, images, tokens: create_model(TINY_RN).apply(
    variables, images, tokens, train=True, mutable=["batch_stats"]))
_eval_forward = jax.jit(lambda variables, images, tokens: create_model(TINY_RN).apply(variables, images, tokens))


def _reference(variables, accum_steps: int):
    """STEPS SGD steps on one device: each micro-batch through the model in train mode in turn (its own BatchNorm
    statistics, the running ones chained through them), the loss over all of their features, autodiff through the
    whole loop; each step (gradient, SGD, the scale's clamp) one compiled function."""
    model = create_model(TINY_RN)
    params, stats = variables["params"], variables["batch_stats"]
    micro_rows = _micro_batch_rows(accum_steps)

    def loss_fn(params, stats, batch):
        images, texts = [], []
        for rows in micro_rows:
            (image, text, scale), updated = model.apply(
                {"params": params, "batch_stats": stats}, batch["images"][rows], batch["tokens"][rows], train=True,
                mutable=["batch_stats"])
            stats = updated["batch_stats"]
            images.append(image)
            texts.append(text)
        return _clip_loss(jnp.concatenate(images), jnp.concatenate(texts), scale), stats

    optimizer = optax.sgd(SGD_LR)

    @jax.jit
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
    return losses, jax.tree.map(np.array, params), jax.tree.map(np.asarray, stats)


def _run(spec: StepSpec, variables, devices: int = DEVICES):
    mesh = mesh_for(spec, jax.devices()[:devices])
    step = build_step(spec, mesh)
    state = step.state_from_params(variables["params"], variables["batch_stats"])
    losses = []
    for batch in _batches():
        state, metrics = step(state, make_global_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return step, losses, state


@pytest.fixture(scope="module")
def start():
    return jax.tree.map(np.asarray, init_variables(create_model(TINY_RN), jax.random.key(5)))


def _assert_matches(start, losses, state, expected):
    expected_losses, expected_params, expected_stats = expected
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 jax.device_get(state.batch_stats), expected_stats)
    # the key bias of a one-query attention shifts every logit alike: its gradient is 0 (nothing to compare)
    k_bias = lambda tree: tree["visual"]["attnpool"]["k_proj"].pop("bias")  # noqa: E731
    before, after = jax.tree.map(np.array, start["params"]), jax.tree.map(np.array, jax.device_get(state.params))
    expected_params = jax.tree.map(np.array, expected_params)
    for tree in (before, after, expected_params):
        k_bias(tree)
    # float32 sums in another order on 8 devices: the bound is their measured rounding (assert_same_update); a wrong
    # normalisation or a missing term is off by far more
    assert_same_update(before, after, expected_params)


@pytest.mark.slow
def test_accumulation_with_fsdp_and_remat_equals_an_independent_single_device_loop(start):
    """Each micro-batch normalised with its own statistics, the running statistics updated once per micro-batch in
    order, the loss over the whole batch; conv kernels split over the devices, every block rematerialised."""
    spec = StepSpec.for_model(TINY_RN, fsdp=True, remat_policy="nothing_saveable", accum_steps=2, optimizer=SGD)
    step, losses, state = _run(spec, start)
    layer4 = step.shardings.params["visual"]["layer4"]["0"]
    assert any(s is not None for s in layer4["conv3"]["kernel"].spec)  # the conv kernel is split
    assert all(s is None for s in layer4["bn3"]["scale"].spec)  # a BatchNorm vector is whole
    assert all(s is None for s in step.shardings.batch_stats["visual"]["layer4"]["0"]["bn3"]["mean"].spec)
    _assert_matches(start, losses, state, _reference(start, accum_steps=2))
    assert int(state.batch_stats["visual"]["layer3"]["0"]["bn2"]["num_batches_tracked"]) == 2 * STEPS
    # the semantics matter: normalised with the whole batch's statistics, the first step's loss is another
    batch = _batches()[0]
    whole_batch, _ = _train_forward(start, batch["images"], batch["tokens"])
    assert abs(float(_clip_loss(*whole_batch)) - losses[0]) > 1e-3


def _run_locked(start, freeze_bn_stats: bool):
    """Two AdamW steps on 2 devices with the image tower locked; the params are checked frozen and the text tower
    moving, and the optimizer to hold two moments for the trainable params only (and a few counters)."""
    adamw = OptimizerSpec("adamw", lr=1e-3)
    spec = StepSpec.for_model(TINY_RN, lock=LockSpec(image=True, image_freeze_bn_stats=freeze_bn_stats),
                              optimizer=adamw)
    _, losses, state = _run(spec, start, devices=2)
    after = jax.device_get(state)
    jax.tree.map(np.testing.assert_array_equal, after.params["visual"], start["params"]["visual"])
    assert not np.allclose(after.params["token_embedding"]["embedding"],
                           start["params"]["token_embedding"]["embedding"])
    trainable = sum(x.size for k, v in start["params"].items() if k != "visual" for x in jax.tree.leaves(v))
    held = sum(x.size for x in jax.tree.leaves(after.opt_state))
    assert 2 * trainable <= held < 2 * trainable + 8
    return losses, after


@pytest.mark.slow
def test_a_locked_image_tower_with_frozen_bn_stats_is_frozen_batch_norm_included(start):
    """Locked with `image_freeze_bn_stats` (OpenCLIP's --lock-image-freeze-bn-stats): no update, no optimizer state,
    BatchNorm in eval mode (running statistics, left as they are); the text tower and the scale train."""
    losses, after = _run_locked(start, freeze_bn_stats=True)
    jax.tree.map(np.testing.assert_array_equal, after.batch_stats, start["batch_stats"])
    # the first step's loss is that of the image tower in eval mode (running statistics), not in train mode
    batch = _batches()[0]
    eval_loss = _clip_loss(*_eval_forward(start, batch["images"], batch["tokens"]))
    train_outputs, _ = _train_forward(start, batch["images"], batch["tokens"])
    np.testing.assert_allclose(losses[0], float(eval_loss), rtol=1e-5)
    assert abs(float(_clip_loss(*train_outputs)) - losses[0]) > 1e-4


@pytest.mark.slow
def test_a_locked_image_tower_keeps_batch_norm_in_train_mode_and_its_statistics_move(start):
    """Locked alone (OpenCLIP's --lock-image): the params stay bit for bit and get no optimizer state, but BatchNorm
    runs in train mode: normalised with the batch's statistics, the running ones updated by every step, as a
    train-mode forward of the frozen tower over each batch in turn updates them."""
    losses, after = _run_locked(start, freeze_bn_stats=False)
    stats, outputs = start["batch_stats"], []
    for batch in _batches():  # the image params never move, so each step sees the starting ones
        out, updated = _train_forward({"params": start["params"], "batch_stats": stats}, batch["images"],
                                      batch["tokens"])
        stats = updated["batch_stats"]
        outputs.append(out)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), after.batch_stats,
                 jax.tree.map(np.asarray, stats))
    first_block = after.batch_stats["visual"]["layer1"]["0"]["bn1"]
    assert not np.allclose(first_block["mean"], start["batch_stats"]["visual"]["layer1"]["0"]["bn1"]["mean"])
    assert int(first_block["num_batches_tracked"]) == STEPS
    # the first step's loss is that of the train-mode forward (the batch's statistics), not of the eval-mode one
    np.testing.assert_allclose(losses[0], float(_clip_loss(*outputs[0])), rtol=1e-5)
    eval_loss = _clip_loss(*_eval_forward(start, _batches()[0]["images"], _batches()[0]["tokens"]))
    assert abs(float(eval_loss) - losses[0]) > 1e-4


def test_the_config_flag_reaches_the_lock_and_is_refused_without_a_locked_image_tower():
    config = default_config()
    config.lock_image = True
    assert not lock_spec(config).image_freeze_bn_stats
    config.lock_image_freeze_bn_stats = True
    assert lock_spec(config) == LockSpec(image=True, image_freeze_bn_stats=True)
    config.lock_image = False
    with pytest.raises(InvalidInput, match="lock_image_freeze_bn_stats.*no effect without a locked image tower"):
        lock_spec(config)


@pytest.mark.parametrize("options, named", [
    ({"lock": LockSpec(image=True, image_unlocked_groups=1)}, "image_unlocked_groups=1"),
    ({"patch_dropout": 0.5}, "patch_dropout=0.5"),
])
def test_what_a_resnet_step_is_not_built_with_is_refused(options, named):
    with pytest.raises(InvalidInput, match=named):
        StepSpec.for_model(TINY_RN, **options)


@pytest.mark.parametrize("precision, param_dtype", [("fp32", jnp.float32), ("bf16", jnp.float32),
                                                     ("pure_bf16", jnp.bfloat16)])
def test_precision_policies_store_conv_and_batch_norm_params_and_keep_statistics_in_fp32(precision, param_dtype):
    step = build_step(StepSpec.for_model(TINY_RN, precision=precision),
                      mesh_for(StepSpec.for_model(TINY_RN), jax.devices()[:1]))
    params, stats = step.abstract_state.params["visual"], step.abstract_state.batch_stats["visual"]
    assert params["layer1"]["0"]["conv2"]["kernel"].dtype == param_dtype
    assert params["layer1"]["0"]["bn2"]["scale"].dtype == param_dtype
    assert stats["layer1"]["0"]["bn2"]["mean"].dtype == jnp.float32
    assert stats["layer1"]["0"]["bn2"]["var"].dtype == jnp.float32
    assert stats["layer1"]["0"]["bn2"]["num_batches_tracked"].dtype == jnp.int32
