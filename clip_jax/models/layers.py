"""The transformer pieces both towers share: LayerNorm, attention, MLP, the residual block and the scanned stack.

Parameter names follow OpenCLIP's state_dict (`ln_1`, `attn.in_proj`, `mlp.c_fc`, ...), so conversion is a matter of
transposes. Parameters are stored in `param_dtype` and cast to the compute `dtype` where they are used; LayerNorm
statistics are always computed in float32.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from clip_jax.models import fused_layer_norm, mixed_precision
from clip_jax.models.attention import attention
from clip_jax.models.config import BlockConfig
from clip_jax.models.remat import resolve_remat_policy

LN_EPS = 1e-5  # OpenCLIP's (torch's) LayerNorm epsilon; Flax defaults to 1e-6
LOGIT_SCALE_MAX = math.log(100.0)  # the clamp of scaled cosine attention's per-head scale (OpenCLIP's ln(1 / 0.01))

Dtype = Any


def gelu(x, quick: bool = False, approximate: str = "none"):
    """Exact (erf) GELU as OpenCLIP uses; QuickGELU x * sigmoid(1.702 x) for OpenAI's original weights; the tanh
    approximation when a tower's act_kwargs ask for torch's `approximate="tanh"`. A 16-bit `x` is computed in
    float32 and rounded once; its backward keeps only `x` and recomputes the rest (`_lean_gelu`)."""
    if is_16_bit(x.dtype):
        return _lean_gelu(x, quick, approximate)
    return _gelu(x, quick, approximate)


def is_16_bit(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 2


def _gelu(x, quick: bool, approximate: str):
    if quick:
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _lean_gelu(x, quick: bool, approximate: str):
    return _gelu(x.astype(jnp.float32), quick, approximate).astype(x.dtype)


def _lean_gelu_forward(x, quick, approximate):
    return _lean_gelu(x, quick, approximate), x  # the 16-bit input is all the backward keeps


def _lean_gelu_backward(quick, approximate, x, cotangent):
    return (_gelu_input_gradient(x.astype(jnp.float32), cotangent.astype(jnp.float32), quick, approximate)
            .astype(x.dtype),)


def _gelu_input_gradient(x, cotangent, quick: bool, approximate: str):
    """The float32 cotangent times GELU'(x), written out: XLA fuses it into one pass with the rounding to 16 bits
    (autodiff's pullback of `jax.nn.gelu` made it write the float32 [batch, tokens, mlp_width] gradient and read it
    back for the bias's sum: benchmarks/RESULTS.md section 34)."""
    return cotangent * _gelu_derivative(x, quick, approximate)


def _gelu_derivative(x, quick: bool, approximate: str):
    if quick:  # d/dx x s(a x) = s + a x s (1 - s)
        s = jax.nn.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1.0 - s)
    if approximate == "tanh":  # d/dx x (1 + tanh u) / 2, u = sqrt(2 / pi) (x + 0.044715 x^3)
        t = jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * math.sqrt(2.0 / math.pi) * (1.0 + 3 * 0.044715 * x * x)
    # d/dx x Phi(x) = Phi(x) + x phi(x)
    return 0.5 * (1.0 + jax.lax.erf(x * math.sqrt(0.5))) + x * jnp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


_lean_gelu.defvjp(_lean_gelu_forward, _lean_gelu_backward)


class LayerNorm(nn.Module):
    """LayerNorm with OpenCLIP's (torch's) eps 1e-5 by default, statistics in float32, output in the compute dtype.
    `use_scale` / `use_bias` False: torch's `elementwise_affine=False` / `bias=False` (no such parameter). A 16-bit
    input or output runs `_lean_layer_norm` (the same float32 arithmetic, a backward that keeps less)."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    eps: float = LN_EPS
    use_scale: bool = True
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        scale = bias = None
        if self.use_scale:
            scale = self.param("scale", nn.initializers.ones, (width,), self.param_dtype)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (width,), self.param_dtype)
        if is_16_bit(x.dtype) or is_16_bit(self.dtype):
            return _lean_layer_norm(x, scale, bias, self.eps, jnp.dtype(self.dtype))
        return _layer_norm(x, scale, bias, self.eps)[0].astype(self.dtype)


def _layer_norm(x, scale, bias, eps: float):
    """(y, mean, 1 / std) in float32, the statistics per row (over the last axis)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + eps)
    y = (x32 - mean) * rstd
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y, mean, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _lean_layer_norm(x, scale, bias, eps: float, out_dtype):
    """LayerNorm of a 16-bit `x` whose backward keeps `x` and the per-row float32 statistics, not autodiff's float32
    copies of `x`, `x - mean` and the normalised rows (two to three times the bytes of every activation)."""
    return _layer_norm(x, scale, bias, eps)[0].astype(out_dtype)


