"""Weights a model starts from, whatever holds them: `load_pretrained(path, model)` (params), or
`load_pretrained_variables(path, model)` (params, and a ResNet image tower's BatchNorm statistics as `batch_stats`).

`path` may be
- an OpenCLIP checkpoint file (`.pt`/`.pth`/`.bin`, `.safetensors`, `.npz`), converted on the fly;
- a clip_jax params (or variables) file (`.npz` written by `clip_jax.convert`);
- an exported model folder (`open_clip_config.json` + `open_clip_model.safetensors`, what `python -m clip_jax.export`
  writes and OpenCLIP loads as `local-dir:PATH`);
- a Hugging Face transformers CLIPModel folder (`config.json` with `model_type: clip`, `model.safetensors` or
  `pytorch_model.bin`, as `openai/clip-vit-large-patch14`), its model read from its `config.json`; a folder holding
  both layouts (an export of clip_jax's) is read as OpenCLIP's;
- a clip_jax run directory (its newest checkpoint), its `checkpoints` folder, or one `checkpoints/STEP` folder.

The weights are fitted to the model as OpenCLIP fits a checkpoint on load: a vision positional embedding made for
another image size is resized (bicubic, antialiased, class token kept), and a model with a `logit_bias` that the
checkpoint lacks gets it as 0. Anything else that differs is refused, naming the keys and shapes.
"""

import dataclasses
import json
import math
import os

import numpy as np

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import hf_folder
from clip_jax.models.config import CLIPConfig, is_resnet, with_patch_dropout, with_siglip_head
from clip_jax.models.open_clip_json import config_from_open_clip
from clip_jax.models.registry import get_model_config

EXPORT_CONFIG = "open_clip_config.json"
EXPORT_WEIGHTS = "open_clip_model.safetensors"
# Weight files an OpenCLIP model folder may hold, in the order OpenCLIP prefers them (its published folders use
# the open_clip_pytorch_model.* names).
_FOLDER_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin",
                   "open_clip_pytorch_model.pth", "model.safetensors", "pytorch_model.bin", "pytorch_model.pth",
                   "model.pth")
RUN_CONFIG = "config.json"  # the training config the trainer writes into its run directory


def model_at_image_size(config) -> CLIPConfig:
    """The model a training config names, at its `force_image_size` when set (OpenCLIP's --force-image-size:
    pretrained weights for another size get their positional embedding resized on load)."""
    model = get_model_config(config.model)
    size = config.force_image_size
    if size:
        model = dataclasses.replace(model, vision=dataclasses.replace(model.vision, image_size=int(size)))
    return model


def run_model_config(config) -> CLIPConfig:
    """The model a training config trains, as its step is built: at its image size, with OpenCLIP's --siglip head
    for the sigmoid loss (unless the model has a logit_bias) and its `force_patch_dropout` (a ViT's)."""
    model = model_at_image_size(config)
    if config.loss == "siglip":
        model = with_siglip_head(model)
    rate = config.force_patch_dropout
    if rate is not None and rate >= 0 and not is_resnet(model):
        model = with_patch_dropout(model, rate)
    return model


def resize_positional_embedding(positional_embedding: np.ndarray, grid_size: int) -> np.ndarray:
    """[1 + g*g, W] -> [1 + grid_size**2, W]: the patch grid resized bicubically with antialiasing (half-pixel
    centres), the class token's row kept as it is, as OpenCLIP resizes a checkpoint's grid on load."""
    import jax
    import jax.numpy as jnp

    positional_embedding = np.asarray(positional_embedding)
    tokens, width = positional_embedding.shape
    old = int(round(math.sqrt(tokens - 1)))
    if old * old != tokens - 1:
        raise InvalidInput(f"positional embedding of {tokens} tokens is not a class token plus a square grid")
    grid = positional_embedding[1:].reshape(old, old, width).astype(np.float32)
    resized = jax.image.resize(jnp.asarray(grid), (grid_size, grid_size, width), method="bicubic", antialias=True)
    resized = np.asarray(resized, np.float32).reshape(grid_size * grid_size, width)
    return np.concatenate([positional_embedding[:1].astype(np.float32), resized]).astype(positional_embedding.dtype)


def _fit(positional_embedding, logit_bias_missing: bool, config: CLIPConfig):
    """The (positional embedding, logit_bias to add or None) that fit `config`."""
    pos = positional_embedding
    if pos is not None and np.ndim(pos) == 2 and np.shape(pos)[0] != config.vision.num_tokens:
        pos = resize_positional_embedding(pos, config.vision.grid_size)
    bias = np.zeros((), np.float32) if logit_bias_missing and config.init_logit_bias is not None else None
    return pos, bias


