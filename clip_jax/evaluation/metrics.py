"""Ranks, top-k accuracy and retrieval recall@k, with ties broken deterministically.

Candidates are ordered by score, highest first; candidates with exactly equal scores are ordered by index, lowest
first. The rank of a candidate is its position in that order (0 = best), so a candidate is "in the top k" when its
rank is below k. A NaN score of the right candidate counts as never found.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from clip_jax.errors import InvalidInput


def label_ranks(logits, labels):
    """Rank of each row's label among its classes: logits [B, C], labels int [B] -> int32 [B] (C for a NaN)."""
    num_classes = logits.shape[-1]
    labels = jnp.clip(labels, 0, num_classes - 1)  # padding rows carry -1
    right = jnp.take_along_axis(logits, labels[:, None], axis=1)  # [B, 1]
    classes = jnp.arange(num_classes)[None, :]
    ahead = (logits > right) | ((logits == right) & (classes < labels[:, None]))  # [B, C]
    ranks = jnp.sum(ahead, axis=1, dtype=jnp.int32)
    return jnp.where(jnp.isnan(right[:, 0]), num_classes, ranks)


def _ranks_of(scores: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Rank of candidate `right[q]` in row q of `scores` [Q, K]; NaN -> K."""
    right_score = scores[np.arange(len(scores)), right][:, None]  # [Q, 1]
    candidates = np.arange(scores.shape[1])[None, :]
    ahead = (scores > right_score) | ((scores == right_score) & (candidates < right[:, None]))
    return np.where(np.isnan(right_score[:, 0]), scores.shape[1], ahead.sum(axis=1))


def text_to_image_ranks(image_features: np.ndarray, text_features: np.ndarray, caption_image: np.ndarray,
                        chunk: int = 1024) -> np.ndarray:
    """For each caption, the rank of its own image among all images: [T]."""
    images = np.asarray(image_features, np.float64)
    ranks = []
    for start in range(0, len(text_features), chunk):
        scores = np.asarray(text_features[start:start + chunk], np.float64) @ images.T  # [t, N]
        ranks.append(_ranks_of(scores, caption_image[start:start + chunk]))
    return np.concatenate(ranks) if ranks else np.zeros(0, np.int64)


def image_to_text_ranks(image_features: np.ndarray, text_features: np.ndarray, caption_image: np.ndarray,
                        chunk: int = 256) -> np.ndarray:
    """For each image, the best rank any of its own captions has among all captions: [N].

    That is the rank of its own caption with the highest score (the lowest index among equal ones)."""
    texts = np.asarray(text_features, np.float64)
    ranks = []
    for start in range(0, len(image_features), chunk):
        scores = np.asarray(image_features[start:start + chunk], np.float64) @ texts.T  # [n, T]
        owned = caption_image[None, :] == np.arange(start, start + len(scores))[:, None]  # [n, T]
        # argmax returns the first maximum: the lowest-index own caption among the best-scoring ones. A NaN own
        # caption is picked only when all are NaN, and then counts as not found.
        rows = np.arange(len(scores))
        best = np.argmax(np.where(owned & ~np.isnan(scores), scores, -np.inf), axis=1)
        best = np.where(owned[rows, best], best, np.argmax(owned, axis=1))
        ranks.append(_ranks_of(scores, best))
    return np.concatenate(ranks) if ranks else np.zeros(0, np.int64)


def check_pairs(num_images: int, num_texts: int, caption_image: np.ndarray) -> np.ndarray:
    """`caption_image` as int64 [T], checked: every entry names an image, every image has a caption."""
    caption_image = np.asarray(caption_image, np.int64)
    if caption_image.shape != (num_texts,):
        raise InvalidInput(f"caption_image has shape {caption_image.shape}; expected ({num_texts},), one image index "
                         "per caption")
    if num_texts and (caption_image.min() < 0 or caption_image.max() >= num_images):
        raise InvalidInput(f"caption_image holds indices outside [0, {num_images}): there are {num_images} images")
    without = np.setdiff1d(np.arange(num_images), caption_image)
    if without.size:
        raise InvalidInput(f"{without.size} image(s) have no caption (first: image {without[0]}); image->text recall "
                         "needs at least one caption per image")
    return caption_image


def retrieval_recall(image_features: np.ndarray, text_features: np.ndarray, caption_image: np.ndarray,
                     ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """Recall@k both ways for images [N, E] and captions [T, E], caption t describing image `caption_image[t]`.

    text->image: the fraction of captions whose own image ranks below k among all images.
    image->text: the fraction of images with any of their own captions ranked below k among all captions.
    Scores are dot products in float64.
    """
    caption_image = check_pairs(len(image_features), len(text_features), caption_image)
    t2i = text_to_image_ranks(image_features, text_features, caption_image)
    i2t = image_to_text_ranks(image_features, text_features, caption_image)
    metrics = {}
    for k in ks:
        metrics[f"image_to_text_recall@{k}"] = float(np.mean(i2t < k))
        metrics[f"text_to_image_recall@{k}"] = float(np.mean(t2i < k))
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# Classification metrics over host logits (CLIP_benchmark's names: acc1, acc5, mean_per_class_recall,
# mean_average_precision). The tie rule is the one above: equal scores order by class (or image) index.


def class_ranks(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Rank of each row's label among its classes: logits [N, C], labels int [N] -> int [N] (C for a NaN)."""
    logits = np.asarray(logits)
    labels = np.asarray(labels, np.int64)
    if logits.ndim != 2 or labels.shape != (len(logits),):
        raise InvalidInput(f"logits {logits.shape} and labels {labels.shape} must be [N, C] and [N]")
    if labels.size and (labels.min() < 0 or labels.max() >= logits.shape[1]):
        raise InvalidInput(f"labels must lie in [0, {logits.shape[1]}): there are {logits.shape[1]} classes")
    return _ranks_of(logits, labels)


def topk_accuracy(logits: np.ndarray, labels: np.ndarray, k: int) -> float:
    """The fraction of rows whose label ranks below `k`; NaN when there are fewer than `k` classes (a top-5 of a
    4-class set says nothing, and CLIP_benchmark reports it as NaN too)."""
    if np.asarray(logits).shape[1] < k:
        return float("nan")
    return float(np.mean(class_ranks(logits, labels) < k))


def predictions(logits: np.ndarray) -> np.ndarray:
    """The top class of each row [N]: the highest score, the lowest class index among equal ones (NaN never wins
    unless the whole row is NaN)."""
    logits = np.asarray(logits, np.float64)
    return np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=1)


