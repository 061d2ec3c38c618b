"""Validation during training on held-out image-caption shards (OpenCLIP's `val_data`): the contrastive loss and
image<->text retrieval recall@k.

The images and captions are encoded over the mesh by the retrieval evaluation's encoder (every process reads the
whole set, which is small); recall comes from `metrics.retrieval_recall` over all captions. The loss is computed on
the host in float64, as the training loss over batches of (image, first caption) pairs: the softmax loss (mean of
image->text and text->image cross-entropy) or, for a SigLIP run, the sigmoid loss. Like the training loss it
depends on the batch: batches of `loss_batch_size` pairs (the last one smaller), averaged per pair.
"""

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from clip_jax.errors import InvalidInput
from clip_jax.evaluation.classifier import tokenize_for
from clip_jax.evaluation.encoder import ShardedEncoder, round_up
from clip_jax.evaluation.evaluator import EvalSetting
from clip_jax.evaluation.metrics import retrieval_recall
from clip_jax.evaluation.retrieval import encode_retrieval_images, first_images
from clip_jax.evaluation.sources import RetrievalSet, load_retrieval_set
from clip_jax.models.variables import params_of
from clip_jax.runtime.stop_signals import never


def open_validation_set(pattern: str, num_samples: int = 0) -> RetrievalSet:
    """The set `pattern` names (its first `num_samples` images when given); refuses an empty one by name."""
    try:
        val_set = load_retrieval_set(pattern)
    except InvalidInput as e:
        raise InvalidInput(f"val_data={pattern!r}: {e}; validation needs at least one image with a caption") from e
    return first_images(val_set, num_samples) if num_samples else val_set


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = x - x.max(axis=axis, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def pair_loss(image_features: np.ndarray, text_features: np.ndarray, logit_scale: float,
              logit_bias: float | None = None, *, batch_size: int) -> float:
    """Mean per-pair loss of the matching rows of image and text features [N, E], in batches of `batch_size`.

    Softmax (CLIP): per batch (CE(rows of scale * I T^T) + CE(columns)) / 2 with the diagonal as labels.
    Sigmoid (SigLIP, `logit_bias` given): per batch -sum(log sigmoid(z * (scale * I T^T + bias))) / n, z = +1 on the
    diagonal and -1 off it."""
    images, texts = np.asarray(image_features, np.float64), np.asarray(text_features, np.float64)
    total = 0.0
    for start in range(0, len(images), batch_size):
        logits = logit_scale * images[start:start + batch_size] @ texts[start:start + batch_size].T
        n = len(logits)
        if logit_bias is None:
            diagonal = np.arange(n)
            loss = -(_log_softmax(logits, 1)[diagonal, diagonal].mean()
                     + _log_softmax(logits, 0)[diagonal, diagonal].mean()) / 2
        else:
            signs = 2 * np.eye(n) - 1
            loss = np.logaddexp(0, -signs * (logits + logit_bias)).sum() / n  # -log sigmoid(x) = log(1 + e^-x)
        total += loss * n
    return float(total / len(images))


def first_caption_rows(caption_image: np.ndarray, num_images: int) -> np.ndarray:
    """The index of each image's first caption [N]."""
    firsts = np.full(num_images, -1, np.int64)
    for t in range(len(caption_image) - 1, -1, -1):
        firsts[caption_image[t]] = t
    return firsts


def validate(model, params, val_set: RetrievalSet, mesh: Mesh, *, batch_size: int, loss_batch_size: int,
             mean: Sequence[float], std: Sequence[float], ks: Sequence[int] = (1, 5, 10),
             text_batch_size: int = 1024, loss: str | None = None,
             should_stop: Callable[[], bool] = never) -> dict[str, float]:
    """`loss`, `image_to_text_recall@k`, `text_to_image_recall@k`, `num_images` of `params` on `val_set`.
    `params` may be as a trainer holds them (e.g. FSDP-sharded; a ResNet image tower's with its batch_stats, see
    `models.variables.eval_variables`); every process gets the same numbers. `loss`: the
    run's ("clip": softmax, "siglip": sigmoid with the params' logit_bias); None: sigmoid when the params have a
    logit_bias. `should_stop` is asked before each batch encoded (see `encoder`)."""
    encoder = ShardedEncoder(model, mesh)
    params = encoder.place(params)
    image_features = encode_retrieval_images(encoder, params, val_set,
                                             batch_size=round_up(min(batch_size, val_set.num_images), mesh.size),
                                             mean=mean, std=std, should_stop=should_stop)
    text_features = encoder.encode_texts(params, tokenize_for(model, val_set.captions), text_batch_size,
                                         should_stop=should_stop)
    metrics = retrieval_recall(image_features, text_features, val_set.caption_image, ks)
    params = params_of(params)
    scale = float(np.exp(np.asarray(jax.device_get(params["logit_scale"]), np.float64)))
    sigmoid = "logit_bias" in params if loss is None else loss == "siglip"
    bias = float(np.asarray(jax.device_get(params["logit_bias"]))) if sigmoid else None
    firsts = first_caption_rows(val_set.caption_image, val_set.num_images)
    metrics["loss"] = pair_loss(image_features, text_features[firsts], scale, bias, batch_size=loss_batch_size)
    metrics["num_images"] = val_set.num_images
    return metrics


class ValidationEvaluator:
    """The `Evaluator` of `validate` on one held-out set: `loss`, the recalls and `num_images`."""

    name = "validation"

    def __init__(self, setting: EvalSetting, val_set: RetrievalSet, *, loss_batch_size: int, loss: str | None = None):
        self.setting, self.val_set, self.loss_batch_size, self.loss = setting, val_set, loss_batch_size, loss

    def run(self, weights, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        s = self.setting
        return validate(s.model, weights, self.val_set, s.mesh, batch_size=s.batch_size,
                        loss_batch_size=self.loss_batch_size, mean=s.mean, std=s.std, loss=self.loss,
                        should_stop=should_stop)
