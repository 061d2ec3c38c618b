"""The classification fine-tuning step: a CLIP image tower with a linear head, trained with cross-entropy.

The trained params are `{"visual": the image tower, "head": {"weights": [E, C], "bias": [C]}}`; the rest of the
CLIP params (the text tower, `logit_scale`) is `frozen`, passed to every call and never changed, so the fine-tuned
model stays a whole CLIP model. An image's logits are `encode_image(image) @ weights + bias`, `encode_image` being
the L2-normalised image embedding: the zero-shot classifier (class embeddings [E, C]) times the logit scale 100 is a
head of this form with bias 0 (`zeroshot_head`).

`step(state, frozen, batch) -> (state, metrics)` takes a global batch split over the mesh's data axis (`{"images":
[B, S, S, 3] float32, "labels": [B] int32}`), applies one update (AdamW with OpenCLIP's weight-decay mask, each
update scaled by its layer's learning-rate multiplier: `optim.layer_decay`) and moves the EMA of the params:
`ema <- d * ema + (1 - d) * params` with `d = min(ema_decay, (1 + step) / (10 + step))`, so that a short run's EMA
is not stuck at the initial weights. With `ema_decay` 0 the EMA is the params themselves.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from clip_jax.evaluation.classifier import LOGIT_SCALE
from clip_jax.optim.adamw import create_optimizer
from clip_jax.optim.layer_decay import lr_multipliers, scale_by_layer
from clip_jax.runtime.mesh import replicated


class FinetuneState(NamedTuple):
    params: Any  # {"visual": ..., "head": {"weights": [E, C], "bias": [C]}}
    opt_state: Any
    step: jax.Array  # int32 scalar: updates applied
    ema: Any  # the params' exponential moving average (the params themselves when ema_decay is 0)


def zeroshot_head(classifier: np.ndarray) -> dict[str, np.ndarray]:
    """The head of the zero-shot classifier [E, C]: its logits are the zero-shot logits."""
    classifier = np.asarray(classifier, np.float32)
    return {"weights": LOGIT_SCALE * classifier, "bias": np.zeros(classifier.shape[1], np.float32)}


def split_params(clip_params: dict, head: dict) -> tuple[dict, dict]:
    """(trained params, frozen params) of a CLIP params tree and a head."""
    frozen = {k: v for k, v in clip_params.items() if k != "visual"}
    return {"visual": clip_params["visual"], "head": head}, frozen


def clip_params(params: dict, frozen: dict) -> dict:
    """The whole CLIP params tree again (the head left out)."""
    return {**frozen, "visual": params["visual"]}


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


def finetune_optimizer(params: dict, learning_rate_fn: Callable, *, weight_decay: float, layer_decay: float,
                       image_layers: int, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       grad_clip_norm: float | None = None) -> optax.GradientTransformation:
    """AdamW (OpenCLIP's decay mask), then the layer-wise learning-rate multipliers of `params`."""
    adamw = create_optimizer(learning_rate_fn, weight_decay=weight_decay, b1=b1, b2=b2, eps=eps,
                             grad_clip_norm=grad_clip_norm)
    return optax.chain(adamw, scale_by_layer(lr_multipliers(params, layer_decay, image_layers)))


def ema_rate(step: jax.Array, ema_decay: float) -> jax.Array:
    """The EMA's decay at update `step` (counted from 0): warmed up, `(1 + step) / (10 + step)` at most."""
    step = jnp.asarray(step, jnp.float32)
    return jnp.minimum(jnp.float32(ema_decay), (1 + step) / (10 + step))


def init_state(params: dict, optimizer: optax.GradientTransformation) -> FinetuneState:
    return FinetuneState(params, optimizer.init(params), jnp.zeros((), jnp.int32), params)


def make_finetune_step(model, optimizer: optax.GradientTransformation, mesh: Mesh, *, ema_decay: float,
                       learning_rate_fn: Callable) -> Callable:
    """The jitted step (see the module docstring); the old state is donated. Params and state are replicated."""

    def step(state: FinetuneState, frozen: dict, batch: dict):
        (loss, accuracy), grads = jax.value_and_grad(
            lambda p: classification_loss(model, p, frozen, batch), has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if ema_decay > 0:
            d = ema_rate(state.step, ema_decay)
            ema = jax.tree.map(lambda e, p: d * e + (1 - d) * p, state.ema, params)
        else:
            ema = params
        metrics = {"loss": loss, "train_acc1": accuracy, "lr": learning_rate_fn(state.step),
                   "grad_norm": optax.tree.norm(grads)}
        return FinetuneState(params, opt_state, state.step + 1, ema), metrics

    everywhere = replicated(mesh)
    return jax.jit(step, donate_argnums=(0,), out_shardings=(everywhere, everywhere))
