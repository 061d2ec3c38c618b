"""The model registry, OpenCLIP's config format, and the run-time options (dtype, remat, scan, attention)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import open_clip
import pytest
import torch
from open_clip_reference import TINY, open_clip_features, open_clip_model, random_inputs, state_dict_numpy
from tiny_model import assert_bf16_features_close

from clip_jax.interop.convert import from_open_clip
from clip_jax.models import count_params, create_model, get_model_config, init_params, list_models

NAMED = ["ViT-B-32", "ViT-B-16", "ViT-L-14", "ViT-L-14-336", "ViT-H-14", "ViT-g-14"]


def _param_count(model) -> int:
    return count_params(jax.eval_shape(lambda rng: init_params(model, rng), jax.random.key(0)))


@pytest.mark.parametrize("name", NAMED)
def test_named_models_have_open_clips_architecture_and_parameter_count(name):
    assert name in list_models()
    open_clip_config = open_clip.get_model_config(name)
    assert get_model_config(open_clip_config) == get_model_config(name).__class__(
        **{**get_model_config(name).__dict__, "name": "custom"})
    with torch.device("meta"):  # no memory is allocated
        expected = sum(p.numel() for p in open_clip.CLIP(**open_clip_config).parameters())
    assert _param_count(create_model(name)) == expected


def test_vit_l_14_has_the_published_parameter_count():
    assert _param_count(create_model("ViT-L-14")) == 427_616_513


def test_an_open_clip_json_file_is_used_as_is(tmp_path):
    path = tmp_path / "my-tiny.json"
    path.write_text(json.dumps({**TINY, "text_cfg": {**TINY["text_cfg"], "ls_init_value": None}}))
    config = get_model_config(str(path))
    assert config.name == "my-tiny"
    assert config.vision.heads == 4 and config.vision.mlp_width == 240
    assert config.text.heads == 4 and config.text.mlp_width == 192


@pytest.mark.parametrize("bad, message", [
    ("ViT-Q-99", "unknown model 'ViT-Q-99'"),
    ({**TINY, "vision_cfg": {**TINY["vision_cfg"], "widht": 96}}, "unknown key(s) ['widht']"),
    ({**TINY, "vision_cfg": {**TINY["vision_cfg"], "attentional_pool": True}}, "attentional_pool=True"),
    ({"embed_dim": 8, "vision_cfg": {}}, "lacks ['text_cfg']"),
    ({**TINY, "text_cfg": {**TINY["text_cfg"], "heads": 5}}, "not divisible by 5 heads"),
    ("/nonexistent/model.json", "does not exist"),
])
def test_bad_model_configs_fail_with_a_message_naming_the_problem(bad, message):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        get_model_config(bad)
    assert message in str(info.value)


def test_bad_run_options_fail_when_the_model_is_created():
    with pytest.raises(ValueError, match="unknown remat_policy 'everything'"):
        create_model(TINY, remat_policy="everything")
    with pytest.raises(ValueError, match="unknown attention_impl"):
        create_model(TINY, attention_impl="flash")


@pytest.mark.slow
def test_wrong_input_shapes_are_named():
    model = create_model(TINY)
    params = init_params(model, jax.random.key(0))
    with pytest.raises(ValueError, match=r"\[B, 32, 32, 3\]"):
        model.apply({"params": params}, jnp.zeros((1, 3, 32, 32)), method="encode_image")
    with pytest.raises(ValueError, match=r"\[B, 20\]"):
        model.apply({"params": params}, jnp.zeros((1, 77), jnp.int32), method="encode_text")


def _loss_and_grads(model, params, images, tokens):
    def loss(p):
        image_f, text_f, scale = model.apply({"params": p}, images, tokens)
        logits = scale * image_f @ text_f.T
        return -jnp.mean(jnp.diag(jax.nn.log_softmax(logits)))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_remat_changes_memory_not_results(policy):
    images, tokens = random_inputs(32, 20, 600, batch=4)
    plain = create_model(TINY)
    params = init_params(plain, jax.random.key(0))
    loss, grads = _loss_and_grads(plain, params, images, tokens)
    loss_r, grads_r = _loss_and_grads(create_model(TINY, remat_policy=policy), params, images, tokens)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    # Recomputing the forward sums in another order: float32 rounding, up to 7e-6 seen on a leaf whose largest
    # gradient is ~3.6 (a remat bug would be off by the gradient's own size)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()), grads_r, grads)


def test_scanned_layers_keep_the_program_size_flat_in_depth():
    def equations(layers):
        config = {**TINY, "vision_cfg": {**TINY["vision_cfg"], "layers": layers},
                  "text_cfg": {**TINY["text_cfg"], "layers": layers}}
        model = create_model(config, remat_policy="nothing_saveable")
        params = jax.eval_shape(lambda r: init_params(model, r), jax.random.key(0))
        images, tokens = random_inputs(32, 20, 600, batch=2)
        def loss(p):
            image_f, text_f, _ = model.apply({"params": p}, images, tokens)
            return jnp.sum(image_f * text_f)

        return str(jax.make_jaxpr(jax.grad(loss))(params)).count("\n")  # one line per equation

    assert equations(2) == equations(12)


@pytest.mark.slow
def test_layer_params_hook_maps_each_layers_weights_at_apply_time_only():
    images, tokens = random_inputs(32, 20, 600, batch=2)
    plain = create_model(TINY, remat_policy="nothing_saveable")
    params = init_params(plain, jax.random.key(0))
    seen = []

    def double(variables, layers):  # one layer's weights, without the layer axis, and the stack's depth
        seen.append((variables["params"]["attn"]["in_proj"]["kernel"].shape, layers))
        return jax.tree.map(lambda w: 2 * w, variables)

    hooked = plain.clone(layer_params_hook=double)
    got = hooked.apply({"params": params}, images, tokens)
    # The same as every block's weights doubled in the stored tree, and nothing else.
    doubled = jax.tree_util.tree_map_with_path(
        lambda path, w: 2 * w if "resblocks" in jax.tree_util.keystr(path) else w, params)
    expected = plain.apply({"params": doubled}, images, tokens)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    assert not np.allclose(got[0], plain.apply({"params": params}, images, tokens)[0])
    assert set(seen) == {((96, 3 * 96), TINY["vision_cfg"]["layers"]), ((64, 3 * 64), TINY["text_cfg"]["layers"])}
    # Initialisation ignores the hook: the same tree and values.
    jax.tree.map(np.testing.assert_array_equal, init_params(hooked, jax.random.key(0)), params)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params_and_features():
    images, tokens = random_inputs(32, 20, 600, batch=4)
    fp32 = create_model(TINY)
    params = init_params(fp32, jax.random.key(0))
    bf16 = create_model(TINY, dtype=jnp.bfloat16)
    assert jax.tree.structure(init_params(bf16, jax.random.key(0))) == jax.tree.structure(params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(init_params(bf16, jax.random.key(0))))
    jaxpr = str(jax.make_jaxpr(lambda p: bf16.apply({"params": p}, images, tokens))(params))
    assert "dot_general" in jaxpr and "preferred_element_type=bfloat16" in jaxpr
    assert_bf16_features_close(jax.jit(fp32.apply), jax.jit(bf16.apply), params, images, tokens)


@pytest.mark.slow
def test_pure_bf16_params_keep_the_same_tree():
    model = create_model(TINY, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params = init_params(model, jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    fp32_params = init_params(create_model(TINY), jax.random.key(0))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, fp32_params)


def test_xla_attention_gives_open_clips_features():
    """attention_impl="xla" against OpenCLIP itself, not against the default: on a CPU the default is XLA's too, so
    that comparison could not fail."""
    torch_model = open_clip_model(TINY)
    images, tokens = random_inputs(32, 20, 600, batch=2)
    expected = open_clip_features(torch_model, images, tokens)
    params = from_open_clip(state_dict_numpy(torch_model), TINY)
    image_f, text_f, scale = create_model(TINY, attention_impl="xla").apply({"params": params}, images, tokens)
    np.testing.assert_allclose(image_f, expected[0], atol=1e-5)
    np.testing.assert_allclose(text_f, expected[1], atol=1e-5)
    assert float(scale) == pytest.approx(expected[2], rel=1e-6)


@pytest.mark.subprocess
def test_the_core_imports_neither_tensorflow_nor_clu_nor_torch():
    code = ("import sys, clip_jax, clip_jax.models, clip_jax.convert\n"
            "bad = sorted(m for m in ('tensorflow', 'clu', 'torch') if m in sys.modules)\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_analytic_flops_match_open_clips_profile_of_vit_l_14():
    from clip_jax.models.flops import forward_flops, image_forward_flops, text_forward_flops, train_flops

    config = get_model_config("ViT-L-14")
    # OpenCLIP's model profile: 162.03 GFLOP image + 13.30 text = 175.33 per sample forward.
    assert image_forward_flops(config) / 1e9 == pytest.approx(162.03, abs=0.005)
    assert text_forward_flops(config) / 1e9 == pytest.approx(13.30, abs=0.005)
    assert forward_flops(config) / 1e9 == pytest.approx(175.33, abs=0.005)
    assert train_flops(config, remat=True) == 4 * forward_flops(config)
