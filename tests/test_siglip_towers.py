"""SigLIP's towers: OpenCLIP's named SigLIP / SigLIP 2 models with OpenCLIP's and transformers' parameters, the
attention-pooled image tower equal to timm's `vit_*_siglip_*` at sizes the tests choose, OpenCLIP's state_dict
both ways, their configs in and out, and the train step's options on a SigLIP-shaped model."""

import copy

import jax
import numpy as np
import open_clip
import pytest
import timm
import torch
from tiny_model import SGD, TINY_MODEL, assert_bf16_features_close, assert_same_update
from xla_flags import FAST_CODEGEN, run_once

from clip_jax.errors import InvalidInput
from clip_jax.interop.convert import from_open_clip, open_clip_shapes, to_open_clip
from clip_jax.models import count_params, create_model, get_model_config, init_params, param_shapes
from clip_jax.models.flops import image_forward_flops, text_forward_flops
from clip_jax.models.open_clip_json import config_from_open_clip, open_clip_model_cfg
from clip_jax.optim.layer_decay import lr_multipliers
from clip_jax.optim.lock import LockSpec, trainable_mask
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import StepSpec, build_step

# The step tests' tiny model with SigLIP's towers: an attention-pooled image tower as wide as embed_dim (it has no
# projection), a bidirectional text tower pooled at its last token with a biased projection, a logit_bias.
SIGLIP_TINY = copy.deepcopy(TINY_MODEL)
SIGLIP_TINY.update(embed_dim=64, init_logit_bias=-10.0, custom_text=True)
SIGLIP_TINY["vision_cfg"].update(pool_type="map", no_ln_pre=True, norm_kwargs={"eps": 1e-6})
SIGLIP_TINY["text_cfg"].update(no_causal_mask=True, pool_type="last", proj_bias=True, norm_kwargs={"eps": 1e-6},
                               act_kwargs={"approximate": "tanh"})


def _open_clip_flops(model: torch.nn.Module, config: dict) -> tuple[int, int]:
    """(image, text) FLOPs of one sample through OpenCLIP's towers as torch's FlopCounterMode counts them (on the
    meta device: nothing is computed)."""
    from torch.utils.flop_counter import FlopCounterMode

    size, context = config["vision_cfg"]["image_size"], config["text_cfg"]["context_length"]
    counts = []
    for encode, inputs in ((model.encode_image, torch.zeros(1, 3, size, size, device="meta")),
                           (model.encode_text, torch.zeros(1, context, dtype=torch.long, device="meta"))):
        with FlopCounterMode(display=False) as counter:
            encode(inputs)
        counts.append(counter.get_total_flops())
    return counts[0], counts[1]


@pytest.mark.parametrize("name", ["ViT-B-16-SigLIP2", "ViT-SO400M-14-SigLIP"])
def test_named_models_have_open_clips_parameters_state_dict_and_flops(name):
    config = open_clip.get_model_config(name)
    with torch.device("meta"):
        reference = open_clip.model.CustomTextCLIP(**{k: v for k, v in config.items() if k != "custom_text"}).eval()
    assert count_params(param_shapes(create_model(name))) == sum(p.numel() for p in reference.parameters())
    assert open_clip_shapes(name) == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert config_from_open_clip(open_clip_model_cfg(get_model_config(name))) == config_from_open_clip(config)
    ours = get_model_config(name)
    assert (image_forward_flops(ours), text_forward_flops(ours)) == _open_clip_flops(reference, config)


def test_siglip_base_has_the_parameters_of_transformers_siglip_model():
    from transformers import SiglipConfig, SiglipModel

    with torch.device("meta"):  # SiglipConfig's defaults are google/siglip-base-patch16-224's sizes
        reference = SiglipModel(SiglipConfig())
    assert count_params(param_shapes(create_model("ViT-B-16-SigLIP"))) == \
        sum(p.numel() for p in reference.parameters())


def _moved_off_init(state_dict: dict, seed: int) -> dict:
    """Every vector (norms, biases, the probe) moved off its init, so a swapped or dropped one shows."""
    rng = np.random.default_rng(seed)
    return {k: v + rng.normal(0, 0.2, v.shape).astype(np.float32) if v.ndim <= 1 or "latent" in k else v
            for k, v in state_dict.items()}


# (timm model whose architecture is taken, its sizes replaced): several heads, MLP ratios and both GELUs
TIMM_TOWERS = {
    "base-exact-gelu": ("vit_base_patch16_siglip_224", dict(img_size=32, patch_size=8, embed_dim=64, depth=2,
                                                            num_heads=4, mlp_ratio=3.5)),
    "so400m-tanh-gelu": ("vit_so400m_patch16_siglip_384", dict(img_size=48, patch_size=16, embed_dim=48, depth=3,
                                                               num_heads=2, mlp_ratio=2.25)),
}


