"""The residual add and LayerNorm as Pallas kernels (`fused_kernels="pallas"`), run here through Pallas's
interpreter on small shapes: the same outputs and gradients as float64 LayerNorm, within the plain path's own
error; the switch off by default and leaving the step's program without a kernel of its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clip_jax.errors import InvalidInput
from clip_jax.models import create_model, layers, param_shapes
from clip_jax.models.layers import Transformer
from clip_jax.models.fused_layer_norm import FUSED_KERNELS, residual_layer_norm, supports
from clip_jax.plan.steps import for_xla_cpu
from clip_jax.run_config import default_config
from clip_jax.training.config_checks import CHOICES, choice_problems
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.step_factory import ClassifierHead, StepSpec, build_step

from test_mixed_precision import BF16_ROUNDING, f64, layer_norm_f64


def reference(args, cotangents):
    """(s, normed) and the gradients of x, y, scale, bias in float64: autodiff of the plain formula with x64, the
    LayerNorm of the residual stream as stored (x + y rounded to x's dtype; its gradient the sum's)."""
    x, y = args[:2]
    rounding = 0.0 if y is None else f64(np.asarray(x) + np.asarray(y)) - (f64(x) + f64(y))  # numpy: rounded once

    def residual_norm_f64(x, y, scale, bias):
        s = x if y is None else x + y + rounding
        return s, layer_norm_f64(s, scale, bias)

    with jax.enable_x64(True):
        args64 = [None if a is None else jnp.asarray(f64(a), jnp.float64) for a in args]
        outputs, pullback = jax.vjp(residual_norm_f64, *args64)
        gradients = pullback(tuple(jnp.asarray(f64(c), jnp.float64) for c in cotangents))
        return [np.asarray(o) for o in outputs], [None if g is None else np.asarray(g) for g in gradients]


def plain(x, y, scale, bias, out_dtype):
    """The residual block's path with the switch off: the add in x's dtype, then `layers.LayerNorm`'s function."""
    s = x if y is None else x + y.astype(x.dtype)
    return s, layers._lean_layer_norm(s, scale, bias, layers.LN_EPS, jnp.dtype(out_dtype))


def fused(x, y, scale, bias, out_dtype):
    return residual_layer_norm(x, y, scale, bias, layers.LN_EPS, jnp.dtype(out_dtype), True)


def inputs(dtype, with_y: bool, rows=(2, 16), width=64):  # two blocks of 16 rows
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(*rows, width)) * 3 + 1, dtype)
    y = jnp.asarray(rng.normal(size=(*rows, width)), dtype) if with_y else None
    scale, bias = (jnp.asarray(rng.normal(size=width), jnp.float32) for _ in range(2))
    cotangents = tuple(jnp.asarray(rng.normal(size=(*rows, width)), dtype) for _ in range(2))  # (d_s, d_normed)
    return (x, y, scale, bias), cotangents


def run(path, args, cotangents, out_dtype):
    @jax.jit
    def outputs_and_gradients(args, cotangents):
        outputs, pullback = jax.vjp(lambda *a: path(*a, out_dtype), *args)
        return outputs, pullback(cotangents)
    return outputs_and_gradients(args, cotangents)


def errors(results, expected):
    (outputs, gradients), (ref_outputs, ref_gradients) = results, expected
    pairs = list(zip(outputs, ref_outputs)) + [(g, r) for g, r in zip(gradients, ref_gradients) if r is not None]
    return [np.max(np.abs(f64(a) - r)) / np.max(np.abs(r)) for a, r in pairs]


@pytest.mark.parametrize("with_y", [True, False], ids=["add", "no-add"])
def test_float32_kernels_give_the_float64_outputs_and_gradients(with_y):
    args, cotangents = inputs(jnp.float32, with_y)
    results = run(fused, args, cotangents, jnp.float32)
    assert max(errors(results, reference(args, cotangents))) < 1e-5


@pytest.mark.parametrize("with_y", [True, False], ids=["add", "no-add"])
def test_bf16_kernels_are_as_close_to_float64_as_the_plain_path(with_y):
    args, cotangents = inputs(jnp.bfloat16, with_y)
    outputs, gradients = run(fused, args, cotangents, jnp.bfloat16)
    expected = reference(args, cotangents)
    assert [o.dtype for o in outputs] == [jnp.bfloat16] * 2
    assert [None if g is None else g.dtype for g in gradients] == [a if a is None else a.dtype for a in args]
    ours, theirs = errors((outputs, gradients), expected), errors(run(plain, args, cotangents, jnp.bfloat16), expected)
    # one bf16 rounding of each result at most (the plain path rounds the input gradient twice: before the add)
    assert all(e <= max(t, BF16_ROUNDING) for e, t in zip(ours, theirs)), (ours, theirs)


