"""The image tower: a ViT with class-token pooling, as OpenCLIP's `VisionTransformer`, or SigLIP's, pooled by
attention (`pool_type="map"`)."""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from clip_jax.models import mixed_precision, naflex
from clip_jax.models.attention_pool import AttentionPool
from clip_jax.models.config import VisionConfig
from clip_jax.models.layers import Dtype, Transformer, tower_norm
from clip_jax.models.position_resize import resize_weights


class VisionTransformer(nn.Module):
    """Patchify (conv, no bias) -> class token -> positional embedding -> ln_pre -> blocks -> ln_post(class token)
    -> proj. Images are NHWC float32, already normalised. The config's options: `no_ln_pre` drops ln_pre;
    `pool_type="avg"` pools the mean of the patch tokens, after ln_post on every token, or before ln_post when
    `final_ln_after_pool`; `block` sets the residual blocks and every LayerNorm (see `BlockConfig`).
    `pool_type="map"` is SigLIP's tower: patchify (conv with bias) -> positional embedding -> blocks -> ln_post on
    every token -> `AttentionPool`, no class token and no projection.

    `kept_patches` ([B, K] int, patch indices in row-major order, see `kept_patch_indices`): patch dropout as
    OpenCLIP applies it, after the positional embedding and before `ln_pre`: the blocks see the class token and
    those K patches only. None (eval, and training without patch dropout): every patch.

    `config.naflex` is SigLIP 2's NaFlex tower (transformers' Siglip2VisionModel): it takes NaFlex rows
    [B, N, P * P * 3 + 2] (`clip_jax.models.naflex`) instead of images, embeds each patch with `conv1` as a matmul,
    adds the positional grid resized to the image's own grid (`position_resize`), and masks the padding patches as
    keys in every block and in the pool. The parameters are the fixed-resolution SigLIP tower's, so weights move
    between the two. It takes no patch dropout yet.
    """

    config: VisionConfig
    embed_dim: int
    quick_gelu: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"
    attention_impl: str | None = None
    layer_params_hook: Callable | None = None
    grad_dtype: Dtype | None = None  # see `mixed_precision`
    residual_dtype: Dtype | None = None  # see `Transformer`
    fp8: bool = False  # see `Transformer`
    fused_kernels: str = "off"  # see `Transformer`
    unroll_layers: bool = False  # see `Transformer`

    @nn.compact
    def __call__(self, images, kept_patches=None, emit_states: bool = False):
        """Images [B, H, W, 3] (NaFlex rows [B, N, P * P * 3 + 2] for a NaFlex tower) -> the image embedding [B, E];
        with `emit_states`, (embedding, states, states under ln_post): the residual stream entering the first block
        and leaving each, [layers + 1, B, T, W] (`CLIP.encode_image_states`)."""
        cfg = self.config
        # own: NaFlex's [B, N] bool, True on an image's own patches (None: every token is)
        x, own = self.naflex_tokens(images, kept_patches) if cfg.naflex else (self.tokens(images, kept_patches), None)
        norm = lambda name: tower_norm(cfg.block, self.dtype, self.param_dtype, name)  # noqa: E731
        if not cfg.no_ln_pre:
            x = norm("ln_pre")(x)
        entering = x
        x = Transformer(cfg.width, cfg.layers, cfg.heads, cfg.mlp_width, causal=False, quick_gelu=self.quick_gelu,
                        dtype=self.dtype, param_dtype=self.param_dtype, remat_policy=self.remat_policy,
                        attention_impl=self.attention_impl, layer_params_hook=self.layer_params_hook,
                        block=cfg.block, grad_dtype=self.grad_dtype, residual_dtype=self.residual_dtype,
                        fp8=self.fp8, fused_kernels=self.fused_kernels, unroll_layers=self.unroll_layers,
                        name="transformer")(x, _key_lengths(own), emit_states=emit_states)
        x, states = x if emit_states else (x, None)
        ln_post = norm("ln_post")
        if cfg.attention_pool:  # no projection: the pooled vector is the embedding
            pool = AttentionPool(cfg.width, cfg.heads, cfg.mlp_width, self.quick_gelu, self.dtype, self.param_dtype,
                                 cfg.block, self.grad_dtype, name="attn_pool")
            features = pool(ln_post(x), own)
        else:
            pool = (lambda t: t[:, 0]) if cfg.pool_type == "tok" else (lambda t: t[:, 1:].mean(axis=1))  # noqa: E731
            if cfg.final_ln_after_pool or cfg.pool_type == "tok":  # per-token LN: the class token's alone is the same
                pooled = ln_post(pool(x))  # [B, W]
            else:
                pooled = pool(ln_post(x))
            proj = self.param("proj", nn.initializers.normal(cfg.width**-0.5), (cfg.width, self.embed_dim),
                              self.param_dtype)
            features = mixed_precision.dense(pooled, proj, None, self.dtype, self.grad_dtype)
        if not emit_states:
            return features
        states = jnp.concatenate([entering[None].astype(states.dtype), states])
        return features, states, ln_post(states)

    def tokens(self, images, kept_patches):
        """Images [B, H, W, 3] -> the tokens entering ln_pre [B, T, W]: the class token (but in SigLIP's tower)
        and the patches, with the positional embedding; only the `kept_patches` under patch dropout."""
        cfg = self.config
        if images.ndim != 4 or images.shape[1:] != (cfg.image_size, cfg.image_size, 3):
            raise ValueError(f"image tower expects images of shape [B, {cfg.image_size}, {cfg.image_size}, 3] "
                             f"(NHWC), got {tuple(images.shape)}")
        scale = cfg.width**-0.5
        x = self.patchify(images)  # [B, g*g, W], row-major patch order
        prefix = int(not cfg.attention_pool)  # the class token, which SigLIP's tower does not have
        if prefix:
            class_embedding = self.param("class_embedding", nn.initializers.normal(scale), (cfg.width,),
                                         self.param_dtype)
            class_token = mixed_precision.broadcast(class_embedding, (x.shape[0], 1, cfg.width), self.dtype,
                                                    self.grad_dtype)
            x = jnp.concatenate([class_token, x], axis=1)  # [B, T, W]
        x = mixed_precision.add(x, self.positional_embedding(), self.grad_dtype)
        if kept_patches is not None:
            # take_along_axis keeps the batch a batch dimension of the gather: it stays split over devices
            kept = jnp.take_along_axis(x[:, prefix:], kept_patches[:, :, None], axis=1)  # [B, K, W]
            x = jnp.concatenate([x[:, :prefix], kept], axis=1)  # [B, prefix + K, W]
        return x

    def naflex_tokens(self, rows, kept_patches):
        """NaFlex rows [B, N, P * P * 3 + 2] -> (tokens [B, N, W], [B, N] bool True on an image's own patches):
        each patch embedded by `conv1`'s kernel and bias as a matmul, plus the positional grid resized to its
        image's grid (zero on padding)."""
        cfg = self.config
        if rows.ndim != 3 or rows.shape[-1] != naflex.row_width(cfg.patch_size):
            raise ValueError(f"a NaFlex image tower expects NaFlex rows of shape [B, N, "
                             f"{naflex.row_width(cfg.patch_size)}] (clip_jax.models.naflex: {cfg.patch_size} x "
                             f"{cfg.patch_size} x 3 pixels per patch, then the grid), got {tuple(rows.shape)}")
        if kept_patches is not None:
            raise ValueError("patch dropout (kept_patches) is not supported with a NaFlex image tower yet: train it "
                             "without patch_dropout")
        patches, grids, own = naflex.split_rows(rows)
        x = PatchMatmul(cfg.width, cfg.patch_size, self.dtype, self.param_dtype, self.grad_dtype, True,
                        name="conv1")(patches)  # [B, N, W]
        weights = resize_weights(grids, rows.shape[1], cfg.grid_size)  # [B, N, g*g]
        # resized in float32, as transformers does, and added in the compute dtype
        positions = mixed_precision.dense(weights, self.positional_embedding(), None, jnp.float32, self.grad_dtype)
        return x + positions.astype(x.dtype), own

    def positional_embedding(self):
        """The learned positions [T, W]: the class token's (but in SigLIP's tower), then the g x g grid's in
        row-major order."""
        cfg = self.config
        return self.param("positional_embedding", nn.initializers.normal(cfg.width**-0.5),
                          (cfg.num_tokens, cfg.width), self.param_dtype)

    def patchify(self, images):
        """[B, H, W, 3] -> [B, g*g, W]: `conv1`, a stride-`patch_size` convolution (kernel HWIO), without bias but
        in SigLIP's tower. With a `grad_dtype` it runs as the matmul it is over the flattened patches, so its
        kernel's gradient does too."""
        cfg, size = self.config, self.config.patch_size
        if self.grad_dtype is None:
            patches = nn.Conv(cfg.width, (size, size), strides=(size, size), padding="VALID",
                              use_bias=cfg.attention_pool, dtype=self.dtype, param_dtype=self.param_dtype,
                              name="conv1")(images)
            return patches.reshape(images.shape[0], cfg.grid_size**2, cfg.width)
        return PatchMatmul(cfg.width, size, self.dtype, self.param_dtype, self.grad_dtype, cfg.attention_pool,
                           name="conv1")(images)


