"""SigLIP 2's NaFlex preprocessing against transformers' `Siglip2ImageProcessor` as it is built by default (the
torchvision backend): the same grids over a sweep of sizes and budgets, and the same padded patches, mask and
spatial shapes for images of many aspect ratios."""

import io
import math
import pickle
from fractions import Fraction

import numpy as np
import pytest
from PIL import Image
from transformers import Siglip2ImageProcessor
from transformers.image_processing_backends import TorchvisionBackend
from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

from clip_jax.data import transforms
from clip_jax.data.naflex import NaFlexTransform, naflex_grid, naflex_rows
from clip_jax.errors import InvalidInput
from clip_jax.models.naflex import split_rows

MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)  # unequal channels, so a channel mix-up shows


def _processor_grid(height, width, patch_size, budget):
    pixel_height, pixel_width = get_image_size_for_max_num_patches(height, width, patch_size, budget)
    return pixel_height // patch_size, pixel_width // patch_size


def _smooth_image(height, width, seed):
    """Smooth colour gradients plus a little noise: a photo's mix of flat regions and edges."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.int16)
    return Image.fromarray(np.clip(smooth + rng.integers(-12, 13, smooth.shape), 0, 255).astype(np.uint8))


# Sizes smaller than a patch, 1 x N and N x 1 grids, extreme and ordinary aspect ratios, and sizes (the last three)
# where the processor's bisection stops one patch short of the exact optimum.
GRID_SIZES = [(1, 1), (3, 500), (500, 3), (10, 10), (15, 16), (16, 16), (17, 17), (7, 1000), (1000, 7), (1, 10000),
              (224, 224), (480, 640), (333, 777), (1000, 37), (4000, 3000), (3485, 5136), (665, 5902), (5982, 1709)]


def test_grid_equals_the_processors_size_search():
    for patch_size in (14, 16):
        for budget in (1, 2, 3, 7, 64, 196, 256, 576, 1024):
            for height, width in GRID_SIZES + [(h, w) for h in (2, 31, 100, 513) for w in (5, 64, 257, 2049)]:
                grid = naflex_grid(height, width, patch_size, budget)
                assert grid == _processor_grid(height, width, patch_size, budget), (height, width, patch_size, budget)
                assert 1 <= grid[0] * grid[1] <= budget


def _exact_grid(height, width, patch_size, budget):
    """The largest grid of any scale up to 100 that fits the budget, in exact arithmetic: the scales where a side
    gains a patch are k * P / n."""
    scales = sorted({Fraction(100)} | {Fraction(k * patch_size, n) for n in (height, width)
                                       for k in range(1, budget + 1) if Fraction(k * patch_size, n) <= 100})
    best = (1, 1)
    for scale in scales:
        grid = tuple(max(1, math.ceil(n * scale / patch_size)) for n in (height, width))
        if grid[0] * grid[1] > budget:
            break
        best = grid
    return best


def test_grid_is_the_exact_optimum_but_where_the_bisection_stops_short():
    assert naflex_grid(1, 1, 16, 256) == _exact_grid(1, 1, 16, 256) == (7, 7)  # at most a 100-fold enlargement
    for height, width in [(3, 500), (480, 640), (1000, 37), (10, 10)]:
        assert naflex_grid(height, width, 16, 256) == _exact_grid(height, width, 16, 256)
    assert _exact_grid(3485, 5136, 16, 576) == (19, 29)
    assert naflex_grid(3485, 5136, 16, 576) == (19, 28)


IMAGE_SIZES = [(3, 500), (500, 3), (10, 10), (1, 1), (7, 1000), (1000, 7), (480, 640), (333, 777), (256, 256),
               (640, 480), (20, 2000)]


@pytest.mark.parametrize("patch_size,budget", [(16, 256), (14, 64)])
def test_rows_match_the_default_processor(patch_size, budget):
    processor = Siglip2ImageProcessor(patch_size=patch_size, max_num_patches=budget, image_mean=list(MEAN),
                                      image_std=list(STD))
    assert isinstance(processor, TorchvisionBackend)  # what transformers builds for SigLIP 2 by default
    images = [_smooth_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    expected = processor(images=images, return_tensors="np")
    rows = np.stack([naflex_rows(image, patch_size, budget, MEAN, STD) for image in images])
    patches, grids, mask = split_rows(rows)
    np.testing.assert_array_equal(grids, expected["spatial_shapes"])
    np.testing.assert_array_equal(mask, expected["pixel_attention_mask"].astype(bool))
    assert not patches[~mask].any()
    # torch's integer kernel rounds its weights to 16 bits, Pillow's to 22: a resized value may land one level apart,
    # 1 / (255 * std) after normalisation. Measured on these images: 0-0.3% of an image's values, 1.5% for 3 x 500
    # at patch 14, 4.2% for 20 x 2000 on a 1 x 64 grid (a near-2x reduction); none more than one level.
    level = 1 / (255 * np.asarray(STD, np.float32))
    difference = np.abs(patches - expected["pixel_values"]).reshape(*patches.shape[:2], -1, 3)
    off = difference > 1e-5
    np.testing.assert_allclose(difference[off], np.broadcast_to(level, difference.shape)[off], rtol=1e-4)
    per_image = off.sum(axis=(1, 2, 3)) / (mask.sum(axis=1) * patch_size * patch_size * 3)
    assert per_image.max() < 0.06 and off.sum() < 0.01 * mask.sum() * patch_size * patch_size * 3, per_image
    if patch_size == 16:  # 256 x 256 is its grid's size already: no resize, no difference
        assert per_image[IMAGE_SIZES.index((256, 256))] == 0

def test_transform_takes_bytes_arrays_and_images_alike_and_pickles():
    image = _smooth_image(45, 120, seed=3)
    encoded = io.BytesIO()
    image.save(encoded, format="png")
    transform = pickle.loads(pickle.dumps(NaFlexTransform(16, 64, MEAN, STD)))
    expected = naflex_rows(image, 16, 64, MEAN, STD)
    assert expected.shape == (64, 16 * 16 * 3 + 2) and expected.dtype == np.float32
    for given in (encoded.getvalue(), np.asarray(image), image, image.convert("RGBA")):
        np.testing.assert_array_equal(transform(given), expected)
    grey = np.asarray(image.convert("L"))
    np.testing.assert_array_equal(transform(grey), naflex_rows(Image.fromarray(grey).convert("RGB"), 16, 64, MEAN, STD))
    with pytest.raises(transforms.ImageDecodeError):
        transform(b"not an image")


@pytest.mark.parametrize("make", [lambda: naflex_grid(10, 10, 16, 0), lambda: NaFlexTransform(16, -3)])
def test_budget_below_one_patch_is_one_line_naming_the_flag(make):
    with pytest.raises(InvalidInput, match="--max_num_patches") as raised:
        make()
    assert "\n" not in str(raised.value)
