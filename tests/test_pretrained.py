"""Pretrained starts: the positional-embedding resize against OpenCLIP's, locked towers against OpenCLIP's grouping
and through real AdamW steps, and clear errors for weights that do not fit."""

import json

import jax
import numpy as np
import open_clip
import optax
import pytest
import torch
from open_clip.model import resize_pos_embed
from open_clip_reference import TINY, open_clip_features, open_clip_model, random_inputs, state_dict_numpy
from safetensors.numpy import save_file

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import convert, weight_files
from clip_jax.interop.export import export_open_clip
from clip_jax.interop.opener import load_pretrained
from clip_jax.interop.pretrained import resize_positional_embedding
from clip_jax.models import create_model, get_model_config, init_params
from clip_jax.models.open_clip_json import open_clip_model_cfg
from clip_jax.optim.lock import LockSpec, trainable_mask
from clip_jax.run_config import default_config
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.config_checks import check_config
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step

TINY_48 = {**TINY, "vision_cfg": {**TINY["vision_cfg"], "image_size": 48}}


class _Grid:
    """What OpenCLIP's resize reads of a model: `model.visual.grid_size`."""

    def __init__(self, grid):
        self.visual = type("Visual", (), {"grid_size": (grid, grid)})()


@pytest.mark.parametrize("old, new", [(16, 24), (4, 6), (7, 4)])  # 224 -> 336 px at patch 14; up; down
def test_positional_embedding_resize_equals_open_clips(old, new):
    pos = np.random.default_rng(old).normal(size=(old * old + 1, 40)).astype(np.float32)
    state_dict = {"visual.positional_embedding": torch.from_numpy(pos.copy())}
    resize_pos_embed(state_dict, _Grid(new))
    expected = state_dict["visual.positional_embedding"].numpy()
    ours = resize_positional_embedding(pos, new)
    assert ours.shape == expected.shape == (new * new + 1, 40)
    np.testing.assert_allclose(ours, expected, atol=1e-5)
    np.testing.assert_array_equal(ours[0], pos[0])  # the class token's row is kept


@pytest.fixture(scope="module")
def torch_model():
    return open_clip_model(TINY, seed=5)


@pytest.mark.slow
def test_a_checkpoint_loaded_at_a_larger_image_size_runs_as_open_clip_resizes_it(torch_model, tmp_path):
    folder = tmp_path / "export"
    params = convert.from_open_clip(state_dict_numpy(torch_model), TINY)
    export_open_clip(params, get_model_config(TINY), str(folder), mean=(0.5,) * 3, std=(0.5,) * 3)
    # OpenCLIP's own load at another size: force_image_size, the grid resized as it loads the weights.
    reference, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}", force_image_size=48)
    reference.eval()
    ours = load_pretrained(str(folder), TINY_48)
    images, tokens = random_inputs(48, 20, 600, batch=2, seed=1)
    image_f, text_f, _ = create_model(TINY_48).apply({"params": ours}, images, tokens)
    expected_image, expected_text, _ = open_clip_features(reference, images, tokens)
    np.testing.assert_allclose(image_f, expected_image, atol=1e-5)
    np.testing.assert_allclose(text_f, expected_text, atol=1e-5)


def _open_clip_requires_grad(lock: LockSpec) -> dict[str, bool]:
    model = open_clip_model(TINY)
    if lock.image:
        model.lock_image_tower(unlocked_groups=lock.image_unlocked_groups)
    if lock.text:
        model.lock_text_tower(unlocked_layers=lock.text_unlocked_layers)
    return {name: p.requires_grad for name, p in model.named_parameters()}


def _our_trainable_keys(lock: LockSpec) -> dict[str, bool]:
    config = get_model_config(TINY)
    shapes = jax.eval_shape(lambda: init_params(create_model(config), jax.random.key(0)))
    mask = trainable_mask(shapes, lock, config.vision.layers, config.text.layers)

    def as_array(trainable, shape):  # 1 where a row trains: per layer in stacks
        rows = np.asarray(trainable, np.float32)
        return np.broadcast_to(rows.reshape(rows.shape + (1,) * (len(shape.shape) - rows.ndim)), shape.shape)

    state_dict = convert.to_open_clip(jax.tree.map(as_array, mask, shapes), config)
    values = {key: set(np.unique(value)) for key, value in state_dict.items()}
    assert all(len(v) == 1 for v in values.values())  # every OpenCLIP tensor trains or not as a whole
    return {key: bool(v.pop()) for key, v in values.items()}


