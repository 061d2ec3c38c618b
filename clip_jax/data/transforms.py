"""Image decoding and OpenCLIP's train/eval transforms, on PIL images, as pure functions.

Train: random resized crop (area scale (0.9, 1.0), aspect ratio (3/4, 4/3), the same sampling rule as torchvision's
``RandomResizedCrop``), bicubic resize to ``size``. Eval: bicubic resize of the shortest side to ``size``, center crop.
Both return ``uint8 [size, size, 3]``; :func:`normalize` turns a batch into float32 as ``(x / 255 - mean) / std``.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Sequence

import numpy as np
from PIL import Image

from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD  # noqa: F401 - the data package's names for them

TRAIN_SCALE = (0.9, 1.0)
TRAIN_RATIO = (3 / 4, 4 / 3)


class ImageDecodeError(ValueError):
    """Bytes that do not decode to an image."""


class TooManyPixels(ImageDecodeError):
    """An image whose header declares more pixels than allowed (a decompression bomb, or just too large)."""


def decode_rgb(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Decodes JPEG/PNG/WebP bytes to an RGB image (greyscale, palette, alpha and CMYK are converted).

    ``max_pixels``: refuse (TooManyPixels) an image whose header declares more pixels, before decoding it.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # palette transparency, EXIF and size warnings
            image = Image.open(io.BytesIO(data))
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise TooManyPixels(f"{image.width}x{image.height} is more than {max_pixels:,} pixels")
            image.load()
            if image.mode != "RGB":
                image = image.convert("RGB")
    except TooManyPixels:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own limit (twice Image.MAX_IMAGE_PIXELS)
        raise TooManyPixels(str(e)) from e
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds (OSError, SyntaxError, ValueError, ...)
        raise ImageDecodeError(f"{type(e).__name__}: {e}") from e
    if image.width == 0 or image.height == 0:
        raise ImageDecodeError("image has zero size")
    return image


def random_resized_crop_box(
    width: int,
    height: int,
    rng: np.random.Generator,
    scale: Sequence[float] = TRAIN_SCALE,
    ratio: Sequence[float] = TRAIN_RATIO,
) -> tuple[int, int, int, int]:
    """A random crop box (left, top, right, bottom): area fraction in ``scale``, aspect ratio (w/h) in ``ratio``.

    Ten tries at a random area and log-uniform aspect ratio; if none fits, the largest central crop whose ratio is
    clamped to ``ratio``.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(rng.integers(0, height - crop_h + 1))
            left = int(rng.integers(0, width - crop_w + 1))
            return left, top, left + crop_w, top + crop_h
    in_ratio = width / height
    if in_ratio < min(ratio):
        crop_w, crop_h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        crop_w, crop_h = int(round(height * max(ratio))), height
    else:
        crop_w, crop_h = width, height
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return left, top, left + crop_w, top + crop_h


def train_crop(
    image: Image.Image,
    size: int,
    rng: np.random.Generator,
    scale: Sequence[float] = TRAIN_SCALE,
    ratio: Sequence[float] = TRAIN_RATIO,
) -> np.ndarray:
    """Random resized crop to ``size`` x ``size``, bicubic. Returns uint8 [size, size, 3]."""
    box = random_resized_crop_box(image.width, image.height, rng, scale, ratio)
    return resized_crop(image, box, size)


def resized_crop(image: Image.Image, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    """Crops ``box`` (left, top, right, bottom), then resizes it to ``size`` x ``size`` bicubic."""
    crop = image.crop(box)
    if crop.size != (size, size):
        crop = crop.resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(crop)


def eval_crop(image: Image.Image, size: int) -> np.ndarray:
    """Bicubic resize of the shortest side to ``size`` (the other as ``int(size * long / short)``), center crop."""
    width, height = image.size
    short, long = min(width, height), max(width, height)
    new_long = int(size * long / short)
    new_size = (size, new_long) if width <= height else (new_long, size)
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.BICUBIC)
    left = int(round((new_size[0] - size) / 2.0))
    top = int(round((new_size[1] - size) / 2.0))
    return np.asarray(image.crop((left, top, left + size, top + size)))


def normalize(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 [..., 3] -> float32 ``(x / 255 - mean) / std``, in float32 like torchvision's ToTensor + Normalize."""
    out = images.astype(np.float32)
    np.divide(out, np.float32(255), out=out)
    np.subtract(out, np.asarray(mean, np.float32), out=out)
    np.divide(out, np.asarray(std, np.float32), out=out)
    return out
