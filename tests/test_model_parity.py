"""clip_jax towers against the real OpenCLIP package: same features from converted weights, exact round trips."""

import jax
import numpy as np
import open_clip
import pytest
from open_clip_reference import TINY, open_clip_features, open_clip_model, random_inputs, state_dict_numpy

from clip_jax.interop.convert import from_open_clip, to_open_clip
from clip_jax.models import create_model


def shallow(name: str, layers: int = 2) -> dict:
    """OpenCLIP's config of `name` with `layers` blocks in each tower: its widths, heads, patch and image size, the
    same code per block (ViT-B-32 at full depth covers two-digit block numbers)."""
    config = open_clip.get_model_config(name)
    return {**config, "vision_cfg": {**config["vision_cfg"], "layers": layers},
            "text_cfg": {**config["text_cfg"], "layers": layers}}


CASES = [  # (model, batch)
    pytest.param((TINY, 3), id="tiny"),
    pytest.param(({**TINY, "quick_gelu": True}, 2), id="tiny-quickgelu"),
    pytest.param(("ViT-B-32", 2), id="ViT-B-32"),
    pytest.param((shallow("ViT-L-14"), 1), id="ViT-L-14-2-layers"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_converted_open_clip_model_gives_the_same_features(case):
    name_or_config, batch = case
    torch_model = open_clip_model(name_or_config)
    state_dict = state_dict_numpy(torch_model)
    model = create_model(name_or_config)
    cfg = model.config
    images, tokens = random_inputs(cfg.vision.image_size, cfg.text.context_length, cfg.text.vocab_size, batch)

    expected_image, expected_text, expected_scale = open_clip_features(torch_model, images, tokens)
    del torch_model
    params = from_open_clip(state_dict, name_or_config)
    image_f, text_f, scale = jax.jit(model.apply)({"params": params}, images, tokens)

    assert np.abs(np.asarray(image_f) - expected_image).max() < 1e-5
    assert np.abs(np.asarray(text_f) - expected_text).max() < 1e-5
    assert float(scale) == pytest.approx(expected_scale, rel=1e-6)

    # The round trip is exact, key for key.
    back = to_open_clip(params, name_or_config)
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        assert back[key].shape == value.shape and back[key].dtype == value.dtype, key
        np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_single_tower_methods_match_the_joint_forward():
    torch_model = open_clip_model(TINY, seed=1)
    params = from_open_clip(state_dict_numpy(torch_model), TINY)
    model = create_model(TINY)
    images, tokens = random_inputs(32, 20, 600, batch=2, seed=1)
    image_f, text_f, _ = open_clip_features(torch_model, images, tokens)
    np.testing.assert_allclose(model.apply({"params": params}, images, method="encode_image"), image_f, atol=1e-5)
    np.testing.assert_allclose(model.apply({"params": params}, tokens, method="encode_text"), text_f, atol=1e-5)

    # Unnormalised features equal OpenCLIP's encode_* without normalisation.
    import torch

    with torch.no_grad():
        raw = torch_model.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()).numpy()
    ours = model.apply({"params": params}, images, normalize=False, method="encode_image")
    np.testing.assert_allclose(ours, raw, atol=1e-5, rtol=1e-5)
