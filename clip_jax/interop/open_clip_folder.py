"""OpenCLIP's model folder, as `python -m clip_jax.export` writes it and OpenCLIP loads it (`local-dir:FOLDER`):
`open_clip_config.json` (`model_cfg`: the architecture, `preprocess_cfg`: the image preprocessing) beside the
weights (`open_clip_model.safetensors`, or the names OpenCLIP's published folders use).

`read_export_config`, `folder_model_config`, `folder_preprocessing` and `folder_weights_file` read one;
`clip_jax.interop.opener` decides whether a path is one.
"""

import json
import os

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import hf_folder
from clip_jax.models.config import UNNAMED, CLIPConfig
from clip_jax.models.open_clip_json import config_from_open_clip

EXPORT_CONFIG = "open_clip_config.json"
EXPORT_WEIGHTS = "open_clip_model.safetensors"
# Weight files an OpenCLIP model folder may hold, in the order OpenCLIP prefers them (its published folders use
# the open_clip_pytorch_model.* names).
FOLDER_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin",
                  "open_clip_pytorch_model.pth", "model.safetensors", "pytorch_model.bin", "pytorch_model.pth",
                  "model.pth")
# Beside OpenCLIP's `model_cfg` and `preprocess_cfg`: the exported model's name, as the commands that read the folder
# report it (a CLIP_benchmark record's `model`). OpenCLIP reads only its own two keys.
MODEL_NAME = "model_name"
# What clip_jax's transforms do (clip_jax.data.transforms), in OpenCLIP's preprocess_cfg words.
INTERPOLATION, RESIZE_MODE = "bicubic", "shortest"


def read_export_config(folder: str) -> tuple[dict, dict]:
    """(model_cfg, preprocess_cfg) of an exported model folder, as OpenCLIP reads its `open_clip_config.json`."""
    saved = _read_config_file(folder)
    return saved["model_cfg"], saved.get("preprocess_cfg", {})


def _read_config_file(folder: str) -> dict:
    """The folder's `open_clip_config.json`, checked: an object with a `model_cfg` object and, where it has one, a
    `preprocess_cfg` object."""
    path = os.path.join(folder, EXPORT_CONFIG)
    if not os.path.isfile(path):
        raise MissingInput(f"{path} is missing: an exported model folder holds {EXPORT_CONFIG} (the model and its "
                           f"preprocessing) beside {EXPORT_WEIGHTS}, or is a transformers CLIPModel folder (its "
                           f"{hf_folder.CONFIG}); write both with python -m clip_jax.export")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{path} is not valid JSON: {e}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model_cfg"), dict):
        raise InvalidInput(f"{path} has no 'model_cfg' object (OpenCLIP's format: model_cfg and preprocess_cfg)")
    preprocess = saved.get("preprocess_cfg", {})
    if not isinstance(preprocess, dict):
        raise InvalidInput(f"{path}: preprocess_cfg must be an object")
    return saved


def folder_model_config(folder: str) -> CLIPConfig:
    """The model an exported folder holds, under the name its export recorded (`model_name`: the run's model,
    `demo-tiny` or `ViT-L-14`), else (a folder OpenCLIP wrote, or a model exported from an unnamed config) the
    folder's name."""
    saved = _read_config_file(folder)
    name = saved.get(MODEL_NAME)
    if not isinstance(name, str) or not name:
        name = os.path.basename(os.path.normpath(folder))
    return config_from_open_clip(saved["model_cfg"], name=name)


def export_config(model_cfg: dict, preprocess_cfg: dict, name: str) -> dict:
    """What an export writes as `open_clip_config.json`: OpenCLIP's two objects, and the model's name (which
    OpenCLIP does not read) unless the model had none (`UNNAMED`)."""
    return {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg,
            **({MODEL_NAME: name} if name != UNNAMED else {})}


def folder_preprocessing(folder: str) -> dict:
    """The `mean` and `std` (those it says) an exported folder's model was trained with, from its `preprocess_cfg`,
    and its eval transform's `resize_mode` when it squashes (SigLIP's); preprocessing clip_jax's transforms do not
    do is refused."""
    from clip_jax.data.transforms import RESIZE_MODES

    saved = read_export_config(folder)[1]
    for key, ours in (("interpolation", (INTERPOLATION,)), ("resize_mode", RESIZE_MODES)):
        if saved.get(key, ours[0]) not in ours:
            raise InvalidInput(f"{folder}: preprocess_cfg {key}={saved[key]!r}; clip_jax's transforms do "
                               f"{key} {' or '.join(map(repr, ours))} only")
    squash = {"resize_mode": "squash"} if saved.get("resize_mode") == "squash" else {}
    return {**{k: tuple(saved[k]) for k in ("mean", "std") if k in saved}, **squash}


def folder_weights_file(folder: str) -> str:
    """The weights file of an exported folder, the first of `FOLDER_WEIGHTS` it holds."""
    held = [name for name in FOLDER_WEIGHTS if os.path.isfile(os.path.join(folder, name))]
    if not held:
        raise MissingInput(f"no model weights in {folder}: expected {EXPORT_WEIGHTS} (or one of "
                           f"{', '.join(FOLDER_WEIGHTS[1:])})")
    return os.path.join(folder, held[0])
