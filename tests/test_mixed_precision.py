"""16-bit compute without float32 copies or bf16 sums: the LayerNorm and GELU backward keep only the 16-bit input
(and per-row float32 statistics) and still give the float32 arithmetic's gradients; a parameter's gradient is
computed and summed over the batch in float32 (`grad_dtype`), where autodiff would add bf16 products."""

import contextlib
import io
import re
from unittest import mock

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from clip_jax.models import layers, mixed_precision
from clip_jax.models.layers import LayerNorm, ResidualBlock, gelu

BF16_ROUNDING = 2.0**-8  # a bf16 value's relative rounding, at most


def bf16_normal(rng, *shape, scale=1.0, shift=0.0):
    return jnp.asarray(rng.normal(size=shape) * scale + shift, jnp.bfloat16)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def layer_norm_f64(x, scale, bias, eps=layers.LN_EPS):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def vjp_f64(f, args, cotangent):
    """The float64 gradients of `f` at `args` (float64 arrays) against `cotangent`: autodiff with x64 enabled."""
    with jax.enable_x64(True):
        _, pullback = jax.vjp(f, *[jnp.asarray(a, jnp.float64) for a in args])
        return [np.asarray(g) for g in pullback(jnp.asarray(cotangent, jnp.float64))]


def test_bf16_layer_norm_gives_the_float64_gradients_of_its_bf16_inputs():
    rng = np.random.default_rng(0)
    x, g = bf16_normal(rng, 4, 6, 64, scale=3.0, shift=1.0), bf16_normal(rng, 4, 6, 64)
    norm = LayerNorm(jnp.bfloat16)
    params = {"params": {"scale": jnp.asarray(rng.normal(size=64), jnp.float32),
                         "bias": jnp.asarray(rng.normal(size=64), jnp.float32)}}
    y, pullback = jax.vjp(lambda p, x: norm.apply(p, x), params, x)
    d_params, d_x = pullback(g)
    scale, bias = (f64(params["params"][k]) for k in ("scale", "bias"))
    ref_dx, ref_dscale, ref_dbias = vjp_f64(lambda x, s, b: layer_norm_f64(x, s, b), (f64(x), scale, bias), f64(g))
    assert y.dtype == d_x.dtype == jnp.bfloat16
    with jax.enable_x64(True):
        expected_y = np.asarray(layer_norm_f64(jnp.asarray(f64(x)), jnp.asarray(scale), jnp.asarray(bias)))
    assert np.max(np.abs(f64(y) - expected_y)) <= BF16_ROUNDING * np.max(np.abs(expected_y))
    assert np.max(np.abs(f64(d_x) - ref_dx)) <= BF16_ROUNDING * np.max(np.abs(ref_dx))
    # the parameters' gradients are float32 sums over every row: float32 rounding only
    np.testing.assert_allclose(f64(d_params["params"]["scale"]), ref_dscale, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(d_params["params"]["bias"]), ref_dbias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quick, approximate", [(False, "none"), (False, "tanh"), (True, "none")])
def test_bf16_gelu_gives_the_float64_gradient_of_its_bf16_input(quick, approximate):
    rng = np.random.default_rng(1)
    x, g = bf16_normal(rng, 8, 128, scale=2.0), bf16_normal(rng, 8, 128)
    y, pullback = jax.vjp(lambda x: gelu(x, quick, approximate), x)
    (d_x,) = pullback(g)

    def reference(x):
        if quick:
            return x * jax.nn.sigmoid(1.702 * x)
        return jax.nn.gelu(x, approximate=approximate == "tanh")

    with jax.enable_x64(True):
        expected_y = np.asarray(reference(jnp.asarray(f64(x))))
    (ref_dx,) = vjp_f64(reference, (f64(x),), f64(g))
    assert y.dtype == d_x.dtype == jnp.bfloat16
    # one rounding to bf16 of the float32 result (autodiff's bf16 GELU rounds every intermediate)
    assert np.max(np.abs(f64(y) - expected_y) / np.maximum(np.abs(expected_y), 1e-3)) <= BF16_ROUNDING
    assert np.max(np.abs(f64(d_x) - ref_dx)) <= BF16_ROUNDING * np.max(np.abs(ref_dx))


def saved_activations(f, *args) -> list[tuple[str, str]]:
    """(dtype, line) of every residual autodiff keeps for `f`'s backward that is shaped like an activation (three
    or more dimensions, the last wider than 1: not a parameter, not per-row statistics), outside the attention
    kernels (`models/attention.py`, whose softmax is XLA's)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    found = []
    for line in printed.getvalue().splitlines():
        match = re.match(r"(\w+)\[([\d,]*)\]", line)
        dims = [int(d) for d in match[2].split(",") if d] if match else []
        if len(dims) >= 3 and dims[-1] > 1 and "models/attention.py" not in line:
            found.append((match[1], line))
    return found


def test_a_bf16_residual_blocks_backward_keeps_no_float32_activation():
    block = ResidualBlock(64, 4, 256, 2, dtype=jnp.bfloat16, grad_dtype=jnp.float32)
    x = jnp.ones((4, 8, 64), jnp.bfloat16)
    params = block.init(jax.random.key(0), x, None)
    loss = lambda p, x: jnp.sum(block.apply(p, x, None)[0].astype(jnp.float32))  # noqa: E731
    kept = saved_activations(loss, params, x)
    assert len(kept) >= 8 and {dtype for dtype, _ in kept} == {"bf16"}, kept
    with mock.patch.object(layers, "is_16_bit", lambda dtype: False):  # autodiff's LayerNorm and GELU
        plain = saved_activations(loss, params, x)
    assert any(dtype == "f32" for dtype, _ in plain)


def test_parameter_gradients_are_float32_sums_of_the_bf16_products():
    """Against float64 sums of the same bf16 values, each `mixed_precision` gradient with grad_dtype float32 is off
    by float32 rounding; the plain bf16 expression's by bf16 rounding."""
    rng = np.random.default_rng(2)
    x, g = bf16_normal(rng, 64, 16, 96), bf16_normal(rng, 64, 16, 32)
    kernel, bias = jnp.asarray(rng.normal(size=(96, 32)), jnp.float32), jnp.asarray(rng.normal(size=32), jnp.float32)
    row = jnp.asarray(rng.normal(size=96), jnp.float32)

    def gradients(grad_dtype):
        dense = lambda k, b: mixed_precision.dense(x, k, b, jnp.bfloat16, grad_dtype)  # noqa: E731
        d_kernel, d_bias = jax.vjp(dense, kernel, bias)[1](g)
        (d_add,) = jax.vjp(lambda p: mixed_precision.add(x, p, grad_dtype), row)[1](x)
        (d_scale,) = jax.vjp(lambda p: mixed_precision.scale(x, p, grad_dtype), row)[1](x)
        return {"kernel": d_kernel, "bias": d_bias, "add": d_add, "scale": d_scale}

    xs, gs = f64(x), f64(g)
    expected = {"kernel": np.einsum("bti,bto->io", xs, gs), "bias": gs.sum((0, 1)), "add": xs.sum((0, 1)),
                "scale": (xs * xs).sum((0, 1))}
    wide, plain = gradients(jnp.float32), gradients(None)
    for name, reference in expected.items():
        wide_error = np.max(np.abs(f64(wide[name]) - reference)) / np.max(np.abs(reference))
        plain_error = np.max(np.abs(f64(plain[name]) - reference)) / np.max(np.abs(reference))
        assert wide[name].dtype == jnp.float32, name
        assert wide_error < 1e-5, (name, wide_error)
        assert plain_error > 20 * wide_error, (name, plain_error, wide_error)


def test_an_embedding_gathered_in_float32_gives_the_same_rows_and_a_float32_gradient():
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(size=(50, 16)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 50, size=(8, 5)), jnp.int32)
    wide, pullback = jax.vjp(lambda t: mixed_precision.embed(t, ids, jnp.bfloat16, jnp.float32), table)
    plain = mixed_precision.embed(table, ids, jnp.bfloat16, None)
    np.testing.assert_array_equal(np.asarray(wide, np.float32), np.asarray(plain, np.float32))
    (d_table,) = pullback(jnp.ones_like(wide))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=50)
    np.testing.assert_array_equal(np.asarray(d_table), np.repeat(counts[:, None], 16, axis=1))