def test_residual_blocks_with_the_kernels_give_the_plain_blocks_outputs_and_gradients():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 32)), jnp.float32)  # one block of 16 rows
    off, on = (Transformer(32, 1, 2, 64, fused_kernels=k) for k in ("off", "pallas_interpret"))
    params = off.init(jax.random.key(0), x)
    assert jax.tree.structure(params) == jax.tree.structure(jax.eval_shape(on.init, jax.random.key(0), x))

    @functools.partial(jax.jit, static_argnums=2)
    def value_and_grads(params, x, model):
        return jax.value_and_grad(lambda p, x: jnp.sum(model.apply(p, x) * jnp.arange(32.0)), (0, 1))(params, x)

    (value_off, grads_off), (value_on, grads_on) = value_and_grads(params, x, off), value_and_grads(params, x, on)
    np.testing.assert_allclose(value_on, value_off, rtol=1e-5)
    for g_on, g_off in zip(jax.tree.leaves(grads_on), jax.tree.leaves(grads_off)):
        np.testing.assert_allclose(g_on, g_off, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(g_off))))


def gradient_program(spec) -> str:
    """The jaxpr (sub-programs included) of the gradient of the spec's model: traced, not run."""
    model = spec.create_model()
    params = param_shapes(model)
    images, tokens = jnp.zeros((2, 32, 32, 3)), jnp.zeros((2, 16), jnp.int32)
    return str(jax.make_jaxpr(jax.grad(lambda p: model.apply({"params": p}, images, tokens)[0].sum()))(params))


def test_the_switch_is_off_by_default_and_off_adds_no_kernel(tiny_model_config):
    spec = StepSpec.for_model(tiny_model_config, "bf16")
    assert spec.fused_kernels == "off"
    assert "pallas_call" not in gradient_program(spec)
    on = gradient_program(StepSpec.for_model(tiny_model_config, "bf16", fused_kernels="pallas_interpret"))
    assert "residual_layer_norm_backward" in on


def test_widths_the_kernels_do_not_take_fall_back_to_layer_norm():
    assert supports(1024, True, True)
    assert not supports(768, True, True)  # Triton's blocks are powers of two
    assert not supports(1024, False, True)


def test_an_unknown_switch_value_names_the_choices(tiny_model_config):
    with pytest.raises(InvalidInput, match="fused_kernels 'triton'.*'pallas'"):
        create_model(tiny_model_config, fused_kernels="triton")
    with pytest.raises(InvalidInput, match="fused_kernels='on'"):
        StepSpec.for_model(tiny_model_config, "bf16", fused_kernels="on")


def test_a_training_config_sets_the_switch_and_a_cpu_run_is_told_to_turn_pallas_off():
    config = default_config()
    config.fused_kernels = "on"
    assert choice_problems(config, CHOICES) == [f"fused_kernels='on': choose one of {FUSED_KERNELS}"]
    config.fused_kernels = "pallas"
    with pytest.raises(InvalidInput, match="fused_kernels='pallas'.* cpu: set --config.fused_kernels=off"):
        StepSpec.from_config(config, platform="cpu")
    assert StepSpec.from_config(config, platform="gpu").fused_kernels == "pallas"
    assert for_xla_cpu(StepSpec.from_config(config, platform="gpu")).fused_kernels == "off"  # the planner's


def test_under_a_mesh_each_device_runs_the_kernels_on_its_own_rows():
    mesh = create_mesh(jax.devices()[:2])
    args, cotangents = inputs(jnp.float32, True)  # 32 rows: 16 a device
    rows, whole = NamedSharding(mesh, P(mesh.axis_names)), NamedSharding(mesh, P())
    on_devices = lambda arrays: [jax.device_put(a, rows if a.ndim > 1 else whole) for a in arrays]  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as the train step traces it
        program = str(jax.make_jaxpr(lambda *a: fused(*a, jnp.float32))(*args))
        outputs, gradients = run(fused, on_devices(args), tuple(on_devices(cotangents)), jnp.float32)
    assert "shard_map" in program
    expected_outputs, expected_gradients = run(fused, args, cotangents, jnp.float32)
    for got, expected in zip([*outputs, *gradients], [*expected_outputs, *expected_gradients]):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_classifier_step_on_several_devices_is_told_to_turn_the_kernels_off(tiny_model_config):
    spec = StepSpec.for_model(tiny_model_config, "bf16", head=ClassifierHead(10), fused_kernels="pallas")
    with pytest.raises(InvalidInput, match="classifier fine-tuning step runs on one device only, not a mesh of 2"):
        build_step(spec, create_mesh(jax.devices()[:2]))