class PatchMatmul(nn.Module):
    """`conv1` as a matmul: non-overlapping `size` x `size` patches, flattened in the kernel's (row, column,
    channel) order, times the kernel [size, size, 3, width] (flax's `Conv` parameter, initialised as it is). Takes
    images, or patches already flattened in that order."""

    width: int
    size: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    grad_dtype: Dtype | None = None
    use_bias: bool = False  # `bias` [width], as flax's `Conv` names it

    @nn.compact
    def __call__(self, images):  # [B, H, W, C] -> [B, (H / size) * (W / size), width]; or patches [B, N, P*P*C]
        if images.ndim == 3:  # already flattened patches (NaFlex rows' pixels)
            patches, channels = images, images.shape[-1] // (self.size * self.size)
        else:
            batch, height, width, channels = images.shape
            rows, cols = height // self.size, width // self.size
            patches = images.reshape(batch, rows, self.size, cols, self.size, channels).transpose(0, 1, 3, 2, 4, 5)
            patches = patches.reshape(batch, rows * cols, self.size * self.size * channels)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (self.size, self.size, channels, self.width),
                            self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.width,), self.param_dtype) if self.use_bias else None
        return mixed_precision.dense(patches, kernel.reshape(-1, self.width), bias, self.dtype, self.grad_dtype)


def _key_lengths(own):
    """[B, N] bool (True on an image's own patches, which come first) -> the blocks' attention mask as key lengths
    [B] int32: every query sees its image's own patches only, a padding suffix either attention kernel takes (None:
    no mask)."""
    return None if own is None else own.sum(axis=-1, dtype=jnp.int32)


def kept_patch_count(num_patches: int, patch_dropout: float) -> int:
    """Patches a sample keeps under patch dropout `patch_dropout`, as OpenCLIP counts them."""
    return max(1, int(num_patches * (1 - patch_dropout)))


def kept_patch_indices(key: jax.Array, batch_size: int, num_patches: int, keep: int) -> jax.Array:
    """[B, keep] int32: per sample, `keep` distinct patches drawn uniformly at random, in increasing order.

    Row i depends only on `key` and i (JAX's partitionable threefry), so the patches a sample keeps do not depend
    on how the batch is split over devices or micro-batches when drawn for the global batch.
    """
    noise = jax.random.uniform(key, (batch_size, num_patches))
    _, indices = jax.lax.top_k(noise, keep)
    return jnp.sort(indices, axis=-1).astype(jnp.int32)
