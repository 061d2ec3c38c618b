"""Each tower's per-token states after any block (`encode_text_states`, `encode_image_states`), as image generation
conditions on them: equal to OpenCLIP's `forward_intermediates` and to transformers' `hidden_states` of our export,
whose towers also load as `CLIPTextModelWithProjection` / `CLIPVisionModelWithProjection`."""

import jax
import numpy as np
import pytest
import torch
import transformers
from open_clip_reference import TINY, TINY_77, open_clip_model, state_dict_numpy

from clip_jax.interop import convert
from clip_jax.interop.export import export_open_clip
from clip_jax.models import create_model, get_model_config

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)


def _inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    size, text = cfg["vision_cfg"]["image_size"], cfg["text_cfg"]
    images = rng.normal(size=(2, size, size, 3)).astype(np.float32)
    tokens = rng.integers(1, text["vocab_size"] - 1, (2, text["context_length"])).astype(np.int32)
    tokens[:, 7:] = 0
    tokens[:, 6] = text["vocab_size"] - 1  # the end-of-text token (the largest id), where the text pools
    return images, tokens


def _ours(cfg, params, images, tokens, final_norm):
    model = create_model(get_model_config(cfg))
    text = model.apply({"params": params}, tokens, final_norm, method="encode_text_states")
    image = model.apply({"params": params}, images, final_norm, method="encode_image_states")
    return [np.asarray(a) for a in (*text, *image)]


@pytest.mark.parametrize("final_norm", [False, True])
def test_every_block_state_equals_open_clips_forward_intermediates(final_norm):
    reference = open_clip_model(TINY, seed=3)
    params = convert.from_open_clip(state_dict_numpy(reference), TINY)
    images, tokens = _inputs(TINY)
    text_states, text_embedding, image_states, image_embedding = _ours(TINY, params, images, tokens, final_norm)
    assert text_states.shape == (TINY["text_cfg"]["layers"] + 1, 2, 20, 64)
    assert image_states.shape == (TINY["vision_cfg"]["layers"] + 1, 2, 17, 96)
    with torch.no_grad():
        out = reference.forward_intermediates(image=torch.from_numpy(images).permute(0, 3, 1, 2),
                                              text=torch.from_numpy(tokens).long(), normalize=False,
                                              normalize_intermediates=final_norm, image_output_fmt="NLC",
                                              image_output_extra_tokens=True)
    expected_image = [torch.cat([prefix, rest], 1).numpy() for prefix, rest in
                      zip(out["image_intermediates_prefix"], out["image_intermediates"])]
    np.testing.assert_allclose(image_states[1:], np.stack(expected_image), atol=1e-5)
    np.testing.assert_allclose(text_states[1:], np.stack([t.numpy() for t in out["text_intermediates"]]), atol=1e-5)
    np.testing.assert_allclose(image_embedding, out["image_features"].numpy(), atol=1e-5)
    np.testing.assert_allclose(text_embedding, out["text_features"].numpy(), atol=1e-5)


def test_states_equal_transformers_hidden_states_and_the_towers_load_with_their_projections(tmp_path):
    cfg = TINY_77
    reference = open_clip_model(cfg, seed=4)
    params = convert.from_open_clip(state_dict_numpy(reference), cfg)
    export_open_clip(params, get_model_config(cfg), str(tmp_path), mean=MEAN, std=STD)
    images, tokens = _inputs(cfg, seed=1)
    text_states, text_embedding, image_states, image_embedding = _ours(cfg, params, images, tokens, False)
    normed_text, _, normed_image, _ = _ours(cfg, params, images, tokens, True)

    pixels, ids = torch.from_numpy(images).permute(0, 3, 1, 2), torch.from_numpy(tokens).long()
    text_model = transformers.CLIPTextModelWithProjection.from_pretrained(str(tmp_path)).eval()
    vision_model = transformers.CLIPVisionModelWithProjection.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        text = text_model(input_ids=ids, output_hidden_states=True)
        vision = vision_model(pixel_values=pixels, output_hidden_states=True)
    assert len(text.hidden_states) == len(text_states) and len(vision.hidden_states) == len(image_states)
    np.testing.assert_allclose(text_states, np.stack([h.numpy() for h in text.hidden_states]), atol=1e-5)
    np.testing.assert_allclose(image_states, np.stack([h.numpy() for h in vision.hidden_states]), atol=1e-5)
    np.testing.assert_allclose(normed_text[-1], text.last_hidden_state.numpy(), atol=1e-5)  # after ln_final
    np.testing.assert_allclose(text_embedding, text.text_embeds.numpy(), atol=1e-5)
    np.testing.assert_allclose(image_embedding, vision.image_embeds.numpy(), atol=1e-5)
    # Stable Diffusion 2's conditioning: the penultimate block's states under the final norm
    penultimate = text_model.text_model.final_layer_norm(text.hidden_states[-2]).detach().numpy()
    model = create_model(get_model_config(cfg))
    conditioning, _ = model.apply({"params": params}, tokens, True, -2, method="encode_text_states")
    np.testing.assert_allclose(np.asarray(conditioning), penultimate, atol=1e-5)
    np.testing.assert_allclose(np.asarray(conditioning), normed_text[-2], atol=0)


def test_a_block_outside_the_tower_is_one_line_and_the_plain_embeddings_are_unchanged():
    model = create_model(get_model_config(TINY))
    params = model.init(jax.random.key(0), *(np.asarray(a) for a in _inputs(TINY)))["params"]
    images, tokens = _inputs(TINY)
    with pytest.raises(ValueError, match=r"^after_block=3: the text tower has 2 blocks; give 0 \(entering the first\) "
                                         r"to 2 \(leaving the last\), or -1 for the last"):
        model.apply({"params": params}, tokens, False, 3, method="encode_text_states")
    with pytest.raises(ValueError, match="^after_block=4: the image tower has 3 blocks"):
        model.apply({"params": params}, images, False, 4, method="encode_image_states")
    _, text_embedding = model.apply({"params": params}, tokens, method="encode_text_states")
    _, image_embedding = model.apply({"params": params}, images, method="encode_image_states")
    np.testing.assert_array_equal(text_embedding, model.apply({"params": params}, tokens, False, method="encode_text"))
    np.testing.assert_array_equal(image_embedding,
                                  model.apply({"params": params}, images, False, method="encode_image"))