def mean_per_class_recall(logits: np.ndarray, labels: np.ndarray) -> float:
    """Balanced accuracy: for each class that occurs among the labels, the fraction of its images predicted as it;
    then the mean over those classes (classes without images do not count)."""
    labels = np.asarray(labels, np.int64)
    class_ranks(logits, labels)  # checks shapes and range
    correct = predictions(logits) == labels
    present = np.unique(labels)
    hits = np.bincount(labels, weights=correct, minlength=int(present.max()) + 1 if present.size else 0)
    counts = np.bincount(labels, minlength=len(hits))
    return float(np.mean(hits[present] / counts[present])) if present.size else float("nan")


def average_precision(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Average precision of each class [C] for scores [N, C] and multi-hot targets [N, C].

    Images are ranked by score per class (highest first, ties by image index); a class's AP is the mean, over its
    positive images, of the precision at each one's rank: sum(precision at positives) / max(number of positives, 1).
    A class without positives therefore has AP 0 (the convention of CLIP_benchmark's multilabel mAP).
    """
    scores = np.asarray(scores, np.float64)
    targets = np.asarray(targets)
    if scores.ndim != 2 or targets.shape != scores.shape:
        raise InvalidInput(f"scores {scores.shape} and targets {targets.shape} must both be [N, C]")
    positive = targets > 0
    # Stable sort of the negated scores: highest first, equal scores in image order.
    order = np.argsort(-scores, axis=0, kind="stable")  # [N, C]
    truth = np.take_along_axis(positive, order, axis=0)  # [N, C], positives in ranked order
    precision = np.cumsum(truth, axis=0) / np.arange(1, len(scores) + 1)[:, None]
    return np.sum(precision * truth, axis=0) / np.maximum(truth.sum(axis=0), 1)


def mean_average_precision(scores: np.ndarray, targets: np.ndarray) -> float:
    """The mean over all classes of `average_precision`."""
    return float(np.mean(average_precision(scores, targets)))
