"""SigLIP: the sharded sigmoid loss against float64 numpy and OpenCLIP's `SigLipLoss`, the train step with it, the
model's `logit_bias` (config, conversion, weight decay) and zero-shot evaluation, which the bias does not enter."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import open_clip
import pytest
import torch
from jax.sharding import Mesh
from open_clip_reference import TINY as OPEN_CLIP_TINY
from open_clip_reference import open_clip_model, random_inputs, state_dict_numpy
from tiny_model import SGD, SGD_LR, assert_same_update, random_batch
from tiny_model import TINY_MODEL as TINY

from clip_jax.evaluation import ClassificationSet, evaluate_zeroshot
from clip_jax.evaluation.datasets import ArraySource
from clip_jax.evaluation.prompts import class_prompts
from clip_jax.interop import convert
from clip_jax.models import create_model, get_model_config, init_params
from clip_jax.optim.adamw import decay_mask
from clip_jax.run_config import default_config
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.config_checks import check_config
from clip_jax.training.loss import contrastive_loss_and_accuracy, sigmoid_loss_and_accuracy
from clip_jax.training.step_factory import StepSpec, build_step

SIGLIP_TINY = {**TINY, "init_logit_scale": math.log(10), "init_logit_bias": -10.0}


def unit_rows(rng, batch, dim):
    x = rng.standard_normal((batch, dim))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def numpy_sigmoid_loss(image, text, scale, bias):
    """Loss, gradients (image, text, scale, bias) and top-1 accuracy in float64, written out by hand."""
    labels = 2 * np.eye(len(image)) - 1
    dots = image @ text.T
    logits = scale * dots + bias
    loss = np.logaddexp(0, -labels * logits).sum() / len(image)
    dlogits = -labels / (1 + np.exp(labels * logits)) / len(image)  # d/dl of log(1 + exp(-z l)), over B
    grads = (scale * dlogits @ text, scale * dlogits.T @ image, (dlogits * dots).sum(), dlogits.sum())
    own = np.arange(len(image))
    hits = (logits.argmax(axis=1) == own).sum() + (logits.argmax(axis=0) == own).sum()
    return loss, grads, hits / (2 * len(image))


def open_clip_sigmoid_loss(image, text, scale, bias):
    """OpenCLIP's `SigLipLoss` on one process given the global batch (float64): value and gradients."""
    inputs = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (image, text, scale, bias)]
    loss = open_clip.loss.SigLipLoss()(*inputs)
    loss.backward()
    return loss.item(), tuple(x.grad.numpy() for x in inputs)


def meshes():
    devices = jax.devices()
    return [create_mesh(devices[:n]) for n in (1, 2, 4, 8)] + [
        Mesh(np.array(devices).reshape(2, 4), ("replica", "data"))]  # the FSDP grid: the batch over both axes


@pytest.mark.slow
@pytest.mark.parametrize("mesh", meshes(), ids=["1", "2", "4", "8", "2x4"])
def test_value_and_gradients_equal_float64_numpy_and_open_clip(mesh):
    rng = np.random.default_rng(0)
    image, text = unit_rows(rng, 16, 12), unit_rows(rng, 16, 12)
    text[:4] = 0.3 * image[:4] + text[:4]  # some pairs that score highest, so the accuracy is not vacuous
    text /= np.linalg.norm(text, axis=1, keepdims=True)
    scale, bias = 10.0, -4.0  # logits on both sides of zero
    expected, expected_grads, expected_accuracy = numpy_sigmoid_loss(image, text, scale, bias)
    open_clip_value, open_clip_grads = open_clip_sigmoid_loss(image, text, np.float64(scale), np.float64(bias))

    loss = jax.jit(jax.value_and_grad(lambda *a: sigmoid_loss_and_accuracy(*a, mesh=mesh), argnums=(0, 1, 2, 3),
                                      has_aux=True))
    (value, accuracy), grads = loss(*(jnp.float32(x) for x in (image, text, scale, bias)))
    for reference, reference_grads in ((expected, expected_grads), (open_clip_value, open_clip_grads)):
        np.testing.assert_allclose(float(value), reference, rtol=1e-5)
        for got, want in zip(grads, reference_grads):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert float(accuracy) == expected_accuracy > 0
    # the same ranking as the softmax loss's: the bias moves every logit alike
    _, softmax_accuracy = contrastive_loss_and_accuracy(jnp.float32(image), jnp.float32(text), scale, mesh=mesh)
    assert float(accuracy) == float(softmax_accuracy)


