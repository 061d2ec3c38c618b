"""Spike telemetry: the per-block signals that rise before a loss spike, computed inside the train step from what
the step already holds (gradients, updates, Adam's second moment, params), on logging steps only.

Per tower (`visual`, `text`) and per residual block (a layer of the scanned stack):

- `grad_rms`: RMS of the block's gradient (before clipping), over all its elements;
- `update_rms`: RMS of the block's parameter change in this step (learning rate included);
- `rms_ratio`: Adam's "RMS ratio" sqrt(mean(g^2 / max(v_hat, eps^2))) over the block's elements, `v_hat` the
  bias-corrected second moment after this step's update. Far above 1, the second moment is out of date: the update
  is larger than the learning rate intends (Wortsman et al. 2023; StableAdamW clips on it per tensor). Only for
  optimizers with Adam's state;
- `q_norm`, `k_norm` (of the last block, after the update): Frobenius norms of its query and key projection
  kernels. Attention logits grow with |q||k|; growing norms precede the attention-entropy collapse behind many
  spikes. (A data-free proxy for the largest attention logit, which would need the last block's activations.) With
  `qk_norm` the logits are bounded by the norms' scales instead and these norms only track the projections' size;
- `attn_logit_scale` (last block, `scaled_cosine_attn` only): the largest per-head factor exp(min(s, ln 100)) that
  multiplies cos(q, k), the bound on that block's attention logits.

`step_telemetry` returns `{tower: {name: [layers] or scalar}}` of fp32 arrays; `flatten` turns a fetched one into
TensorBoard tags such as `telemetry/visual/grad_rms/block_3`.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clip_jax.models.layers import LOGIT_SCALE_MAX as ATTN_LOGIT_SCALE_MAX
from clip_jax.runtime.mesh import LAYER_STACK_KEY, path_names

TEXT_TOWER_ROOT = "transformer"  # OpenCLIP's text blocks live at the top level: transformer.resblocks


def tower_of(names: list[str]) -> str | None:
    """The tower a block leaf belongs to ('visual', 'text'), or None for a leaf outside the block stacks."""
    if LAYER_STACK_KEY not in names:
        return None
    return "text" if names[0] == TEXT_TOWER_ROOT else names[0]


def _block_sums(tree, value: Callable) -> dict[str, tuple[jax.Array, int]]:
    """Per tower: (sum over each layer of value(leaf) [layers], elements per layer) over every block leaf. `tree`
    may also be a list of (path, leaf) pairs."""
    sums: dict[str, tuple[jax.Array, int]] = {}
    pairs = tree if isinstance(tree, list) else jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in pairs:
        tower = tower_of(path_names(path))
        if tower is None:
            continue
        per_layer = jnp.sum(value(leaf).reshape(leaf.shape[0], -1), axis=1)
        total, count = sums.get(tower, (0.0, 0))
        sums[tower] = (total + per_layer, count + int(np.prod(leaf.shape[1:])))
    return sums


def _square(x):
    return jnp.square(x.astype(jnp.float32))


def find_adam_state(opt_state) -> optax.ScaleByAdamState | None:
    """The first `ScaleByAdamState` (AdamW's or StableAdamW's moments) in an optimizer state, if any."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    return found[0] if found else None


def step_telemetry(grads, updates, new_opt_state, new_params, *, b2: float,
                   eps: float) -> dict[str, dict[str, jax.Array]]:
    """The signals of the module docstring for one step. `new_opt_state`, `new_params`: the state after this step's
    update (the second moment includes this step's gradient). Only the step's outputs and its own intermediates are
    read: a donated input read after the update would cost a copy of it on every step."""
    out: dict[str, dict[str, jax.Array]] = {}
    for tower, (total, count) in _block_sums(grads, _square).items():
        out.setdefault(tower, {})["grad_rms"] = jnp.sqrt(total / count)
    for tower, (total, count) in _block_sums(updates, _square).items():
        out[tower]["update_rms"] = jnp.sqrt(total / count)
    adam = find_adam_state(new_opt_state)
    if adam is not None:
        bias_correction = 1 - b2 ** adam.count.astype(jnp.float32)
        # Matched by path: a locked tower (clip_jax.optim.lock) has no moments, its leaves are absent from `nu`.
        nu = {jax.tree_util.keystr(path): v for path, v in jax.tree_util.tree_flatten_with_path(adam.nu)[0]}
        ratios = [(path, _square(g) / jnp.maximum(nu[key].astype(jnp.float32) / bias_correction, eps**2))
                  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                  if (key := jax.tree_util.keystr(path)) in nu]
        for tower, (total, count) in _block_sums(ratios, lambda x: x).items():
            out[tower]["rms_ratio"] = jnp.sqrt(total / count)
    for path, leaf in jax.tree_util.tree_flatten_with_path(new_params)[0]:
        names = path_names(path)
        tower = tower_of(names)
        if tower is not None and names[-2:] == ["attn", "logit_scale"]:  # [layers, heads, 1, 1]
            largest = jnp.max(leaf[-1].astype(jnp.float32))
            out[tower]["attn_logit_scale"] = jnp.exp(jnp.minimum(largest, ATTN_LOGIT_SCALE_MAX))
        if tower is None or names[-3:] != ["attn", "in_proj", "kernel"]:
            continue
        width = leaf.shape[-1] // 3  # [layers, W, 3W]: query, key, value columns
        last = leaf[-1].astype(jnp.float32)
        out[tower]["q_norm"] = jnp.linalg.norm(last[:, :width])
        out[tower]["k_norm"] = jnp.linalg.norm(last[:, width:2 * width])
    return out


def every_n_steps(telemetry: Callable, n: int) -> Callable:
    """`telemetry(*args)` on steps whose count after the update is a multiple of `n` (the trainer's logging steps),
    zeros on the others: `lax.cond` runs only the branch taken, so other steps pay for none of the reductions."""

    def maybe(step, *args):
        shapes = jax.eval_shape(telemetry, *args)
        return jax.lax.cond((step + 1) % n == 0, telemetry,
                            lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), *args)

    return maybe


def flatten(telemetry: dict) -> dict[str, float]:
    """Fetched telemetry as scalars: `telemetry/TOWER/NAME/block_I` per block, `telemetry/TOWER/NAME` else."""
    scalars = {}
    for tower, stats in telemetry.items():
        for name, value in stats.items():
            value = np.asarray(value, np.float64)
            if value.ndim == 0:
                scalars[f"telemetry/{tower}/{name}"] = float(value)
            else:
                scalars.update({f"telemetry/{tower}/{name}/block_{i}": float(v) for i, v in enumerate(value)})
    return scalars
