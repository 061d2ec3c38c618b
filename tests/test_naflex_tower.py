"""SigLIP 2's NaFlex image tower: given the same NaFlex rows, its features are transformers' Siglip2Model's and
timm's naflexvit's at every aspect ratio (down- and upscaling the position grid, non-square) and budget; its
positional resize is torch's antialiased bilinear `F.interpolate`; one compiled program serves every aspect ratio at
a budget; a Siglip2Model's config and state_dict convert both ways exactly; the released towers have transformers'
and timm's parameter counts; and what it does not take is refused in one line."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import transformers
from hf_layouts import moved_from_init, off_init

from clip_jax.errors import InvalidInput
from clip_jax.interop import convert, hf_siglip, hf_siglip2
from clip_jax.models import naflex
from clip_jax.models.clip import count_params, create_model, param_shapes
from clip_jax.models.config import VisionConfig
from clip_jax.models.position_resize import resize_weights
from clip_jax.models.vit import VisionTransformer

PATCH, GRID = 4, 6  # patch size and the learned position grid's side: 36 positions
# Per budget, image grids (rows, columns) from the 6 x 6 positions: square and not, smaller, larger and mixed on
# the two axes, one row, padded and not.
GRIDS = {20: [(4, 4), (2, 7), (6, 2), (1, 20)], 40: [(8, 4), (3, 9), (6, 6), (1, 13)]}
OTHER_GRIDS = {20: [(3, 3), (5, 4), (2, 2)], 40: [(13, 3), (4, 5), (1, 1)]}  # the same budgets, other aspect ratios


def _rows(grids, budget, seed):
    """NaFlex rows of random pixels, one image per grid."""
    rng = np.random.default_rng(seed)
    return np.stack([naflex.pack_rows(rng.standard_normal((r * c, PATCH * PATCH * 3)), (r, c), budget)
                     for r, c in grids])


@pytest.fixture(scope="module")
def theirs():
    """A tiny Siglip2Model, its norms, biases, probe and positions moved from their init."""
    config = transformers.Siglip2Config(
        text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 8, "projection_size": 40,
                     "pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
        vision_config={"hidden_size": 40, "intermediate_size": 56, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "num_patches": GRID * GRID, "patch_size": PATCH})
    torch.manual_seed(0)
    return moved_from_init(transformers.Siglip2Model(config).eval())


@pytest.fixture(scope="module")
def ours(theirs):
    """(config, model, params, `encode(params, rows)` recording the shape of each trace) read from `theirs`."""
    config = hf_siglip2.config_from_hf(theirs.config.to_dict(), name="tiny")
    state_dict = {k: v.numpy() for k, v in theirs.state_dict().items()}
    params = convert.from_open_clip(hf_siglip2.from_hf_state_dict(state_dict, config, "theirs"), config)
    model = create_model(config)
    traces = []

    def encode(params, rows):
        traces.append(rows.shape)
        return model.apply({"params": params}, rows, normalize=False, method="encode_image")

    return config, model, params, jax.jit(encode), traces


def _transformers_inputs(rows):
    """Siglip2Model's image inputs of the same NaFlex rows."""
    patches, grids, own = naflex.split_rows(rows)
    return {"pixel_values": torch.from_numpy(patches), "pixel_attention_mask": torch.from_numpy(own.astype(np.int64)),
            "spatial_shapes": torch.from_numpy(grids.astype(np.int64))}


def _transformers_features(model, rows):
    with torch.no_grad():
        return model.get_image_features(**_transformers_inputs(rows)).pooler_output.numpy()


