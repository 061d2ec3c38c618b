"""Scaled dot-product attention over [B, T, N, H] queries, keys and values: which kernel (XLA's or cuDNN's fused
one, `choose_attention_impl`), the padding cuDNN's kernel needs, and the CPU's form of float16 products."""

import jax
import jax.numpy as jnp

from clip_jax.errors import InvalidInput
from clip_jax.models import mixed_precision

ATTENTION_IMPLS = (None, "xla", "cudnn")  # what `jax.nn.dot_product_attention` takes (None: JAX chooses)
ATTENTION_CHOICES = ("auto", "xla", "cudnn")  # a training config's attention_impl ("auto": `choose_attention_impl`)
# cuDNN's fused attention takes sequence lengths that are multiples of this (ViT-L/14's 257 tokens and the text
# tower's 77 are not): `attention` pads to it and masks the padding.
CUDNN_SEQ_MULTIPLE = 8


# cuDNN's fused attention runs on GPUs of this compute capability and later (Ampere on)
CUDNN_MIN_COMPUTE_CAPABILITY = (8, 0)


def choose_attention_impl(asked: str, platform: str, compute_dtype,
                          compute_capability: tuple[int, int] | None = None) -> str | None:
    """The kernel for the config's `attention_impl` ("auto", "xla" or "cudnn") on a `platform` ("gpu", "cpu") of
    `compute_capability` (None: unknown, taken as recent): "auto" is cuDNN's fused attention on a GPU of compute
    capability 8.0 or later with 16-bit compute (the faster kernel for ViT-L/14 on an H200, and the one that fits
    without remat: benchmarks/RESULTS.md section 8), XLA's elsewhere (cuDNN's takes no float32, runs on no earlier
    GPU (T4, V100), and no other platform has it)."""
    if asked == "auto":
        sixteen_bit = jnp.dtype(compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        recent = compute_capability is None or tuple(compute_capability) >= CUDNN_MIN_COMPUTE_CAPABILITY
        return "cudnn" if platform == "gpu" and sixteen_bit and recent else "xla"
    if asked not in ATTENTION_CHOICES:
        raise InvalidInput(f"attention_impl={asked!r}: choose one of {ATTENTION_CHOICES}")
    return asked


def attention(q, k, v, causal: bool, implementation: str | None, pad_to_multiple: int | None = None, *,
              mask=None, scale: float | None = None):
    """`jax.nn.dot_product_attention` over [B, T, N, H] inputs, with T padded up to a multiple of `pad_to_multiple`
    (by default cuDNN's, for the cuDNN kernel only). The padded keys are masked out through `key_value_seq_lengths`
    and the padded queries through `query_seq_lengths`; their rows are cut off the output, so no gradient reaches
    them. Under a causal mask no real query sees a padded key anyway (they come after it).

    `mask`: [B, 1, T, T] bool, True where a query may see a key (on top of `causal`), runs XLA's attention whatever
    `implementation` asks: the fused cuDNN kernel takes padding and causal masks, not an arbitrary key mask. Or
    [B] int, each row's key length (its keys from that position on are padding, as a NaFlex batch's), which either
    kernel takes as `key_value_seq_lengths`. `scale`: the logits' factor (None: 1 / sqrt(head_dim)).
    """
    kernel = cudnn_attention if implementation == "cudnn" else xla_attention
    key_lengths = None
    if mask is not None and mask.ndim == 1:
        key_lengths, mask = mask, None
    if mask is not None:
        return xla_attention(q, k, v, mask=mask, is_causal=causal, scale=scale)
    if pad_to_multiple is None:
        pad_to_multiple = CUDNN_SEQ_MULTIPLE if implementation == "cudnn" else 1
    batch, length = q.shape[:2]
    padding = -length % pad_to_multiple
    if padding == 0 and key_lengths is None:
        return kernel(q, k, v, is_causal=causal, scale=scale)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, padding), (0, 0), (0, 0)))  # noqa: E731
    lengths = jnp.full((batch,), length, jnp.int32)
    # a row of padding alone (a batch padded with empty images) keeps one key: no row's softmax is over nothing
    keys = lengths if key_lengths is None else jnp.clip(key_lengths.astype(jnp.int32), 1, length)
    out = kernel(pad(q), pad(k), pad(v), is_causal=causal, query_seq_lengths=lengths, key_value_seq_lengths=keys,
                 scale=scale)
    return out[:, :length]


def xla_attention(q, k, v, **options):
    """`jax.nn.dot_product_attention` with XLA's kernel (its float16 products widened on a CPU, which has no
    float16 x float16 -> float32 product: `mixed_precision.float16_widened_on_cpu`)."""
    return mixed_precision.float16_widened_on_cpu(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **options), q, k, v)


def cudnn_attention(q, k, v, **options):
    """`jax.nn.dot_product_attention` with cuDNN's fused kernel (a GPU's only)."""
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **options)