def _fitted_state_dict(state_dict: dict, config: CLIPConfig) -> dict:
    from clip_jax.interop.convert import _strip_prefix

    state_dict = _strip_prefix(state_dict)
    pos, bias = _fit(state_dict.get("visual.positional_embedding"), "logit_bias" not in state_dict, config)
    if pos is not None:
        state_dict["visual.positional_embedding"] = pos
    if bias is not None:
        state_dict["logit_bias"] = bias
    return state_dict


def _fitted_tree(params: dict, config: CLIPConfig) -> dict:
    params = dict(params)
    visual = dict(params.get("visual", {}))
    pos, bias = _fit(visual.get("positional_embedding"), "logit_bias" not in params, config)
    if pos is not None:
        params["visual"] = {**visual, "positional_embedding": pos}
    if bias is not None:
        params["logit_bias"] = bias
    return params


def is_export_folder(path: str) -> bool:
    """A folder holding a model (OpenCLIP's config or one of its weight files, or a transformers model's
    `config.json`) rather than a clip_jax run."""
    return os.path.isdir(path) and (any(os.path.isfile(os.path.join(path, name))
                                        for name in (EXPORT_CONFIG,) + _FOLDER_WEIGHTS) or hf_folder.is_hf_folder(path))


def is_hf_model_folder(path: str) -> bool:
    """A transformers model folder without OpenCLIP's config (which, when both are there, is read instead)."""
    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, EXPORT_CONFIG))
            and hf_folder.is_hf_folder(path))


def read_export_config(folder: str) -> tuple[dict, dict]:
    """(model_cfg, preprocess_cfg) of an exported model folder, as OpenCLIP reads its `open_clip_config.json`."""
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
    return saved["model_cfg"], preprocess


def export_model_config(folder: str) -> CLIPConfig:
    """The model an exported folder (OpenCLIP's or transformers') holds."""
    if is_hf_model_folder(folder):
        return hf_folder.hf_model_config(folder)
    model_cfg, _ = read_export_config(folder)
    return config_from_open_clip(model_cfg, name=os.path.basename(os.path.normpath(folder)))


def folder_preprocessing(folder: str) -> dict:
    """The `mean` and `std` (those it says) an exported folder's model was trained with: OpenCLIP's
    `preprocess_cfg`, or a transformers folder's image processor; preprocessing clip_jax's transforms do not do is
    refused."""
    if is_hf_model_folder(folder):
        return hf_folder.hf_preprocessing(folder)
    saved = read_export_config(folder)[1]
    for key, ours in (("interpolation", "bicubic"), ("resize_mode", "shortest")):
        if saved.get(key, ours) != ours:
            raise InvalidInput(f"{folder}: preprocess_cfg {key}={saved[key]!r}; clip_jax's transforms do "
                               f"{key} {ours!r} only")
    return {k: tuple(saved[k]) for k in ("mean", "std") if k in saved}


def _hf_recorded(c: CLIPConfig) -> dict:
    """What a transformers `config.json` records of a ViT model, to compare with the model asked for (not the image
    size: a checkpoint's positional embedding is resized to the model's, as for any pretrained start)."""
    v, t = c.vision, c.text
    return {"embed_dim": c.embed_dim, "quick_gelu": c.quick_gelu,
            **{f"vision {k}": getattr(v, k) for k in ("patch_size", "width", "layers", "heads", "mlp_width")},
            **{f"text {k}": getattr(t, k) for k in ("context_length", "vocab_size", "width", "heads", "layers",
                                                    "mlp_width", "pool_type")},
            **{f"{tower} {k}": getattr(getattr(c, tower).block, k) for tower in ("vision", "text")
               for k in ("norm_eps", "gelu_approximate")}}


def _check_hf_model(folder: str, held: CLIPConfig, wanted: CLIPConfig) -> None:
    """Refuses, in one line naming the differences, a transformers folder whose model is not `wanted`."""
    if is_resnet(wanted):
        differences = [f"{wanted.name} has a ResNet image tower, the folder's model a ViT"]
    else:
        ours, theirs = _hf_recorded(held), _hf_recorded(wanted)
        differences = [f"{what} {ours[what]} (not {theirs[what]})" for what in ours if ours[what] != theirs[what]]
    if differences:
        raise InvalidInput(f"{folder} holds another model than {wanted.name} (its {hf_folder.CONFIG}: "
                           f"{', '.join(differences)}): leave the model out to use the folder's, or name the "
                           "model it holds")


