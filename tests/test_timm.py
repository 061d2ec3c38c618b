"""The README's timm block: an export's image tower in timm's CLIP ViT gives clip_jax's image embeddings."""

import json
import os
import re

import numpy as np
import pytest
from open_clip_reference import TINY, open_clip_model, state_dict_numpy
from PIL import Image

import clip_jax
from clip_jax.errors import InvalidInput
from clip_jax.interop import convert
from clip_jax.interop.export import export_open_clip
from clip_jax.interop.timm_tower import timm_args
from clip_jax.models import get_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)  # not OpenAI's, which timm's data config for these names has


def readme_timm_block() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    return re.search(r"### timm\n\n```python\n(.*?)```", readme, re.S).group(1)


@pytest.mark.parametrize("activation", [{}, {"quick_gelu": True}])
def test_the_readme_block_gives_the_export_image_embeddings(activation, tmp_path, monkeypatch):
    cfg = {**TINY, **activation}  # 4 heads of 24, MLP ratio 2.5, 3 blocks
    params = convert.from_open_clip(state_dict_numpy(open_clip_model(cfg, seed=2)), cfg)
    export_open_clip(params, get_model_config(cfg), str(tmp_path / "exported"), mean=MEAN, std=STD)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (45, 37, 3), dtype=np.uint8))
    image.save(tmp_path / "photo.jpg", quality=95)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(readme_timm_block(), namespace)  # noqa: S102 - the README's own block, run as a reader would
    assert namespace["name"] == ("vit_base_patch16_clip_quickgelu_224" if activation else "vit_base_patch16_clip_224")

    model, variables, _, eval_transform = clip_jax.create_model_and_transforms(None, pretrained="exported")
    pixels = np.asarray(eval_transform(Image.open("photo.jpg").convert("RGB")))
    timm_pixels = namespace["transform"](Image.open("photo.jpg").convert("RGB")).permute(1, 2, 0).numpy()
    np.testing.assert_allclose(timm_pixels, pixels, atol=1e-6)
    expected = np.asarray(model.apply({"params": variables}, pixels[None], normalize=False, method="encode_image"))
    got = namespace["image_embedding"].numpy()
    assert got.shape == expected.shape == (1, cfg["embed_dim"])
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("change, said", [
    ({"vision_cfg": {"layers": [1, 1, 1, 1], "width": 16, "image_size": 32}}, "a ResNet image tower (layers [1, 1, 1,"),
    ({"vision_cfg": {**TINY["vision_cfg"], "no_ln_pre": True}}, "custom option(s) no_ln_pre"),
    ({"init_logit_bias": -10.0}, "a SigLIP model (init_logit_bias)"),
])
def test_a_tower_timms_clip_vit_does_not_build_is_refused_in_one_line(change, said, tmp_path):
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": {**TINY, **change}}))
    (folder / "open_clip_model.safetensors").write_bytes(b"")
    with pytest.raises(InvalidInput) as refused:
        timm_args(str(folder))
    message = str(refused.value)
    assert "\n" not in message and said in message and "timm's CLIP ViT (vit_*_clip_*)" in message, message
