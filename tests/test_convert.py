"""Weight conversion: checkpoint files, the command line, and clear errors for checkpoints that do not fit."""

import jax
import numpy as np
import pytest
import torch
from open_clip_reference import TINY, open_clip_features, open_clip_model, random_inputs, state_dict_numpy
from safetensors.numpy import load_file

from clip_jax.interop import convert, weight_files
from clip_jax.models import create_model

SMALLER = {**TINY, "vision_cfg": {**TINY["vision_cfg"], "patch_size": 16}, "text_cfg": {**TINY["text_cfg"],
                                                                                        "layers": 1}}


@pytest.fixture(scope="module")
def torch_model():
    return open_clip_model(TINY, seed=3)


@pytest.fixture(scope="module")
def state_dict(torch_model):
    return state_dict_numpy(torch_model)


def _features_match(params, torch_model):
    images, tokens = random_inputs(32, 20, 600, batch=2, seed=3)
    image_f, text_f, _ = create_model(TINY).apply({"params": params}, images, tokens)
    expected_image, expected_text, _ = open_clip_features(torch_model, images, tokens)
    np.testing.assert_allclose(image_f, expected_image, atol=1e-5)
    np.testing.assert_allclose(text_f, expected_text, atol=1e-5)


def test_a_ddp_module_prefix_is_accepted(state_dict):
    prefixed = {f"module.{k}": v for k, v in state_dict.items()}
    a, b = convert.from_open_clip(prefixed, TINY), convert.from_open_clip(state_dict, TINY)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_checkpoint_of_another_model_names_the_mismatched_keys(state_dict):
    with pytest.raises(ValueError) as info:
        convert.from_open_clip(state_dict, SMALLER)
    message = str(info.value)
    assert "visual.conv1.weight (96, 3, 8, 8) (expected (96, 3, 16, 16))" in message
    assert "visual.positional_embedding" in message
    assert "unexpected: transformer.resblocks.1." in message
    assert "Check --model" in message


def test_missing_and_extra_keys_are_named(state_dict):
    broken = dict(state_dict)
    del broken["visual.ln_post.bias"]
    broken["visual.head.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError) as info:
        convert.from_open_clip(broken, TINY)
    assert "1 missing: visual.ln_post.bias" in str(info.value)
    assert "1 unexpected: visual.head.weight" in str(info.value)


def test_params_of_another_model_are_refused_by_to_open_clip(state_dict):
    params = convert.from_open_clip(state_dict, TINY)
    with pytest.raises(ValueError) as info:
        convert.to_open_clip(params, SMALLER)
    assert "transformer/resblocks/attn/in_proj/kernel (2, 64, 192) (expected (1, 64, 192))" in str(info.value)


@pytest.mark.slow
def test_cli_converts_an_open_clip_training_checkpoint_and_back(tmp_path, torch_model, state_dict, capsys):
    src = tmp_path / "epoch_3.pt"  # OpenCLIP's training checkpoint layout, saved from DDP
    ddp_state_dict = {f"module.{k}": v for k, v in torch_model.state_dict().items()}
    torch.save({"epoch": 3, "name": "run", "state_dict": ddp_state_dict, "optimizer": {}}, src)
    dst = tmp_path / "params.npz"
    assert weight_files.main([str(src), str(dst), "--model", "ViT-B-32"]) == 2
    assert "does not match model 'ViT-B-32'" in capsys.readouterr().err

    tiny_json = tmp_path / "tiny.json"
    tiny_json.write_text(__import__("json").dumps(TINY))
    assert weight_files.main([str(src), str(dst), "--model", str(tiny_json)]) == 0
    params = weight_files.load_params(str(dst), TINY)
    _features_match(params, torch_model)

    back = tmp_path / "back.safetensors"
    assert weight_files.main([str(dst), str(back), "--model", str(tiny_json)]) == 0
    restored = load_file(str(back))
    assert sorted(restored) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)


def test_safetensors_checkpoints_convert_on_load(tmp_path, torch_model, state_dict):
    path = tmp_path / "open_clip.safetensors"
    weight_files.write_open_clip(str(path), state_dict)
    _features_match(weight_files.load_params(str(path), TINY), torch_model)
    with pytest.raises(ValueError, match="pass the model name"):
        weight_files.load_params(str(path))


def test_unreadable_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt does not exist"):
        weight_files.read_arrays(str(tmp_path / "missing.pt"))
    odd = tmp_path / "weights.ckpt"
    odd.write_bytes(b"")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        weight_files.read_arrays(str(odd))