def export_weights_file(folder: str) -> str:
    for name in _FOLDER_WEIGHTS:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise MissingInput(f"no model weights in {folder}: expected {EXPORT_WEIGHTS} (or one of "
                       f"{', '.join(_FOLDER_WEIGHTS[1:])})")


def run_directory(path: str) -> str | None:
    """The run directory a run path names (the run, its `checkpoints`, or `checkpoints/STEP`), or None."""
    path = os.path.abspath(path)
    for candidate in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        if os.path.isfile(os.path.join(candidate, RUN_CONFIG)) and os.path.isdir(os.path.join(candidate,
                                                                                              "checkpoints")):
            return candidate
    return None


def read_run_config(path: str):
    """The training config (a ConfigDict) of the run `path` names (see `run_directory`), with every field: those
    the run's version of clip_jax did not have yet at their defaults."""
    from clip_jax.run_config import saved_run_config

    run_dir = run_directory(path)
    if run_dir is None:
        raise MissingInput(f"{path} is not in a clip_jax run directory (no {RUN_CONFIG} beside checkpoints/)")
    config_path = os.path.join(run_dir, RUN_CONFIG)
    try:
        with open(config_path) as f:
            return saved_run_config(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{config_path} is not valid JSON: {e}") from None


def load_pretrained(path: str, name_or_config) -> dict:
    """Host params (numpy, float32) of the model `name_or_config` from `path` (see the module docstring). A ResNet
    image tower also needs its BatchNorm statistics: `load_pretrained_variables`."""
    config = get_model_config(name_or_config)
    if is_resnet(config):
        raise InvalidInput(f"{config.name} has a ResNet image tower: its weights are params and BatchNorm "
                           "statistics; load both with load_pretrained_variables")
    return load_pretrained_variables(path, config)["params"]


def load_pretrained_variables(path: str, name_or_config) -> dict:
    """Host variables of the model `name_or_config` from `path` (see the module docstring): `{"params": ...}`, and
    `"batch_stats"` (BatchNorm's running statistics) for a ResNet image tower; what `model.apply` takes."""
    from clip_jax.interop.convert import variables_from_open_clip
    from clip_jax.interop.weight_files import _is_clip_jax, _unflatten, read_arrays

    config = get_model_config(name_or_config)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingInput(f"pretrained weights {path} do not exist")
    if is_hf_model_folder(path):
        held = hf_folder.hf_model_config(path)
        _check_hf_model(path, held, config)
        state_dict = hf_folder.read_hf_state_dict(path, held)
        try:
            return variables_from_open_clip(_fitted_state_dict(state_dict, config), config)
        except InvalidInput as e:
            raise InvalidInput(f"pretrained weights {hf_folder.hf_weights_file(path)}: {e}") from None
    if os.path.isdir(path) and is_export_folder(path):
        read_export_config(path)  # an exported folder is whole: its config says how to preprocess
        weights = export_weights_file(path)
    elif os.path.isdir(path):
        from clip_jax.runtime.checkpoints import CheckpointNotFoundError, read_variables

        try:
            variables = read_variables(path)
        except CheckpointNotFoundError as e:
            raise MissingInput(f"{path} is neither an exported model folder (no {EXPORT_CONFIG}) nor a clip_jax run "
                               f"with a checkpoint ({e})") from None
        return _checked_variables(_fitted_variables(variables, config), config, path)
    else:
        weights = path
    arrays = read_arrays(weights)
    if _is_clip_jax(arrays):
        tree = _unflatten(arrays)  # checked once fitted (another image size, a logit_bias to add)
        variables = tree if "params" in tree else {"params": tree}
        return _checked_variables(_fitted_variables(variables, config), config, weights)
    try:
        return variables_from_open_clip(_fitted_state_dict(arrays, config), config)
    except InvalidInput as e:
        raise InvalidInput(f"pretrained weights {weights}: {e}") from None


def _fitted_variables(variables: dict, config: CLIPConfig) -> dict:
    return {**variables, "params": _fitted_tree(variables["params"], config)}


def _checked_variables(variables: dict, config: CLIPConfig, where: str) -> dict:
    from clip_jax.interop.convert import variables_to_open_clip

    if not is_resnet(config) and set(variables) != {"params"}:
        raise InvalidInput(f"pretrained weights {where} hold {sorted(set(variables) - {'params'})} besides params: "
                           f"they are not of {config.name}, a ViT model")
    try:
        variables_to_open_clip(variables, config)  # refuses, naming the keys and shapes, weights of another model
    except InvalidInput as e:
        raise InvalidInput(f"pretrained weights {where}: {e}") from None
    return variables
