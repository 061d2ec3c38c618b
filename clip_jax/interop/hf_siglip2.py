"""Hugging Face transformers' `Siglip2Model` (SigLIP 2 with NaFlex, model_type `siglip2`) <-> clip_jax: its
`config.json` and its state_dict.

A Siglip2Model is a SiglipModel (`hf_siglip`, whose pieces this shares) but for its image tower's input: each image
at its own aspect ratio as a grid of flattened patches under a patch budget, embedded by a Linear
[W, P * P * 3] over (row, column, channel) patches, its learned position grid (`num_patches` positions, a square)
resized to each image's grid: clip_jax's NaFlex tower (`VisionConfig.naflex`). Its vision_config names no image
size: clip_jax's is the position grid's side times the patch size. The conversions are exact both ways (the patch
Linear is OpenCLIP's patch convolution's kernel [W, 3, P, P] transposed to [W, P, P, 3] and flattened).
"""

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.interop import hf_siglip
from clip_jax.models.config import CLIPConfig

MODEL_TYPE = "siglip2"  # config.json's `model_type` of a Siglip2Model folder
MODEL = "Siglip2Model"
# Siglip2ImageProcessor's defaults: the patch budget an image is resized under, and its patch size.
MAX_NUM_PATCHES = 256
PATCH_SIZE = 16
# transformers' Siglip2VisionConfig defaults (google/siglip2-base-patch16-naflex) for the keys a config.json may leave
# out: SiglipVisionConfig's, with a position grid of `num_patches` instead of an image size.
_VISION_DEFAULTS = {**{k: v for k, v in hf_siglip.VISION_DEFAULTS.items() if k != "image_size"}, "num_patches": 256}
# OpenCLIP's patch convolution kernel [W, 3, P, P] <-> Siglip2Model's patch Linear [W, P * P * 3]
_PATCH_LINEAR = (lambda x: np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(x.shape[0], -1),
                 lambda x: np.ascontiguousarray(_as_patches(x).transpose(0, 3, 1, 2)))


def _as_patches(weight: np.ndarray) -> np.ndarray:
    """The patch Linear's weight [W, P * P * 3] as [W, P, P, 3]."""
    size = math.isqrt(weight.shape[1] // 3)
    return weight.reshape(weight.shape[0], size, size, 3)


def hf_unsupported(config: CLIPConfig) -> str | None:
    """Why transformers' Siglip2Model cannot hold `config` (one clause), or None when it can."""
    reason = hf_siglip.unsupported(config, MODEL)
    if reason is None and not config.vision.naflex:
        return "its image tower takes fixed-size images (a SiglipModel holds it; a Siglip2Model's is NaFlex)"
    return reason


def hf_config(config: CLIPConfig) -> dict:
    """The `config.json` transformers' `Siglip2Model.from_pretrained` reads for `config` (see `hf_unsupported`)."""
    hf_siglip.refuse(config, hf_unsupported(config), MODEL)
    text, vision = hf_siglip.tower_configs(config)
    del vision["image_size"]
    vision.update(model_type="siglip2_vision_model", num_patches=config.vision.grid_size**2)
    text.update(model_type="siglip2_text_model")
    return {"architectures": [MODEL], "model_type": MODEL_TYPE, "initializer_factor": 1.0, "dtype": "float32",
            "text_config": text, "vision_config": vision}


def config_from_hf(cfg: Mapping[str, Any], name: str = "custom", where: str = "config.json") -> CLIPConfig:
    """The clip_jax model of a transformers Siglip2Config dict (a Siglip2Model folder's `config.json`): a NaFlex
    image tower whose image_size is the position grid's side times the patch size."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise InvalidInput(f"{where} is a transformers {cfg.get('model_type')!r} model; this reads {MODEL} folders "
                           f"(model_type {MODEL_TYPE!r})")
    t, v = hf_siglip.towers(cfg, where, _VISION_DEFAULTS)
    grid = math.isqrt(v["num_patches"]) if v["num_patches"] > 0 else 0
    if grid * grid != v["num_patches"] or not grid:
        raise InvalidInput(f"{where}: vision_config.num_patches={v['num_patches']} is not a positive square: "
                           "clip_jax's NaFlex tower holds a square grid of learned positions")
    patch_size = hf_siglip.square(v["patch_size"], "patch_size", where)
    return hf_siglip.clip_config(t, v, grid * patch_size, True, name, where)


def to_hf_state_dict(state_dict: Mapping[str, np.ndarray], config: CLIPConfig) -> dict[str, np.ndarray]:
    """Siglip2Model's state_dict from an OpenCLIP one of `config` (numpy values; the image tower under
    `visual.trunk.` in timm's names, as OpenCLIP's SigLIP towers)."""
    hf_siglip.refuse(config, hf_unsupported(config), MODEL)
    return hf_siglip.hf_state_dict(state_dict, config, _PATCH_LINEAR)


def from_hf_state_dict(state_dict: Mapping[str, Any], config: CLIPConfig, where: str) -> dict[str, np.ndarray]:
    """The OpenCLIP state_dict of `config` from a Siglip2Model one (numpy values); a key missing or left over is
    named."""
    return hf_siglip.open_clip_state_dict(state_dict, config, where, MODEL, _PATCH_LINEAR)
