"""The transformer pieces both towers share: LayerNorm, attention, MLP, the residual block and the scanned stack.

Parameter names follow OpenCLIP's state_dict (`ln_1`, `attn.in_proj`, `mlp.c_fc`, ...), so conversion is a matter of
transposes. Parameters are stored in `param_dtype` and cast to the compute `dtype` where they are used; LayerNorm
statistics are always computed in float32.
"""

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from clip_jax.errors import InvalidInput

LN_EPS = 1e-5  # OpenCLIP's (torch's) LayerNorm epsilon; Flax defaults to 1e-6
ATTENTION_IMPLS = (None, "xla", "cudnn")
# cuDNN's fused attention takes sequence lengths that are multiples of this (ViT-L/14's 257 tokens and the text
# tower's 77 are not): `attention` pads to it and masks the padding.
CUDNN_SEQ_MULTIPLE = 8

Dtype = Any


def choose_attention_impl(asked: str, platform: str, compute_dtype) -> str | None:
    """The kernel for the config's `attention_impl` ("auto", "xla" or "cudnn") on a `platform` ("gpu", "cpu"):
    "auto" is cuDNN's fused attention on a GPU with 16-bit compute (ViT-L/14 bf16 on an H200, remat
    nothing_saveable: 552 samples/s against 419 with XLA's, which without remat runs out of memory at batch 256
    where cuDNN's fits in 125 GiB), XLA's elsewhere (cuDNN takes no float32, and no other platform has it)."""
    if asked == "auto":
        sixteen_bit = jnp.dtype(compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if platform == "gpu" and sixteen_bit else "xla"
    if asked is None or asked not in ATTENTION_IMPLS:
        raise InvalidInput(f"attention_impl={asked!r}: choose auto, xla or cudnn")
    return asked


def remat_policy_names() -> list[str]:
    """Names accepted as `remat_policy`: "none" (keep every activation) or a policy of `jax.checkpoint_policies`."""
    return ["none"] + sorted(
        name for name, value in vars(jax.checkpoint_policies).items()
        if not name.startswith("_") and callable(value) and name.endswith("saveable")
    )


def resolve_remat_policy(name: str):
    """The `jax.checkpoint` policy for a name; None for "none" (no rematerialisation)."""
    if name == "none":
        return None
    if name not in remat_policy_names():
        raise InvalidInput(f"unknown remat_policy {name!r}; choose one of {remat_policy_names()}")
    return getattr(jax.checkpoint_policies, name)


def gelu(x, quick: bool = False):
    """Exact (erf) GELU as OpenCLIP uses; QuickGELU x * sigmoid(1.702 x) for OpenAI's original weights."""
    if quick:
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=False)


class LayerNorm(nn.Module):
    """LayerNorm with eps 1e-5, statistics in float32, output in the compute dtype."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (width,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (width,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + LN_EPS)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def attention(q, k, v, causal: bool, implementation: str | None, pad_to_multiple: int | None = None):
    """`jax.nn.dot_product_attention` over [B, T, N, H] inputs, with T padded up to a multiple of `pad_to_multiple`
    (by default cuDNN's, for the cuDNN kernel only). The padded keys are masked out through `key_value_seq_lengths`
    and the padded queries through `query_seq_lengths`; their rows are cut off the output, so no gradient reaches
    them. Under a causal mask no real query sees a padded key anyway (they come after it).
    """
    if pad_to_multiple is None:
        pad_to_multiple = CUDNN_SEQ_MULTIPLE if implementation == "cudnn" else 1
    batch, length = q.shape[:2]
    padding = -length % pad_to_multiple
    if padding == 0:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, padding), (0, 0), (0, 0)))  # noqa: E731
    lengths = jnp.full((batch,), length, jnp.int32)
    out = jax.nn.dot_product_attention(pad(q), pad(k), pad(v), is_causal=causal, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, implementation=implementation)
    return out[:, :length]


class Attention(nn.Module):
    """Multi-head self-attention with a packed q,k,v projection (`in_proj`) and an output projection."""

    width: int
    heads: int
    causal: bool
    out_std: float
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention_impl: str | None = None

    @nn.compact
    def __call__(self, x):  # [B, T, W]
        batch, length, _ = x.shape
        head_dim = self.width // self.heads
        qkv = nn.Dense(3 * self.width, dtype=self.dtype, param_dtype=self.param_dtype,
                       kernel_init=nn.initializers.normal(self.width**-0.5), name="in_proj")(x)  # [B, T, 3W]
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.heads, head_dim), 3, axis=2)  # [B, T, N, H] each
        out = attention(q, k, v, self.causal, self.attention_impl)  # [B, T, N, H]
        out = out.reshape(batch, length, self.width)
        return nn.Dense(self.width, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.out_std), name="out_proj")(out)


class MLP(nn.Module):
    width: int
    mlp_width: int
    out_std: float
    quick_gelu: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.mlp_width, dtype=self.dtype, param_dtype=self.param_dtype,
                     kernel_init=nn.initializers.normal((2 * self.width) ** -0.5), name="c_fc")(x)
        x = gelu(x, self.quick_gelu)
        return nn.Dense(self.width, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.out_std), name="c_proj")(x)


class ResidualBlock(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). Scan-shaped: (carry, _) -> (carry, None)."""

    width: int
    heads: int
    mlp_width: int
    layers: int
    causal: bool = False
    quick_gelu: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention_impl: str | None = None

    @nn.compact
    def __call__(self, x, _):
        # Output projections start smaller as depth grows, as in OpenCLIP's text tower initialisation.
        out_std = self.width**-0.5 * (2 * self.layers) ** -0.5
        norm = lambda name: LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=name)  # noqa: E731
        x = x + Attention(self.width, self.heads, self.causal, out_std, self.dtype, self.param_dtype,
                          self.attention_impl, name="attn")(norm("ln_1")(x))
        x = x + MLP(self.width, self.mlp_width, out_std, self.quick_gelu, self.dtype, self.param_dtype,
                    name="mlp")(norm("ln_2")(x))
        return x, None


class Transformer(nn.Module):
    """`layers` residual blocks stacked with `nn.scan` (one compiled block whatever the depth), each optionally
    rematerialised under a named `jax.checkpoint` policy. Parameters under `resblocks` carry a leading layer axis.

    `layer_params_hook(variables, layers=...)`, when set, maps the parameters of the layer being run
    (`{"params": {...}}`, without the layer axis; `layers`: the depth of the stack they come from) before the block
    uses them, inside the scan and inside remat: the train step gathers FSDP-split weights with it one layer at a
    time. It applies when the model is applied, not when it is initialised.
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

    @nn.compact
    def __call__(self, x):  # [B, T, W]
        block = ResidualBlock
        if self.layer_params_hook is not None and not self.is_initializing():
            hook = functools.partial(self.layer_params_hook, layers=self.layers)
            block = nn.map_variables(block, "params", trans_in_fn=hook)
        if self.remat_policy != "none":
            block = nn.remat(block, policy=resolve_remat_policy(self.remat_policy), prevent_cse=False)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        x, _ = stack(self.width, self.heads, self.mlp_width, self.layers, self.causal, self.quick_gelu, self.dtype,
                     self.param_dtype, self.attention_impl, name="resblocks")(x, None)
        return x
