"""Image decoding and OpenCLIP's train/eval transforms, on PIL images, as pure functions.

Train: random resized crop (area scale (0.9, 1.0), aspect ratio (3/4, 4/3), the same sampling rule as torchvision's
``RandomResizedCrop``), bicubic resize to ``size``. Eval: bicubic resize of the shortest side to ``size``, center crop
(or, SigLIP's "squash", of the whole image to ``size`` x ``size``).
Both return ``uint8 [size, size, 3]``; :func:`normalize` turns a batch into float32 as ``(x / 255 - mean) / std``.

OpenCLIP's ``aug_cfg`` (its transform without timm) adds, after the crop: a colour jitter applied with probability
``color_jitter_prob`` (brightness, contrast, saturation, hue in a random order, as torchvision's ``ColorJitter``), then
greyscale with probability ``gray_scale_prob`` (:class:`TrainAugment`, :func:`train_augment`). The random draws come
from the per-sample generator after the crop's, in a fixed order: jitter coin, jitter order and factors, grey coin.
With ``use_timm`` (OpenCLIP's timm transform) the crop takes ``ratio`` too and, after normalisation, timm's random
erasing (``re_prob``, up to ``re_count`` regions, per-pixel normal noise) may overwrite rectangles
(:func:`random_erasing`, :func:`apply_erasing`; the collate step applies them after normalising).
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageEnhance

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


def to_rgb(image: "bytes | np.ndarray | Image.Image") -> Image.Image:
    """An RGB PIL image from encoded bytes (`decode_rgb`), a uint8 array [H, W(, 3)] or a PIL image of any mode."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode_rgb(bytes(image))
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image, np.uint8))
    return image if image.mode == "RGB" else image.convert("RGB")


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


