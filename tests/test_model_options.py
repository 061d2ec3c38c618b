"""OpenCLIP's ViT/text-tower options against the real OpenCLIP: features, conversion, parameter counts, the config
round trip, the train step under FSDP and accumulation, and the errors for configs that cannot be built."""

import copy

import jax
import numpy as np
import open_clip
import pytest
import torch
from open_clip_reference import TINY, random_inputs
from tiny_model import SGD, TINY_MODEL, assert_bf16_features_close, assert_same_update
from xla_flags import FAST_CODEGEN, run_once

from clip_jax.interop.convert import from_open_clip, open_clip_shapes, to_open_clip
from clip_jax.models import count_params, create_model, get_model_config, init_params, param_shapes
from clip_jax.models.open_clip_json import config_from_open_clip, open_clip_model_cfg
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import StepSpec, build_step

NORMFORMER = {"qk_norm": True, "scale_heads": True, "scale_attn_inner": True, "scale_attn": True, "scale_fc": True,
              "ls_init_value": 0.1}


def _tiny(vision=None, text=None, **top):
    """TINY (several heads a tower) with two image layers and the given options."""
    return {**TINY, **top, "vision_cfg": {**TINY["vision_cfg"], "layers": 2, **(vision or {})},
            "text_cfg": {**TINY["text_cfg"], **(text or {})}}


CASES = {
    # NormFormer-like extra norms, QK norm and LayerScale in both towers.
    "custom-block": _tiny(NORMFORMER, NORMFORMER),
    # Swin-V2's scaled cosine attention (what OpenCLIP 3.3.0 itself cannot run) with per-head output scales.
    "scaled-cosine": _tiny({"scaled_cosine_attn": True, "scale_heads": True, "ls_init_value": 0.5},
                           {"scaled_cosine_attn": True, "scale_attn": True}),
    # Pooling and head options: mean of the patches with ln_post after pooling and no ln_pre; CoCa's text class
    # embedding (custom_text) with a padding id, a biased projection; norm eps, tanh GELU, a SigLIP head.
    "cls-avg-head": _tiny(
        {"no_ln_pre": True, "pool_type": "avg", "final_ln_after_pool": True, "norm_kwargs": {"eps": 1e-6},
         "act_kwargs": {"approximate": "tanh"}},
        {"embed_cls": True, "pad_id": 1, "proj_bias": True, "norm_kwargs": {"eps": 1e-3}, "ls_init_value": 0.2,
         "act_kwargs": {"approximate": "tanh"}},
        custom_text=True, init_logit_scale=2.0, init_logit_bias=-3.0),
    # Bidirectional text pooled at its first eos_id, no text projection; avg pooling after ln_post; LayerNorms
    # without bias (image) or without any affine parameter (text); the custom block chosen by name alone.
    "bidirectional-eos": _tiny(
        {"pool_type": "avg", "block_type": "custom", "norm_kwargs": {"bias": False}},
        {"no_causal_mask": True, "pool_type": "eos", "eos_id": 7, "proj_type": "none", "qk_norm": True,
         "norm_kwargs": {"elementwise_affine": False}},
        embed_dim=64),
    "text-first": _tiny(text={"pool_type": "first", "final_ln_after_pool": True, "scale_fc": True}),
    "text-last": _tiny(text={"pool_type": "last", "scale_heads": True, "ls_init_value": 1e-5}),
}


@pytest.fixture
def batched_bmm(monkeypatch):
    """OpenCLIP 3.3.0's custom attention calls torch.bmm on [N, heads, L, head_dim] tensors when scaled cosine
    attention is on, which torch refuses; its maths with that one call a batched matmul is the reference."""
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: torch.matmul(a, b) if a.ndim == 4 else bmm(a, b))


