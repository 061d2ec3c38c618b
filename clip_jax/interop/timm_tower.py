"""An exported model's image tower in timm: the timm model that holds it, with its arguments and its data config.

    name, kwargs, data = timm_args("exported/")
    tower = timm.create_model(name, **kwargs)        # the export's image tower, its weights loaded by timm
    transform = timm.data.create_transform(**data)   # the eval transform, with the export's own mean and std

An OpenCLIP ViT image tower (GELU or quick GELU, any width, depth, heads, patch, image size and MLP ratio) is timm's
`vit_base_patch16_clip_224` (or `..._quickgelu_224`) built at the export's sizes: timm converts OpenCLIP's state_dict
itself, and `tower(pixels)` is `encode_image(pixels, normalize=False)`. Only the names' architecture is taken from
them; their own sizes, weights and data config (OpenAI's mean and std) are replaced by the export's. Towers timm's
CLIP ViT does not build (ResNet, OpenCLIP's custom-block options, SigLIP's attention pooling) are refused in one
line naming what differs. Reads only the folder's `open_clip_config.json`; timm is not needed to call it.
"""

import json
import os

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD

CONFIG_FILE, WEIGHTS_FILE = "open_clip_config.json", "open_clip_model.safetensors"
# The vision_cfg keys of a tower timm's CLIP ViT builds as OpenCLIP does; any other is a custom option.
PLAIN_VISION_KEYS = ("image_size", "layers", "width", "patch_size", "head_width", "mlp_ratio", "patch_dropout")


def timm_args(folder: str) -> tuple[str, dict, dict]:
    """(timm model name, `timm.create_model` keyword arguments, `timm.data.create_transform` keyword arguments) of
    the image tower of the exported model in `folder`."""
    config_path, weights_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(config_path) and _model_type(folder) == "siglip2":
        raise InvalidInput(f"{folder} is a transformers SigLIP 2 NaFlex folder (no {CONFIG_FILE}): this names "
                           "timm's CLIP ViT for OpenCLIP exports of a plain ViT tower; load the folder with "
                           "transformers' Siglip2Model")
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise MissingInput(f"{path} does not exist: give a folder `python -m clip_jax.export` wrote")
    with open(config_path) as f:
        config = json.load(f)
    model, preprocess = config["model_cfg"], config.get("preprocess_cfg", {})
    vision = model["vision_cfg"]
    refused = refusal(model)
    if refused:
        raise InvalidInput(f"{folder}: {refused}; timm's CLIP ViT (vit_*_clip_*) builds OpenCLIP's plain ViT "
                           "image tower only")
    name = "vit_base_patch16_clip_quickgelu_224" if model.get("quick_gelu") else "vit_base_patch16_clip_224"
    embed_dim = model["embed_dim"]
    kwargs = {"pretrained": True, "pretrained_cfg_overlay": {"file": weights_path, "num_classes": embed_dim},
              "img_size": vision["image_size"], "patch_size": vision["patch_size"], "embed_dim": vision["width"],
              "depth": vision["layers"], "num_heads": vision["width"] // vision.get("head_width", 64),
              "mlp_ratio": vision.get("mlp_ratio", 4.0), "num_classes": embed_dim}
    size = vision["image_size"]
    data = {"input_size": (3, size, size), "interpolation": preprocess.get("interpolation", "bicubic"),
            "crop_pct": 1.0, "crop_mode": "center", "mean": tuple(preprocess.get("mean", OPENAI_MEAN)),
            "std": tuple(preprocess.get("std", OPENAI_STD))}
    return name, kwargs, data


def _model_type(folder: str) -> str | None:
    """The `model_type` of a transformers folder's config.json (None: none there, or not one)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def refusal(model: dict) -> str | None:
    """What makes `model`'s image tower one timm's CLIP ViT does not build (None: it builds it)."""
    vision = model["vision_cfg"]
    if not isinstance(vision.get("layers"), int):
        return f"a ResNet image tower (layers {vision.get('layers')}) has no timm counterpart that reads its weights"
    if model.get("init_logit_bias") is not None:
        return "a SigLIP model (init_logit_bias): its image tower pools by attention"
    custom = sorted(key for key in vision if key not in PLAIN_VISION_KEYS)
    if custom:
        return f"the image tower has OpenCLIP's custom option(s) {', '.join(custom)}"
    if vision.get("image_size") is None or isinstance(vision["image_size"], (list, tuple)):
        return f"a non-square image size {vision.get('image_size')}"
    return None
