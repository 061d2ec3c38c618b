"""The optimizer of a train step and its learning-rate schedule (`OptimizerSpec`, part of a `StepSpec`).

The schedule is OpenCLIP's warm-up and cosine over the steps the run planned at its start. A run whose global batch
was changed on resume (`run_config.resume_global_batch`) goes on along the same curve counted in samples: the rate
of step t is the curve at the step the original global batch would have reached with the samples seen by then
(`sample_position`), so warm-up and decay end where they would have, at the same sample counts. It stays a pure
function of the step, baked into the compiled step.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import optax

from clip_jax.errors import InvalidInput
from clip_jax.optim.adamw import create_optimizer, warmup_cosine_schedule
from clip_jax.optim.layer_decay import lr_multipliers, scale_by_layer

# stable_adamw: clip_jax.optim.stable_adamw; sgd: plain SGD, the update tests can predict exactly (no moments, no decay)
OPTIMIZERS = ("adamw", "stable_adamw", "sgd")


def sample_position(step, segments: tuple[tuple[int, float, float], ...]):
    """The position on the planned schedule (float32) of optimizer step `step` (an integer array): each segment
    (first step, position there, positions per step) holds from its first step until the next segment's; before
    the first, the step itself. A position is samples seen / the run's first global batch, so a step of a larger
    global batch advances the schedule by more than one."""
    step = jnp.asarray(step)
    position = step.astype(jnp.float32)
    for first, at, rate in segments:
        position = jnp.where(step >= first, jnp.float32(at) + (step - first).astype(jnp.float32) * jnp.float32(rate),
                             position)
    return position


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer and its learning-rate schedule. Without `total_steps` the rate is constant: enough to compile
    a step (the schedule's state is one counter either way). `total_steps` is the schedule's length in steps of the
    run's first global batch; `lr_segments`, where the global batch changed since, how steps map onto it
    (`sample_position`; empty: one step is one position)."""

    name: str = "adamw"
    lr: float = 1e-3
    warmup: int = 0
    total_steps: int | None = None
    weight_decay: float = 0.2
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-6
    grad_clip_norm: float | None = None  # None: no clipping
    layer_decay: float = 1.0  # layer-wise learning-rate decay over the image tower (`optim.layer_decay`); 1: off
    lr_segments: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise InvalidInput(f"optimizer {self.name!r}: choose one of {OPTIMIZERS}")

    @classmethod
    def from_config(cls, config, total_steps: int | None = None,
                    lr_segments: tuple[tuple[int, float, float], ...] = ()) -> "OptimizerSpec":
        """The optimizer a run config says (pretraining's or fine-tuning's: `opt` and `layer_decay` where it has
        them)."""
        return cls(config.get("opt", "adamw"), lr=config.lr, warmup=config.warmup, total_steps=total_steps,
                   weight_decay=config.wd, b1=config.beta1, b2=config.beta2, eps=config.eps,
                   grad_clip_norm=config.grad_clip_norm or None, layer_decay=config.get("layer_decay", 1.0),
                   lr_segments=tuple(lr_segments))

    def learning_rate_fn(self) -> Callable:
        if self.total_steps is None:
            return optax.constant_schedule(self.lr)
        planned = warmup_cosine_schedule(self.lr, self.warmup, self.total_steps)
        if not self.lr_segments:
            return planned
        segments = self.lr_segments
        return lambda step: planned(sample_position(step, segments))

    def create(self, learning_rate_fn: Callable) -> optax.GradientTransformation:
        if self.name == "sgd":
            return optax.sgd(learning_rate_fn)
        return create_optimizer(learning_rate_fn, weight_decay=self.weight_decay, b1=self.b1, b2=self.b2,
                                eps=self.eps, grad_clip_norm=self.grad_clip_norm,
                                stable=self.name == "stable_adamw")

    def with_layer_decay(self, optimizer: optax.GradientTransformation, params, image_layers: int):
        """`optimizer`, its updates then scaled by the layer multipliers of `params` (shapes are enough)."""
        if self.layer_decay == 1:
            return optimizer
        return optax.chain(optimizer, scale_by_layer(lr_multipliers(params, self.layer_decay, image_layers)))
