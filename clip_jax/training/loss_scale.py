"""Dynamic loss scaling, for a precision policy with `loss_scaling` (`fp16`: float16's largest value is 65504 and its
smallest normal 6e-5, so small gradients underflow unless the backward starts from a scaled loss).

The rule is PyTorch's `GradScaler`'s: the backward starts from `scale` (the gradient of `scale * loss`); the
gradients are divided by `scale` in float32 before anything reads them; a step whose gradients hold an inf or NaN
applies no update and halves the scale; after `growth_interval` finite steps in a row the scale doubles (unless
doubling it would overflow float32), and the count starts again. The state is two scalars, the same on every device,
carried in the train state's `policy_state` slot (`training.train_step.TrainState`) and saved with it.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clip_jax.errors import InvalidInput

GROWTH_FACTOR, BACKOFF_FACTOR = 2.0, 0.5


@dataclasses.dataclass(frozen=True)
class LossScaleSpec:
    """The loss scale a run starts from (`loss_scale_init`) and the finite steps in a row after which it doubles
    (`loss_scale_growth_interval`)."""

    init: float = 65536.0
    growth_interval: int = 2000

    def __post_init__(self):
        if not self.init > 0 or self.growth_interval < 1:
            raise InvalidInput(f"loss_scale_init={self.init} must be positive and "
                               f"loss_scale_growth_interval={self.growth_interval} at least 1")


class LossScale(NamedTuple):
    """The `fp16` policy's own state."""

    scale: jax.Array  # float32 scalar: what the backward starts from
    finite_steps: jax.Array  # int32 scalar: finite steps in a row since the scale last changed


def initial_loss_scale(spec: LossScaleSpec) -> LossScale:
    return LossScale(jnp.asarray(spec.init, jnp.float32), jnp.zeros((), jnp.int32))


def value_and_grads(f: Callable, *primals, loss_scale: jax.Array | None = None):
    """`((value, aux), grads)` of `f(*primals) -> (value, aux)`, grads with respect to every primal (a tuple), the
    backward starting from `loss_scale` instead of 1 when given: the gradients of `loss_scale * value`, the value
    itself unscaled."""
    if loss_scale is None:
        return jax.value_and_grad(f, argnums=tuple(range(len(primals))), has_aux=True)(*primals)
    value, pullback, aux = jax.vjp(f, *primals, has_aux=True)
    return (value, aux), pullback(loss_scale.astype(value.dtype))


def unscaled(grads, scale: jax.Array):
    """`grads` (computed from a loss multiplied by `scale`) divided by `scale` in float32, each leaf in its dtype."""
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)


def next_loss_scale(state: LossScale, finite: jax.Array, growth_interval: int) -> LossScale:
    """The state after a step whose gradients were `finite` (or not): halved on an overflow, doubled after
    `growth_interval` finite steps in a row."""
    finite_steps = state.finite_steps + 1
    grown = state.scale * GROWTH_FACTOR
    grow = (finite_steps >= growth_interval) & jnp.isfinite(grown)
    scale = jnp.where(finite, jnp.where(grow, grown, state.scale), state.scale * BACKOFF_FACTOR)
    finite_steps = jnp.where(finite & (finite_steps < growth_interval), finite_steps, 0)
    return LossScale(scale, finite_steps.astype(jnp.int32))
