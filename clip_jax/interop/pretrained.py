"""Weights fitted to the model they start, as OpenCLIP fits a checkpoint on load: a vision positional embedding
made for another image size is resized (bicubic, antialiased, class token kept), and a model with a `logit_bias`
that the checkpoint lacks gets it as 0. Anything else that differs is refused, naming the keys and shapes.

`open_clip_variables(state_dict, config, where)` fits and converts an OpenCLIP state_dict, `clip_jax_variables(
variables, config, where)` fits and checks clip_jax variables (a run's, a `.npz`'s); what holds them is decided by
`clip_jax.interop.opener`, whose `load_pretrained_variables(path, model)` reads any of them.
"""

import math

import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.interop.convert import _strip_prefix, variables_from_open_clip, variables_to_open_clip
from clip_jax.models.config import CLIPConfig, is_resnet


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


def open_clip_variables(state_dict: dict, config: CLIPConfig, where: str) -> dict:
    """Host variables of `config` from an OpenCLIP `state_dict` (read from `where`), fitted to it."""
    try:
        return variables_from_open_clip(_fitted_state_dict(state_dict, config), config)
    except InvalidInput as e:
        raise InvalidInput(f"pretrained weights {where}: {e}") from None


def clip_jax_variables(variables: dict, config: CLIPConfig, where: str) -> dict:
    """clip_jax `variables` (read from `where`) fitted to `config`, refused when they are another model's."""
    variables = {**variables, "params": _fitted_tree(variables["params"], config)}
    if not is_resnet(config) and set(variables) != {"params"}:
        raise InvalidInput(f"pretrained weights {where} hold {sorted(set(variables) - {'params'})} besides params: "
                           f"they are not of {config.name}, a ViT model")
    try:
        variables_to_open_clip(variables, config)  # refuses, naming the keys and shapes, weights of another model
    except InvalidInput as e:
        raise InvalidInput(f"pretrained weights {where}: {e}") from None
    return variables
