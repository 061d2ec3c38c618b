"""Where a parameter meets 16-bit activations, with its gradient computed and summed over the batch in `grad_dtype`.

In a data-parallel step a parameter's gradient is a sum over the batch, and the batch is split over devices: the
gradient of a bf16 matmul is a bf16 product whose per-device parts XLA all-reduces in bf16 (so 384 devices add 384
partial sums with an 8-bit mantissa; OpenCLIP's DDP adds float32 gradients). Each function here computes its
result in the compute dtype as the plain expression would, but its backward produces the parameter's gradient in
`grad_dtype` (float32): a matmul's weight gradient accumulates into float32 (`preferred_element_type`), a bias's
or an embedding's sum runs in float32, and the all-reduce or reduce-scatter XLA inserts after it moves float32.

`grad_dtype=None` is the plain expression, autodiff's gradients in the compute dtype: what the fp32 policy runs
(nothing to widen) and what `grad_reduce_dtype="bfloat16"` asks for.
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The name `dense`'s result carries: a custom VJP hides its matmul from the remat policies that save matmul outputs,
# so those save this name too (`layers.resolve_remat_policy`).
MATMUL_OUTPUT = "mixed_precision_matmul"
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)  # `fp8_dense`'s two FP8 formats


def dense(x, kernel, bias, dtype, grad_dtype):
    """x @ kernel (+ bias) in `dtype`: `kernel` [in, out] and `bias` [out] (or None) in their stored dtype."""
    if grad_dtype is None:
        return _matmul(x.astype(dtype), kernel, bias)
    return checkpoint_name(_dense(x.astype(dtype), kernel, bias, jnp.dtype(grad_dtype)), MATMUL_OUTPUT)


def _matmul(x, kernel, bias):
    y = jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())))
    return y if bias is None else y + bias.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x, kernel, bias, grad_dtype):
    return _matmul(x, kernel, bias)


def _dense_forward(x, kernel, bias, grad_dtype):
    # The cast kernel, not the stored one: the backward needs it in the compute dtype, and (FSDP without remat)
    # it is what a replica would hold.
    return _dense(x, kernel, bias, grad_dtype), (x, kernel.astype(x.dtype), _like(kernel), _like(bias))


def _dense_backward(grad_dtype, saved, g):
    x, kernel, kernel_like, bias_like = saved
    return (g @ kernel.T, *_param_gradients(x, g, kernel_like, bias_like, grad_dtype))


def _param_gradients(x, g, kernel_like, bias_like, grad_dtype):
    """The kernel's gradient x^T g from the 16-bit x and g, accumulated in `grad_dtype`, and the bias's."""
    rows = tuple(range(x.ndim - 1))
    d_kernel = float16_widened_on_cpu(
        lambda x, g: jax.lax.dot_general(x, g, ((rows, rows), ((), ())), preferred_element_type=grad_dtype), x, g)
    d_bias = None if bias_like is None else jnp.sum(g.astype(grad_dtype), rows).astype(bias_like.dtype)
    return d_kernel.astype(kernel_like.dtype), d_bias


_dense.defvjp(_dense_forward, _dense_backward)


def fp8_dense(x, kernel, bias, dtype, grad_dtype):
    """`dense` with its two large products in FP8, each operand scaled by its own amax in this step (current
    scaling: no state): the forward x @ kernel in e4m3 x e4m3, the input gradient g @ kernel^T in e5m2 x e4m3 (the
    output gradient needs e5m2's range). The kernel's gradient x^T g stays a 16-bit product accumulated in
    `grad_dtype` (None: the compute dtype), as Wortsman et al. 2023 found FP8 weight gradients unstable. XLA:GPU
    runs the FP8 products as cuBLASLt FP8 GEMMs on GPUs that have them; elsewhere XLA emulates them."""
    grad_dtype = jnp.dtype(grad_dtype or dtype)
    return checkpoint_name(_fp8_dense(x.astype(dtype), kernel, bias, grad_dtype), MATMUL_OUTPUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_dense(x, kernel, bias, grad_dtype):
    y = _fp8_product(x, E4M3, kernel.astype(x.dtype), E4M3, ((x.ndim - 1,), (0,)))
    return y if bias is None else y + bias.astype(x.dtype)


def _fp8_dense_forward(x, kernel, bias, grad_dtype):
    return _fp8_dense(x, kernel, bias, grad_dtype), (x, kernel.astype(x.dtype), _like(kernel), _like(bias))


def _fp8_dense_backward(grad_dtype, saved, g):
    x, kernel, kernel_like, bias_like = saved
    d_x = _fp8_product(g, E5M2, kernel, E4M3, ((g.ndim - 1,), (1,)))
    return (d_x, *_param_gradients(x, g, kernel_like, bias_like, grad_dtype))


_fp8_dense.defvjp(_fp8_dense_forward, _fp8_dense_backward)


def _fp8_product(a, a_type, b, b_type, contracting):
    """a . b contracting `contracting` ((a's axis,), (b's axis,)), in a's dtype, from FP8 copies of both."""
    qa, scale_a = _quantize(a, a_type)
    qb, scale_b = _quantize(b, b_type)
    y = jax.lax.dot_general(qa, qb, (contracting, ((), ())), preferred_element_type=jnp.float32)
    return (y * (scale_a * scale_b)).astype(a.dtype)


def _quantize(t, fp8_type):
    """(t / s in `fp8_type`, s), s = amax(|t|) / the type's largest value (float32; 1 for an all-zero t)."""
    largest = float(jnp.finfo(fp8_type).max)
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    return jnp.clip(t.astype(jnp.float32) / scale, -largest, largest).astype(fp8_type), scale


def add(x, param, grad_dtype):
    """x + param, `param` broadcast over x's leading axes and cast to x's dtype (a positional embedding)."""
    if grad_dtype is None:
        return x + param.astype(x.dtype)
    return _add(x, param, jnp.dtype(grad_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add(x, param, grad_dtype):
    return x + param.astype(x.dtype)


def _add_forward(x, param, grad_dtype):
    return _add(x, param, grad_dtype), param


def _add_backward(grad_dtype, param, g):
    return g, _sum_to(g, param, grad_dtype)


_add.defvjp(_add_forward, _add_backward)


def scale(x, param, grad_dtype):
    """x * param, `param` broadcast over x's leading axes and cast to x's dtype (LayerScale, a per-head scale)."""
    if grad_dtype is None:
        return x * param.astype(x.dtype)
    return _scale(x, param, jnp.dtype(grad_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scale(x, param, grad_dtype):
    return x * param.astype(x.dtype)


def _scale_forward(x, param, grad_dtype):
    return _scale(x, param, grad_dtype), (x, param)


def _scale_backward(grad_dtype, saved, g):
    x, param = saved
    return g * param.astype(g.dtype), _sum_to(g.astype(grad_dtype) * x.astype(grad_dtype), param, grad_dtype)


_scale.defvjp(_scale_forward, _scale_backward)


def broadcast(param, shape, dtype, grad_dtype):
    """`param` cast to `dtype` and broadcast to `shape` (a class token for every sample)."""
    return add(jnp.zeros(shape, dtype), param, grad_dtype)


def embed(table, ids, dtype, grad_dtype):
    """Rows `ids` of `table` [vocab, width] in `dtype`. Gathering before the cast gives the same rows; its backward
    (a scatter-add of the batch's rows) then adds in `grad_dtype` (or the table's dtype if wider)."""
    if grad_dtype is None:
        return jnp.take(table.astype(dtype), ids, axis=0)
    return jnp.take(table.astype(jnp.promote_types(table.dtype, grad_dtype)), ids, axis=0).astype(dtype)


def float16_widened_on_cpu(fn, *operands):
    """`fn(*operands)`, except in a program lowered for a CPU with a float16 operand: there the float16 operands are
    widened to float32 and the results cast back to `fn`'s dtypes. XLA's CPU backend has no float16 x float16 ->
    float32 product ("F16_F16_F32 is not supported by dot_general"), which a GPU runs on its tensor cores. The choice
    is made where the program is lowered (`lax.platform_dependent`), so a GPU program planned on a CPU keeps its
    float16 operands; without a float16 operand `fn` is called as it is."""
    if not any(jnp.dtype(x.dtype) == jnp.float16 for x in operands):
        return fn(*operands)
    result_types = jax.eval_shape(fn, *operands)

    def widened(*operands):
        results = fn(*(x.astype(jnp.float32) if jnp.dtype(x.dtype) == jnp.float16 else x for x in operands))
        return jax.tree.map(lambda y, t: y.astype(t.dtype), results, result_types)

    return jax.lax.platform_dependent(*operands, cpu=widened, default=fn)


def _like(param):
    """A zero-size stand-in that carries `param`'s dtype (and None for None) into a backward."""
    return None if param is None else jnp.zeros((0,), param.dtype)


def _sum_to(g, param, grad_dtype):
    """g summed, in `grad_dtype`, over its leading axes down to `param`'s shape, in `param`'s dtype."""
    leading = g.ndim - param.ndim
    summed = jnp.sum(g.astype(grad_dtype), tuple(range(leading)))
    keep = tuple(i for i, n in enumerate(param.shape) if n == 1 and summed.shape[i] != 1)
    return jnp.sum(summed, keep, keepdims=True).astype(param.dtype)