def _timm_state_dict(state_dict, grid):
    """timm's naflexvit image tower of an OpenCLIP SigLIP state_dict (`visual.trunk.`, timm's ViT names): its patch
    embedding a Linear over (row, column, channel) patches, its positions a [1, g, g, W] grid."""
    trunk = {k.removeprefix("visual.trunk."): v for k, v in state_dict.items() if k.startswith("visual.trunk.")}
    kernel, bias, positions = (trunk.pop(k) for k in ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed"))
    return {**trunk, "embeds.proj.weight": kernel.transpose(0, 2, 3, 1).reshape(kernel.shape[0], -1),
            "embeds.proj.bias": bias, "embeds.pos_embed": positions.reshape(1, grid, grid, -1)}


def _timm_features(model, rows):
    patches, grids, own = naflex.split_rows(rows)
    token = np.arange(rows.shape[1])
    coords = np.stack([np.stack([token // c, token % c], -1) * own[b, :, None] for b, (_, c) in enumerate(grids)])
    with torch.no_grad():
        out = model({"patches": torch.from_numpy(patches), "patch_coord": torch.from_numpy(coords),
                     "patch_valid": torch.from_numpy(own)})
    return out.numpy()


@pytest.mark.parametrize("budget", sorted(GRIDS))
def test_features_are_transformers_and_timms_at_every_aspect_ratio(theirs, ours, budget):
    config, _, params, encode, _ = ours
    rows = _rows(GRIDS[budget], budget, seed=budget)
    got = np.asarray(encode(params, rows))
    np.testing.assert_allclose(got, _transformers_features(theirs, rows), atol=1e-5)
    v = config.vision
    tower = timm.create_model("naflexvit_base_patch16_siglip", pretrained=False, num_classes=0, embed_dim=v.width,
                              depth=v.layers, num_heads=v.heads, mlp_ratio=v.mlp_width / v.width,
                              patch_size=PATCH, pos_embed_grid_size=(GRID, GRID)).eval()
    weights = _timm_state_dict(convert.to_open_clip(params, config), GRID)
    tower.load_state_dict({k: torch.from_numpy(np.asarray(w)) for k, w in weights.items()})
    np.testing.assert_allclose(got, _timm_features(tower, rows), atol=1e-5)


def test_one_program_serves_every_aspect_ratio_at_a_budget(ours):
    """A batch shape traces once, whatever grids its images have; an image's features do not depend on the others
    in its batch."""
    _, _, params, encode, traces = ours
    for budget, grids in GRIDS.items():
        first = _rows(grids[:1], budget, seed=0)
        batches = [np.concatenate([first, _rows(others, budget, seed=i)])
                   for i, others in enumerate([grids[1:], OTHER_GRIDS[budget], grids[:0:-1]])]
        features = [np.asarray(encode(params, rows)) for rows in batches]
        for f in features[1:]:
            np.testing.assert_allclose(f[0], features[0][0], atol=1e-5)
        assert traces.count(batches[0].shape) == 1, traces


@pytest.mark.parametrize("grid_size", [GRID, 16])
def test_the_position_resize_is_torchs_antialiased_bilinear_interpolate(grid_size):
    table = np.random.default_rng(grid_size).standard_normal((grid_size, grid_size, 5)).astype(np.float32)
    sizes = [(3, 4), (1, 1), (2, 11), (9, 7), (grid_size, grid_size), (grid_size + 5, 2), (1, 40)]
    budget = max(r * c for r, c in sizes) + 3
    weights = np.asarray(jax.jit(resize_weights, static_argnums=(1, 2))(np.array(sizes), budget, grid_size))
    resized = weights @ table.reshape(-1, 5)
    for b, (r, c) in enumerate(sizes):
        expected = F.interpolate(torch.from_numpy(table).permute(2, 0, 1)[None], size=(r, c), mode="bilinear",
                                 align_corners=False, antialias=True)[0].permute(1, 2, 0).reshape(r * c, 5)
        np.testing.assert_allclose(resized[b, :r * c], expected.numpy(), atol=1e-6, err_msg=str((r, c)))
        assert not resized[b, r * c:].any()  # the padding tokens get no position


def test_conversion_both_ways_is_bit_for_bit_and_loads_in_transformers(theirs, ours):
    config = ours[0]
    assert hf_siglip2.config_from_hf(hf_siglip2.hf_config(config), name="tiny") == config
    assert (config.vision.naflex, config.vision.image_size, config.vision.patch_size) == (True, GRID * PATCH, PATCH)
    # ours -> transformers -> ours
    params = off_init(ours[2], seed=2)
    state_dict = convert.to_open_clip(params, config)
    hf = hf_siglip2.to_hf_state_dict(state_dict, config)
    back = hf_siglip2.from_hf_state_dict(hf, config, "model.safetensors")
    assert back.keys() == state_dict.keys()
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
    # which transformers' own Siglip2Model of hf_config loads, with our features
    reference = transformers.Siglip2Model(transformers.Siglip2Config(**hf_siglip2.hf_config(config))).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()})
    rows = _rows(GRIDS[20], 20, seed=7)
    np.testing.assert_allclose(ours[3](params, rows), _transformers_features(reference, rows), atol=1e-5)
    # and the whole model's logits, from NaFlex rows and tokens
    tokens = np.random.default_rng(8).integers(0, 64, (3, 8)).astype(np.int32)
    image, text, scale, bias = jax.jit(ours[1].apply)({"params": params}, rows, tokens)
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(tokens).long(), **_transformers_inputs(rows))
    np.testing.assert_allclose(scale * np.asarray(image) @ np.asarray(text).T + bias,
                               logits.logits_per_image.numpy(), atol=1e-4)
    # transformers' -> ours -> transformers': its own tensors
    again = hf_siglip2.to_hf_state_dict(convert.to_open_clip(ours[2], config), config)
    assert again.keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        np.testing.assert_array_equal(again[key], value.numpy(), err_msg=key)


def test_the_fixed_and_naflex_towers_share_their_parameters(ours):
    """The NaFlex tower's parameter tree is the fixed-resolution SigLIP tower's; on a full g x g grid it computes
    the fixed tower's features from the same weights (the position grid unresized)."""
    config, _, params, encode, _ = ours
    fixed = dataclasses.replace(config, vision=dataclasses.replace(config.vision, naflex=False))
    fixed_model = create_model(fixed)
    assert jax.tree.map(np.shape, param_shapes(fixed_model)) == jax.tree.map(np.shape, params)
    images = np.random.default_rng(3).standard_normal((4, GRID * PATCH, GRID * PATCH, 3)).astype(np.float32)
    patches = images.reshape(4, GRID, PATCH, GRID, PATCH, 3).transpose(0, 1, 3, 2, 4, 5).reshape(4, GRID * GRID, -1)
    rows = np.stack([naflex.pack_rows(p, (GRID, GRID), 40) for p in patches])
    expected = jax.jit(functools.partial(fixed_model.apply, normalize=False, method="encode_image"))(
        {"params": params}, images)
    np.testing.assert_allclose(encode(params, rows), expected, atol=1e-5)


def _vision_params(vision: VisionConfig) -> int:
    tower = VisionTransformer(vision, vision.width)
    rows = naflex.blank_rows(1, vision.patch_size, (2, 3), 8)
    return count_params(jax.eval_shape(lambda key: tower.init(key, rows), jax.random.key(0)))


@pytest.mark.parametrize("timm_name, width, layers, heads, mlp_width", [
    ("naflexvit_base_patch16_siglip", 768, 12, 12, 3072),
    ("naflexvit_so400m_patch16_siglip", 1152, 27, 16, 4304)])
def test_the_released_towers_have_transformers_and_timms_parameter_counts(timm_name, width, layers, heads, mlp_width):
    hf_vision = {"hidden_size": width, "intermediate_size": mlp_width, "num_hidden_layers": layers,
                 "num_attention_heads": heads, "num_patches": 256, "patch_size": 16}
    config = hf_siglip2.config_from_hf({"model_type": "siglip2", "vision_config": hf_vision,
                                        "text_config": {"projection_size": width}})
    with torch.device("meta"):
        reference = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**hf_vision))
        tower = timm.create_model(timm_name, pretrained=False, num_classes=0)
    expected = sum(p.numel() for p in reference.parameters())
    assert sum(p.numel() for p in tower.parameters()) == expected
    assert _vision_params(config.vision) == expected


