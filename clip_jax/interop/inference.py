"""Using a model as OpenCLIP's users do: `create_model_and_transforms` and `get_tokenizer`.

    model, params, train_transform, eval_transform = clip_jax.create_model_and_transforms(
        "ViT-L-14", pretrained="open_clip_pytorch_model.bin")
    tokenizer = clip_jax.get_tokenizer("ViT-L-14")

`name_or_config` is a registered name, an OpenCLIP model-config dict or .json, a `CLIPConfig`, or
`"local-dir:FOLDER"` for an exported folder, OpenCLIP's or transformers' (its model, weights and
preprocessing). The transforms are clip_jax's own (`clip_jax.data.transforms`), equal pixel for pixel to
OpenCLIP's: they take a PIL image and return float32 [size, size, 3] (NHWC, normalised). The mean and std come from
the pretrained weights where they say (an exported folder's `preprocess_cfg` or image processor, a run's config),
else OpenAI's, as OpenCLIP's defaults.
"""

import functools
import os
from collections.abc import Callable, Sequence

import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD

LOCAL_DIR = "local-dir:"


def eval_transform(image, *, size: int, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """OpenCLIP's eval preprocessing: shortest side to `size` (bicubic), center crop, normalise."""
    from clip_jax.data.transforms import eval_crop, normalize

    return normalize(eval_crop(_rgb(image), size), mean, std)


def train_transform(image, rng: np.random.Generator | None = None, *, size: int, mean: Sequence[float],
                    std: Sequence[float]) -> np.ndarray:
    """OpenCLIP's train preprocessing: random resized crop (scale 0.9-1) to `size` (bicubic), normalise."""
    from clip_jax.data.transforms import normalize, train_crop

    return normalize(train_crop(_rgb(image), size, np.random.default_rng() if rng is None else rng), mean, std)


def _rgb(image):
    from PIL import Image

    if isinstance(image, bytes):
        from clip_jax.data.transforms import decode_rgb

        return decode_rgb(image)
    if not isinstance(image, Image.Image):
        raise InvalidInput(f"the transforms take a PIL image (or encoded bytes), got {type(image).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


def saved_preprocessing(pretrained: str | None) -> dict:
    """The mean/std (and, for a folder, interpolation and resize mode) the pretrained weights were trained with."""
    from clip_jax.interop.pretrained import folder_preprocessing, is_export_folder, read_run_config, run_directory

    if pretrained is None or not os.path.isdir(pretrained):
        return {}
    if is_export_folder(pretrained):
        return folder_preprocessing(pretrained)
    if run_directory(pretrained) is not None:
        run_config = read_run_config(pretrained)
        return {"mean": tuple(run_config.image_mean), "std": tuple(run_config.image_std)}
    return {}


def pretrained_model_config(pretrained: str | None):
    """The model an exported folder or a run holds (at the image size the run trained at)."""
    from clip_jax.interop.pretrained import export_model_config, is_export_folder, read_run_config, run_directory

    if pretrained is not None and is_export_folder(pretrained):
        return export_model_config(pretrained)
    if pretrained is not None and os.path.isdir(pretrained) and run_directory(pretrained) is not None:
        from clip_jax.interop.export import trained_model

        return trained_model(read_run_config(pretrained))
    raise InvalidInput(f"{pretrained!r} is neither an exported model folder nor a clip_jax run, so it does not say "
                       "which model it holds: name the model")


def create_model_and_transforms(name_or_config, pretrained: str | None = None, *, image_mean=None, image_std=None,
                                dtype=None, seed: int = 0) -> tuple:
    """(model, params, train_transform, eval_transform), like OpenCLIP's function of the same name. For a ResNet
    image tower `params` are its variables `{"params": ..., "batch_stats": ...}`, which `model.apply` takes as they
    are (eval mode: BatchNorm's running statistics); a ViT model's are its params tree (`{"params": params}`).

    `name_or_config` None: the model an exported folder or a run given as `pretrained` holds (a run's at the image
    size it trained at; a model named here instead gets the weights fitted to its own size, as OpenCLIP does).

    `pretrained`: anything `clip_jax.interop.pretrained.load_pretrained` reads (OpenCLIP checkpoint, exported folder,
    clip_jax run or params file); None: freshly initialised params (`seed`). `image_mean` / `image_std` replace
    the pretrained weights' own. `dtype`: the compute dtype (default float32); params are float32.
    """
    import jax
    import jax.numpy as jnp

    from clip_jax.interop.pretrained import export_model_config, load_pretrained_variables
    from clip_jax.models import create_model, get_model_config, init_variables
    from clip_jax.models.variables import eval_variables

    if isinstance(name_or_config, str) and name_or_config.startswith(LOCAL_DIR):
        folder = name_or_config[len(LOCAL_DIR):]
        config = export_model_config(folder)
        pretrained = folder if pretrained is None else pretrained
    elif name_or_config is None:
        config = pretrained_model_config(pretrained)
    else:
        config = get_model_config(name_or_config)
    model = create_model(config, dtype=jnp.float32 if dtype is None else dtype)
    if pretrained is None:
        variables = init_variables(model, jax.random.key(seed))
    else:
        variables = load_pretrained_variables(pretrained, config)
    params = eval_variables(**variables)
    saved = saved_preprocessing(pretrained)
    mean = tuple(image_mean or saved.get("mean") or OPENAI_MEAN)
    std = tuple(image_std or saved.get("std") or OPENAI_STD)
    options = {"size": config.vision.image_size, "mean": mean, "std": std}
    return model, params, functools.partial(train_transform, **options), functools.partial(eval_transform, **options)


def get_tokenizer(name_or_config) -> Callable:
    """`tokenizer(texts) -> int32 [N, context_length]` for the model (OpenAI's BPE, the model's context length)."""
    from clip_jax.interop.pretrained import export_model_config
    from clip_jax.tokenizer import tokenize

    if isinstance(name_or_config, str) and name_or_config.startswith(LOCAL_DIR):
        config = export_model_config(name_or_config[len(LOCAL_DIR):])
    else:
        from clip_jax.models import get_model_config

        config = get_model_config(name_or_config)
    return functools.partial(tokenize, context_length=config.text.context_length)