def _config_of(timm_name: str, sizes: dict) -> dict:
    tanh = timm_name.startswith("vit_so400m_patch16")
    vision = {"image_size": sizes["img_size"], "patch_size": sizes["patch_size"], "width": sizes["embed_dim"],
              "layers": sizes["depth"], "head_width": sizes["embed_dim"] // sizes["num_heads"],
              "mlp_ratio": sizes["mlp_ratio"], "pool_type": "map", "no_ln_pre": True, "norm_kwargs": {"eps": 1e-6},
              **({"act_kwargs": {"approximate": "tanh"}} if tanh else {})}
    return {**SIGLIP_TINY, "embed_dim": sizes["embed_dim"], "vision_cfg": vision}


@pytest.mark.parametrize("case", list(TIMM_TOWERS))
def test_image_tower_gives_timms_siglip_features_and_converts_bit_for_bit(case):
    timm_name, sizes = TIMM_TOWERS[case]
    torch.manual_seed(0)
    tower = timm.create_model(timm_name, pretrained=False, num_classes=0, **sizes).eval()
    trunk = _moved_off_init({k: v.numpy() for k, v in tower.state_dict().items()}, seed=1)
    tower.load_state_dict({k: torch.from_numpy(v) for k, v in trunk.items()})
    cfg = _config_of(timm_name, sizes)
    model = create_model(cfg)
    weights = to_open_clip(jax.tree.map(np.asarray, init_params(model, jax.random.key(0))), cfg)
    weights = {k: v for k, v in weights.items() if not k.startswith("visual.")} | \
        {f"visual.trunk.{k}": v for k, v in trunk.items()}
    params = from_open_clip(weights, cfg)

    images = np.random.default_rng(2).normal(size=(3, sizes["img_size"], sizes["img_size"], 3)).astype(np.float32)
    with torch.no_grad():
        expected = tower(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
    got = jax.jit(lambda p, x: model.apply({"params": p}, x, normalize=False, method="encode_image"))(params, images)
    assert count_params(params["visual"]) == sum(p.numel() for p in tower.parameters())
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)
    back = to_open_clip(params, cfg)
    assert sorted(back) == sorted(weights)
    for key, value in weights.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_the_attention_pool_and_the_patch_bias_change_the_features():
    """The test above could not pass with the probe's MLP or the patch bias ignored (moved by a random vector: a
    constant one is a shift every LayerNorm takes out)."""
    cfg = _config_of(*TIMM_TOWERS["base-exact-gelu"])
    model = create_model(cfg)
    params = jax.tree.map(np.asarray, init_params(model, jax.random.key(0)))
    images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    encode = jax.jit(lambda p: model.apply({"params": p}, images, normalize=False, method="encode_image"))
    base = np.asarray(encode(params))
    for path in (("attn_pool", "mlp", "c_proj", "bias"), ("conv1", "bias"), ("attn_pool", "probe")):
        changed = copy.deepcopy(params)
        node = changed["visual"]
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = node[path[-1]] + np.random.default_rng(1).normal(0, 0.5, node[path[-1]].shape)
        assert np.abs(np.asarray(encode(changed)) - base).max() > 1e-3, path


def test_toy_siglip_configs_round_trip_and_named_ones_keep_timms_name():
    config = config_from_open_clip(SIGLIP_TINY, name="tiny-siglip")
    exported = open_clip_model_cfg(config)
    assert exported["vision_cfg"]["pool_type"] == "map"  # no timm model has these sizes
    assert config_from_open_clip(exported, name="tiny-siglip") == config
    named = open_clip_model_cfg(get_model_config("ViT-SO400M-16-SigLIP2-384"))
    assert named["vision_cfg"]["timm_model_name"] == "vit_so400m_patch16_siglip_384"
    vision = get_model_config("ViT-SO400M-16-SigLIP2-384").vision
    assert (vision.block.gelu_approximate, vision.block.norm_eps, vision.mlp_width) == ("tanh", 1e-6, 4304)


def _siglip(**vision):
    return {**open_clip.get_model_config("ViT-B-16-SigLIP"),
            "vision_cfg": {**open_clip.get_model_config("ViT-B-16-SigLIP")["vision_cfg"], **vision}}


@pytest.mark.parametrize("bad, message", [
    (_siglip(timm_model_name="vit_base_patch16_clip_224"), "timm_model_name='vit_base_patch16_clip_224': timm"),
    (_siglip(timm_pool="avg"), "timm_pool='avg' (SigLIP's: 'map')"),
    (_siglip(timm_proj="linear"), "timm_proj='linear' (SigLIP's: 'none')"),
    (_siglip(image_size=256), "image_size=256 (timm builds vit_base_patch16_siglip_224 at 224)"),
    (_siglip(width=512), "['width'] (OpenCLIP ignores them beside timm_model_name"),
    (_siglip(timm_model_pretrained=True), "timm_model_pretrained=true"),
    ({**SIGLIP_TINY, "embed_dim": 32}, "width 64 must be embed_dim=32"),
    ({**SIGLIP_TINY, "vision_cfg": {**SIGLIP_TINY["vision_cfg"], "final_ln_after_pool": True}},
     "pool_type='map' with final_ln_after_pool"),
])
def test_bad_siglip_configs_name_the_key_before_anything_is_built(bad, message):
    with pytest.raises(InvalidInput) as info:
        create_model(bad)
    assert message in str(info.value)


