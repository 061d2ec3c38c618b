"""Locked towers (LiT): parameters that training leaves exactly as they were, with OpenCLIP's grouping.

OpenCLIP's `lock_image_tower(unlocked_groups)` splits the image tower into groups, from the input: the stem
(`conv1`, `class_embedding`, `positional_embedding`, `ln_pre`), one group per residual block but the last, the last
block with `ln_post`, and `proj` (SigLIP's tower: its attention pool `attn_pool`, which ends it); the last
`unlocked_groups` groups train. `lock_text_tower(unlocked_layers)` does the
same for the text tower: the embeddings (`token_embedding`, `positional_embedding`), the blocks, the last block with
`ln_final`, and `text_projection`. `logit_scale` (and `logit_bias`) always train.

Here the residual blocks of a tower are one stacked leaf per parameter (axis 0 = layer), so a leaf is trainable
(True), locked (False), or trainable in some layers only (a bool vector over the layers). `locked_optimizer` gives
locked leaves no update and no optimizer state (optax's `multi_transform` with `set_to_zero`); in a partly locked
stack the locked layers' gradients and updates are zeroed, so their moments stay 0 and they do not move. The train
step also stops the gradients into locked params (`stop_locked_gradients`), so no backward work is spent on them.

A ResNet image tower (OpenCLIP's ModifiedResNet; its `image_layers` here are the 4 stages' block counts) is locked
whole or not at all, as OpenCLIP's `ModifiedResNet.lock` allows: `image_unlocked_groups > 0` is refused. Its
BatchNorm statistics are not params, so locking alone leaves them to the BatchNorm's mode, as OpenCLIP's `--lock-image`
does: train mode, normalising with the batch's statistics and updating the running ones. `image_freeze_bn_stats`
(OpenCLIP's `--lock-image-freeze-bn-stats`) runs the locked tower's BatchNorm in eval mode instead
(`clip_jax.training.train_step`): normalised with the running statistics, which stay as they are. A ViT has no
BatchNorm, and the flag changes nothing there.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clip_jax.errors import InvalidInput
from clip_jax.runtime.mesh import LAYER_STACK_KEY, path_names

_TEXT_EMBEDDINGS = ("token_embedding", "positional_embedding")
_TEXT_TOWER = _TEXT_EMBEDDINGS + ("transformer", "ln_final", "text_projection")
_IMAGE_STEM = ("conv1", "class_embedding", "positional_embedding", "ln_pre")
TRAINABLE, LOCKED = "trainable", "locked"


@dataclasses.dataclass(frozen=True)
class LockSpec:
    """Which towers are locked and how many of their last groups (image) / layers (text) still train;
    `image_freeze_bn_stats`: a locked ResNet image tower's BatchNorm in eval mode (running statistics, left as they
    are) rather than train mode."""

    image: bool = False
    image_unlocked_groups: int = 0
    image_freeze_bn_stats: bool = False
    text: bool = False
    text_unlocked_layers: int = 0

    def __post_init__(self):
        for field in ("image_unlocked_groups", "text_unlocked_layers"):
            if getattr(self, field) < 0:
                raise InvalidInput(f"lock: {field}={getattr(self, field)} must not be negative")
        if self.image_freeze_bn_stats and not self.image:
            raise InvalidInput("lock: image_freeze_bn_stats=True (the config's lock_image_freeze_bn_stats) has no "
                               "effect without a locked image tower: set lock_image=True too, or leave it out")

    @property
    def any(self) -> bool:
        return self.image or self.text


def _group_trainable(group: int, num_groups: int, unlocked: int) -> bool:
    """Group `group` of `num_groups` trains when it is among the last `unlocked`."""
    return group >= num_groups - unlocked


def _tower_leaf(names: list[str], layers: int, unlocked: int, first: tuple[str, ...], last_norm: str,
                proj: tuple[str, ...]):
    """True / False / [layers] bool for a leaf of a locked tower whose names are relative to the tower. Groups: 0 the
    stem `first`, 1..layers-1 blocks 0..layers-2, `layers` the last block with `last_norm`, `layers + 1` the head
    `proj` (the projection, or SigLIP's attention pool)."""
    num_groups = layers + 2
    head = names[0]
    if head in first:
        return _group_trainable(0, num_groups, unlocked)
    if head == last_norm:
        return _group_trainable(layers, num_groups, unlocked)
    if head in proj:
        return _group_trainable(layers + 1, num_groups, unlocked)
    if head == "transformer" and LAYER_STACK_KEY in names:
        per_layer = np.array([_group_trainable(min(i + 1, layers), num_groups, unlocked) for i in range(layers)])
        return bool(per_layer[0]) if per_layer.all() or not per_layer.any() else per_layer
    raise InvalidInput(f"lock: parameter {'/'.join(names)} belongs to no group of OpenCLIP's tower locking")


def leaf_trainable(names: list[str], lock: LockSpec, image_layers: int, text_layers: int):
    """Whether the parameter at path `names` trains under `lock`: True, False, or a bool vector over its layers."""
    if names[0] == "visual":
        if not lock.image:
            return True
        if not isinstance(image_layers, int):  # a ResNet tower: its stages' block counts
            check_resnet_lock(lock)
            return False
        return _tower_leaf(names[1:], image_layers, lock.image_unlocked_groups, _IMAGE_STEM, "ln_post",
                           ("proj", "attn_pool"))
    if names[0] in _TEXT_TOWER:
        if not lock.text:
            return True
        return _tower_leaf(names, text_layers, lock.text_unlocked_layers, _TEXT_EMBEDDINGS, "ln_final",
                           ("text_projection",))
    return True  # logit_scale, logit_bias


def check_resnet_lock(lock: LockSpec) -> None:
    """Refuses a partly unlocked ResNet image tower: it is locked whole (OpenCLIP's ModifiedResNet.lock) or not."""
    if lock.image and lock.image_unlocked_groups:
        raise InvalidInput(f"lock: image_unlocked_groups={lock.image_unlocked_groups} with a ResNet image tower; a "
                           "ResNet tower is locked whole (as OpenCLIP's ModifiedResNet.lock): set "
                           "lock_image_unlocked_groups to 0, or do not lock the image tower")


def trainable_mask(params, lock: LockSpec, image_layers: int, text_layers: int):
    """`params`' tree with `leaf_trainable` at every leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: leaf_trainable(path_names(path), lock, image_layers, text_layers), params)


def stop_locked_gradients(params, lock: LockSpec, image_layers: int, text_layers: int):
    """`params` with no gradient flowing into the locked leaves (and rows): the backward then skips what only they
    need, as OpenCLIP's autograd does for params without `requires_grad` (a fully locked image tower is not
    back-propagated through at all)."""
    if not lock.any:
        return params

    def stop(path, leaf):
        trainable = leaf_trainable(path_names(path), lock, image_layers, text_layers)
        if trainable is True:
            return leaf
        if trainable is False:
            return jax.lax.stop_gradient(leaf)
        rows = jnp.asarray(trainable).reshape((-1,) + (1,) * (leaf.ndim - 1))
        return jnp.where(rows, leaf, jax.lax.stop_gradient(leaf))

    return jax.tree_util.tree_map_with_path(stop, params)


def _labels(lock, image_layers, text_layers):
    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: LOCKED if leaf_trainable(path_names(path), lock, image_layers, text_layers) is False
            else TRAINABLE, params)

    return labels


def _zero_locked_layers(lock, image_layers, text_layers) -> optax.GradientTransformation:
    """Zeroes the locked layers' rows of partly locked stacks (the rest passes as it is)."""

    def zero(path, update):
        trainable = leaf_trainable(path_names(path), lock, image_layers, text_layers)
        if isinstance(trainable, np.ndarray):
            rows = jnp.asarray(trainable).reshape((-1,) + (1,) * (update.ndim - 1))
            return jnp.where(rows, update, jnp.zeros_like(update))
        return update

    def update_fn(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(zero, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def locked_optimizer(inner: optax.GradientTransformation, lock: LockSpec, image_layers: int,
                     text_layers: int) -> optax.GradientTransformation:
    """`inner` on the trainable params only: locked leaves get no update and no state; partly locked stacks get
    their locked layers' gradients and updates zeroed (before `inner`, so its moments stay 0, and after, so weight
    decay does not move them)."""
    if not lock.any:
        return inner
    zero = _zero_locked_layers(lock, image_layers, text_layers)
    return optax.multi_transform({TRAINABLE: optax.chain(zero, inner, zero), LOCKED: optax.set_to_zero()},
                                 _labels(lock, image_layers, text_layers))
