"""Image transforms against OpenCLIP's own (torchvision) transforms on the same PIL images."""

import io

import numpy as np
import open_clip
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image

from clip_jax.data import transforms

MEAN_STD = [((0.5,) * 3, (0.5,) * 3), (transforms.OPENAI_MEAN, transforms.OPENAI_STD)]


def _photo(width, height, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    # Smooth gradients plus noise: interpolation differences show up everywhere.
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    return image.convert("L") if mode == "L" else image


@pytest.mark.parametrize("mean,std", MEAN_STD)
@pytest.mark.parametrize("size", [(300, 200), (200, 333), (224, 224), (97, 150)])
def test_eval_transform_equals_open_clip(size, mean, std):
    image = _photo(*size)
    reference = open_clip.image_transform(224, is_train=False, mean=mean, std=std)(image)  # [3, 224, 224]
    ours = transforms.normalize(transforms.eval_crop(image, 224)[None], mean, std)[0]  # [224, 224, 3]
    np.testing.assert_array_equal(ours, reference.permute(1, 2, 0).numpy())


def test_train_crop_equals_torchvision_resized_crop_for_the_same_box():
    image = _photo(256, 256, seed=1)
    rng = np.random.default_rng(0)
    for _ in range(5):
        left, top, right, bottom = transforms.random_resized_crop_box(256, 256, rng)
        reference = TF.resized_crop(image, top, left, bottom - top, right - left, [224, 224],
                                    TF.InterpolationMode.BICUBIC)
        ours = transforms.resized_crop(image, (left, top, right, bottom), 224)
        np.testing.assert_array_equal(ours, np.asarray(reference))


def test_random_crop_boxes_respect_scale_and_ratio():
    rng = np.random.default_rng(1)
    scale, ratio = (0.9, 1.0), (3 / 4, 4 / 3)
    areas, ratios = [], []
    for _ in range(2000):
        left, top, right, bottom = transforms.random_resized_crop_box(400, 300, rng, scale, ratio)
        assert 0 <= left < right <= 400 and 0 <= top < bottom <= 300
        w, h = right - left, bottom - top
        areas.append(w * h / (400 * 300))
        ratios.append(w / h)
    areas, ratios = np.asarray(areas), np.asarray(ratios)
    # Rounding to whole pixels moves the area by well under 1%.
    assert areas.min() > 0.89 and areas.max() <= 1.0
    assert ratios.min() > 0.74 and ratios.max() < 1.34
    # Boxes are spread over positions and sizes, not stuck in the fallback.
    assert np.std(areas) > 0.01


def test_random_crop_box_distribution_matches_torchvision():
    # Same sampling rule, different RNGs: compare the distribution of crop widths on a 256x256 image.
    rng = np.random.default_rng(0)
    boxes = np.asarray([transforms.random_resized_crop_box(256, 256, rng) for _ in range(3000)])
    ours_w = boxes[:, 2] - boxes[:, 0]
    torch.manual_seed(0)
    image = torch.zeros(3, 256, 256)
    theirs_w = np.asarray([open_clip.transform.RandomResizedCrop.get_params(image, [0.9, 1.0], [3 / 4, 4 / 3])[3]
                           for _ in range(3000)])
    for q in (0.1, 0.5, 0.9):
        assert abs(np.quantile(ours_w, q) - np.quantile(theirs_w, q)) <= 3


def test_fallback_is_a_central_crop_clamped_to_the_ratio():
    # A 1000x10 strip cannot hold a 0.9-area crop with ratio <= 4/3: the fallback is a central 13x10 crop.
    box = transforms.random_resized_crop_box(1000, 10, np.random.default_rng(0))
    assert box == ((1000 - 13) // 2, 0, (1000 - 13) // 2 + 13, 10)


@pytest.mark.parametrize("mean,std", MEAN_STD)
def test_normalize_equals_to_tensor_then_normalize(mean, std):
    pixels = np.random.default_rng(2).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    ours = transforms.normalize(pixels, mean, std)
    for i in range(2):
        reference = TF.normalize(TF.to_tensor(Image.fromarray(pixels[i])), mean, std)
        np.testing.assert_array_equal(ours[i], reference.permute(1, 2, 0).numpy())
    assert ours.dtype == np.float32


def test_greyscale_and_palette_images_decode_to_rgb():
    grey = _photo(30, 20, mode="L")
    buffer = io.BytesIO()
    grey.save(buffer, "JPEG")
    with Image.open(io.BytesIO(buffer.getvalue())) as stored:
        assert stored.mode == "L"  # a 1-channel JPEG, as img2dataset writes greyscale images
    decoded = transforms.decode_rgb(buffer.getvalue())
    pixels = np.asarray(decoded)
    assert decoded.mode == "RGB" and pixels.shape == (20, 30, 3)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()
    buffer = io.BytesIO()
    Image.new("RGBA", (4, 4), (10, 20, 30, 0)).convert("P").save(buffer, "PNG", transparency=0)
    assert np.asarray(transforms.decode_rgb(buffer.getvalue())).shape == (4, 4, 3)


@pytest.mark.parametrize("data", [b"", b"not an image", b"\xff\xd8\xff\xe0" + b"\x00" * 50])
def test_undecodable_bytes_raise_image_decode_error(data):
    with pytest.raises(transforms.ImageDecodeError):
        transforms.decode_rgb(data)


def test_train_crop_is_deterministic_given_the_rng():
    image = _photo(256, 256)
    a = transforms.train_crop(image, 224, np.random.default_rng(5))
    b = transforms.train_crop(image, 224, np.random.default_rng(5))
    c = transforms.train_crop(image, 224, np.random.default_rng(6))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (224, 224, 3) and a.dtype == np.uint8