def torch_model(cfg, seed=0) -> torch.nn.Module:
    """OpenCLIP's model for `cfg`, with every LayerNorm, bias, LayerScale, per-head scale and class embedding moved
    away from its init (one head's cosine scale above the ln 100 clamp)."""
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in cfg.items() if k != "custom_text"}
    model = (open_clip.CustomTextCLIP if cfg.get("custom_text") else open_clip.CLIP)(**kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "logit_scale":
                p.fill_(2.9)
            elif name.endswith("attn.logit_scale"):
                p.add_(0.3 * torch.randn_like(p))
                p[0] = 5.0
            elif p.ndim < 2 or name.endswith(("bias", "head_scale", "cls_emb")):
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def inputs(cfg, batch=3, seed=0):
    text = cfg["text_cfg"]
    images, tokens = random_inputs(32, text["context_length"], text["vocab_size"], batch, seed)
    if text.get("pad_id", 0) != 0:  # padding with the config's id, used nowhere else
        tokens[tokens == text["pad_id"]] = text["pad_id"] + 2
        tokens[tokens == 0] = text["pad_id"]
    if text.get("pool_type") == "eos":  # eos_id away from the largest id, twice in row 0, nowhere in the last row
        tokens[tokens == text["eos_id"]] = text["eos_id"] + 1
        tokens[0, [1, 3]] = text["eos_id"]
        tokens[1, 2] = text["eos_id"]
    return images, tokens


def torch_features(model, images, tokens):
    with torch.no_grad():
        image = model.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), normalize=True)
        text = model.encode_text(torch.from_numpy(tokens).long(), normalize=True)
    return image.numpy(), text.numpy()


