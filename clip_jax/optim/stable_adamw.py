"""StableAdamW (Wortsman et al. 2023, "Stable and low-precision training for large-scale vision-language models"):
AdamW whose step on a tensor shrinks when that tensor's second-moment estimate is out of date.

Loss spikes in CLIP training follow steps where a gradient is suddenly much larger than Adam's running second
moment `v` remembers: `g / sqrt(v)` is then far above 1 and the update is far larger than the learning rate
intends. StableAdamW measures this per tensor and divides that tensor's learning rate by it (AdaFactor's update
clipping, applied to AdamW).

The maths, per parameter tensor `p` (for a scanned stack of blocks, each layer's slice is its own tensor), at the
t-th update (t = 1, 2, ...), with learning rate `lr_t`, betas `b1`, `b2`, epsilon `eps`, weight decay `wd`:

    m_t = b1 m_{t-1} + (1 - b1) g            m_hat = m_t / (1 - b1^t)
    v_t = b2 v_{t-1} + (1 - b2) g^2          v_hat = v_t / (1 - b2^t)
    rms_t = sqrt( mean over the tensor's elements of  g^2 / max(v_hat, eps^2) )
    eta_t = lr_t / max(1, rms_t)
    p <- p - eta_t (m_hat / (sqrt(v_hat) + eps) + wd p)       (wd = 0 where the decay mask says no decay)

`v_hat` includes the current gradient, as in the paper, so at t = 1 every ratio is 1 up to eps and the first
step is AdamW's. Both the Adam direction and the decay use `eta_t`, as in the paper's algorithm. `max(v_hat,
eps^2)` keeps an all-zero gradient (a frozen or unused tensor) from producing 0/0. When every `rms_t <= 1` the
update is exactly AdamW's (optax.adamw with the same betas, eps and mask).

The state is optax's `ScaleByAdamState` (count, mu, nu shaped like the params) beside the schedule's counter:
the layout of `optax.adamw`'s state, so FSDP splits the moments exactly like the parameters they track.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from clip_jax.runtime.mesh import LAYER_STACK_KEY, path_names


def is_stacked(path) -> bool:
    """A leaf of the scanned block stack: its first axis counts layers, each layer's slice a tensor of its own."""
    return LAYER_STACK_KEY in path_names(path)


def per_tensor_mean(path, x: jax.Array) -> jax.Array:
    """Mean over each tensor's elements, in fp32: a scalar, or [layers] for a stacked leaf."""
    x = x.astype(jnp.float32)
    if is_stacked(path) and x.ndim >= 1:
        return jnp.mean(x.reshape(x.shape[0], -1), axis=1)
    return jnp.mean(x)


def rms_ratio(path, grad: jax.Array, nu_hat: jax.Array, eps: float) -> jax.Array:
    """sqrt(mean(g^2 / max(v_hat, eps^2))) of one leaf: a scalar, or [layers] for a stacked leaf."""
    g = grad.astype(jnp.float32)
    return jnp.sqrt(per_tensor_mean(path, jnp.square(g) / jnp.maximum(nu_hat.astype(jnp.float32), eps**2)))


def scale_by_stable_adam(b1: float = 0.9, b2: float = 0.98, eps: float = 1e-6, weight_decay: float = 0.0,
                         mask: Callable | None = None) -> optax.GradientTransformation:
    """The StableAdamW direction, decay included, before the learning rate: `(m_hat / (sqrt(v_hat) + eps) + wd p)
    / max(1, rms)` per tensor (see the module docstring). `mask(params)`: True where weight decay applies."""

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        return optax.ScaleByAdamState(count=jnp.zeros((), jnp.int32), mu=zeros,
                                      nu=jax.tree.map(jnp.zeros_like, zeros))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("StableAdamW needs the params (for weight decay): call update(grads, state, params)")
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        mu = jax.tree.map(lambda m, g: (b1 * m + (1 - b1) * g).astype(m.dtype), state.mu, grads)
        nu = jax.tree.map(lambda v, g: (b2 * v + (1 - b2) * jnp.square(g)).astype(v.dtype), state.nu, grads)
        decays = mask(params) if mask is not None else jax.tree.map(lambda _: True, params)

        def leaf_update(path, g, m, v, p, decayed):
            m_hat = m.astype(jnp.float32) / (1 - b1**t)
            v_hat = v.astype(jnp.float32) / (1 - b2**t)
            direction = m_hat / (jnp.sqrt(v_hat) + eps)
            if decayed and weight_decay:
                direction = direction + weight_decay * p.astype(jnp.float32)
            shrink = 1.0 / jnp.maximum(1.0, rms_ratio(path, g, v_hat, eps))  # scalar, or [layers]
            shrink = shrink.reshape(shrink.shape + (1,) * (direction.ndim - shrink.ndim))
            return (direction * shrink).astype(p.dtype)

        updates = jax.tree_util.tree_map_with_path(leaf_update, grads, mu, nu, params, decays)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def stable_adamw(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.98, eps: float = 1e-6,
                 weight_decay: float = 0.0, mask: Callable | None = None) -> optax.GradientTransformation:
    """StableAdamW: `scale_by_stable_adam` followed by the (scheduled) learning rate, like `optax.adamw`."""
    return optax.chain(scale_by_stable_adam(b1, b2, eps, weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
