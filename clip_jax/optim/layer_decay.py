"""Layer-wise learning-rate decay (LLRD) over a ViT image tower, as fine-tuning recipes (BEiT, WiSE-FT's
classification fine-tunes) use it: the deeper a layer, the larger its step.

A ViT image tower of L residual blocks is numbered by depth: its stem (`conv1`, `class_embedding`,
`positional_embedding`, `ln_pre`) is layer 0, block i is layer i + 1, and what follows the blocks (`ln_post`, `proj`,
or SigLIP's attention pool `attn_pool`) is layer L + 1, as is everything outside the image tower (a classification
head). A parameter of layer l steps at `decay ** (L + 1 - l)` times the learning rate: the head and `proj` at the
full rate, the last block at `decay`, the stem at `decay ** (L + 1)`. The blocks are one stacked leaf per parameter
(axis 0 = block), whose multiplier is a vector over the blocks.

`scale_by_layer` multiplies each update by its multiplier; chained after AdamW it scales the whole step, weight decay
included, as a per-group learning rate does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clip_jax.errors import InvalidInput
from clip_jax.runtime.mesh import LAYER_STACK_KEY, path_names

_STEM = ("conv1", "class_embedding", "positional_embedding", "ln_pre")
_TOP = ("ln_post", "proj", "attn_pool")  # the projection, or SigLIP's attention pool


def image_layer_id(names: list[str], layers: int) -> int | np.ndarray:
    """The depth of the parameter at path `names` (see the module docstring): an int, or int [layers] for the
    stacked blocks of the image tower (`visual/transformer/resblocks/...`)."""
    if not names or names[0] != "visual":
        return layers + 1
    head = names[1] if len(names) > 1 else ""
    if head in _STEM:
        return 0
    if head in _TOP:
        return layers + 1
    if head == "transformer" and LAYER_STACK_KEY in names:
        return np.arange(1, layers + 1)
    raise InvalidInput(f"layer-wise learning-rate decay: parameter {'/'.join(names)} has no depth in a ViT image "
                       "tower (a ResNet image tower is not supported)")


def lr_multipliers(params, decay: float, layers: int):
    """`params`' tree with each leaf's learning-rate multiplier, `decay ** (layers + 1 - depth)`: a float, or a
    float32 vector [layers] for the stacked blocks."""
    if not 0 < decay <= 1:
        raise InvalidInput(f"layer-wise learning-rate decay {decay} must be in (0, 1] (1: off)")

    def multiplier(path, _):
        depth = image_layer_id(path_names(path), layers)
        scale = np.float32(decay) ** (layers + 1 - np.asarray(depth, np.float32))
        return scale.astype(np.float32) if np.ndim(depth) else float(scale)

    return jax.tree_util.tree_map_with_path(multiplier, params)


def scale_by_layer(multipliers) -> optax.GradientTransformation:
    """Multiplies every update by its leaf's multiplier (a vector multiplier scales a stacked leaf row by row)."""

    def scale(update, multiplier):
        if np.ndim(multiplier):
            return update * jnp.asarray(multiplier, update.dtype).reshape((-1,) + (1,) * (update.ndim - 1))
        return update * jnp.asarray(multiplier, update.dtype)

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates, multipliers), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