def test_fp8_dense_is_the_product_to_fp8_rounding_and_keeps_the_16_bit_weight_gradient():
    """Forward e4m3 x e4m3 and input gradient e5m2 x e4m3, each operand scaled by its amax: off the float64
    product by FP8's rounding (e4m3 keeps 3 mantissa bits, e5m2 2: measured 2.4% and 5.9% here); the kernel's and
    bias's gradients are `dense`'s, bit for bit."""
    rng = np.random.default_rng(4)
    x, g = bf16_normal(rng, 32, 16, 256), bf16_normal(rng, 32, 16, 128)
    kernel = jnp.asarray(rng.normal(size=(256, 128)) * 0.05, jnp.float32)
    bias = jnp.asarray(rng.normal(size=128), jnp.float32)
    y, pullback = jax.vjp(lambda x, k, b: mixed_precision.fp8_dense(x, k, b, jnp.bfloat16, jnp.float32),
                          x, kernel, bias)
    d_x, d_kernel, d_bias = pullback(g)
    _, plain_pullback = jax.vjp(lambda x, k, b: mixed_precision.dense(x, k, b, jnp.bfloat16, jnp.float32), x, kernel,
                                bias)
    _, plain_kernel, plain_bias = plain_pullback(g)
    k64 = f64(kernel.astype(jnp.bfloat16))
    expected_y, expected_dx = f64(x) @ k64 + f64(bias.astype(jnp.bfloat16)), f64(g) @ k64.T
    relative = lambda a, b: np.linalg.norm(f64(a) - b) / np.linalg.norm(b)  # noqa: E731
    assert y.dtype == d_x.dtype == jnp.bfloat16
    assert 0.005 < relative(y, expected_y) < 0.06
    assert 0.01 < relative(d_x, expected_dx) < 0.09
    np.testing.assert_array_equal(np.asarray(d_kernel), np.asarray(plain_kernel))
    np.testing.assert_array_equal(np.asarray(d_bias), np.asarray(plain_bias))