def state_dict(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_options_give_open_clips_features_and_convert_bit_for_bit(case, batched_bmm):
    cfg = CASES[case]
    reference = torch_model(cfg)
    weights = state_dict(reference)
    images, tokens = inputs(cfg)
    expected_image, expected_text = torch_features(reference, images, tokens)

    model = create_model(cfg)
    assert count_params(param_shapes(model)) == sum(p.numel() for p in reference.parameters())
    assert open_clip_shapes(cfg) == {k: v.shape for k, v in weights.items()}
    params = from_open_clip(weights, cfg)
    image_f, text_f, *head = jax.jit(model.apply)({"params": params}, images, tokens)
    np.testing.assert_allclose(image_f, expected_image, atol=1e-5, rtol=0)
    np.testing.assert_allclose(text_f, expected_text, atol=1e-5, rtol=0)
    assert float(head[0]) == pytest.approx(float(reference.logit_scale.detach().exp()), rel=1e-6)
    if cfg.get("init_logit_bias") is not None:
        assert float(head[1]) == float(reference.logit_bias.detach())

    back = to_open_clip(params, cfg)
    assert sorted(back) == sorted(weights)
    for key, value in weights.items():
        assert back[key].dtype == value.dtype, key
        np.testing.assert_array_equal(back[key], value, err_msg=key)


@pytest.mark.slow
def test_the_text_options_change_the_features():
    """The pooled token and the mask do matter here: the cases above could not pass with them ignored."""
    cfg = CASES["bidirectional-eos"]
    images, tokens = inputs(cfg)
    params = from_open_clip(state_dict(torch_model(cfg)), cfg)
    variants = [cfg, {**cfg, "text_cfg": {**cfg["text_cfg"], "no_causal_mask": False}},
                {**cfg, "text_cfg": {**cfg["text_cfg"], "pool_type": "argmax"}}]
    texts = [np.asarray(create_model(v).apply({"params": params}, tokens, method="encode_text")) for v in variants]
    assert np.abs(texts[0] - texts[1]).max() > 1e-3 and np.abs(texts[0] - texts[2]).max() > 1e-3


def test_open_clip_3_3_cannot_run_scaled_cosine_attention():
    """The fact the README states: without the batched matmul, OpenCLIP's own forward fails."""
    model = torch_model(_tiny({"scaled_cosine_attn": True}))
    images, tokens = inputs(CASES["custom-block"], batch=1)
    with pytest.raises(RuntimeError, match="batch1 must be a 3D tensor"):
        torch_features(model, images, tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_open_clip_model_cfg_round_trips_and_open_clip_builds_it(case, tmp_path):
    config = config_from_open_clip(CASES[case], name=f"clip-jax-{case}")
    exported = open_clip_model_cfg(config)
    assert config_from_open_clip(exported, name=config.name) == config
    (tmp_path / f"{config.name}.json").write_text(__import__("json").dumps(exported))
    open_clip.add_model_config(tmp_path)
    built = open_clip.create_model(config.name)
    assert {k: tuple(v.shape) for k, v in built.state_dict().items()} == open_clip_shapes(config)


def test_named_models_export_as_open_clip_ships_them():
    for name in ("ViT-B-32", "ViT-H-14", "ViT-g-14"):
        exported = open_clip_model_cfg(get_model_config(name))
        shipped = open_clip.get_model_config(name)
        assert config_from_open_clip(exported) == config_from_open_clip(shipped), name


# The tiny step model with options in both towers; the text tower's class embedding puts a mask in every block.
HEAVY = copy.deepcopy(TINY_MODEL)
HEAVY["vision_cfg"].update(NORMFORMER, pool_type="avg", final_ln_after_pool=True, no_ln_pre=True)
HEAVY["text_cfg"].update(scaled_cosine_attn=True, scale_heads=True, scale_attn_inner=True, ls_init_value=0.3,
                         embed_cls=True, pad_id=999, proj_bias=True)
HEAVY["custom_text"] = True


@pytest.fixture(scope="module")
def heavy_params():
    return jax.tree.map(np.asarray, init_params(create_model(HEAVY), jax.random.key(0)))


def _sgd_step(params, batch, *, n_devices, **spec):
    mesh = create_mesh(jax.devices()[:n_devices])
    step = build_step(StepSpec.for_model(HEAVY, optimizer=SGD, **spec), mesh)
    state, metrics = run_once(step.update, step.state_from_params(params), make_global_batch(batch, mesh))
    return jax.tree.map(np.asarray, state.params), float(metrics["loss"])


@pytest.fixture(scope="module")
def heavy_one_device(heavy_params, random_batch):
    return _sgd_step(heavy_params, random_batch(16), n_devices=1, patch_dropout=0.5)


def _moving(params):
    """The params without the key LayerNorm's bias, whose gradient is zero in exact arithmetic (adding one vector
    to every key shifts a query's logits by a constant, which softmax ignores), so its update is rounding noise."""
    vision = params["visual"]["transformer"]["resblocks"]
    attn = {**vision["attn"], "ln_k": {"scale": vision["attn"]["ln_k"]["scale"]}}
    return {**params, "visual": {**params["visual"], "transformer": {"resblocks": {**vision, "attn": attn}}}}


@pytest.mark.slow
def test_option_heavy_step_with_fsdp_on_8_devices_equals_one_device(heavy_params, random_batch, heavy_one_device):
    after, loss = _sgd_step(heavy_params, random_batch(16), n_devices=8, fsdp=True, patch_dropout=0.5)
    assert_same_update(_moving(heavy_params), after, heavy_one_device[0])
    assert loss == pytest.approx(heavy_one_device[1], rel=1e-5)


@pytest.mark.slow
def test_option_heavy_step_with_accumulation_and_remat_equals_one_device(heavy_params, random_batch,
                                                                         heavy_one_device):
    after, loss = _sgd_step(heavy_params, random_batch(16), n_devices=8, fsdp=True, accum_steps=2,
                            remat_policy="nothing_saveable", patch_dropout=0.5)
    assert_same_update(_moving(heavy_params), after, heavy_one_device[0])
    assert loss == pytest.approx(heavy_one_device[1], rel=1e-5)


@pytest.mark.slow
def test_option_heavy_model_runs_in_bf16():
    model = create_model(HEAVY)
    params = init_params(model, jax.random.key(1))
    images, tokens = random_inputs(32, 16, 1000, batch=2)
    assert_bf16_features_close(jax.jit(model.apply, compiler_options=FAST_CODEGEN),
                               jax.jit(create_model(HEAVY, dtype="bfloat16").apply, compiler_options=FAST_CODEGEN),
                               params, images, tokens)


def _with(tower, **keys):
    return {**TINY, tower: {**TINY[tower], **keys}}


@pytest.mark.parametrize("bad, message", [
    (_with("vision_cfg", qk_norm=True, scaled_cosine_attn=True), "qk_norm and scaled_cosine_attn cannot both"),
    (_with("text_cfg", qk_norm="yes"), "text_cfg.qk_norm='yes' (str) must be true or false"),
    (_with("vision_cfg", layers="24"), "vision_cfg.layers='24' (str) must be an integer"),
    (_with("vision_cfg", ls_init_value=True), "vision_cfg.ls_init_value=True (bool) must be a number or null"),
    (_with("text_cfg", qk_nrom=True), "unknown key(s) ['qk_nrom']"),
    (_with("vision_cfg", block_type="default", scale_fc=True), "block_type='default' with ['scale_fc']"),
    (_with("vision_cfg", block_type="fancy"), "block_type='fancy'"),
    (_with("vision_cfg", pool_type="none"), "vision pool_type='none'"),
    (_with("text_cfg", pool_type="mean"), "text pool_type='mean'"),
    (_with("text_cfg", proj_type="mlp"), "text proj_type='mlp'"),
    (_with("text_cfg", embed_cls=True), "embed_cls needs custom_text"),
    (_with("text_cfg", proj_type="none"), "proj_type='none' gives 64-wide text features"),
    (_with("vision_cfg", attentional_pool=True), "vision_cfg.attentional_pool=True: the attentional pooler"),
    (_with("vision_cfg", timm_model_name="vit_base"), "timm image towers are not built"),
    (_with("text_cfg", hf_model_name="roberta-base"), "Hugging Face text towers are not built"),
    (_with("vision_cfg", pos_embed_type="sin_cos_2d"), "pos_embed_type='sin_cos_2d'"),
    (_with("vision_cfg", norm_kwargs={"momentum": 0.1}), "norm_kwargs: unknown key(s) ['momentum']"),
    (_with("vision_cfg", norm_kwargs={"eps": "small"}), "norm_kwargs.eps='small' (str) must be a number"),
    (_with("text_cfg", act_kwargs={"approximate": "sigmoid"}), "approximate='sigmoid'"),
    ({**_with("text_cfg", act_kwargs={"approximate": "tanh"}), "quick_gelu": True}, "QuickGELU takes no arguments"),
    ({**TINY, "init_logit_bias": "-10"}, "init_logit_bias='-10' (str) must be a number or null"),
    ({**TINY, "vision_cfg": [32]}, "vision_cfg must be a dict"),
    (_with("vision_cfg", image_interpolation="bilinear"), "vision_cfg.image_interpolation='bilinear'"),
    (_with("vision_cfg", image_resize_mode="squash"), "vision_cfg.image_resize_mode='squash'"),
])
def test_bad_option_configs_name_the_key_before_anything_is_built(bad, message):
    with pytest.raises(ValueError) as info:
        create_model(bad)
    assert message in str(info.value)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_cudnn_fused_attention_compiles_with_the_block_options_and_embed_cls_falls_back_to_xla():
    """XLA:GPU without a GPU: the custom block's options (QK norm, scaled cosine folded into the queries) keep
    cuDNN's fused attention, forward and backward; a text tower with embed_cls runs XLA's (its key mask)."""
    import re

    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from clip_jax.runtime import xla_gpu
    from clip_jax.runtime.hardware import get_gpu

    mesh = create_mesh(xla_gpu.devices(get_gpu("h100"), 1, 1))
    whole = NamedSharding(mesh, P())

    def fused_lengths(cfg):
        model = create_model(cfg, dtype=jnp.bfloat16, attention_impl="cudnn")
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole), param_shapes(model))
        images = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32, sharding=whole)
        tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32, sharding=whole)

        def loss(params, images, tokens):
            image_features, text_features, scale = model.apply({"params": params}, images, tokens)
            return jnp.sum(scale * image_features @ text_features.T)

        hlo = xla_gpu.compile_lowered(jax.jit(jax.grad(loss)).lower(params, images, tokens)).as_text()
        padded = {int(n) for line in hlo.splitlines() if "__cudnn$fmha" in line
                  for n in re.findall(r"bf16\[2,(?:\d+,)?(24),", line)}
        return padded, xla_gpu.fused_attention(hlo)

    options = copy.deepcopy(HEAVY)
    del options["custom_text"], options["text_cfg"]["embed_cls"], options["text_cfg"]["pad_id"]
    padded, calls = fused_lengths(options)
    assert padded == {24} and calls["forward"] >= 2 and calls["backward"] >= 2  # 17 image tokens padded to 24
    padded, calls_cls = fused_lengths(HEAVY)
    assert 0 < calls_cls["forward"] < calls["forward"] and 0 < calls_cls["backward"] < calls["backward"]
