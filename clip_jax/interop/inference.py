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


def create_model_and_transforms(name_or_config, pretrained: str | None = None, *, image_mean=None, image_std=None,
                                dtype=None, seed: int = 0) -> tuple:
    """(model, params, train_transform, eval_transform), like OpenCLIP's function of the same name. For a ResNet
    image tower `params` are its variables `{"params": ..., "batch_stats": ...}`, which `model.apply` takes as they
    are (eval mode: BatchNorm's running statistics); a ViT model's are its params tree (`{"params": params}`).

    `name_or_config` None: the model an exported folder or a run given as `pretrained` holds (a run's at the image
    size it trained at; a model named here instead gets the weights fitted to its own size, as OpenCLIP does).

    `pretrained`: any model path `clip_jax.interop.opener.open_model` opens (OpenCLIP checkpoint, exported or
    transformers folder, clip_jax run, checkpoint or params file); None: freshly initialised params (`seed`).
    `image_mean` / `image_std` replace the pretrained weights' own. `dtype`: the compute dtype (default float32);
    params are float32.
    """
    import jax
    import jax.numpy as jnp

    from clip_jax.interop.opener import open_model
    from clip_jax.models import create_model, get_model_config, init_variables
    from clip_jax.models.variables import eval_variables

    if isinstance(name_or_config, str) and name_or_config.startswith(LOCAL_DIR):
        folder = name_or_config[len(LOCAL_DIR):]
        name_or_config = open_model(folder).config
        pretrained = folder if pretrained is None else pretrained
    if name_or_config is None and pretrained is None:
        raise InvalidInput("name a model, or give pretrained weights that hold one (an exported folder, a run)")
    opened = None if pretrained is None else open_model(pretrained, name_or_config)
    config = get_model_config(name_or_config) if opened is None else opened.config
    model = create_model(config, dtype=jnp.float32 if dtype is None else dtype)
    if opened is None:
        variables = init_variables(model, jax.random.key(seed))
        mean, std = tuple(image_mean or OPENAI_MEAN), tuple(image_std or OPENAI_STD)
    else:
        variables = opened.variables()
        mean, std = opened.normalization(image_mean, image_std)
    options = {"size": config.vision.image_size, "mean": mean, "std": std}
    return model, eval_variables(**variables), functools.partial(train_transform, **options), functools.partial(
        eval_transform, **options)


def get_tokenizer(name_or_config) -> Callable:
    """`tokenizer(texts) -> int32 [N, context_length]` for the model: its own (`clip_jax.text.model_tokenizer`:
    OpenAI's BPE, or a SigLIP model's SentencePiece files), at the model's context length."""
    from clip_jax.interop.opener import open_model
    from clip_jax.text.model_tokenizer import tokenizer_for
    from clip_jax.models import get_model_config

    if isinstance(name_or_config, str) and name_or_config.startswith(LOCAL_DIR):
        return open_model(name_or_config[len(LOCAL_DIR):]).tokenizer
    return tokenizer_for(get_model_config(name_or_config))
