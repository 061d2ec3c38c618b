"""The residual add and the LayerNorm after it as Pallas kernels (Triton's on a GPU): one pass forward, one back.

`residual_layer_norm(x, y, scale, bias, ...)` is `(s, LayerNorm(s))` with `s = x + y` in x's dtype (`x` itself when
`y` is None), the statistics in float32 and the normed rows rounded once to the next product's dtype. Its backward
takes both cotangents, the normed rows' and the residual stream's, and writes the input gradient once:
`d_s + LayerNorm'(d_normed)`, with the scale's and bias's gradients as float32 column sums per block of rows, summed
after. XLA on its own writes the LayerNorm's input gradient, reads it back for the residual add, and writes the
float32 `g * normed` its column sums read (benchmarks/RESULTS.md section 34).

Triton's lowering takes power-of-two blocks only: `supports` says whether a width and its parameters fit; a residual
block falls back to `layers.LayerNorm` where they do not. `interpret=True` runs the same kernels through Pallas's
interpreter, on any backend (the CPU tests' way).
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton
from jax.sharding import PartitionSpec as P

FUSED_KERNELS = ("off", "pallas", "pallas_interpret")  # a model's `fused_kernels`: off, Triton, the interpreter
BLOCK_ROWS = 16  # rows per program, at most (a power of two that divides the rows)
NUM_WARPS = 4


def supports(width: int, use_scale: bool, use_bias: bool) -> bool:
    """Whether the kernels take LayerNorms of this width and parameters (power-of-two widths, scale and bias)."""
    return use_scale and use_bias and width > 0 and width & (width - 1) == 0


def _block_rows(rows: int) -> int:
    block = BLOCK_ROWS
    while rows % block:
        block //= 2
    return block


def _call(kernel, name: str, inputs, outputs, interpret: bool, partial_sums: int = 0):
    """`kernel` over blocks of rows of `inputs` ([rows, columns] arrays split by rows, [width] ones whole); `outputs`:
    the (columns, dtype) of each [rows, columns] result, then `partial_sums` float32 [blocks, width] ones. Under a
    mesh (`jax.sharding.use_abstract_mesh`, as the train step sets it), each device runs it on its own rows: a Triton
    call has no partitioning rule, and XLA would gather every device's rows for it."""
    call = functools.partial(_call_on_rows, kernel, name, outputs=outputs, interpret=interpret,
                             partial_sums=partial_sums)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return call(*inputs)
    rows = P(mesh.axis_names)
    in_specs = tuple(P() if a.ndim == 1 else rows for a in inputs)
    return jax.shard_map(call, in_specs=in_specs, out_specs=(rows,) * (len(outputs) + partial_sums),
                         check_vma=False)(*inputs)


def _call_on_rows(kernel, name: str, *inputs, outputs, interpret: bool, partial_sums: int):
    rows, width = inputs[0].shape[0], inputs[-1].shape[0]  # the last input: a [width] parameter
    block = _block_rows(rows)
    grid = rows // block

    def spec(shape):
        if len(shape) == 1:
            return pl.BlockSpec((width,), lambda i: (0,))
        return pl.BlockSpec((block, shape[1]), lambda i: (i, 0))

    out_shapes = [jax.ShapeDtypeStruct((rows, columns), dtype) for columns, dtype in outputs]
    out_shapes += [jax.ShapeDtypeStruct((grid, width), jnp.float32)] * partial_sums
    out_specs = [spec(s.shape) for s in out_shapes[:len(outputs)]]
    out_specs += [pl.BlockSpec((1, width), lambda i: (i, 0))] * partial_sums
    return pl.pallas_call(kernel, grid=(grid,), in_specs=[spec(a.shape) for a in inputs], out_specs=out_specs,
                          out_shape=out_shapes, interpret=interpret, name=name,
                          compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS))(*inputs)


