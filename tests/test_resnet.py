"""The ResNet image towers (OpenCLIP's ModifiedResNet): configs, parameter counts, conversion and parity with real
OpenCLIP in eval mode (running statistics) and train mode (batch statistics), and the refusals of what is not built
for them."""

import json
import os

import jax
import numpy as np
import open_clip
import pytest
import torch

from clip_jax.errors import InvalidInput
from clip_jax.interop import convert, weight_files
from clip_jax.models import count_params, create_model, get_model_config, init_variables, list_models, param_shapes
from clip_jax.models.open_clip_json import config_from_open_clip, open_clip_model_cfg

# Every stage with a different block count and the attention pool several heads on a 2x2 grid (64 px / 32).
TINY_RN = {
    "embed_dim": 24,
    "vision_cfg": {"image_size": 64, "layers": [1, 2, 1, 2], "width": 16, "head_width": 128},
    "text_cfg": {"context_length": 8, "vocab_size": 50, "width": 32, "heads": 2, "layers": 1},
}
RN_NAMES = ["RN50", "RN101", "RN50x4", "RN50x16", "RN50x64"]
OPEN_CLIP_CONFIGS = os.path.join(os.path.dirname(open_clip.__file__), "model_configs")


def _perturbed_open_clip(config, seed: int) -> torch.nn.Module:
    """An OpenCLIP model whose every BatchNorm statistic, norm weight and bias is moved off its init (running
    variances stay positive), in eval mode."""
    torch.manual_seed(seed)
    model = open_clip.CLIP(**config) if isinstance(config, dict) else open_clip.create_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.add_(0.2 * torch.randn_like(buffer))
            elif name.endswith("running_var"):
                buffer.mul_(torch.empty_like(buffer).uniform_(0.5, 2.0))
            elif name.endswith("num_batches_tracked"):
                buffer.fill_(int(torch.randint(1, 1000, ())))
    return model.eval()


def _state_dict(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _images(size: int, batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, size, size, 3)).astype(np.float32)


def _open_clip_image_features(model: torch.nn.Module, images: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()).numpy()


@pytest.fixture(scope="module")
def tiny_torch():
    return _perturbed_open_clip(TINY_RN, seed=1)


# ---------------------------------------------------------------------------------------------------------------
# Configs


@pytest.mark.parametrize("name", RN_NAMES)
def test_open_clips_json_gives_the_registered_model(name):
    for suffix in ("", "-quickgelu"):
        with open(os.path.join(OPEN_CLIP_CONFIGS, f"{name}{suffix}.json")) as f:
            from_json = config_from_open_clip(json.load(f), name=f"{name}{suffix}")
        assert from_json == get_model_config(f"{name}{suffix}")
        assert from_json.quick_gelu == bool(suffix)
    config = get_model_config(name)
    assert config_from_open_clip(open_clip_model_cfg(config), name=name) == config
    assert name in list_models()


def test_rn50x4_pools_a_9x9_grid():
    vision = get_model_config("RN50x4").vision
    assert (vision.image_size, vision.grid_size, vision.heads) == (288, 9, 40)


@pytest.mark.parametrize("change, named", [
    ({"layers": [3, 4, 6]}, "vision_cfg.layers=[3, 4, 6]"),
    ({"layers": [3, 4, 6, 3, 2]}, "vision_cfg.layers=[3, 4, 6, 3, 2]"),
    ({"layers": [3, 0, 6, 3]}, "vision_cfg.layers=[3, 0, 6, 3]"),
    ({"mlp_ratio": 2.0}, "unknown key(s) ['mlp_ratio']"),
    ({"image_size": 100}, "vision_cfg.image_size=100"),
    ({"image_size": 16}, "vision_cfg.image_size=16"),
    ({"width": 15}, "vision_cfg.width=15"),
    ({"head_width": 100}, "vision_cfg.head_width=100"),
    ({"patch_size": 16}, "vision_cfg.patch_size=16"),
    ({"image_size": "224"}, "vision_cfg.image_size='224'"),
])
def test_a_bad_resnet_config_is_refused_naming_the_key(change, named):
    config = {**TINY_RN, "vision_cfg": {**TINY_RN["vision_cfg"], **change}}
    with pytest.raises(InvalidInput) as info:
        config_from_open_clip(config, name="bad")
    assert named in str(info.value)
    assert "'bad'" in str(info.value)