def test_lit_locking_and_layer_decay_put_the_attention_pool_at_the_top():
    params = param_shapes(create_model(SIGLIP_TINY))
    head_only = trainable_mask(params, LockSpec(image=True, image_unlocked_groups=1), 2, 2)
    assert all(jax.tree.leaves(head_only["visual"]["attn_pool"]))
    assert not any(np.any(x) for x in jax.tree.leaves({k: v for k, v in head_only["visual"].items()
                                                         if k != "attn_pool"}))
    multipliers = lr_multipliers(params, 0.5, 2)
    assert set(jax.tree.leaves(multipliers["visual"]["attn_pool"])) == {1.0}
    assert set(jax.tree.leaves(multipliers["visual"]["conv1"])) == {0.125}


@pytest.fixture(scope="module")
def siglip_params():
    return jax.tree.map(np.asarray, init_params(create_model(SIGLIP_TINY), jax.random.key(0)))


def _sgd_step(params, batch, *, n_devices, **spec):
    mesh = create_mesh(jax.devices()[:n_devices])
    step = build_step(StepSpec.for_model(SIGLIP_TINY, optimizer=SGD, loss="siglip", **spec), mesh)
    state, metrics = run_once(step.update, step.state_from_params(params), make_global_batch(batch, mesh))
    return jax.tree.map(np.asarray, state.params), float(metrics["loss"])


@pytest.mark.slow
def test_sigmoid_step_with_fsdp_accumulation_remat_and_patch_dropout_equals_one_device(siglip_params, random_batch):
    batch = random_batch(16)
    expected, expected_loss = _sgd_step(siglip_params, batch, n_devices=1, patch_dropout=0.5)
    for options in ({"fsdp": True}, {"fsdp": True, "accum_steps": 2, "remat_policy": "nothing_saveable"}):
        after, loss = _sgd_step(siglip_params, batch, n_devices=8, patch_dropout=0.5, **options)
        assert_same_update(siglip_params, after, expected)
        assert loss == pytest.approx(expected_loss, rel=1e-5), options


@pytest.mark.slow
def test_siglip_model_runs_in_bf16():
    model = create_model(SIGLIP_TINY)
    params = init_params(model, jax.random.key(1))
    images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    tokens = np.random.default_rng(1).integers(1, 1000, size=(2, 16)).astype(np.int32)
    bf16_model = create_model(SIGLIP_TINY, dtype="bfloat16")
    assert_bf16_features_close(jax.jit(model.apply, compiler_options=FAST_CODEGEN),
                               jax.jit(bf16_model.apply, compiler_options=FAST_CODEGEN), params, images, tokens)


@pytest.mark.slow
def test_every_precision_policy_trains_a_siglip_model_near_fp32(siglip_params, random_batch):
    from clip_jax.models.precision import POLICIES, cast_params, get_policy
    from clip_jax.training.loss_scale import LossScaleSpec
    from clip_jax.training.step_factory import OptimizerSpec

    mesh = create_mesh()
    batch = make_global_batch(random_batch(16), mesh)
    losses = {}
    # fp16's loss scale starts where this model's first backward does not overflow (at 65536 it does, and the step
    # is skipped, as GradScaler's first steps are: tests/test_loss_scale.py)
    loss_scale = LossScaleSpec(init=1024.0)
    for name in POLICIES:  # lr 1e-2: Adam's first step moves a pure_bf16 norm scale of 1 by more than bf16's spacing
        step = build_step(StepSpec.for_model(SIGLIP_TINY, name, loss="siglip", optimizer=OptimizerSpec(lr=1e-2),
                                             lock=LockSpec(image=True, image_unlocked_groups=2),
                                             loss_scale=loss_scale), mesh)
        start = jax.tree.map(np.asarray, cast_params(siglip_params, get_policy(name)))
        state, metrics = run_once(step.update, step.state_from_params(start), batch)
        losses[name] = float(metrics["loss"])
        after = jax.tree.map(np.asarray, state.params["visual"])
        changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), after, start["visual"])
        assert all(jax.tree.leaves(changed["attn_pool"])), name  # the head group trains
        assert not any(changed["conv1"].values()) and not changed["positional_embedding"], name  # the stem is locked
    for name, loss in losses.items():
        assert np.isfinite(loss) and loss == pytest.approx(losses["fp32"], rel=0.1), (name, losses)
