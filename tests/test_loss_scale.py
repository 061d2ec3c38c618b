"""fp16's dynamic loss scale in the train step: an overflowing step changes nothing but the scale, which follows
GradScaler's rule (modelled here in plain Python, fed with each step's finite flag), and under accumulation the
backward of every micro-batch starts from the scaled feature gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clip_jax.models import create_model, init_params
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.loss_scale import LossScale, LossScaleSpec, next_loss_scale
from clip_jax.training.stability import OverflowWatch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step

ROWS, GROWTH_INTERVAL = 16, 3


def gradscaler(scale: float, finite_steps: int, finite: bool, growth_interval: int) -> tuple[float, int]:
    """torch.amp.GradScaler.update's rule for one step: (scale, finite steps in a row) after it."""
    if not finite:
        return scale * 0.5, 0
    if finite_steps + 1 == growth_interval:
        return scale * 2.0, 0
    return scale, finite_steps + 1


@pytest.fixture(scope="module")
def params(tiny_model_config):
    return jax.tree.map(np.asarray, init_params(create_model(tiny_model_config), jax.random.key(0)))


@pytest.fixture(scope="module")
def batch(random_batch):
    return make_global_batch(random_batch(ROWS), create_mesh(jax.devices()[:1]))


def fp16_step(tiny_model_config, accum_steps=1):
    spec = StepSpec.for_model(tiny_model_config, "fp16", optimizer=OptimizerSpec(lr=1e-3), accum_steps=accum_steps,
                              loss_scale=LossScaleSpec(2.0**40, GROWTH_INTERVAL))
    return build_step(spec, create_mesh(jax.devices()[:1]))


@pytest.fixture(scope="module")
def full_batch_step(tiny_model_config):
    return fp16_step(tiny_model_config)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def with_scale(step, state, scale: float):
    """A copy of the host train state `state` laid out for `step` (which donates what it is given), at loss scale
    `scale`."""
    return jax.device_put(state._replace(policy_state=LossScale(np.float32(scale), np.int32(0))), step.shardings)


def assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


def test_overflowing_steps_change_nothing_but_the_scale_which_follows_gradscalers_rule(full_batch_step, params,
                                                                                      batch):
    state = full_batch_step.state_from_params(params)
    assert float(state.policy_state.scale) == 2.0**40
    expected, flags = (2.0**40, 0), []
    for step in range(36):
        before = host((state.params, state.opt_state))
        state, metrics = full_batch_step(state, batch)
        finite = bool(metrics["finite"])
        flags.append(finite)
        assert bool(metrics["overflow"]) == (not finite) and np.isfinite(float(metrics["loss"]))
        if not finite:  # skipped: parameters and optimizer state as they were, bit for bit
            assert_bit_identical(host((state.params, state.opt_state)), before)
        expected = gradscaler(*expected, finite, GROWTH_INTERVAL)
        assert float(metrics["loss_scale"]) == float(state.policy_state.scale) == expected[0], step
        assert int(state.policy_state.finite_steps) == expected[1]
        assert int(state.step) == step + 1
    overflows = flags.index(True)
    # 2**40 overflows float16's backward until the scale is down to a few thousand; from there every step is finite
    # and the scale doubles every GROWTH_INTERVAL steps
    assert 20 <= overflows < 30 and all(flags[overflows:])
    assert len(flags) - overflows >= 2 * GROWTH_INTERVAL
    assert float(state.policy_state.scale) == 2.0 ** (40 - overflows + (len(flags) - overflows) // GROWTH_INTERVAL)
    assert not np.array_equal(host(state.params)["logit_scale"], params["logit_scale"])


def test_accumulation_starts_each_micro_batch_backward_from_the_scaled_loss(tiny_model_config, full_batch_step,
                                                                           params, batch):
    accumulated = fp16_step(tiny_model_config, accum_steps=2)
    start = host(accumulated.state_from_params(params))  # the full-batch step's state too
    # 2**40 reaches the float16 backward of the micro-batches through their feature-gradient seeds: it overflows
    state, metrics = accumulated(with_scale(accumulated, start, 2.0**40), batch)
    assert bool(metrics["overflow"]) and float(metrics["loss_scale"]) == 2.0**39
    assert_bit_identical(host((state.params, state.opt_state)), (start.params, start.opt_state))
    # at a scale that fits, the unscaled gradients are the full batch's (up to float16 rounding)
    _, micro = accumulated(with_scale(accumulated, start, 2.0**10), batch)
    _, full = full_batch_step(with_scale(full_batch_step, start, 2.0**10), batch)
    assert bool(micro["finite"]) and bool(full["finite"])
    assert float(micro["loss"]) == pytest.approx(float(full["loss"]), rel=1e-3)
    assert float(micro["grad_norm"]) == pytest.approx(float(full["grad_norm"]), rel=1e-2)


def test_the_scale_rule_matches_gradscalers_and_stops_growing_below_float32s_limit():
    rng = np.random.default_rng(0)
    flags = rng.random(200) < 0.9
    update = jax.jit(next_loss_scale, static_argnums=2)
    state, expected = LossScale(jnp.float32(2.0**16), jnp.int32(0)), (2.0**16, 0)
    for finite in flags:
        state = update(state, jnp.bool_(finite), 4)
        expected = gradscaler(*expected, bool(finite), 4)
        assert (float(state.scale), int(state.finite_steps)) == expected
    top = update(LossScale(jnp.float32(2.0**127), jnp.int32(3)), jnp.bool_(True), 4)
    assert float(top.scale) == 2.0**127  # doubling would overflow float32: kept


def test_overflows_are_counted_and_only_a_scale_below_one_is_a_reason_to_roll_back():
    watch = OverflowWatch(skipped=5)
    assert not watch.observe({"loss": 1.0, "finite": True})  # a step without a loss scale
    assert watch.observe({"overflow": True, "loss_scale": 2.0}) and watch.problem is None
    assert watch.observe({"overflow": True, "loss_scale": 1.0}) and watch.problem is None
    assert watch.observe({"overflow": True, "loss_scale": 0.5})
    assert watch.problem == "loss scale driven below 1 (0.5) by 3 overflows in a row"
    assert not watch.observe({"overflow": False, "loss_scale": 0.5}) and watch.problem is None
    assert watch.skipped == 8 and watch.in_a_row == 0


def test_torch_gradscaler_moves_its_scale_as_ours_does():
    """A smoke test against the rule's source: torch's GradScaler on the CPU, its gradients made inf or finite."""
    torch = pytest.importorskip("torch")
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    state = LossScale(jnp.float32(2.0**16), jnp.int32(0))
    for finite in (False, False, True, True, True, True, False, True, True, True, True):
        optimizer.zero_grad()
        scaler.scale((weight * (1.0 if finite else float("inf"))).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        state = next_loss_scale(state, jnp.bool_(finite), 3)
        assert scaler.get_scale() == float(state.scale)