def test_a_list_of_layers_in_the_text_tower_is_refused():
    config = {**TINY_RN, "text_cfg": {**TINY_RN["text_cfg"], "layers": [1, 1, 1, 1]}}
    with pytest.raises(InvalidInput, match="text_cfg.layers"):
        config_from_open_clip(config)


# ---------------------------------------------------------------------------------------------------------------
# Parameters: counts and OpenCLIP's init


def _open_clip_count(name: str) -> int:
    with torch.device("meta"):  # shapes only: RN50x64 is never allocated
        model = open_clip.create_model(name, device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", RN_NAMES)
def test_parameter_counts_equal_open_clips(name):
    ours = count_params(param_shapes(create_model(name)))  # abstract: jax.eval_shape
    assert ours == _open_clip_count(name)
    assert count_params(param_shapes(create_model(f"{name}-quickgelu"))) == ours


@pytest.mark.slow
def test_init_follows_open_clip():
    variables = init_variables(create_model(TINY_RN), jax.random.key(0))
    visual, stats = variables["params"]["visual"], variables["batch_stats"]["visual"]
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        for block in visual[stage].values():  # the last BatchNorm of each block starts at zero
            assert not np.any(block["bn3"]["scale"])
            assert np.all(block["bn1"]["scale"] == 1)
    pool_width = 16 * 32
    for proj in ("q_proj", "k_proj", "v_proj", "c_proj"):
        std = np.std(np.asarray(visual["attnpool"][proj]["kernel"]))
        assert abs(std - pool_width**-0.5) < 0.1 * pool_width**-0.5
    np.testing.assert_array_equal(stats["bn1"]["mean"], 0)
    np.testing.assert_array_equal(stats["bn1"]["var"], 1)
    assert int(stats["bn1"]["num_batches_tracked"]) == 0


# ---------------------------------------------------------------------------------------------------------------
# Conversion


def test_round_trip_is_bit_for_bit(tiny_torch):
    state_dict = _state_dict(tiny_torch)
    variables = convert.variables_from_open_clip(state_dict, TINY_RN)
    assert set(variables) == {"params", "batch_stats"}
    back = convert.variables_to_open_clip(variables, TINY_RN)
    assert set(back) == set(state_dict)
    for key, value in state_dict.items():
        assert back[key].dtype == value.dtype, key
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    assert back["visual.layer2.1.bn2.num_batches_tracked"].dtype == np.int64


def test_params_only_conversion_refuses_a_resnet_model(tiny_torch):
    with pytest.raises(InvalidInput, match="variables_from_open_clip"):
        convert.from_open_clip(_state_dict(tiny_torch), TINY_RN)
    with pytest.raises(InvalidInput, match="variables_to_open_clip"):
        convert.to_open_clip({}, TINY_RN)


@pytest.mark.slow
def test_the_command_line_converts_both_ways(tiny_torch, tmp_path):
    config_file = tmp_path / "tiny_rn.json"
    config_file.write_text(json.dumps(TINY_RN))
    source = tmp_path / "open_clip.pt"
    torch.save(tiny_torch.state_dict(), source)
    assert weight_files.main([str(source), str(tmp_path / "ours.npz"), "--model", str(config_file)]) == 0
    assert weight_files.main([str(tmp_path / "ours.npz"), str(tmp_path / "back.pt"), "--model", str(config_file)]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for key, value in tiny_torch.state_dict().items():
        assert torch.equal(back[key], value), key
    variables = weight_files.load_variables(str(tmp_path / "ours.npz"), str(config_file))
    assert int(variables["batch_stats"]["visual"]["bn1"]["num_batches_tracked"]) == \
        int(tiny_torch.visual.bn1.num_batches_tracked)


def test_applying_params_without_batch_stats_says_what_is_missing(tiny_torch):
    variables = convert.variables_from_open_clip(_state_dict(tiny_torch), TINY_RN)
    with pytest.raises(InvalidInput, match="batch_stats"):
        create_model(TINY_RN).apply({"params": variables["params"]}, _images(64, 1), method="encode_image")


# ---------------------------------------------------------------------------------------------------------------
# Parity with OpenCLIP


@pytest.mark.slow
def test_eval_features_equal_open_clips_for_a_tiny_model(tiny_torch):
    variables = convert.variables_from_open_clip(_state_dict(tiny_torch), TINY_RN)
    images = _images(64, 3, seed=2)
    tokens = np.zeros((3, 8), np.int32)
    tokens[:, 0], tokens[:, 1:4], tokens[:, 4] = 48, [[5, 6, 7], [8, 9, 10], [11, 12, 13]], 49
    image_f, text_f, scale = jax.jit(create_model(TINY_RN).apply)(variables, images, tokens)  # op by op: seconds
    with torch.no_grad():
        expected = tiny_torch(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
                              torch.from_numpy(tokens).long())
    np.testing.assert_allclose(image_f, expected[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(text_f, expected[1].numpy(), atol=1e-5)
    np.testing.assert_allclose(scale, float(expected[2]), rtol=1e-6)


@pytest.mark.slow
def test_eval_features_equal_open_clips_for_rn50():
    """RN50's image tower as OpenCLIP ships it (its RN50.json: 224 px, [3, 4, 6, 3] blocks, width 64, a 7x7 grid
    pooled by 32 heads to 1024); the text tower, which the image features do not read, is TINY_RN's (RN50's own
    63M-param one took seconds to build, copy and convert)."""
    with open(os.path.join(OPEN_CLIP_CONFIGS, "RN50.json")) as f:
        config = {**json.load(f), "text_cfg": TINY_RN["text_cfg"]}
    assert config_from_open_clip(config).vision == get_model_config("RN50").vision
    model = _perturbed_open_clip(config, seed=2)
    variables = convert.variables_from_open_clip(_state_dict(model), config)
    images = _images(224, 2, seed=3)
    features = jax.jit(lambda v, x: create_model(config).apply(v, x, normalize=False, method="encode_image"))(
        variables, images)
    expected = _open_clip_image_features(model, images)
    assert np.abs(expected).max() > 0.1  # the comparison is not between two near-zero vectors
    np.testing.assert_allclose(features, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_train_mode_batch_statistics_equal_open_clips(tiny_torch):
    """Batch statistics normalise, and the running ones move as torch moves them (unbiased variance, momentum
    0.1, the counter up by one)."""
    variables = convert.variables_from_open_clip(_state_dict(tiny_torch), TINY_RN)
    images = _images(64, 4, seed=5)
    apply = jax.jit(lambda v, x: create_model(TINY_RN).apply(v, x, normalize=False, train=True,
                                                             method="encode_image", mutable=["batch_stats"]))
    features, updated = apply(variables, images)
    torch_model = _perturbed_open_clip(TINY_RN, seed=1).train()
    with torch.no_grad():
        expected = torch_model.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()).numpy()
    np.testing.assert_allclose(features, expected, atol=1e-5, rtol=1e-5)
    after = convert.variables_to_open_clip({"params": variables["params"], **updated}, TINY_RN)
    statistics = [key for key in after if "running_" in key or "num_batches_tracked" in key]
    assert len(statistics) == 3 * 25  # 3 stem BatchNorms, 3 per block (6 blocks), 1 per downsample (4)
    for key in statistics:
        np.testing.assert_allclose(after[key], torch_model.state_dict()[key].numpy(), atol=1e-5, rtol=1e-5,
                                   err_msg=key)
        assert not np.array_equal(after[key], tiny_torch.state_dict()[key].numpy()), key  # it moved


# ---------------------------------------------------------------------------------------------------------------
# What is not built for ResNet towers is refused by name


def test_loading_params_alone_refuses_a_resnet_model(tmp_path):
    from clip_jax.interop import opener

    with pytest.raises(InvalidInput, match="load_pretrained_variables"):  # its BatchNorm statistics would be lost
        opener.load_pretrained(str(tmp_path), "RN50")
