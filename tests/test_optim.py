"""AdamW, weight-decay mask, schedule, clipping and the logit-scale clamp against hand values and torch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from open_clip.model import CLIP as OpenClipCLIP

from clip_jax.models import create_model, init_params
from clip_jax.optim.adamw import clamp_logit_scale, create_optimizer, decay_mask, warmup_cosine_schedule

# Written out by hand from OpenCLIP's rule: kernels, embeddings and projections decay; norms, biases,
# class_embedding (1-D) and logit_scale do not.
EXPECTED_DECAYED = {
    "positional_embedding",
    "text_projection",
    "token_embedding/embedding",
    "transformer/resblocks/attn/in_proj/kernel",
    "transformer/resblocks/attn/out_proj/kernel",
    "transformer/resblocks/mlp/c_fc/kernel",
    "transformer/resblocks/mlp/c_proj/kernel",
    "visual/conv1/kernel",
    "visual/positional_embedding",
    "visual/proj",
    "visual/transformer/resblocks/attn/in_proj/kernel",
    "visual/transformer/resblocks/attn/out_proj/kernel",
    "visual/transformer/resblocks/mlp/c_fc/kernel",
    "visual/transformer/resblocks/mlp/c_proj/kernel",
}


def flat_names(tree):
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@pytest.fixture(scope="module")
def tiny_params(tiny_model_config):
    return init_params(create_model(tiny_model_config), jax.random.key(0))


@pytest.mark.slow
def test_decay_mask_on_the_model_tree_matches_hand_list(tiny_params):
    mask = flat_names(decay_mask(tiny_params))
    decayed = {name for name, decays in mask.items() if decays}
    assert decayed == EXPECTED_DECAYED
    # stacked layer biases and norm scales are 2-D as stored, yet not decayed
    assert mask["visual/transformer/resblocks/ln_1/scale"] is False
    assert mask["transformer/resblocks/mlp/c_fc/bias"] is False


def test_decay_mask_decays_as_many_weights_as_open_clip(tiny_params, tiny_model_config):
    torch.manual_seed(0)
    open_clip_model = OpenClipCLIP(**tiny_model_config)

    def open_clip_excludes(name, p):  # the rule of OpenCLIP's training script
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name

    open_clip_decayed = sum(
        p.numel() for n, p in open_clip_model.named_parameters() if not open_clip_excludes(n, p)
    )
    open_clip_total = sum(p.numel() for p in open_clip_model.parameters())
    mask = flat_names(decay_mask(tiny_params))
    sizes = {name: leaf.size for name, leaf in flat_names(tiny_params).items()}
    assert sum(sizes.values()) == open_clip_total
    assert sum(size for name, size in sizes.items() if mask[name]) == open_clip_decayed


def test_schedule_warms_up_linearly_then_follows_the_cosine_to_zero():
    schedule = warmup_cosine_schedule(1e-3, warmup_steps=10, total_steps=110)
    expected = {
        0: 1e-4,  # (0 + 1) / 10
        4: 5e-4,
        9: 1e-3,
        10: 1e-3,  # cosine starts at the peak
        35: 8.535533905932737e-4,  # 0.5 * (1 + cos(pi / 4))
        60: 5e-4,
        110: 0.0,
        200: 0.0,
    }
    for step, lr in expected.items():
        assert float(schedule(step)) == pytest.approx(lr, rel=1e-6, abs=1e-12), step


def test_schedule_rejects_warmup_not_shorter_than_training():
    with pytest.raises(ValueError, match="warmup_steps < total_steps"):
        warmup_cosine_schedule(1e-3, warmup_steps=100, total_steps=100)


@pytest.mark.parametrize("warmup, total_steps, largest", [(50, 8, 7), (8, 8, 7), (3, 1, 0)])
def test_a_warmup_too_long_for_the_run_is_refused_naming_the_largest_that_fits(warmup, total_steps, largest):
    """A first run on a small data set (the demo's warmup of 50 against 8 steps): the one line says what to set."""
    with pytest.raises(ValueError) as refused:
        warmup_cosine_schedule(1e-3, warmup_steps=warmup, total_steps=total_steps)
    message = str(refused.value)
    assert "\n" not in message and f"warmup={warmup}" in message and f"{total_steps} step" in message
    assert f"the largest warmup that fits is {largest}: --config.warmup={largest}" in message
    warmup_cosine_schedule(1e-3, warmup_steps=largest, total_steps=total_steps)  # which the schedule takes


def open_clip_lr(base_lr, warmup, total, step):
    """OpenCLIP's cosine_lr, restated."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) * base_lr


@pytest.mark.slow
def test_three_updates_equal_torch_adamw_with_open_clip_param_groups_and_clipping():
    rng = np.random.default_rng(0)
    shapes = {
        "visual": {"proj": (4, 3), "ln_post": {"scale": (3,), "bias": (3,)}},
        "transformer": {"resblocks": {"mlp": {"c_fc": {"kernel": (2, 3, 5), "bias": (2, 5)}}}},
        "logit_scale": (),
    }
    params = jax.tree.map(
        lambda s: rng.normal(size=s).astype(np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    grads = [
        jax.tree.map(lambda p: (10 * rng.normal(size=p.shape)).astype(np.float32), params) for _ in range(3)
    ]
    base_lr, warmup, total, clip = 1e-2, 2, 5, 0.5

    tx = create_optimizer(
        warmup_cosine_schedule(base_lr, warmup, total), weight_decay=0.2, grad_clip_norm=clip
    )
    state = tx.init(params)
    jax_params = params
    for g in grads:
        updates, state = tx.update(g, state, jax_params)
        jax_params = optax.apply_updates(jax_params, updates)

    names = flat_names(params)
    torch_params = {n: torch.tensor(p, requires_grad=True) for n, p in names.items()}
    no_decay = {
        "visual/ln_post/scale",
        "visual/ln_post/bias",
        "transformer/resblocks/mlp/c_fc/bias",
        "logit_scale",
    }
    groups = [
        {"params": [p for n, p in torch_params.items() if n in no_decay], "weight_decay": 0.0},
        {"params": [p for n, p in torch_params.items() if n not in no_decay], "weight_decay": 0.2},
    ]
    optimizer = torch.optim.AdamW(groups, lr=base_lr, betas=(0.9, 0.98), eps=1e-6)
    for step, g in enumerate(grads):
        for group in optimizer.param_groups:
            group["lr"] = open_clip_lr(base_lr, warmup, total, step)
        for n, p in torch_params.items():
            p.grad = torch.tensor(flat_names(g)[n])
        torch.nn.utils.clip_grad_norm_(list(torch_params.values()), clip)
        optimizer.step()

    for name, leaf in flat_names(jax_params).items():
        np.testing.assert_allclose(
            leaf, torch_params[name].detach().numpy(), rtol=2e-5, atol=1e-6, err_msg=name
        )
        assert not np.allclose(leaf, names[name])  # every leaf moved


def test_clipping_does_not_change_the_state_structure():
    params = {"w": jnp.ones((3, 3)), "logit_scale": jnp.float32(1.0)}
    with_clip = create_optimizer(1e-3, grad_clip_norm=1.0).init(params)
    without = create_optimizer(1e-3).init(params)
    assert jax.tree.structure(with_clip) == jax.tree.structure(without)
    with pytest.raises(ValueError, match="grad_clip_norm"):
        create_optimizer(1e-3, grad_clip_norm=0.0)


def test_logit_scale_is_clamped_to_zero_and_log_100():
    for value, expected in [(5.0, math.log(100)), (-0.5, 0.0), (2.5, 2.5), (math.log(100), math.log(100))]:
        params = {"logit_scale": jnp.float32(value), "w": jnp.ones(2)}
        clamped = clamp_logit_scale(params)
        assert float(clamped["logit_scale"]) == pytest.approx(expected, rel=1e-7)
        np.testing.assert_array_equal(clamped["w"], params["w"])
    with pytest.raises(KeyError, match="logit_scale"):
        clamp_logit_scale({"w": jnp.ones(2)})
