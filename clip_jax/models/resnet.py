"""The ResNet image tower: OpenCLIP's ModifiedResNet (OpenAI's RN50 ... RN50x64) in Flax linen.

Three changes from a torchvision ResNet, all kept here: a stem of three 3x3 convs ending in a 2x2 average pool (no
max pool); strides taken by a 2x2 average pool after the middle conv of a block (and before the 1x1 conv of its
shortcut) rather than by strided convs, so downsampling is anti-aliased; and attention pooling in place of global
average pooling, with the mean of the grid as the only query.

Images are NHWC. Parameter names follow OpenCLIP's state_dict (`conv1`, `bn1`, `layer1/0/conv2`, `attnpool/q_proj`,
...). BatchNorm's running statistics live in the `batch_stats` collection: `mean`, `var` and `num_batches_tracked`,
torch's `running_mean`, `running_var` and the counter it keeps beside them.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from clip_jax.errors import InvalidInput
from clip_jax.models.config import ResNetVisionConfig
from clip_jax.models.attention import xla_attention
from clip_jax.models.layers import Dtype
from clip_jax.models.remat import resolve_remat_policy

BN_EPS = 1e-5  # torch's BatchNorm2d defaults
BN_MOMENTUM = 0.1  # running = (1 - momentum) * running + momentum * batch
EXPANSION = 4  # a bottleneck block's output is 4x its width

# torch's default init of conv and linear weights (kaiming_uniform with a = sqrt(5)): uniform, variance 1/(3 fan_in)
torch_default_kernel_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


def torch_default_bias_init(fan_in: int):
    """torch's default init of a Linear's bias: uniform in +-1/sqrt(fan_in)."""
    bound = fan_in**-0.5
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class BatchNorm(nn.Module):
    """torch's BatchNorm2d over the channels (last axis) of NHWC activations, statistics in float32.

    `train=False` normalises with the running statistics. `train=True` normalises with the batch's mean and biased
    variance over N, H, W and, when `batch_stats` is mutable, moves the running mean and the running variance
    towards the batch's mean and *unbiased* variance by `BN_MOMENTUM`, and counts the update, as torch does.
    `zero_init`: the scale starts at zero (OpenCLIP's init of each block's last BatchNorm, so that a fresh block
    is the identity on its shortcut).
    """

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    zero_init: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        channels = x.shape[-1]
        if not (self.is_initializing() or self.has_variable("batch_stats", "mean")):
            raise InvalidInput("a ResNet image tower needs its BatchNorm statistics: apply the model to "
                               "{'params': ..., 'batch_stats': ...} (see clip_jax.models.init_variables)")
        scale = self.param("scale", nn.initializers.zeros if self.zero_init else nn.initializers.ones, (channels,),
                           self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (channels,), self.param_dtype)
        running_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((channels,), jnp.float32))
        running_var = self.variable("batch_stats", "var", lambda: jnp.ones((channels,), jnp.float32))
        count = self.variable("batch_stats", "num_batches_tracked", lambda: jnp.zeros((), jnp.int32))
        x32 = x.astype(jnp.float32)
        if train:
            axes = tuple(range(x.ndim - 1))
            mean = x32.mean(axis=axes)
            var = jnp.square(x32 - mean).mean(axis=axes)  # biased, as torch normalises with
            if self.is_mutable_collection("batch_stats") and not self.is_initializing():
                n = x.size // channels
                running_mean.value = (1 - BN_MOMENTUM) * running_mean.value + BN_MOMENTUM * mean
                running_var.value = (1 - BN_MOMENTUM) * running_var.value + BN_MOMENTUM * var * (n / max(n - 1, 1))
                count.value = count.value + 1
        else:
            mean, var = running_mean.value, running_var.value
        y = (x32 - mean) * (jax.lax.rsqrt(var + BN_EPS) * scale.astype(jnp.float32)) + bias.astype(jnp.float32)
        return y.astype(self.dtype)


def avg_pool(x, size: int):
    """A `size` x `size` average pool with stride `size` (torch's AvgPool2d(size): a partial last row is dropped)."""
    return x if size == 1 else nn.avg_pool(x, (size, size), strides=(size, size), padding="VALID")


class Bottleneck(nn.Module):
    """1x1 conv -> 3x3 conv -> (average pool when strided) -> 1x1 conv to 4x `planes`, each with BatchNorm, plus
    the shortcut: the input, or (average pool, 1x1 conv, BatchNorm) when the stride or the width changes."""

    planes: int
    stride: int = 1
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        conv = lambda width, kernel, name: nn.Conv(  # noqa: E731
            width, (kernel, kernel), padding=kernel // 2, use_bias=False, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=torch_default_kernel_init, name=name)
        norm = lambda name, zero_init=False: BatchNorm(self.dtype, self.param_dtype, zero_init, name=name)  # noqa
        out = nn.relu(norm("bn1")(conv(self.planes, 1, "conv1")(x), train))
        out = nn.relu(norm("bn2")(conv(self.planes, 3, "conv2")(out), train))
        out = avg_pool(out, self.stride)
        out = norm("bn3", zero_init=True)(conv(self.planes * EXPANSION, 1, "conv3")(out), train)
        if self.stride > 1 or x.shape[-1] != self.planes * EXPANSION:
            shortcut = conv(self.planes * EXPANSION, 1, "downsample_conv")(avg_pool(x, self.stride))
            x = norm("downsample_bn")(shortcut, train)
        return nn.relu(out + x)


class ResNetStage(nn.Module):
    """`blocks` bottlenecks of width `planes`, the first taking the stride (OpenCLIP's `layer1` ... `layer4`).

    `remat_policy` other than "none": each block is rematerialised under that `jax.checkpoint` policy (its
    activations recomputed in the backward; the running statistics it updates are not updated twice: the recompute
    only replays the forward's arithmetic). The parameter tree is the same either way."""

    planes: int
    blocks: int
    stride: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"

    @nn.compact
    def __call__(self, x, train: bool = False):
        block = Bottleneck
        if self.remat_policy != "none":  # `train` (argument 2, after self and x) is a Python bool: static
            block = nn.remat(block, policy=resolve_remat_policy(self.remat_policy), static_argnums=(2,))
        for i in range(self.blocks):
            x = block(self.planes, self.stride if i == 0 else 1, self.dtype, self.param_dtype, name=str(i))(x, train)
        return x


class AttentionPool2d(nn.Module):
    """Multi-head attention of one query, the mean of the grid, over the grid cells and that mean, each with a
    learned positional embedding; then the output projection `c_proj` to `output_dim`. [B, H, W, C] -> [B, D]."""

    heads: int
    output_dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        batch, height, width, channels = x.shape
        x = x.reshape(batch, height * width, channels)
        x = jnp.concatenate([x.mean(axis=1, keepdims=True), x], axis=1)  # [B, 1 + HW, C]
        positional_embedding = self.param("positional_embedding", nn.initializers.normal(channels**-0.5),
                                          (height * width + 1, channels), self.param_dtype)
        x = x + positional_embedding.astype(self.dtype)
        # OpenCLIP's init of the four projections' weights; the biases keep torch's default
        dense = lambda features, name: nn.Dense(  # noqa: E731
            features, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(channels**-0.5), bias_init=torch_default_bias_init(channels),
            name=name)
        head_dim = channels // self.heads
        split = lambda t: t.reshape(batch, t.shape[1], self.heads, head_dim)  # noqa: E731
        q = split(dense(channels, "q_proj")(x[:, :1]))  # [B, 1, heads, head_dim]: only the mean is read out
        k, v = split(dense(channels, "k_proj")(x)), split(dense(channels, "v_proj")(x))
        out = xla_attention(q, k, v)  # scale 1/sqrt(head_dim), as torch
        return dense(self.output_dim, "c_proj")(out.reshape(batch, channels))


class ModifiedResNet(nn.Module):
    """The image tower: stem -> layer1 ... layer4 -> attnpool. [B, S, S, 3] float32 NHWC -> [B, embed_dim].

    `train=True` runs BatchNorm on batch statistics (and updates the running ones when `batch_stats` is mutable);
    `kept_patches` (the ViT's patch dropout) has no meaning here and must be None. `remat_policy`: applied to every
    bottleneck block (see `ResNetStage`); the stem and the attention pool keep their activations."""

    config: ResNetVisionConfig
    embed_dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"

    @nn.compact
    def __call__(self, images, kept_patches=None, train: bool = False):
        cfg = self.config
        if images.ndim != 4 or images.shape[1:] != (cfg.image_size, cfg.image_size, 3):
            raise ValueError(f"image tower expects images of shape [B, {cfg.image_size}, {cfg.image_size}, 3] "
                             f"(NHWC), got {tuple(images.shape)}")
        if kept_patches is not None:
            raise InvalidInput("patch dropout is a ViT option: a ResNet image tower has no patches to drop")
        x = images.astype(self.dtype)
        for i, (width, stride) in enumerate(((cfg.width // 2, 2), (cfg.width // 2, 1), (cfg.width, 1)), start=1):
            x = nn.Conv(width, (3, 3), strides=(stride, stride), padding=1, use_bias=False, dtype=self.dtype,
                        param_dtype=self.param_dtype, kernel_init=torch_default_kernel_init, name=f"conv{i}")(x)
            x = nn.relu(BatchNorm(self.dtype, self.param_dtype, name=f"bn{i}")(x, train))
        x = avg_pool(x, 2)
        for i, blocks in enumerate(cfg.layers):
            x = ResNetStage(cfg.width * 2**i, blocks, 1 if i == 0 else 2, self.dtype, self.param_dtype,
                            self.remat_policy, name=f"layer{i + 1}")(x, train)
        return AttentionPool2d(cfg.heads, self.embed_dim, self.dtype, self.param_dtype, name="attnpool")(x)