@pytest.mark.parametrize("lock", [
    LockSpec(image=True), LockSpec(image=True, image_unlocked_groups=1), LockSpec(image=True, image_unlocked_groups=2),
    LockSpec(image=True, image_unlocked_groups=4), LockSpec(image=True, image_unlocked_groups=9),
    LockSpec(text=True), LockSpec(text=True, text_unlocked_layers=2), LockSpec(text=True, text_unlocked_layers=3),
    LockSpec(image=True, image_unlocked_groups=3, text=True, text_unlocked_layers=1),
], ids=repr)
def test_locked_groups_are_open_clips(lock):
    assert _our_trainable_keys(lock) == _open_clip_requires_grad(lock)


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(create_model(TINY), jax.random.key(0))


def _run_steps(lock: LockSpec, params, steps=2):
    adamw = OptimizerSpec(lr=1e-2, weight_decay=0.2)
    step = build_step(StepSpec.for_model(TINY, optimizer=adamw, lock=lock), create_mesh())
    state = step.state_from_params(jax.tree.map(np.array, params))
    images, tokens = random_inputs(32, 20, 600, batch=16, seed=2)
    for _ in range(steps):
        state, _ = step(state, {"images": images, "tokens": tokens})
    return jax.device_get(state)


@pytest.mark.slow
def test_a_locked_image_tower_is_bit_identical_after_adamw_steps_and_has_no_moments(tiny_params):
    state = _run_steps(LockSpec(image=True), tiny_params)
    jax.tree.map(np.testing.assert_array_equal, state.params["visual"], jax.device_get(tiny_params["visual"]))
    assert not np.array_equal(state.params["text_projection"], tiny_params["text_projection"])
    adam = _adam_state(state.opt_state)
    assert jax.tree.leaves(adam.mu["visual"]) == [] and jax.tree.leaves(adam.nu["visual"]) == []
    trained = sum(x.size for x in jax.tree.leaves(tiny_params)) - sum(
        x.size for x in jax.tree.leaves(tiny_params["visual"]))
    assert sum(x.size for x in jax.tree.leaves(adam.mu)) == trained  # the text tower and the head only


def _adam_state(opt_state) -> optax.ScaleByAdamState:
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    return adam


@pytest.mark.slow
def test_a_locked_image_tower_is_not_back_propagated_through(tiny_params):
    def step_flops(lock):
        step = build_step(StepSpec.for_model(TINY, lock=lock), create_mesh(jax.devices()[:1]))
        return step.compile(per_device_batch=2).cost_analysis()["flops"]

    assert step_flops(LockSpec(image=True)) < 0.8 * step_flops(LockSpec())


@pytest.mark.slow
def test_spike_telemetry_of_a_locked_image_tower_reads_no_moments_for_it(tiny_params):
    spec = StepSpec.for_model(TINY, optimizer=OptimizerSpec(lr=1e-2), lock=LockSpec(image=True), telemetry_every=1)
    step = build_step(spec, create_mesh())
    images, tokens = random_inputs(32, 20, 600, batch=16, seed=2)
    _, metrics = step(step.state_from_params(jax.tree.map(np.array, tiny_params)),
                      {"images": images, "tokens": tokens})
    telemetry = jax.device_get(metrics["telemetry"])
    assert "rms_ratio" not in telemetry["visual"]  # a locked tower has no second moment to compare against
    assert not np.any(telemetry["visual"]["grad_rms"]) and not np.any(telemetry["visual"]["update_rms"])
    assert np.all(telemetry["text"]["rms_ratio"] > 0) and np.all(telemetry["text"]["grad_rms"] > 0)


