"""Weights fitted to the model they start, as OpenCLIP fits a checkpoint on load: a vision positional embedding
made for another image size is resized (bicubic, antialiased; a class token kept, as OpenCLIP does; a SigLIP tower's
grid alone, timm's `visual.trunk.pos_embed`, as timm does), and a model with a `logit_bias` that the checkpoint
lacks gets it as 0. Anything else that differs is refused, naming the keys and shapes.

`open_clip_variables(state_dict, config, where)` fits and converts an OpenCLIP state_dict, `clip_jax_variables(
variables, config, where)` fits and checks clip_jax variables (a run's, a `.npz`'s); what holds them is decided by
`clip_jax.interop.opener`, whose `load_pretrained_variables(path, model)` reads any of them.
"""

import math

import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.interop.convert import _strip_prefix, variables_from_open_clip, variables_to_open_clip
from clip_jax.models.config import CLIPConfig, is_resnet


INTERPOLATIONS = ("bicubic", "bilinear")  # as torch's F.interpolate names them; antialiased, half-pixel centres
_JAX_METHODS = {"bicubic": "bicubic", "bilinear": "linear"}
TIMM_POS_EMBED = "visual.trunk.pos_embed"  # a SigLIP image tower's, timm's [1, g*g, W]: no class token


def resize_positional_embedding(positional_embedding: np.ndarray, grid_size: int, *, prefix_tokens: int = 1,
                                interpolation: str = "bicubic") -> np.ndarray:
    """[prefix_tokens + g*g, W] -> [prefix_tokens + grid_size**2, W]: the patch grid resized (`interpolation`, with
    antialiasing, half-pixel centres), the rows before it kept as they are, as OpenCLIP resizes a checkpoint's grid
    on load (a class token: `prefix_tokens=1`) and timm a SigLIP tower's (none: 0)."""
    import jax
    import jax.numpy as jnp

    if interpolation not in INTERPOLATIONS:
        raise InvalidInput(f"interpolation {interpolation!r}: choose one of {', '.join(INTERPOLATIONS)}")
    positional_embedding = np.asarray(positional_embedding)
    tokens, width = positional_embedding.shape
    old = int(round(math.sqrt(max(tokens - prefix_tokens, 0))))
    if old < 1 or old * old != tokens - prefix_tokens:
        what = {0: "a square grid", 1: "a class token plus a square grid"}.get(prefix_tokens, "its tokens plus a grid")
        raise InvalidInput(f"positional embedding of {tokens} tokens is not {what}")
    grid = positional_embedding[prefix_tokens:].reshape(old, old, width).astype(np.float32)
    resized = jax.image.resize(jnp.asarray(grid), (grid_size, grid_size, width), method=_JAX_METHODS[interpolation],
                               antialias=True)
    resized = np.asarray(resized, np.float32).reshape(grid_size * grid_size, width)
    kept = positional_embedding[:prefix_tokens].astype(np.float32)
    return np.concatenate([kept, resized]).astype(positional_embedding.dtype)


def _fit(positional_embedding, logit_bias_missing: bool, config: CLIPConfig):
    """The (positional embedding, logit_bias to add or None) that fit `config`. The embedding is [T, W], or timm's
    [1, T, W] (a SigLIP tower's), given back in its own layout."""
    pos = positional_embedding
    if pos is not None and np.ndim(pos) in (2, 3) and np.shape(pos)[-2] != config.vision.num_tokens:
        leading = np.shape(pos)[:-2]
        prefix_tokens = config.vision.num_tokens - config.vision.grid_size**2  # the class token, or none
        pos = resize_positional_embedding(np.reshape(pos, np.shape(pos)[-2:]), config.vision.grid_size,
                                          prefix_tokens=prefix_tokens)
        pos = pos.reshape(leading + pos.shape)
    bias = np.zeros((), np.float32) if logit_bias_missing and config.init_logit_bias is not None else None
    return pos, bias


def _fitted_state_dict(state_dict: dict, config: CLIPConfig) -> dict:
    state_dict = _strip_prefix(state_dict)
    key = TIMM_POS_EMBED if TIMM_POS_EMBED in state_dict else "visual.positional_embedding"
    pos, bias = _fit(state_dict.get(key), "logit_bias" not in state_dict, config)
    if pos is not None:
        state_dict[key] = pos
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
