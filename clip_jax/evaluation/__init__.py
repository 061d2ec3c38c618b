"""Zero-shot classification and image-text retrieval, by OpenCLIP's protocol.

    from clip_jax import evaluation

    dataset = evaluation.open_classification_set("imagenet-val", "/data/imagenet/val")
    metrics = evaluation.evaluate_zeroshot(model, params, dataset, mesh, batch_size=256, mean=mean, std=std)
    # {"top1": 0.753, "top5": 0.944, "num_images": 50000}

The command line is `python -m clip_jax.zeroshot`.
"""

from clip_jax.evaluation.classification import evaluate_zeroshot
from clip_jax.evaluation.classifier import build_zeroshot_classifier, zeroshot_logits
from clip_jax.evaluation.datasets import (
    KINDS,
    ClassificationSet,
    demo_set,
    image_folder_set,
    open_classification_set,
    tfds_set,
)
from clip_jax.evaluation.metrics import label_ranks, retrieval_recall
from clip_jax.evaluation.prompts import imagenet_class_names, imagenet_wnids, templates
from clip_jax.evaluation.retrieval import evaluate_retrieval

__all__ = [
    "KINDS", "ClassificationSet", "build_zeroshot_classifier", "demo_set", "evaluate_retrieval", "evaluate_zeroshot",
    "image_folder_set", "imagenet_class_names", "imagenet_wnids", "label_ranks", "open_classification_set",
    "retrieval_recall", "templates", "tfds_set", "zeroshot_logits",
]