@pytest.mark.slow
def test_partly_unlocked_stacks_move_only_their_unlocked_layers(tiny_params):
    # 3 image layers; 2 unlocked groups: the last block with ln_post, and proj
    state = _run_steps(LockSpec(image=True, image_unlocked_groups=2, text=True, text_unlocked_layers=1), tiny_params)
    before, after = jax.device_get(tiny_params), state.params
    blocks = after["visual"]["transformer"]["resblocks"]["mlp"]["c_fc"]["kernel"]
    old_blocks = before["visual"]["transformer"]["resblocks"]["mlp"]["c_fc"]["kernel"]
    np.testing.assert_array_equal(blocks[:2], old_blocks[:2])
    assert not np.array_equal(blocks[2], old_blocks[2])
    assert not np.array_equal(after["visual"]["ln_post"]["scale"], before["visual"]["ln_post"]["scale"])
    np.testing.assert_array_equal(after["visual"]["conv1"]["kernel"], before["visual"]["conv1"]["kernel"])
    # text: only text_projection trains (1 unlocked layer group); the text blocks all stay
    jax.tree.map(np.testing.assert_array_equal, after["transformer"], before["transformer"])
    assert not np.array_equal(after["text_projection"], before["text_projection"])
    # the locked rows' moments stay zero
    mu = _adam_state(state.opt_state).mu
    mu_blocks = mu["visual"]["transformer"]["resblocks"]["mlp"]["c_fc"]["kernel"]
    assert not np.any(mu_blocks[:2]) and np.any(mu_blocks[2])


def test_the_model_config_written_for_open_clip_builds_the_same_model(torch_model):
    config = get_model_config(TINY)
    rebuilt = open_clip.CLIP(**open_clip_model_cfg(config))
    assert {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()} == convert.open_clip_shapes(config)


@pytest.mark.slow
def test_a_sigmoid_loss_model_exports_its_logit_bias(tmp_path):
    config = get_model_config({**TINY, "init_logit_scale": 2.3, "init_logit_bias": -10.0})
    params = jax.device_get(init_params(create_model(config), jax.random.key(1)))
    export_open_clip(params, config, str(tmp_path), mean=(0.5,) * 3, std=(0.5,) * 3)
    reference, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path}")
    assert reference.logit_bias.item() == float(params["logit_bias"]) == -10.0
    assert reference.logit_scale.item() == pytest.approx(2.3)


def test_a_checkpoint_of_another_architecture_is_refused_naming_file_keys_and_shapes(torch_model, tmp_path):
    path = str(tmp_path / "other.safetensors")
    save_file(state_dict_numpy(torch_model), path)
    smaller = {**TINY, "text_cfg": {**TINY["text_cfg"], "width": 32, "heads": 2}}
    with pytest.raises(InvalidInput) as info:
        load_pretrained(path, smaller)
    message = str(info.value)
    assert path in message
    assert "token_embedding.weight (600, 64) (expected (600, 32))" in message