def _lean_layer_norm_forward(x, scale, bias, eps, out_dtype):
    y, mean, rstd = _layer_norm(x, scale, bias, eps)
    return y.astype(out_dtype), (x, scale, bias, mean, rstd)


def _lean_layer_norm_backward(eps, out_dtype, saved, cotangent):
    x, scale, bias, mean, rstd = saved
    g = cotangent.astype(jnp.float32)
    normed = (x.astype(jnp.float32) - mean) * rstd
    rows = tuple(range(x.ndim - 1))
    d_scale = None if scale is None else jnp.sum(g * normed, rows).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(g, rows).astype(bias.dtype)
    if scale is not None:
        g = g * scale.astype(jnp.float32)
    d_x = rstd * (g - g.mean(-1, keepdims=True) - normed * (g * normed).mean(-1, keepdims=True))
    return d_x.astype(x.dtype), d_scale, d_bias


_lean_layer_norm.defvjp(_lean_layer_norm_forward, _lean_layer_norm_backward)


def tower_norm(block: BlockConfig, dtype, param_dtype, name: str | None = None) -> LayerNorm:
    """A LayerNorm with the tower's norm_kwargs (eps, affine, bias)."""
    return LayerNorm(dtype, param_dtype, block.norm_eps, block.norm_scale, block.norm_bias, name=name)


class LayerScale(nn.Module):
    """x * gamma, gamma a learned per-channel vector starting at `init_value` (CaiT's LayerScale; `ls_1`, `ls_2`)."""

    init_value: float
    param_dtype: Dtype = jnp.float32
    grad_dtype: Dtype | None = None

    @nn.compact
    def __call__(self, x):
        gamma = self.param("gamma", nn.initializers.constant(self.init_value), (x.shape[-1],), self.param_dtype)
        return mixed_precision.scale(x, gamma, self.grad_dtype)


class Dense(nn.Module):
    """`flax.linen.Dense`'s parameters (`kernel` [in, out], `bias` [out]) and result, its kernel's and bias's
    gradients in `grad_dtype` (see `mixed_precision`; None: the compute dtype); `fp8`: its products in FP8
    (`mixed_precision.fp8_dense`)."""

    features: int
    kernel_init: Callable
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    grad_dtype: Dtype | None = None
    fp8: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        product = mixed_precision.fp8_dense if self.fp8 else mixed_precision.dense
        return product(x, kernel, bias, self.dtype, self.grad_dtype)


def _unit(x, dtype):
    """x / max(|x|, 1e-12) along the last axis in float32 (torch's F.normalize), cast to `dtype`."""
    x = x.astype(jnp.float32)
    return (x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)).astype(dtype)


