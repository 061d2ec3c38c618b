"""SigLIP 2's NaFlex preprocessing: an image at its own aspect ratio resized to a grid of patches under a patch
budget, normalised and flattened into NaFlex rows (`clip_jax.models.naflex`), as transformers'
`Siglip2ImageProcessor` prepares it.

The grid (`naflex_grid`) comes from a bisection over one scale factor s for both sides: a side of n pixels becomes
ceil(n * s / P) patches (at least one), and the search keeps the largest s, to within 1e-5, whose grid holds at most
`max_num_patches` patches. The bisection's bounds are part of the result: s never exceeds 100, so an image smaller
than a patch is enlarged at most 100-fold (a 1 x 1 image gets at most a 7 x 7 grid of 16-pixel patches), and its
tolerance can, rarely (5 in 20,000 random sizes), stop one patch short of the exact optimum. `naflex_grid` runs
the same search, so every grid equals the processor's.

The pixels (`naflex_rows`): Pillow's bilinear, antialiased resize of the uint8 image to the grid's size, one side at
a time, the width first (a single Pillow resize picks the cheaper order, torch always this one), then
`(x / 255 - mean) / std` in float32, then the patches in row-major order over the grid, each in (row, column,
channel) order. The processor by default (its torchvision backend, on a CPU with AVX2 or AVX-512) resizes the
uint8 image with torch's integer kernel: Pillow's algorithm in the same order of passes, its weights rounded to
16-bit integers rather than Pillow's 22-bit fixed point. So a few resized values round to the neighbouring level
(typically 0.1-0.3% of them, up to about 5% at near-2x reductions): a value differs by at most 1 / (255 * std), the
rest agree to float32 rounding. The grids, the patch order and the padding are equal.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from clip_jax.data import transforms
from clip_jax.errors import InvalidInput
from clip_jax.models.naflex import pack_rows

SIGLIP2_MEAN = SIGLIP2_STD = (0.5, 0.5, 0.5)  # Siglip2ImageProcessor's defaults

_SCALE_TOLERANCE = 1e-5  # the bisection stops once its interval is narrower than this
_SCALE_LOW = _SCALE_TOLERANCE / 10  # its first lower bound (1e-6 up to rounding, as the processor computes it)
_SCALE_HIGH = 100.0  # and its first upper bound: no side grows more than 100-fold


def check_budget(max_num_patches: int) -> None:
    """Raises `InvalidInput` (one line naming --max_num_patches) when the patch budget holds no patch."""
    if max_num_patches < 1:
        raise InvalidInput(f"--max_num_patches {max_num_patches}: a NaFlex image needs a budget of at least one "
                           "patch; give a positive --max_num_patches (SigLIP 2 uses 256)")


def _patches_along(pixels: int, scale: float, patch_size: int) -> int:
    """The patches a side of `pixels` spans at `scale`: its scaled length in patches, rounded up, at least one."""
    return max(1, math.ceil(pixels * scale / patch_size))


def naflex_grid(height: int, width: int, patch_size: int, max_num_patches: int) -> tuple[int, int]:
    """The patch grid (rows, columns) of a `height` x `width` image under a budget of `max_num_patches` patches:
    both sides scaled by one factor and rounded up to whole patches, the factor the largest the bisection of
    `Siglip2ImageProcessor` finds in (0, 100] whose grid fits the budget. The resized image is
    (rows * patch_size, columns * patch_size) pixels."""
    check_budget(max_num_patches)
    if height < 1 or width < 1 or patch_size < 1:
        raise ValueError(f"a {height} x {width} image in {patch_size}-pixel patches has no grid")

    def grid(scale):
        return _patches_along(height, scale, patch_size), _patches_along(width, scale, patch_size)

    low, high = _SCALE_LOW, _SCALE_HIGH  # the grid at `low` fits whenever the search moved it
    while high - low >= _SCALE_TOLERANCE:
        middle = (low + high) / 2
        rows, columns = grid(middle)
        if rows * columns <= max_num_patches:
            low = middle
        else:
            high = middle
    return grid(low)


def naflex_patches(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """[rows * P, columns * P, C] -> [rows * columns, P * P * C]: the patches in row-major order over the grid,
    each flattened in (row, column, channel) order."""
    height, width, channels = pixels.shape
    rows, columns = height // patch_size, width // patch_size
    grid = pixels.reshape(rows, patch_size, columns, patch_size, channels).swapaxes(1, 2)
    return grid.reshape(rows * columns, patch_size * patch_size * channels)


def naflex_pixels(image: Image.Image, patch_size: int, max_num_patches: int) -> np.ndarray:
    """An RGB image's NaFlex rows before normalisation, float32 [max_num_patches, P * P * 3 + 2], pixels 0-255:
    resized (bilinear, antialiased) to its `naflex_grid`, cut into patches, padded to the budget. The eval transform
    of a NaFlex model (`NaFlexResize`); `transforms.normalize` normalises them."""
    rows, columns = naflex_grid(image.height, image.width, patch_size, max_num_patches)
    width, height = columns * patch_size, rows * patch_size
    if image.width != width:  # the width first, then the height, as torch does (Pillow picks the cheaper order)
        image = image.resize((width, image.height), Image.Resampling.BILINEAR)
    if image.height != height:
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    return pack_rows(naflex_patches(np.asarray(image), patch_size), (rows, columns), max_num_patches)


def naflex_rows(
    image: Image.Image,
    patch_size: int,
    max_num_patches: int,
    mean: Sequence[float] = SIGLIP2_MEAN,
    std: Sequence[float] = SIGLIP2_STD,
) -> np.ndarray:
    """An RGB image's NaFlex rows float32 [max_num_patches, P * P * 3 + 2]: `naflex_pixels` normalised as
    `(x / 255 - mean) / std`."""
    return transforms.normalize(naflex_pixels(image, patch_size, max_num_patches), mean, std)


@dataclasses.dataclass(frozen=True)
class NaFlexResize:
    """SigLIP 2's NaFlex eval transform, as a resize mode: the image kept at its own aspect ratio, resized to the
    largest grid of `patch_size` patches within `max_num_patches` (`naflex_grid`) and returned as
    NaFlex rows [max_num_patches, P * P * 3 + 2] (`clip_jax.models.naflex`) whose pixels are still 0-255:
    `transforms.normalize` normalises them as it does images."""

    patch_size: int
    max_num_patches: int

    def __str__(self) -> str:
        return f"naflex at {self.max_num_patches} patches of {self.patch_size} px"


@dataclasses.dataclass(frozen=True)
class NaFlexTransform:
    """Encoded bytes, a uint8 array [H, W(, 3)] or a PIL image -> its NaFlex rows (`naflex_rows`); a picklable
    class so Grain can run it in its threads. Bytes that do not decode raise `transforms.ImageDecodeError`; a
    budget below one patch raises `InvalidInput` when the transform is made."""

    patch_size: int
    max_num_patches: int
    mean: tuple[float, ...] = SIGLIP2_MEAN
    std: tuple[float, ...] = SIGLIP2_STD

    def __post_init__(self):
        check_budget(self.max_num_patches)

    def __call__(self, image: "bytes | np.ndarray | Image.Image") -> np.ndarray:
        return naflex_rows(transforms.to_rgb(image), self.patch_size, self.max_num_patches, self.mean, self.std)