def test_an_export_folder_without_its_config_is_refused_naming_the_file(torch_model, tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    save_file(state_dict_numpy(torch_model), str(folder / "open_clip_model.safetensors"))
    with pytest.raises(MissingInput, match=r"export/open_clip_config.json is missing"):
        load_pretrained(str(folder), TINY)
    (folder / "open_clip_config.json").write_text("{not json")
    with pytest.raises(InvalidInput, match=r"open_clip_config.json is not valid JSON"):
        load_pretrained(str(folder), TINY)
    (folder / "open_clip_config.json").write_text(json.dumps({"preprocess_cfg": {}}))
    with pytest.raises(InvalidInput, match=r"open_clip_config.json has no 'model_cfg'"):
        load_pretrained(str(folder), TINY)


def test_a_folder_that_is_neither_a_run_nor_an_export_is_named(tmp_path):
    with pytest.raises(MissingInput, match="neither an exported model folder"):
        load_pretrained(str(tmp_path), TINY)


@pytest.mark.parametrize("overrides, message", [
    ({"pretrained": "/no/such/weights.pt"}, "pretrained='/no/such/weights.pt' does not exist"),
    ({"force_image_size": -1}, "force_image_size=-1 must not be negative"),
    ({"lock_image_unlocked_groups": 2}, "lock_image_unlocked_groups=2 has no effect without lock_image=True"),
    ({"lock_text": True, "lock_text_unlocked_layers": -1}, "lock_text_unlocked_layers=-1 must not be negative"),
])
def test_bad_fine_tuning_settings_are_named(overrides, message):
    config = default_config()
    config.train_data = "/data/{0..1}.tar"
    config.update(overrides)
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(config, num_devices=8)


def test_the_fine_tuning_config_without_its_weights_names_the_missing_file():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "l14_336_finetune.py")
    spec = importlib.util.spec_from_file_location("l14_336_finetune", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    assert config.force_image_size == 336 and config.model == "ViT-L-14"
    with pytest.raises(InvalidInput, match=r"pretrained='/weights/CLIP-ViT-L-14-laion2B-s32B-b82K/.*' does not exist"):
        check_config(config, num_devices=8)


def _torch_resize(pos: np.ndarray, new: int, prefix_tokens: int, mode: str) -> np.ndarray:
    """The reference: torch's antialiased F.interpolate of the grid (NCHW), as OpenCLIP and timm resize on load."""
    old = int(round((pos.shape[0] - prefix_tokens) ** 0.5))
    grid = torch.from_numpy(pos[prefix_tokens:].copy()).reshape(1, old, old, -1).permute(0, 3, 1, 2)
    resized = torch.nn.functional.interpolate(grid, size=(new, new), mode=mode, antialias=True, align_corners=False)
    return np.concatenate([pos[:prefix_tokens], resized.permute(0, 2, 3, 1).reshape(new * new, -1).numpy()])


@pytest.mark.parametrize("prefix_tokens", [1, 0])  # a class token (OpenCLIP's ViT), none (timm's SigLIP tower)
@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
@pytest.mark.parametrize("old, new", [(4, 6), (7, 4)])
def test_positional_embedding_resize_equals_torchs_in_either_layout(prefix_tokens, interpolation, old, new):
    pos = np.random.default_rng(old).normal(size=(old * old + prefix_tokens, 24)).astype(np.float32)
    ours = resize_positional_embedding(pos, new, prefix_tokens=prefix_tokens, interpolation=interpolation)
    assert ours.shape == (new * new + prefix_tokens, 24)
    np.testing.assert_allclose(ours, _torch_resize(pos, new, prefix_tokens, interpolation), atol=1e-5)


SIGLIP_32 = {"embed_dim": 32, "init_logit_bias": -10, "custom_text": True,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16,
                            "pool_type": "map", "no_ln_pre": True},
             "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1,
                          "no_causal_mask": True, "proj_bias": True, "pool_type": "last"}}
SIGLIP_48 = {**SIGLIP_32, "vision_cfg": {**SIGLIP_32["vision_cfg"], "image_size": 48}}


def test_a_siglip_checkpoint_at_another_image_size_has_its_grid_resized_as_timm_does(tmp_path):
    """A SigLIP image tower has no class token: its 4 x 4 grid (OpenCLIP's `visual.trunk.pos_embed`, and clip_jax's
    params) goes to 6 x 6 for a model at 48 px, as timm resizes it, whichever way the weights come."""
    shapes = jax.eval_shape(lambda: init_params(create_model(get_model_config(SIGLIP_32)), jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), shapes)
    pos = params["visual"]["positional_embedding"]
    assert pos.shape == (16, 32)
    expected = _torch_resize(pos, 6, 0, "bicubic")
    state_dict = convert.to_open_clip(params, get_model_config(SIGLIP_32))
    assert state_dict["visual.trunk.pos_embed"].shape == (1, 16, 32)
    save_file({k: np.ascontiguousarray(v) for k, v in state_dict.items()}, str(tmp_path / "open_clip.safetensors"))
    weight_files.save_params(str(tmp_path / "params.npz"), params)
    for path in ("open_clip.safetensors", "params.npz"):
        resized = load_pretrained(str(tmp_path / path), SIGLIP_48)
        np.testing.assert_allclose(resized["visual"]["positional_embedding"], expected, atol=1e-5, err_msg=path)
        np.testing.assert_array_equal(resized["visual"]["attn_pool"]["probe"], params["visual"]["attn_pool"]["probe"])
