"""StableAdamW against an independent numpy float64 implementation, against AdamW when its clipping is idle, and in
the train step: selected by the run config, its state split under FSDP exactly like AdamW's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from clip_jax.optim.adamw import create_optimizer
from clip_jax.optim.stable_adamw import stable_adamw
from clip_jax.run_config import default_config
from clip_jax.training.config_checks import check_config
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step, mesh_for

B1, B2, EPS, WD, LR = 0.9, 0.98, 1e-6, 0.2, 1e-2

# A stacked leaf (two layers, each its own tensor), a plain matrix, and a vector that is not decayed.
SHAPES = {"visual": {"transformer": {"resblocks": {"kernel": (2, 3, 4)}}}, "proj": (3, 5), "scale": (5,)}
DECAYED = {"visual": {"transformer": {"resblocks": {"kernel": True}}}, "proj": True, "scale": False}


def numpy_stable_adamw(params, grads_per_step, *, lr, b1, b2, eps, wd, decayed, stacked):
    """Float64 StableAdamW as written in Wortsman et al. 2023, Algorithm 2 (bias-corrected moments, per-tensor
    RMS of g / sqrt(v_hat), the step and the decay divided by max(1, RMS)); one tensor per layer for `stacked`
    names. Returns the params after every step and the RMS of every tensor at every step."""
    params = {k: np.array(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    history, ratios = [], []
    for t, grads in enumerate(grads_per_step, start=1):
        step_ratios = {}
        for name in params:
            g = np.array(grads[name], np.float64)
            m[name] = b1 * m[name] + (1 - b1) * g
            v[name] = b2 * v[name] + (1 - b2) * g * g
            m_hat, v_hat = m[name] / (1 - b1**t), v[name] / (1 - b2**t)
            tensors = range(g.shape[0]) if name in stacked else [slice(None)]
            for i in tensors:
                rms = np.sqrt(np.mean(g[i] ** 2 / np.maximum(v_hat[i], eps**2)))
                step_ratios.setdefault(name, []).append(rms)
                eta = lr / max(1.0, rms)
                direction = m_hat[i] / (np.sqrt(v_hat[i]) + eps) + (wd * params[name][i] if decayed[name] else 0)
                params[name][i] = params[name][i] - eta * direction
        history.append({k: p.copy() for k, p in params.items()})
        ratios.append(step_ratios)
    return history, ratios


def flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflat(flat_tree: dict, like):
    names = list(flat(like))
    return jax.tree.unflatten(jax.tree.structure(like), [jnp.asarray(flat_tree[n], jnp.float32) for n in names])


def run_optimizer(optimizer, params, grads_per_step):
    state, out = optimizer.init(params), []
    for grads in grads_per_step:
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(params)
    return out


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), SHAPES,
                          is_leaf=lambda x: isinstance(x, tuple))
    grads = []
    for t in range(6):
        g = {name: rng.normal(size=x.shape) * 0.1 for name, x in flat(params).items()}
        if t == 3:  # a sudden large gradient in layer 1 of the stack and in proj: v is out of date, RMS > 1
            g["visual/transformer/resblocks/kernel"][1] *= 30.0
            g["proj"] *= 30.0
        grads.append(unflat(g, params))
    return params, grads


def test_stable_adamw_matches_numpy_over_several_steps_with_a_clipped_step(problem):
    params, grads = problem
    mask = lambda p: DECAYED  # noqa: E731
    ours = run_optimizer(create_optimizer(LR, weight_decay=WD, b1=B1, b2=B2, eps=EPS, stable=True), params, grads)
    ours_with_mask = run_optimizer(stable_adamw(LR, B1, B2, EPS, WD, mask), params, grads)
    stacked = {"visual/transformer/resblocks/kernel"}
    decayed = {name: bool(d) for name, d in flat(DECAYED).items()}
    expected, ratios = numpy_stable_adamw(flat(params), [flat(g) for g in grads], lr=LR, b1=B1, b2=B2, eps=EPS,
                                          wd=WD, decayed=decayed, stacked=stacked)
    # the reference's step 4 (index 3) clips layer 1 of the stack and proj, and only them
    assert ratios[3]["visual/transformer/resblocks/kernel"][1] > 1.5 and ratios[3]["proj"][0] > 1.5
    assert ratios[3]["visual/transformer/resblocks/kernel"][0] < 1.2
    for got, want in zip(ours_with_mask, expected):
        for name, value in flat(got).items():
            np.testing.assert_allclose(value, want[name], rtol=2e-5, atol=1e-6, err_msg=name)
    # create_optimizer's mask is OpenCLIP's rule: the 1-D `scale` is not decayed, the matrices are
    for got, want in zip(ours, expected):
        for name, value in flat(got).items():
            np.testing.assert_allclose(value, want[name], rtol=2e-5, atol=1e-6, err_msg=name)


def test_with_its_clipping_idle_stable_adamw_is_adamw(problem):
    params, _ = problem
    rng = np.random.default_rng(1)
    base = {name: rng.normal(size=x.shape) for name, x in flat(params).items()}
    # shrinking gradients: v_hat (a mean of larger past g^2) stays above g^2, so every RMS is at most 1
    grads = [unflat({n: g * 0.7**t for n, g in base.items()}, params) for t in range(5)]
    _, ratios = numpy_stable_adamw(flat(params), [flat(g) for g in grads], lr=LR, b1=B1, b2=B2, eps=EPS, wd=WD,
                                   decayed={n: True for n in base}, stacked={"visual/transformer/resblocks/kernel"})
    assert max(max(r) for step in ratios for r in step.values()) <= 1 + 1e-9
    stable = run_optimizer(create_optimizer(LR, weight_decay=WD, stable=True), params, grads)
    adamw = run_optimizer(create_optimizer(LR, weight_decay=WD), params, grads)
    for got, want in zip(stable, adamw):
        for name, value in flat(got).items():
            np.testing.assert_allclose(value, flat(want)[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_run_config_selects_stable_adamw_and_rejects_an_unknown_optimizer():
    config = default_config()
    config.train_data = "/data/{0..1}.tar"
    config.opt = "stable_adamw"
    check_config(config, num_devices=8)
    assert StepSpec.from_config(config, platform="cpu").optimizer.name == "stable_adamw"
    config.opt = "lion"
    with pytest.raises(ValueError, match="opt='lion'"):
        check_config(config, num_devices=8)


@pytest.mark.slow
def test_train_step_with_stable_adamw_splits_its_state_like_adamw_under_fsdp(tiny_model_config, random_batch):
    specs = {name: StepSpec.for_model(tiny_model_config, fsdp=True, accum_steps=2,
                                      optimizer=OptimizerSpec(name, lr=1e-3))
             for name in ("adamw", "stable_adamw")}
    mesh = mesh_for(specs["adamw"])
    steps = {name: build_step(spec, mesh) for name, spec in specs.items()}
    adam_moments = steps["adamw"].shardings.opt_state[1][0]
    stable_moments = steps["stable_adamw"].shardings.opt_state[1][0]
    assert isinstance(steps["stable_adamw"].abstract_state.opt_state[1][0], optax.ScaleByAdamState)
    assert jax.tree.map(lambda s: s.spec, stable_moments.nu) == jax.tree.map(lambda s: s.spec, adam_moments.nu)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(stable_moments.mu))
    step = steps["stable_adamw"]
    state = step.init(0)
    before = jax.device_get(state.params)
    state, metrics = step(state, random_batch(16))
    assert bool(metrics["finite"])
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), before,
                         jax.device_get(state.params))
    assert all(jax.tree.leaves(moved))
