"""Zero-shot classification and image-text retrieval, by OpenCLIP's protocol.

    from clip_jax import evaluation

    dataset = evaluation.open_classification_set("imagenet-val", "/data/imagenet/val")
    evaluator = evaluation.ZeroShotEvaluator(model, dataset, mesh, batch_size=256, mean=mean, std=std)
    metrics = evaluator(params)  # {"top1": 0.753, "top5": 0.944, "num_images": 50000}; call again with new params

Modules: `sources` (image folders, TFDS, in-memory arrays, retrieval shards), `datasets` (classification sets with
their class names and prompts), `batches` (the eval transform, padded batches), `encoder` (the image and text towers
over the mesh), `classifier` and `classification` (zero-shot accuracy), `retrieval` and `metrics` (recall@k, ranks),
`prompts` (class names and templates). The command line is `python -m clip_jax.zeroshot`.
"""

from clip_jax.evaluation.classification import ZeroShotEvaluator, evaluate_zeroshot
from clip_jax.evaluation.classifier import build_zeroshot_classifier, zeroshot_logits
from clip_jax.evaluation.datasets import (
    KINDS,
    ClassificationSet,
    demo_set,
    image_folder_set,
    open_classification_set,
    tfds_set,
)
from clip_jax.evaluation.encoder import ShardedEncoder
from clip_jax.evaluation.metrics import label_ranks, retrieval_recall
from clip_jax.evaluation.prompts import imagenet_class_names, imagenet_wnids, templates
from clip_jax.evaluation.retrieval import evaluate_retrieval
from clip_jax.evaluation.sources import RetrievalSet, load_retrieval_set

__all__ = [
    "KINDS", "ClassificationSet", "RetrievalSet", "ShardedEncoder", "ZeroShotEvaluator", "build_zeroshot_classifier",
    "demo_set", "evaluate_retrieval", "evaluate_zeroshot", "image_folder_set", "imagenet_class_names",
    "imagenet_wnids", "label_ranks", "load_retrieval_set", "open_classification_set", "retrieval_recall",
    "templates", "tfds_set", "zeroshot_logits",
]
