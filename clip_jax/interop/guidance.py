"""CLIP guidance: a model's image-text similarity and its gradient with respect to the pixels, as CLIP-guided
diffusion and VQGAN-CLIP take them.

Pixels are float [H, W, 3] in [0, 1]. `preprocess` is OpenCLIP's eval transform written in JAX, so it is
differentiable: the shortest side resized bicubically to the model's size as PIL resizes (two matrix products with
PIL's own coefficients in its 22-bit fixed point, horizontal then vertical, each pass rounded to uint8 as PIL rounds:
the forward pass rounds, the gradient goes straight through), the centre crop, the normalisation. On an image of
whole uint8 levels it gives the eval transform's pixels (tests/test_guidance.py: at most one uint8 level apart, rarely).
`cutouts` takes random square crops (seeded) resized to the model's size instead, the augmentation guidance uses
against adversarial pixels. `similarity` is (pixels, key) -> the image-text cosine; `guidance` its jitted value and
gradient.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clip_jax.data.transforms import eval_geometry

PRECISION_BITS = 22  # PIL's fixed-point coefficients for 8-bit images


def _bicubic(x: float, a: float = -0.5) -> float:
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


@functools.lru_cache(maxsize=64)
def resize_matrix(in_size: int, out_size: int) -> np.ndarray:
    """float32 [out, in]: PIL's bicubic resampling of one axis (its support widened by the scale when shrinking,
    each row's weights normalised, then rounded to its fixed point)."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale
    matrix = np.zeros((out_size, in_size))
    for out in range(out_size):
        center = (out + 0.5) * scale
        first = max(int(center - support + 0.5), 0)
        count = min(int(center + support + 0.5), in_size) - first
        weights = np.array([_bicubic((i + first - center + 0.5) / filter_scale) for i in range(count)])
        if weights.sum() != 0:
            weights /= weights.sum()
        matrix[out, first:first + count] = np.floor(0.5 + weights * (1 << PRECISION_BITS)) / (1 << PRECISION_BITS)
    return matrix.astype(np.float32)  # exact: 22-bit fractions of weights below 2


def _to_uint8_levels(x):
    """PIL's rounding of a pass to uint8 (half up, clipped) in the forward pass; the identity for the gradient."""
    return x + jax.lax.stop_gradient(jnp.clip(jnp.floor(x + 0.5), 0, 255) - x)


def preprocess(pixels, size: int, mean: Sequence[float], std: Sequence[float]):
    """float [H, W, 3] in [0, 1] -> [size, size, 3], the eval transform, differentiable (see the module)."""
    height, width = pixels.shape[:2]
    (new_width, new_height), left, top = eval_geometry(width, height, size)
    x = pixels * 255
    if new_width != width:
        x = _to_uint8_levels(jnp.einsum("ow,hwc->hoc", resize_matrix(width, new_width), x))
    if new_height != height:
        x = _to_uint8_levels(jnp.einsum("oh,hwc->owc", resize_matrix(height, new_height), x))
    x = x[top:top + size, left:left + size] / 255
    return (x - jnp.asarray(mean, x.dtype)) / jnp.asarray(std, x.dtype)


def cutouts(pixels, key, count: int, size: int, min_fraction: float = 0.5):
    """[count, size, size, 3]: random squares of `pixels` (side a fraction in [min_fraction, 1] of the
    shorter side, anywhere inside), each resized to `size` (bicubic, antialiased)."""
    height, width = pixels.shape[:2]
    short = min(height, width)
    side_key, y_key, x_key = jax.random.split(key, 3)
    sides = short * jax.random.uniform(side_key, (count,), minval=min_fraction, maxval=1.0)
    tops = jax.random.uniform(y_key, (count,)) * (height - sides)
    lefts = jax.random.uniform(x_key, (count,)) * (width - sides)

    def one(side, top, left):
        scale = jnp.stack([size / side, size / side])
        return jax.image.scale_and_translate(pixels, (size, size, 3), (0, 1), scale,
                                             -jnp.stack([top, left]) * scale, "cubic")

    return jax.vmap(one)(sides, tops, lefts)


def similarity(model, variables, text_features, *, size: int, mean: Sequence[float], std: Sequence[float],
               num_cutouts: int = 0, min_fraction: float = 0.5) -> Callable:
    """(pixels [H, W, 3] in [0, 1], key) -> the cosine of the image embedding (`model.apply(variables, ...)`) and
    `text_features` (a normalised [E]), of the eval transform of the whole image, or with `num_cutouts` averaged
    over that many cutouts drawn with `key`."""
    text = jnp.asarray(text_features)

    def of(pixels, key):
        if num_cutouts:
            images = cutouts(pixels, key, num_cutouts, size, min_fraction)
            images = (images - jnp.asarray(mean, images.dtype)) / jnp.asarray(std, images.dtype)
        else:
            images = preprocess(pixels, size, mean, std)[None]
        features = model.apply(variables, images, method="encode_image")  # L2-normalised
        return jnp.mean(features @ text)

    return of


def guidance(model, variables, text_features, **options) -> Callable:
    """The jitted (pixels, key) -> (similarity, d similarity / d pixels) of `similarity(..., **options)`."""
    return jax.jit(jax.value_and_grad(similarity(model, variables, text_features, **options)))