def test_what_the_naflex_tower_does_not_take_is_refused_in_one_line(ours):
    config, model, params, _, _ = ours
    images = np.zeros((1, GRID * PATCH, GRID * PATCH, 3), np.float32)
    with pytest.raises(ValueError, match=r"NaFlex rows of shape \[B, N, 50\].*got \(1, 24, 24, 3\)"):
        model.apply({"params": params}, images, method="encode_image")
    rows = _rows(GRIDS[20], 20, seed=0)
    with pytest.raises(ValueError, match="patch dropout"):
        model.apply({"params": params}, rows, kept_patches=np.zeros((4, 5), np.int32), method="encode_image")
    with pytest.raises(InvalidInput, match="naflex with patch_dropout=0.5"):
        dataclasses.replace(config.vision, patch_dropout=0.5)
    saved = hf_siglip2.hf_config(config)
    oblong = {**saved, "vision_config": {**saved["vision_config"], "num_patches": 32}}
    with pytest.raises(InvalidInput) as info:
        hf_siglip2.config_from_hf(oblong, where="x/config.json")
    assert str(info.value) == ("x/config.json: vision_config.num_patches=32 is not a positive square: clip_jax's "
                               "NaFlex tower holds a square grid of learned positions")
    fixed = dataclasses.replace(config, vision=dataclasses.replace(config.vision, naflex=False))
    assert hf_siglip2.hf_unsupported(fixed).startswith("its image tower takes fixed-size images")
    assert hf_siglip.hf_unsupported(config).startswith("its image tower is NaFlex")
    with pytest.raises(InvalidInput, match="tiny has no transformers SiglipModel counterpart: its image tower is NaF"):
        hf_siglip.hf_config(config)