def _forward_kernel(*refs, has_y: bool, eps: float):
    if has_y:
        x_ref, y_ref, scale_ref, bias_ref, s_ref, normed_ref, mean_ref, rstd_ref = refs
        s = (x_ref[...].astype(jnp.float32) + y_ref[...].astype(jnp.float32)).astype(s_ref.dtype)
        s_ref[...] = s
    else:
        x_ref, scale_ref, bias_ref, normed_ref, mean_ref, rstd_ref = refs
        s = x_ref[...]
    s = s.astype(jnp.float32)  # [R, W]
    mean = jnp.mean(s, axis=1, keepdims=True)  # [R, 1]
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(s - mean), axis=1, keepdims=True) + eps)
    normed = (s - mean) * rstd * scale_ref[...].astype(jnp.float32)[None] + bias_ref[...].astype(jnp.float32)[None]
    normed_ref[...] = normed.astype(normed_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _backward_kernel(s_ref, mean_ref, rstd_ref, d_normed_ref, d_s_ref, scale_ref, d_x_ref, d_scale_ref, d_bias_ref):
    rstd = rstd_ref[...]  # [R, 1]
    normed = (s_ref[...].astype(jnp.float32) - mean_ref[...]) * rstd  # [R, W], before scale and bias
    g = d_normed_ref[...].astype(jnp.float32)
    d_scale_ref[...] = jnp.sum(g * normed, axis=0, keepdims=True)  # [1, W]: this block's part
    d_bias_ref[...] = jnp.sum(g, axis=0, keepdims=True)
    g = g * scale_ref[...].astype(jnp.float32)[None]
    d_x = rstd * (g - jnp.mean(g, axis=1, keepdims=True) - normed * jnp.mean(g * normed, axis=1, keepdims=True))
    d_x_ref[...] = (d_x + d_s_ref[...].astype(jnp.float32)).astype(d_x_ref.dtype)


def _forward(x, y, scale, bias, eps, out_dtype, interpret):
    """(s, normed, mean, rstd): s [..., W] in x's dtype, normed in `out_dtype`, the statistics [rows, 1] float32."""
    width = x.shape[-1]
    rows = x.size // width
    inputs = [x.reshape(rows, width)] + ([] if y is None else [y.reshape(rows, width)]) + [scale, bias]
    outputs = ([] if y is None else [(width, x.dtype)]) + [(width, jnp.dtype(out_dtype)), (1, jnp.float32),
                                                            (1, jnp.float32)]
    kernel = functools.partial(_forward_kernel, has_y=y is not None, eps=eps)
    results = _call(kernel, "residual_layer_norm", inputs, outputs, interpret)
    s = x if y is None else results[0].reshape(x.shape)
    normed, mean, rstd = results[-3:]
    return s, normed.reshape(x.shape), mean, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def residual_layer_norm(x, y, scale, bias, eps: float, out_dtype, interpret: bool = False):
    """(x + y in x's dtype, its LayerNorm in `out_dtype`); `y` None: (x, LayerNorm(x)), whose backward still adds
    the residual stream's gradient to the LayerNorm's in one pass. x, y: [..., W]; scale, bias: [W]."""
    return _forward(x, y, scale, bias, eps, out_dtype, interpret)[:2]


def _residual_layer_norm_forward(x, y, scale, bias, eps, out_dtype, interpret):
    s, normed, mean, rstd = _forward(x, y, scale, bias, eps, out_dtype, interpret)
    y_like = None if y is None else jnp.zeros((0,), y.dtype)  # y's dtype, for its gradient
    return (s, normed), (s, mean, rstd, scale, bias, y_like)


def _residual_layer_norm_backward(eps, out_dtype, interpret, saved, cotangents):
    s, mean, rstd, scale, bias, y_like = saved
    d_s, d_normed = cotangents
    width = s.shape[-1]
    rows = s.size // width
    flat = lambda a: a.reshape(rows, width)  # noqa: E731
    inputs = [flat(s), mean, rstd, flat(d_normed), flat(d_s), scale]
    d_x, d_scale, d_bias = _call(_backward_kernel, "residual_layer_norm_backward", inputs, [(width, s.dtype)],
                                 interpret, partial_sums=2)
    d_x = d_x.reshape(s.shape)
    d_y = None if y_like is None else d_x.astype(y_like.dtype)
    return d_x, d_y, d_scale.sum(0).astype(scale.dtype), d_bias.sum(0).astype(bias.dtype)


residual_layer_norm.defvjp(_residual_layer_norm_forward, _residual_layer_norm_backward)


def residual_norms(fused_kernels: str, block, width: int, dtype, param_dtype, norm):
    """A residual block's `(name, x, y) -> (x + y, LayerNorm(x + y))` (y None: no add): `ResidualLayerNorm` where
    `fused_kernels` asks for the kernels and they take the block's LayerNorms (`block`: its `BlockConfig`), else
    the add in x's dtype and `norm(name)`, the block's `layers.LayerNorm`."""
    if fused_kernels != "off" and supports(width, block.norm_scale, block.norm_bias):
        interpret = fused_kernels == "pallas_interpret"
        return lambda name, x, y: ResidualLayerNorm(dtype, param_dtype, block.norm_eps, interpret, name=name)(x, y)

    def add_norm(name, x, y):
        if y is not None:
            x = x + y.astype(x.dtype)
        return x, norm(name)(x)
    return add_norm


class ResidualLayerNorm(nn.Module):
    """`(x + y, LayerNorm(x + y))` (`(x, LayerNorm(x))` without `y`): `residual_layer_norm` with `layers.LayerNorm`'s
    parameters, by the same names; its output in `dtype`. `interpret`: through Pallas's interpreter."""

    dtype: Any
    param_dtype: Any
    eps: float
    interpret: bool = False

    @nn.compact
    def __call__(self, x, y=None):
        width = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (width,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (width,), self.param_dtype)
        return residual_layer_norm(x, y, scale, bias, self.eps, jnp.dtype(self.dtype), self.interpret)
