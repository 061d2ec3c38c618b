"""OpenCLIP's aug_cfg (its transform without timm): colour jitter and greyscale equal torchvision's, pixel for pixel,
through OpenCLIP's own train transform given the same random draws; config validation."""

import io

import numpy as np
import open_clip
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from PIL import Image

from clip_jax import data
from clip_jax.data import train_config, transforms
from clip_jax.run_config import default_config
from clip_jax.training.config_checks import check_config

MEAN, STD = (0.48, 0.45, 0.40), (0.27, 0.26, 0.28)


def _photo(seed, size=(57, 43)):
    """A colourful test image: gradients plus noise, through JPEG like a real sample."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]] / max(size)
    base = np.stack([x, y, 1 - x * y], -1) * 255 * rng.uniform(0.4, 1.0, 3)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return transforms.decode_rgb(buffer.getvalue())


@pytest.mark.parametrize("name,factor", [("brightness", 0.6), ("brightness", 1.3), ("contrast", 0.7),
                                         ("contrast", 1.4), ("saturation", 0.2), ("saturation", 1.6),
                                         ("hue", 0.13), ("hue", -0.27), ("hue", -0.5), ("hue", 0.5)])
def test_each_adjustment_equals_torchvision(name, factor):
    image = _photo(1)
    theirs = getattr(TF, f"adjust_{name}")(image, factor)
    np.testing.assert_array_equal(np.asarray(transforms.adjust(image, name, factor)), np.asarray(theirs))


def test_greyscale_equals_torchvision():
    image = _photo(2)
    theirs = TF.rgb_to_grayscale(image, num_output_channels=3)
    np.testing.assert_array_equal(np.asarray(transforms.greyscale_rgb(image)), np.asarray(theirs))


@pytest.mark.parametrize("jitter", [(0.4, 0.4, 0.4, 0.1), (0.8, 0.0, 0.3, 0.0), (0.0, 0.0, 0.0, 0.5)])
def test_jitter_factors_follow_torchvision_ranges(jitter):
    reference = T.ColorJitter(*jitter)
    rng = np.random.default_rng(0)
    seen = {}
    for _ in range(400):
        params = transforms.color_jitter_params(rng, jitter)
        for name, factor in params:
            seen.setdefault(name, []).append(factor)
        assert len({n for n, _ in params}) == len(params)
    for name in ("brightness", "contrast", "saturation", "hue"):
        bounds = getattr(reference, name)
        if bounds is None:
            assert name not in seen
        else:
            values = np.asarray(seen[name])
            assert bounds[0] <= values.min() and values.max() <= bounds[1]
            assert values.min() < bounds[0] + 0.1 * (bounds[1] - bounds[0])  # spread over the range
            assert values.max() > bounds[1] - 0.1 * (bounds[1] - bounds[0])


class _Queue:
    """Hands out given values in order (stands in for the random module OpenCLIP's transform calls)."""

    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


@pytest.mark.parametrize("aug", [
    dict(scale=(0.5, 1.0), color_jitter=(0.4, 0.4, 0.4, 0.1), color_jitter_prob=0.8, gray_scale_prob=0.4),
    dict(scale=(0.9, 1.0), color_jitter=(0.3, 0.0, 0.5, 0.2), color_jitter_prob=1.0, gray_scale_prob=0.0),
    dict(scale=(0.9, 1.0), gray_scale_prob=0.5),
])
@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")
def test_train_augment_equals_open_clips_transform_given_the_same_draws(aug, monkeypatch):
    """OpenCLIP's train transform with its random draws replaced by ours gives the same normalised pixels."""
    reference = open_clip.image_transform(32, is_train=True, mean=MEAN, std=STD, aug_cfg=aug)
    augment = train_config.augment_from_config(aug)
    jitter_used = grey_used = 0
    for seed in range(12):
        image = _photo(seed, size=(50 + seed * 7, 40 + seed * 3))
        ours = transforms.train_augment(image, 32, np.random.default_rng(seed), augment)
        # The same draws, in our order: crop box, jitter coin, jitter order + factors, grey coin.
        rng = np.random.default_rng(seed)
        left, top, right, bottom = transforms.random_resized_crop_box(image.width, image.height, rng, augment.scale)
        coins, jitter = [], None
        if augment.color_jitter_prob:
            coins.append(rng.random())
            if coins[-1] < augment.color_jitter_prob:
                state = rng.bit_generator.state
                order = rng.permutation(4)
                rng.bit_generator.state = state
                params = dict(transforms.color_jitter_params(rng, augment.color_jitter))
                jitter = (torch.as_tensor(order), *(params.get(n) for n in
                                                     ("brightness", "contrast", "saturation", "hue")))
                jitter_used += 1
        if augment.gray_scale_prob:
            coins.append(rng.random())
            grey_used += coins[-1] < augment.gray_scale_prob
        monkeypatch.setattr(open_clip.transform.RandomResizedCrop, "get_params",
                            staticmethod(lambda img, scale, ratio: (top, left, bottom - top, right - left)))
        monkeypatch.setattr(open_clip.transform, "random", _Queue(coins))
        monkeypatch.setattr(T.ColorJitter, "get_params", staticmethod(lambda *ranges: jitter))
        theirs = reference(image).numpy().transpose(1, 2, 0)  # [S, S, 3]
        np.testing.assert_array_equal(transforms.normalize(ours, MEAN, STD), theirs)
    assert grey_used or not augment.gray_scale_prob
    assert jitter_used or not augment.color_jitter_prob


def test_a_plain_aug_cfg_gives_the_crop_only_transform():
    image = _photo(3)
    plain = transforms.TrainAugment()
    assert plain.plain
    np.testing.assert_array_equal(transforms.train_augment(image, 24, np.random.default_rng(5), plain),
                                  transforms.train_crop(image, 24, np.random.default_rng(5)))


def test_the_pipeline_applies_aug_cfg_from_the_run_config(tmp_path):
    import webdataset as wds

    buffer = io.BytesIO()
    Image.new("RGB", (20, 20), (200, 30, 60)).save(buffer, "PNG")
    with wds.TarWriter(str(tmp_path / "00000.tar"), encoder=False) as sink:
        for i in range(4):
            sink.write({"__key__": f"{i:09d}", "png": buffer.getvalue(), "txt": b"red"})
    c = default_config()
    c.train_data, c.workers = str(tmp_path / "00000.tar"), 0
    c.aug_cfg.gray_scale_prob = 1.0
    cfg = data.TrainDataConfig.from_run_config(c)
    it = data.build_train_iterator(cfg, global_batch_size=4, image_size=8, mean=(0.5,) * 3, std=(0.5,) * 3)
    images = next(it)["images"]
    np.testing.assert_array_equal(images[..., 0], images[..., 1])  # every image greyscale


@pytest.mark.parametrize("change,message", [
    ({"re_prob": 0.25}, "aug_cfg re_prob: not supported without use_timm"),
    ({"use_timm": True, "gray_scale_prob": 0.5}, "aug_cfg gray_scale_prob: not supported with use_timm"),
    ({"auto_augment": "rand-m9"}, "aug_cfg auto_augment: not supported"),
    ({"use_timm": True, "re_prob": 0.5, "re_count": -1}, "re_count=-1 >= 1"),
    ({"color_jitter_prob": 0.8}, "color_jitter_prob needs color_jitter"),
    ({"gray_scale_prob": 1.5}, "gray_scale_prob=1.5 must be in"),
    ({"scale": (0.0, 1.0)}, "scale"),
    ({"color_jitter": (0.4, 0.4, 0.4, 0.7), "color_jitter_prob": 1.0}, "hue <= 0.5"),
])
def test_bad_aug_cfg_is_refused_before_compiling(change, message):
    c = default_config()
    c.train_data = "/data/{0..1}.tar"
    c.aug_cfg.unlock()
    c.aug_cfg.update(change)
    with pytest.raises(ValueError, match=message):
        check_config(c, num_devices=1)


# -- timm's transform (use_timm): crop with ratio, random erasing ---------------------------------------------------


class _Recorder:
    """A numpy Generator that notes every draw, so that timm's transform can be handed the same values."""

    def __init__(self, rng):
        self.rng, self.draws = rng, []

    def random(self):
        self.draws.append(("random", self.rng.random()))
        return self.draws[-1][1]

    def uniform(self, low, high):
        self.draws.append(("uniform", self.rng.uniform(low, high)))
        return self.draws[-1][1]

    def integers(self, low, high):
        self.draws.append(("randint", int(self.rng.integers(low, high))))
        return self.draws[-1][1]

    def standard_normal(self, shape, dtype):
        self.draws.append(("normal", self.rng.standard_normal(shape, dtype=dtype)))
        return self.draws[-1][1]


class _Replay:
    """Stands in for the random module timm's RandomErasing calls, replaying recorded draws of the same kind."""

    def __init__(self, draws):
        self.draws = list(draws)

    def _next(self, kind):
        got, value = self.draws.pop(0)
        assert got == kind, (got, kind)
        return value

    def random(self):
        return self._next("random")

    def uniform(self, low, high):
        return self._next("uniform")

    def randint(self, low, high):
        return self._next("randint")

    def pixels(self, per_pixel, rand_color, patch_size, dtype=torch.float32, device="cpu"):
        assert per_pixel and tuple(patch_size) == self.draws[0][1].shape
        return torch.from_numpy(self._next("normal"))


@pytest.mark.parametrize("aug", [
    dict(use_timm=True, scale=(0.4, 1.0), ratio=(0.5, 2.0), re_prob=0.7),
    dict(use_timm=True, scale=(0.9, 1.0), re_prob=1.0, re_count=3),
])
def test_timm_path_equals_open_clips_timm_transform_given_the_same_draws(aug, monkeypatch):
    import timm.data.random_erasing
    import timm.data.transforms

    reference = open_clip.image_transform(24, is_train=True, mean=MEAN, std=STD, aug_cfg=aug)
    augment = train_config.augment_from_config(aug)
    erased = 0
    for seed in range(16):
        image = _photo(seed, size=(40 + seed * 5, 60 - seed * 2))
        rng = np.random.default_rng(seed)
        pixels = transforms.train_augment(image, 24, rng, augment)
        recorder = _Recorder(rng)
        regions = transforms.random_erasing(recorder, 24, augment.re_prob, augment.re_count)
        ours = transforms.normalize(pixels, MEAN, STD)
        transforms.apply_erasing(ours, regions)
        erased += bool(regions)
        left, top, right, bottom = transforms.random_resized_crop_box(
            image.width, image.height, np.random.default_rng(seed), augment.scale, augment.ratio)
        monkeypatch.setattr(timm.data.transforms.RandomResizedCropAndInterpolation, "get_params",
                            staticmethod(lambda img, scale, ratio: (top, left, bottom - top, right - left)))
        replay = _Replay(recorder.draws)
        monkeypatch.setattr(timm.data.random_erasing, "random", replay)
        monkeypatch.setattr(timm.data.random_erasing, "_get_pixels", replay.pixels)
        theirs = reference(image).numpy().transpose(1, 2, 0)
        np.testing.assert_array_equal(ours, theirs)
        assert not replay.draws
    assert erased >= 4


def test_the_pipeline_erases_after_normalising(tmp_path):
    import webdataset as wds

    buffer = io.BytesIO()
    Image.new("RGB", (20, 20), (255, 255, 255)).save(buffer, "PNG")
    with wds.TarWriter(str(tmp_path / "00000.tar"), encoder=False) as sink:
        for i in range(8):
            sink.write({"__key__": f"{i:09d}", "png": buffer.getvalue(), "txt": b"white"})
    c = default_config()
    c.train_data, c.workers = str(tmp_path / "00000.tar"), 0
    c.aug_cfg.use_timm, c.aug_cfg.re_prob = True, 1.0
    cfg = data.TrainDataConfig.from_run_config(c)
    images = next(data.build_train_iterator(cfg, global_batch_size=8, image_size=16, mean=(0.5,) * 3,
                                            std=(0.5,) * 3))["images"]
    noisy = images != 1.0  # white normalises to 1; erased pixels are normal noise
    assert noisy.any(axis=(1, 2, 3)).all() and noisy.mean() < 0.5