@dataclasses.dataclass(frozen=True)
class TrainAugment:
    """OpenCLIP's ``aug_cfg`` without timm: crop ``scale``, and colour jitter / greyscale with their probabilities.

    ``color_jitter``: (brightness, contrast, saturation, hue) as OpenCLIP passes them to torchvision's
    ``ColorJitter``: factors drawn in ``[max(0, 1 - b), 1 + b]`` (``[-h, h]`` for hue, ``h <= 0.5``), 0 turns one off.
    """

    scale: tuple[float, float] = TRAIN_SCALE
    color_jitter: tuple[float, float, float, float] | None = None
    color_jitter_prob: float = 0.0
    gray_scale_prob: float = 0.0
    ratio: tuple[float, float] = TRAIN_RATIO  # the crop's aspect ratio range (timm's transform only)
    re_prob: float = 0.0  # random erasing probability (timm's transform only)
    re_count: int = 1  # at most this many erased regions

    def __post_init__(self):
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"aug_cfg scale {self.scale}: need 0 < low <= high <= 1")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"aug_cfg ratio {self.ratio}: need 0 < low <= high")
        if not 0 <= self.re_prob <= 1 or self.re_count < 1:
            raise ValueError(f"aug_cfg re_prob={self.re_prob} must be in [0, 1] and re_count={self.re_count} >= 1")
        for name in ("color_jitter_prob", "gray_scale_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"aug_cfg {name}={getattr(self, name)} must be in [0, 1]")
        if self.color_jitter_prob:
            if self.color_jitter is None or len(self.color_jitter) != 4:
                raise ValueError("aug_cfg color_jitter_prob needs color_jitter = (brightness, contrast, saturation, "
                                 f"hue), got {self.color_jitter}")
            if min(self.color_jitter) < 0 or self.color_jitter[3] > 0.5:
                raise ValueError(f"aug_cfg color_jitter {self.color_jitter}: need values >= 0 and hue <= 0.5")

    @property
    def plain(self) -> bool:
        """Crop only: :func:`train_crop` gives the same pixels."""
        return not self.color_jitter_prob and not self.gray_scale_prob and not self.re_prob


def color_jitter_params(rng: np.random.Generator, jitter: Sequence[float]) -> list[tuple[str, float]]:
    """The adjustments of one jitter, in the order applied: (name, factor) for brightness/contrast/saturation/hue.

    Draws, as torchvision's ``ColorJitter.get_params``: an order of the four, then a factor for each one whose
    strength is not 0 (brightness, contrast, saturation, hue); one with strength 0 is neither drawn nor applied."""
    brightness, contrast, saturation, hue = (float(v) for v in jitter)
    order = rng.permutation(4)
    factors = {}
    for name, strength in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
        if strength:
            factors[name] = float(rng.uniform(max(0.0, 1 - strength), 1 + strength))
    if hue:
        factors["hue"] = float(rng.uniform(-hue, hue))
    names = ("brightness", "contrast", "saturation", "hue")
    return [(names[i], factors[names[i]]) for i in order if names[i] in factors]


def adjust(image: Image.Image, name: str, factor: float) -> Image.Image:
    """One colour adjustment on an RGB image: brightness, contrast, saturation (PIL's enhancers) or a hue shift."""
    if name == "brightness":
        return ImageEnhance.Brightness(image).enhance(factor)
    if name == "contrast":
        return ImageEnhance.Contrast(image).enhance(factor)
    if name == "saturation":
        return ImageEnhance.Color(image).enhance(factor)
    hue, sat, val = image.convert("HSV").split()
    shift = int(factor * 255) % 256  # toward zero, then around the hue circle of 256 steps
    hue = Image.fromarray(((np.asarray(hue, np.uint16) + shift) % 256).astype(np.uint8), "L")
    return Image.merge("HSV", (hue, sat, val)).convert("RGB")


def greyscale_rgb(image: Image.Image) -> Image.Image:
    """ITU-R 601 luma (PIL's ``convert("L")``) in all three channels."""
    luma = np.asarray(image.convert("L"))
    return Image.fromarray(np.repeat(luma[..., None], 3, axis=-1), "RGB")


def train_augment(image: Image.Image, size: int, rng: np.random.Generator, aug: TrainAugment) -> np.ndarray:
    """Random resized crop (``aug.scale``, ``aug.ratio``), then OpenCLIP's colour jitter and greyscale.
    uint8 [size, size, 3]; random erasing is drawn next (:func:`random_erasing`) and applied after normalising."""
    box = random_resized_crop_box(image.width, image.height, rng, aug.scale, aug.ratio)
    crop = image.crop(box)
    if crop.size != (size, size):
        crop = crop.resize((size, size), Image.Resampling.BICUBIC)
    if aug.color_jitter_prob and rng.random() < aug.color_jitter_prob:
        for name, factor in color_jitter_params(rng, aug.color_jitter):
            crop = adjust(crop, name, factor)
    if aug.gray_scale_prob and rng.random() < aug.gray_scale_prob:
        crop = greyscale_rgb(crop)
    return np.asarray(crop)


ERASE_AREA = (0.02, 1 / 3)  # timm's RandomErasing defaults: area fraction and aspect ratio range of a region
ERASE_LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))

Erasure = tuple[int, int, np.ndarray]  # top, left, float32 [h, w, 3] noise that replaces the normalised pixels


def random_erasing(rng: np.random.Generator, size: int, prob: float, max_count: int = 1) -> list[Erasure]:
    """timm's RandomErasing in 'pixel' mode on a ``size`` x ``size`` image: with probability ``prob``, 1 to
    ``max_count`` regions (each of area fraction in [0.02, 1/3] / count, log-uniform aspect in [0.3, 1/0.3], ten
    tries to fit strictly inside) filled with standard normal noise, drawn channel-major as timm draws it."""
    if not prob or rng.random() > prob:
        return []
    count = 1 if max_count == 1 else int(rng.integers(1, max_count + 1))
    area = size * size
    regions = []
    for _ in range(count):
        for _ in range(10):
            target_area = rng.uniform(*ERASE_AREA) * area / count
            aspect = math.exp(rng.uniform(*ERASE_LOG_ASPECT))
            h = int(round(math.sqrt(target_area * aspect)))
            w = int(round(math.sqrt(target_area / aspect)))
            if w < size and h < size:
                top = int(rng.integers(0, size - h + 1))
                left = int(rng.integers(0, size - w + 1))
                noise = rng.standard_normal((3, h, w), dtype=np.float32)
                regions.append((top, left, np.ascontiguousarray(noise.transpose(1, 2, 0))))
                break
    return regions