class Attention(nn.Module):
    """Multi-head self-attention with a packed q,k,v projection (`in_proj`) and an output projection, plus the
    custom block's options (see `BlockConfig`). Every option runs through `jax.nn.dot_product_attention`, so the
    fused kernel stays usable: scaled cosine attention folds its per-head scale into the unit queries and asks
    for a logit factor of 1."""

    width: int
    heads: int
    causal: bool
    out_std: float
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention_impl: str | None = None
    block: BlockConfig = BlockConfig()
    grad_dtype: Dtype | None = None
    fp8: bool = False  # in_proj and out_proj in FP8

    @nn.compact
    def __call__(self, x, mask=None):  # [B, T, W]
        batch, length, _ = x.shape
        head_dim = self.width // self.heads
        opts = self.block
        qkv = Dense(3 * self.width, nn.initializers.normal(self.width**-0.5), self.dtype, self.param_dtype,
                    self.grad_dtype, self.fp8, name="in_proj")(x)  # [B, T, 3W]
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.heads, head_dim), 3, axis=2)  # [B, T, N, H] each
        scale = None
        if opts.scaled_cosine_attn:  # Swin-V2: cos(q, k) * exp(min(s_head, ln 100)), s_head learned, init ln 10
            logit_scale = self.param("logit_scale", nn.initializers.constant(math.log(10.0)), (self.heads, 1, 1),
                                     self.param_dtype)
            head_factor = jnp.exp(jnp.minimum(logit_scale.astype(jnp.float32), LOGIT_SCALE_MAX)).reshape(self.heads, 1)
            q = _unit(q, jnp.float32) * head_factor
            q, k, scale = q.astype(self.dtype), _unit(k, self.dtype), 1.0
        elif opts.qk_norm:
            q = tower_norm(opts, self.dtype, self.param_dtype, "ln_q")(q)
            k = tower_norm(opts, self.dtype, self.param_dtype, "ln_k")(k)
        out = attention(q, k, v, self.causal, self.attention_impl, mask=mask, scale=scale)  # [B, T, N, H]
        if opts.scale_heads:  # NormFormer's per-head scale of the attention output
            head_scale = self.param("head_scale", nn.initializers.ones, (self.heads, 1, 1), self.param_dtype)
            out = mixed_precision.scale(out, head_scale.reshape(self.heads, 1), self.grad_dtype)
        out = out.reshape(batch, length, self.width)
        if opts.scale_attn_inner:
            out = tower_norm(opts, self.dtype, self.param_dtype, "ln_inner")(out)
        return Dense(self.width, nn.initializers.normal(self.out_std), self.dtype, self.param_dtype, self.grad_dtype,
                     self.fp8, name="out_proj")(out)


class MLP(nn.Module):
    width: int
    mlp_width: int
    out_std: float
    quick_gelu: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    block: BlockConfig = BlockConfig()
    grad_dtype: Dtype | None = None
    fp8: bool = False  # c_fc and c_proj in FP8

    @nn.compact
    def __call__(self, x):
        x = Dense(self.mlp_width, nn.initializers.normal((2 * self.width) ** -0.5), self.dtype, self.param_dtype,
                  self.grad_dtype, self.fp8, name="c_fc")(x)
        x = gelu(x, self.quick_gelu, self.block.gelu_approximate)
        if self.block.scale_fc:  # NormFormer's LayerNorm after the activation
            x = tower_norm(self.block, self.dtype, self.param_dtype, "ln")(x)
        return Dense(self.width, nn.initializers.normal(self.out_std), self.dtype, self.param_dtype, self.grad_dtype,
                     self.fp8, name="c_proj")(x)


class ResidualBlock(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); with the block's options,
    x + ls_1(ln_attn(attn(ln_1(x)))), then x + ls_2(mlp(ln_2(x))). Scan-shaped: (carry, mask) -> (carry, None),
    the attention `mask` (or None) the same for every layer; with `emit`, (carry, carry): the scan stacks every
    block's output."""

    width: int
    heads: int
    mlp_width: int
    layers: int
    causal: bool = False
    quick_gelu: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention_impl: str | None = None
    block: BlockConfig = BlockConfig()
    grad_dtype: Dtype | None = None
    fp8: bool = False
    emit: bool = False
    fused_kernels: str = "off"  # see `Transformer`

    @nn.compact
    def __call__(self, x, mask):  # x: the residual stream, in its own dtype; each branch adds in it
        # Output projections start smaller as depth grows, as in OpenCLIP's text tower initialisation.
        out_std = self.width**-0.5 * (2 * self.layers) ** -0.5
        opts = self.block
        norm = lambda name: tower_norm(opts, self.dtype, self.param_dtype, name)  # noqa: E731
        add_norm = fused_layer_norm.residual_norms(self.fused_kernels, opts, self.width, self.dtype,
                                                   self.param_dtype, norm)
        x, normed = add_norm("ln_1", x, None)
        y = Attention(self.width, self.heads, self.causal, out_std, self.dtype, self.param_dtype,
                      self.attention_impl, opts, self.grad_dtype, self.fp8, name="attn")(normed, mask)
        if opts.scale_attn:
            y = norm("ln_attn")(y)
        if opts.ls_init_value is not None:
            y = LayerScale(opts.ls_init_value, self.param_dtype, self.grad_dtype, name="ls_1")(y)
        x, normed = add_norm("ln_2", x, y)
        y = MLP(self.width, self.mlp_width, out_std, self.quick_gelu, self.dtype, self.param_dtype, opts,
                self.grad_dtype, self.fp8, name="mlp")(normed)
        if opts.ls_init_value is not None:
            y = LayerScale(opts.ls_init_value, self.param_dtype, self.grad_dtype, name="ls_2")(y)
        x = x + y.astype(x.dtype)
        return x, (x if self.emit else None)