def test_memory_per_device_is_the_softmax_losss_never_the_global_square():
    """Forward: one [B_local, B_local] block at a time. The backward keeps each block's sigmoid (autodiff through the
    ring), [B_local, B_global] in all, as the softmax loss holds its two [B_local, B_global] blocks of logits."""
    mesh, batch, dim = create_mesh(), 512, 4
    features = jax.ShapeDtypeStruct((batch, dim), jnp.float32)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)

    def temp_bytes(loss, *args):
        grad = jax.value_and_grad(lambda *a: loss(*a, mesh=mesh)[0], argnums=tuple(range(len(args))))
        return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

    sigmoid = temp_bytes(sigmoid_loss_and_accuracy, features, features, scalar, scalar)
    softmax = temp_bytes(contrastive_loss_and_accuracy, features, features, scalar)
    assert sigmoid <= softmax
    assert sigmoid < 2 * (batch // 8) * batch * 4 < batch * batch * 4


@pytest.mark.slow
def test_a_model_config_with_init_logit_bias_has_the_bias_and_returns_it():
    config = get_model_config(SIGLIP_TINY)
    assert (config.init_logit_scale, config.init_logit_bias) == (math.log(10), -10.0)
    model = create_model(config)
    params = init_params(model, jax.random.key(0))
    assert float(params["logit_scale"]) == pytest.approx(math.log(10))
    assert params["logit_bias"].shape == () and float(params["logit_bias"]) == -10.0
    images, tokens = random_inputs(32, 16, 1000, batch=2)
    image_f, text_f, scale, bias = model.apply({"params": params}, images, tokens)
    assert float(scale) == pytest.approx(10.0) and float(bias) == -10.0
    # without init_logit_bias the tree and the forward are CLIP's, with init_logit_scale still read
    plain = create_model({**TINY, "init_logit_scale": 2.0})
    plain_params = init_params(plain, jax.random.key(0))
    assert "logit_bias" not in plain_params and float(plain_params["logit_scale"]) == 2.0
    plain_params = {**plain_params, **{k: v for k, v in params.items() if k != "logit_bias"}}
    outputs = plain.apply({"params": plain_params}, images, tokens)
    assert len(outputs) == 3
    np.testing.assert_array_equal(outputs[0], image_f)
    np.testing.assert_array_equal(outputs[1], text_f)


def test_logit_bias_is_not_decayed():
    params = jax.eval_shape(lambda: init_params(create_model(SIGLIP_TINY), jax.random.key(0)))
    mask = decay_mask(params)
    assert mask["logit_bias"] is False and mask["logit_scale"] is False and mask["text_projection"] is True


def test_the_siglip_loss_gives_a_model_without_a_bias_open_clips_siglip_head():
    spec = StepSpec.for_model(TINY, loss="siglip")
    assert (spec.model.init_logit_scale, spec.model.init_logit_bias) == (math.log(10), -10.0)
    own = StepSpec.for_model({**SIGLIP_TINY, "init_logit_bias": -5.0, "init_logit_scale": 1.0}, loss="siglip")
    assert (own.model.init_logit_scale, own.model.init_logit_bias) == (1.0, -5.0)  # a config's own head is kept
    assert StepSpec.for_model(TINY).model.init_logit_bias is None

    config = default_config()
    assert config.loss == "clip"
    config.model, config.loss = "ViT-B-32", "siglip"
    assert StepSpec.from_config(config, platform="cpu").loss == "siglip"
    config.train_data, config.loss = "/data/x.tar", "sigmoid"
    with pytest.raises(ValueError, match="loss='sigmoid'"):
        check_config(config, num_devices=8)


def siglip_sgd_step(params, batch, *, n_devices, accum_steps=1, fsdp=False):
    mesh = create_mesh(jax.devices()[:n_devices])
    step = build_step(StepSpec.for_model(SIGLIP_TINY, fsdp=fsdp, loss="siglip", optimizer=SGD, accum_steps=accum_steps),
                      mesh)
    state, metrics = step(step.state_from_params(params), make_global_batch(batch, mesh))
    return jax.tree.map(np.asarray, state.params), {k: float(v) for k, v in metrics.items()}


@pytest.mark.slow
def test_train_step_under_fsdp_and_accumulation_equals_the_plain_step_and_numpy():
    model = create_model(SIGLIP_TINY)
    params = jax.tree.map(np.asarray, init_params(model, jax.random.key(0)))
    params["logit_bias"] = np.float32(-2.0)  # positives and negatives both pull on the bias
    params["logit_scale"] = np.float32(4.0)
    batch = random_batch(32)
    after_1, metrics_1 = siglip_sgd_step(params, batch, n_devices=1)
    after_8, metrics_8 = siglip_sgd_step(params, batch, n_devices=8, accum_steps=2, fsdp=True)
    assert_same_update(params, after_8, after_1)
    for name in ("loss", "accuracy", "logit_scale", "logit_bias", "grad_norm"):
        assert metrics_8[name] == pytest.approx(metrics_1[name], rel=1e-5), name

    image_f, text_f, scale, bias = (np.asarray(x, np.float64) for x in
                                    model.apply({"params": params}, batch["images"], batch["tokens"]))
    loss, grads, _ = numpy_sigmoid_loss(image_f, text_f, scale, bias)
    assert metrics_1["loss"] == pytest.approx(loss, rel=1e-5) and metrics_1["logit_bias"] == -2.0
    # SGD: the bias moved by -lr x its gradient, and the raw scale by -lr x (d loss / d scale) x scale, clamped
    assert after_1["logit_bias"] - params["logit_bias"] == pytest.approx(-SGD_LR * grads[3], rel=1e-4)
    raw_scale = np.clip(params["logit_scale"] - SGD_LR * grads[2] * scale, 0, math.log(100))
    assert after_1["logit_scale"] == pytest.approx(raw_scale, rel=1e-5)


@pytest.fixture(scope="module")
def siglip_torch_model():
    return open_clip_model({**OPEN_CLIP_TINY, "init_logit_scale": math.log(10), "init_logit_bias": -10.0}, seed=3)


@pytest.mark.slow
def test_conversion_carries_logit_bias_both_ways_and_open_clip_loads_it(siglip_torch_model):
    config = {**OPEN_CLIP_TINY, "init_logit_bias": -10.0}
    state_dict = state_dict_numpy(siglip_torch_model)
    assert state_dict["logit_bias"].shape == () and state_dict["logit_bias"] != -10.0  # perturbed
    params = convert.from_open_clip(state_dict, config)
    assert params["logit_bias"] == state_dict["logit_bias"]
    back = convert.to_open_clip(params, config)
    assert back.keys() == state_dict.keys()
    for key in state_dict:
        np.testing.assert_array_equal(back[key], state_dict[key], err_msg=key)
    fresh = open_clip.CLIP(**OPEN_CLIP_TINY, init_logit_bias=0.0)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
    assert fresh.logit_bias.item() == float(state_dict["logit_bias"])

    images, tokens = random_inputs(32, 20, 600, batch=3)
    with torch.no_grad():
        *_, torch_bias = siglip_torch_model(torch.from_numpy(images).permute(0, 3, 1, 2), torch.from_numpy(tokens))
    *_, bias = create_model(config).apply({"params": params}, images, tokens)
    assert float(bias) == torch_bias.item()

    # a [1]-shaped bias (OpenCLIP's nonscalar_logit_scale) converts to our scalar
    shaped = {**state_dict, "logit_bias": state_dict["logit_bias"].reshape(1)}
    assert convert.from_open_clip(shaped, config)["logit_bias"].shape == ()
    with pytest.raises(ValueError, match="init_logit_bias"):  # a SigLIP checkpoint read as a CLIP model
        convert.from_open_clip(state_dict, OPEN_CLIP_TINY)


def test_zero_shot_evaluation_is_the_same_whatever_the_bias(tmp_path):
    """Zero-shot ranks classes by image-text similarity; the bias adds the same to every class and is not used."""
    clip_77 = {**OPEN_CLIP_TINY, "text_cfg": {**OPEN_CLIP_TINY["text_cfg"], "context_length": 77,
                                               "vocab_size": 49408}}
    siglip_77 = {**clip_77, "init_logit_scale": math.log(10), "init_logit_bias": -10.0}
    params = convert.from_open_clip(state_dict_numpy(open_clip_model(siglip_77, seed=1)), siglip_77)
    rng = np.random.default_rng(0)
    names = ("cat", "dog", "car")
    dataset = ClassificationSet("toy", ArraySource(rng.integers(0, 256, (8, 32, 32), dtype=np.uint8),
                                                   rng.integers(0, 3, 8)),
                                names, class_prompts(names, ["a photo of a {}."]))
    mesh = create_mesh()
    json_path = tmp_path / "siglip.json"
    json_path.write_text(json.dumps(siglip_77))
    siglip = evaluate_zeroshot(create_model(str(json_path)), params, dataset, mesh, batch_size=8, num_threads=1,
                               text_batch_size=200)
    without_bias = {k: v for k, v in params.items() if k != "logit_bias"}
    clip = evaluate_zeroshot(create_model(clip_77), without_bias, dataset, mesh, batch_size=8, num_threads=1,
                             text_batch_size=200)
    assert siglip == clip and siglip["num_images"] == 8


def test_configs_differing_only_in_the_head_are_different_specs():
    """The planner keys compiles on the spec: a SigLIP head must not be mistaken for CLIP's."""
    clip = get_model_config(TINY)
    assert dataclasses.replace(clip, init_logit_bias=-10.0) != clip
    assert StepSpec.for_model(TINY, loss="siglip") != StepSpec.for_model(TINY)