def apply_erasing(image: np.ndarray, regions: Sequence[Erasure]) -> None:
    """Writes each region's noise into a normalised float image [S, S, 3], in place, in order."""
    for top, left, noise in regions:
        image[top:top + noise.shape[0], left:left + noise.shape[1]] = noise


def resized_crop(image: Image.Image, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    """Crops ``box`` (left, top, right, bottom), then resizes it to ``size`` x ``size`` bicubic."""
    crop = image.crop(box)
    if crop.size != (size, size):
        crop = crop.resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(crop)


def eval_geometry(width: int, height: int, size: int) -> tuple[tuple[int, int], int, int]:
    """((width, height) after the shortest side is resized to ``size``, the other to ``int(size * long / short)``;
    the centre crop's left and top): the eval transform's sizes, for PIL here and JAX in ``interop.guidance``."""
    short, long = min(width, height), max(width, height)
    new_long = int(size * long / short)
    new_size = (size, new_long) if width <= height else (new_long, size)
    return new_size, int(round((new_size[0] - size) / 2.0)), int(round((new_size[1] - size) / 2.0))


RESIZE_MODES = ("shortest", "squash")  # OpenCLIP's eval resize modes clip_jax builds


def eval_crop(image: Image.Image, size: int, resize_mode: str = "shortest") -> np.ndarray:
    """"shortest": bicubic resize of the shortest side to ``size`` (the other as ``int(size * long / short)``),
    center crop. "squash" (SigLIP's; OpenCLIP's ``resize_mode`` of that name, transformers' SiglipImageProcessor):
    bicubic resize of the whole image to ``size`` x ``size``, no crop. (A NaFlex model's eval transform:
    ``clip_jax.data.classification.eval_image``.)"""
    if resize_mode == "squash":
        return np.asarray(image if image.size == (size, size) else image.resize((size, size), Image.Resampling.BICUBIC))
    if resize_mode != "shortest":
        raise ValueError(f"resize_mode={resize_mode!r}: choose one of {RESIZE_MODES}")
    new_size, left, top = eval_geometry(*image.size, size)
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.BICUBIC)
    return np.asarray(image.crop((left, top, left + size, top + size)))


def normalize(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 [..., 3] -> float32 ``(x / 255 - mean) / std``, in float32 like torchvision's ToTensor + Normalize.
    NaFlex rows [..., N, P * P * 3 + 2] (``clip_jax.data.naflex.naflex_pixels``) have their pixels normalised so,
    their grids kept."""
    if images.shape[-1] != 3:
        return _normalize_naflex(images, mean, std)
    out = images.astype(np.float32)
    np.divide(out, np.float32(255), out=out)
    np.subtract(out, np.asarray(mean, np.float32), out=out)
    np.divide(out, np.asarray(std, np.float32), out=out)
    return out


def _normalize_naflex(rows: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    from clip_jax.models.naflex import GRID_COLUMNS

    out = np.array(rows, np.float32)
    pixels = out[..., :-GRID_COLUMNS]
    if pixels.shape[-1] % 3:
        raise ValueError(f"normalize takes images [..., 3] or NaFlex rows [..., P * P * 3 + 2], got {rows.shape}")
    mask = out[..., -1:] > 0  # padding rows stay zero
    shaped = pixels.reshape(*pixels.shape[:-1], -1, 3)
    shaped[...] = normalize(shaped, mean, std) * mask[..., None]
    return out
