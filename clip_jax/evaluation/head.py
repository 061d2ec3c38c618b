"""A classification head scored on a labelled set: an `Evaluator` (`clip_jax.evaluation.evaluator`) whose weights
are CLIP params with a linear head, `{**clip_params, "head": {"weights": [E, C], "bias": [C]}}` (what classification
fine-tuning trains: the image tower and the head). An image's logits are its L2-normalised image embedding times `weights`, plus
`bias`; the metrics are CLIP_benchmark's: `acc1`, `acc5`, `mean_per_class_recall`.
"""

from collections.abc import Callable

import numpy as np

from clip_jax.evaluation.benchmark import classification_metrics
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.runtime.stop_signals import never


class HeadEvaluator:
    """The head's accuracy on the set whose images `images` encodes (a `ZeroShotEvaluator` of the set, over the
    run's mesh; its prompts play no part)."""

    def __init__(self, images: ZeroShotEvaluator):
        self.images = images

    @property
    def name(self) -> str:
        return self.images.name

    def run(self, weights, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        clip_params = {k: v for k, v in weights.items() if k != "head"}
        features, labels = self.images.image_features(clip_params, should_stop=should_stop)
        head = weights["head"]
        return classification_metrics(features @ np.asarray(head["weights"]) + np.asarray(head["bias"]), labels)