class Transformer(nn.Module):
    """`layers` residual blocks stacked with `nn.scan` (one compiled block whatever the depth), each optionally
    rematerialised under a named `jax.checkpoint` policy. Parameters under `resblocks` carry a leading layer axis.

    `layer_params_hook(variables, layers=...)`, when set, maps the parameters of the layer being run
    (`{"params": {...}}`, without the layer axis; `layers`: the depth of the stack they come from) before the block
    uses them, inside the scan and inside remat: the train step gathers FSDP-split weights with it one layer at a
    time. It applies when the model is applied, not when it is initialised.

    `mask` ([B, 1, T, T] bool, [B] int key lengths, or None): an attention mask every block applies on top of
    `causal` (see `attention.attention`).
    `residual_dtype`: the residual stream's dtype through the blocks and out of them (None: the compute dtype).
    `emit_states`: also return every block's output, stacked [layers, B, T, W] (the towers' hidden states).
    `unroll_layers`: the scan unrolled, every block its own code (the same parameters): what a block saves for the
    backward stays where it was written, not copied into zero-filled [layers, ...] stacks and sliced back out
    (benchmarks/RESULTS.md section 36); the program grows with the depth. Its remat has `prevent_cse` on, so that
    XLA does not merge the backward's recompute with the forward (a scanned loop's body never is: off there).
    """

    width: int
    layers: int
    heads: int
    mlp_width: int
    causal: bool = False
    quick_gelu: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"
    attention_impl: str | None = None
    layer_params_hook: Callable | None = None
    block: BlockConfig = BlockConfig()
    grad_dtype: Dtype | None = None
    residual_dtype: Dtype | None = None
    fp8: bool = False  # each block's four matmuls in FP8 (`mixed_precision.fp8_dense`)
    # "pallas": each block's residual adds and LayerNorms as Pallas kernels (`fused_layer_norm`; Triton's, for a GPU),
    # "pallas_interpret" the same through Pallas's interpreter (tests on a CPU); "off": XLA's fusions
    fused_kernels: str = "off"
    unroll_layers: bool = False

    @nn.compact
    def __call__(self, x, mask=None, emit_states: bool = False):  # [B, T, W]
        block = ResidualBlock
        if self.layer_params_hook is not None and not self.is_initializing():
            hook = functools.partial(self.layer_params_hook, layers=self.layers)
            block = nn.map_variables(block, "params", trans_in_fn=hook)
        if self.remat_policy != "none":
            block = nn.remat(block, policy=resolve_remat_policy(self.remat_policy), prevent_cse=self.unroll_layers)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers,
                        in_axes=nn.broadcast, unroll=self.layers if self.unroll_layers else 1)
        x = x.astype(self.residual_dtype or self.dtype)
        x, states = stack(self.width, self.heads, self.mlp_width, self.layers, self.causal, self.quick_gelu,
                          self.dtype, self.param_dtype, self.attention_impl, self.block, self.grad_dtype, self.fp8,
                          emit_states, self.fused_kernels, name="resblocks")(x, mask)
        return (x, states) if emit_states else x
