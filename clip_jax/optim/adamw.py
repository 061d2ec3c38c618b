"""OpenCLIP's optimizer as an optax chain: AdamW (or StableAdamW), its weight-decay mask, warmup + cosine,
clipping, clamp."""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from clip_jax.errors import InvalidInput
from clip_jax.optim.stable_adamw import stable_adamw
from clip_jax.runtime.mesh import LAYER_STACK_KEY, path_names

LOGIT_SCALE_MAX = math.log(100.0)


def decays(names: list[str], ndim: int) -> bool:
    """OpenCLIP's rule: no decay for params with ndim < 2, norm scales/biases, biases, `logit_scale` and
    `logit_bias`.

    `names` is the path in the parameter tree; `ndim` the rank of one layer's parameter (a scanned stack
    counts without its layer axis). Embeddings, projections and every kernel are decayed.
    """
    if ndim < 2:
        return False
    is_norm = any(name.startswith(("ln", "bn")) for name in names)  # LayerNorm modules are named ln_*
    return not (is_norm or names[-1] in ("bias", "logit_bias") or "logit_scale" in names)


def decay_mask(params):
    """Pytree of bools, True where weight decay applies (see `decays`)."""

    def leaf_decays(path, leaf):
        names = path_names(path)
        ndim = jnp.ndim(leaf) - (1 if LAYER_STACK_KEY in names else 0)
        return decays(names, ndim)

    return jax.tree_util.tree_map_with_path(leaf_decays, params)


def warmup_cosine_schedule(base_lr: float, warmup_steps: int, total_steps: int) -> Callable:
    """OpenCLIP's `cosine_lr`: `base_lr * (step + 1) / warmup` for step < warmup, then a cosine from base_lr
    to 0 at `total_steps`, where it stays. `step` counts optimizer updates from 0.
    """
    if warmup_steps < 0 or total_steps < 1:
        raise InvalidInput(
            f"learning-rate schedule: need 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}; lower the warmup or train for more steps"
        )
    if warmup_steps >= total_steps:
        largest = total_steps - 1
        raise InvalidInput(
            f"warmup={warmup_steps} does not fit a run of {total_steps} step{'s' if total_steps > 1 else ''} (the "
            f"learning-rate schedule needs warmup_steps < total_steps): the largest warmup that fits is {largest}: "
            f"--config.warmup={largest}, or train for more steps"
        )

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warmup_lr = base_lr * (step + 1) / max(warmup_steps, 1)
        progress = jnp.minimum((step - warmup_steps) / (total_steps - warmup_steps), 1.0)
        cosine_lr = 0.5 * (1 + jnp.cos(jnp.pi * progress)) * base_lr
        return jnp.where(step < warmup_steps, warmup_lr, cosine_lr)

    return schedule


def create_optimizer(
    learning_rate: float | Callable,
    *,
    weight_decay: float = 0.2,
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 1e-6,
    grad_clip_norm: float | None = None,
    stable: bool = False,
) -> optax.GradientTransformation:
    """Global-norm clipping (when `grad_clip_norm` is set) followed by AdamW with OpenCLIP's decay mask, or by
    StableAdamW (`stable`: AdamW with the per-tensor update clipping of `clip_jax.optim.stable_adamw`).

    The state has the same structure with or without clipping, so a run can resume with either.
    """
    if grad_clip_norm is not None and grad_clip_norm <= 0:
        raise InvalidInput(f"grad_clip_norm must be positive or None, got {grad_clip_norm}")
    clip = optax.identity() if grad_clip_norm is None else optax.clip_by_global_norm(grad_clip_norm)
    if stable:
        adamw = stable_adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    else:
        adamw = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    return optax.chain(clip, adamw)


def clamp_logit_scale(params: dict) -> dict:
    """`params` with the raw `logit_scale` clamped to [0, ln 100], as after each OpenCLIP update."""
    if "logit_scale" not in params:
        raise KeyError(f"clamp_logit_scale: no 'logit_scale' among the top-level params {sorted(params)}")
    return {**params, "logit_scale": jnp.clip(params["logit_scale"], 0.0, LOGIT_SCALE_MAX)}
