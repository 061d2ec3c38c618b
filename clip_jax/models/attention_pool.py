"""SigLIP's pooling head (timm's `AttentionPoolLatent`, transformers' `SiglipMultiheadAttentionPoolingHead`): a
learned probe attends over every token of the image tower, and a residual MLP follows."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from clip_jax.models import mixed_precision
from clip_jax.models.config import BlockConfig
from clip_jax.models.attention import xla_attention
from clip_jax.models.layers import MLP, Dense, Dtype, tower_norm


class AttentionPool(nn.Module):
    """[B, T, W] -> [B, W]: a = out_proj(attention(q(probe), k(x), v(x))) with the tower's heads, then
    a + mlp(norm(a)). Parameters: `probe` [1, W], `q` and `kv` (keys then values, [W, 2W]) and `out_proj` with
    biases, `norm`, `mlp` (`c_fc`, `c_proj`). One query per sample: its cost is that of a block's MLP on one token
    plus the keys and values of every token. `mask` ([B, T] bool or None): the tokens the probe may attend to (the
    NaFlex tower's own patches, not its padding)."""

    width: int
    heads: int
    mlp_width: int
    quick_gelu: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    block: BlockConfig = BlockConfig()
    grad_dtype: Dtype | None = None

    @nn.compact
    def __call__(self, x, mask=None):
        batch, length, width = x.shape
        head_dim = width // self.heads
        dense = lambda features, name: Dense(features, nn.initializers.normal(width**-0.5), self.dtype,  # noqa: E731
                                             self.param_dtype, self.grad_dtype, name=name)
        probe = self.param("probe", nn.initializers.normal(width**-0.5), (1, width), self.param_dtype)
        # the probe per sample, so that its gradient is summed over the batch as every parameter's is
        q = dense(width, "q")(mixed_precision.broadcast(probe, (batch, 1, width), self.dtype, self.grad_dtype))
        k, v = jnp.split(dense(2 * width, "kv")(x), 2, axis=-1)  # [B, T, W] each
        heads = lambda t: t.reshape(batch, t.shape[1], self.heads, head_dim)  # noqa: E731
        key_mask = None if mask is None else mask[:, None, None, :]  # [B, 1, 1, T]
        pooled = xla_attention(heads(q), heads(k), heads(v), mask=key_mask).reshape(batch, 1, width)
        pooled = dense(width, "out_proj")(pooled)[:, 0]  # [B, W]
        mlp = MLP(width, self.mlp_width, self.mlp_width**-0.5, self.quick_gelu, self.dtype, self.param_dtype,
                  self.block, self.grad_dtype, name="mlp")
        return pooled + mlp(tower_norm(self.block, self.dtype, self.param_dtype, "norm")(pooled))
