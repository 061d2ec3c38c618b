"""The classification fine-tuning step: a CLIP image tower with a linear head, trained with cross-entropy; assembled
by `clip_jax.training.step_factory.build_step` for a `StepSpec` with a `ClassifierHead`.

The trained params are `{"visual": the image tower, "head": {"weights": [E, C], "bias": [C]}}`; the rest of the
CLIP params (the text tower, `logit_scale`) is `frozen`: carried in the state unchanged (the model's `apply` takes a
whole CLIP params tree), so that the fine-tuned model stays a whole CLIP model (`clip_params`). An image's logits are `encode_image(image) @ weights + bias`,
`encode_image` being the L2-normalised image embedding: the zero-shot classifier (class embeddings [E, C]) times the
logit scale 100 is a head of this form with bias 0 (`zeroshot_head`).

`step(state, batch) -> (state, metrics)` takes a global batch split over the mesh's data axis (`{"images":
[B, S, S, 3] float32, "labels": [B] int32}`), applies one update (AdamW with OpenCLIP's weight-decay mask, each
update scaled by its layer's learning-rate multiplier: `optim.layer_decay`) and moves the EMA of the params:
`ema <- d * ema + (1 - d) * params` with `d = min(ema_decay, (1 + step) / (10 + step))`, so that a short run's EMA
is not stuck at the initial weights. With `ema_decay` 0 the EMA is the params themselves. A non-finite loss or
gradient skips the update, as CLIP's step does: params, optimizer state and EMA stay as they were, the step counts.
Metrics: `loss`, `train_acc1`, `grad_norm`, `learning_rate` (of this update) and `finite`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from clip_jax.evaluation.classifier import LOGIT_SCALE
from clip_jax.runtime.mesh import batch_sharding, replicated
from clip_jax.training.train_step import global_norm


class FinetuneState(NamedTuple):
    params: Any  # {"visual": ..., "head": {"weights": [E, C], "bias": [C]}}
    opt_state: Any
    step: jax.Array  # int32 scalar: batches consumed (updates applied, or skipped as non-finite)
    ema: Any  # the params' exponential moving average (the params themselves when ema_decay is 0)
    frozen: Any  # the rest of the CLIP params, never updated


def zeroshot_head(classifier: np.ndarray) -> dict[str, np.ndarray]:
    """The head of the zero-shot classifier [E, C]: its logits are the zero-shot logits."""
    classifier = np.asarray(classifier, np.float32)
    return {"weights": LOGIT_SCALE * classifier, "bias": np.zeros(classifier.shape[1], np.float32)}


def split_params(clip_params: dict, head: dict) -> tuple[dict, dict]:
    """(trained params, frozen params) of a CLIP params tree and a head."""
    frozen = {k: v for k, v in clip_params.items() if k not in ("visual", "head")}
    return {"visual": clip_params["visual"], "head": head}, frozen


def clip_params(params: dict, frozen: dict) -> dict:
    """The whole CLIP params tree again (the head left out)."""
    return {**frozen, "visual": params["visual"]}


def param_shapes(model, classes: int) -> dict:
    """The shapes (`jax.ShapeDtypeStruct`s) of `model`'s CLIP params with a head of `classes` (float32): what
    `init_state` takes."""
    from clip_jax.models import param_shapes as clip_param_shapes

    embed = model.config.embed_dim
    return {**clip_param_shapes(model), "head": {"weights": jax.ShapeDtypeStruct((embed, classes), jnp.float32),
                                                 "bias": jax.ShapeDtypeStruct((classes,), jnp.float32)}}


def head_logits(model, params: dict, frozen: dict, images: jax.Array) -> jax.Array:
    """Logits [B, C] of images [B, S, S, 3]."""
    features = model.apply({"params": clip_params(params, frozen)}, images, method="encode_image")
    head = params["head"]
    return jnp.matmul(features, head["weights"], precision=jax.lax.Precision.HIGHEST) + head["bias"]


def classification_loss(model, params: dict, frozen: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy, top-1 accuracy) over the batch."""
    logits = head_logits(model, params, frozen, batch["images"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.mean(losses), jnp.mean(jnp.argmax(logits, -1) == batch["labels"])


def ema_rate(step: jax.Array, ema_decay: float) -> jax.Array:
    """The EMA's decay at update `step` (counted from 0): warmed up, `(1 + step) / (10 + step)` at most."""
    step = jnp.asarray(step, jnp.float32)
    return jnp.minimum(jnp.float32(ema_decay), (1 + step) / (10 + step))


def trained(params: dict) -> dict:
    """The trained part of CLIP params with a head: `{"visual", "head"}`."""
    return {"visual": params["visual"], "head": params["head"]}


def init_state(params: dict, optimizer: optax.GradientTransformation) -> FinetuneState:
    """The state of CLIP params with a head (`{**clip_params, "head": ...}`): step 0, the EMA at the weights."""
    weights, frozen = split_params(params, params["head"])
    return FinetuneState(weights, optimizer.init(weights), jnp.zeros((), jnp.int32), weights, frozen)


def make_classification_step(model, optimizer: optax.GradientTransformation, learning_rate_fn: Callable,
                             mesh: Mesh, shardings: FinetuneState, *, ema_decay: float) -> Callable:
    """The jitted step (see the module docstring); the old state is donated."""

    def step(state: FinetuneState, batch: dict):
        (loss, accuracy), grads = jax.value_and_grad(
            lambda p: classification_loss(model, p, state.frozen, batch), has_aux=True)(state.params)
        grad_norm = global_norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if ema_decay > 0:
            d = ema_rate(state.step, ema_decay)
            ema = jax.tree.map(lambda e, p: d * e + (1 - d) * p, state.ema, params)
        else:
            ema = params
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state, ema = jax.tree.map(lambda new, old: jnp.where(finite, new, old), (params, opt_state, ema),
                                              (state.params, state.opt_state, state.ema))
        metrics = {"loss": loss, "train_acc1": accuracy, "grad_norm": grad_norm,
                   "learning_rate": learning_rate_fn(state.step), "finite": finite}
        return FinetuneState(params, opt_state, state.step + 1, ema, state.frozen), metrics

    return jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, replicated(mesh)),
                   donate_argnums=0)
